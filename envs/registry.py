"""Environments by name, so a worker process builds its own from a picklable (name, kwargs) spec.

  make_env("alfworld", expert=True)          -> envs.alfworld.AlfWorldEnv
  make_env("textworld", quest_length=6)      -> envs.textworld_games.TextWorldEnv
  make_env("toy", num_rooms=5)               -> envs.toy.ToyEnv
  make_expert_env("textworld", max_steps=6)  -> one whose expert_action() works (demonstrations)
  make_env("webshop", human_goals=True)      -> envs.webshop.WebShopEnv
  make_env("tests.fakes:CrashingEnv")        -> any TextEnv class by "module:Class"
  task_list("alfworld", "valid_unseen")      -> the tasks of a split
  entry("alfworld").train_split              -> its default splits (train, eval)

Modules are imported on first use: a worker that plays the toy env never imports alfworld. Task
lists accept the env's own keyword arguments too (e.g. `data_dir`, `quest_length`) and ignore the
ones that only concern playing (`max_steps`, `expert`), so one kwargs dict can serve both calls.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from typing import Any, Callable

from envs.base import Task, TextEnv


@dataclasses.dataclass(frozen=True)
class EnvEntry:
  """One environment family: where its class and task function live, and its default splits."""

  env: str                  # "module:EnvClass"
  tasks: str                # "module:task_function"
  train_split: str
  eval_splits: tuple[str, ...]


# The one registry of environments: the trainer, the worker pool and the scripts all read it.
_REGISTRY = {
    "alfworld": EnvEntry("envs.alfworld:AlfWorldEnv", "envs.alfworld:alfworld_tasks",
                         "valid_train", ("valid_seen", "valid_unseen")),
    "textworld": EnvEntry("envs.textworld_games:TextWorldEnv",
                          "envs.textworld_games:textworld_tasks", "train", ("heldout",)),
    "toy": EnvEntry("envs.toy:ToyEnv", "envs.toy:toy_tasks", "train", ("eval",)),
    "webshop": EnvEntry("envs.webshop:WebShopEnv", "envs.webshop:webshop_tasks", "train",
                        ("test",)),
}


def names() -> tuple[str, ...]:
  return tuple(sorted(_REGISTRY))


def _load(ref: str) -> Callable:
  module, attr = ref.split(":")
  return getattr(importlib.import_module(module), attr)


def entry(name: str) -> EnvEntry:
  """The registry entry of `name`; ValueError naming the known ones otherwise."""
  if name not in _REGISTRY:
    raise ValueError(f"unknown environment {name!r}; known: {names()}")
  return _REGISTRY[name]


def make_env(name: str, **kwargs: Any) -> TextEnv:
  """A new environment instance of family `name` (or of a "package.module:Class" outside the
  registry, e.g. a test's) built with `kwargs`."""
  return _load(name if ":" in name else entry(name).env)(**kwargs)


# Families whose constructor takes `expert` (alfworld's and textworld's cost every step when on;
# webshop's is always there but takes the flag); the toy env's expert is always there.
_EXPERT_ON_REQUEST = ("alfworld", "textworld", "webshop")


def make_expert_env(name: str, **kwargs: Any) -> TextEnv:
  """`make_env(name, **kwargs)` with the family's expert enabled, so `expert_action()` works."""
  if name in _EXPERT_ON_REQUEST:
    kwargs = {**kwargs, "expert": True}
  return make_env(name, **kwargs)


def training_tasks(env_config) -> list[Task]:
  """The training tasks of an `EnvConfig` (or a `TrainConfig`): its train split (default: the
  env's), the tasks named by `train_task_ids` in that order, else the split's first
  `num_train_tasks` (None: all). A named id the split lacks is an error."""
  kwargs = dict(env_config.env_kwargs)
  ids = env_config.train_task_ids
  if env_config.num_train_tasks is not None and ids is None:
    kwargs["num_tasks"] = env_config.num_train_tasks
  split = env_config.train_split or entry(env_config.env).train_split
  tasks = task_list(env_config.env, split, **kwargs)
  if ids is None:
    return tasks
  by_id = {t.task_id: t for t in tasks}
  missing = [i for i in ids if i not in by_id]
  if missing:
    raise ValueError(f"{len(missing)} of train_task_ids are not tasks of {env_config.env}'s "
                     f"{split!r} split, e.g. {missing[0]!r}")
  return [by_id[i] for i in ids]


def task_list(name: str, split: str, **kwargs: Any) -> list[Task]:
  """The tasks of `split` for family `name`.

  Splits: alfworld valid_train / valid_seen / valid_unseen (or any folder of `$ALFWORLD_DATA`);
  textworld train / heldout; toy any name; webshop train / test. Keyword arguments the task
  function does not take are dropped (they are the env's, e.g. `max_steps`), except that the task
  function's own must match.
  """
  fn = _load(entry(name).tasks)
  params = inspect.signature(fn).parameters
  if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
    # textworld_tasks takes GameParams fields through **params: keep those, drop env-only ones.
    env_only = set(inspect.signature(_load(entry(name).env).__init__).parameters) - {"self", "params"}
    kept = {k: v for k, v in kwargs.items() if k not in env_only or k in params}
  else:
    kept = {k: v for k, v in kwargs.items() if k in params}
  return fn(split=split, **kept)
