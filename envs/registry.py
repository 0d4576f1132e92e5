"""Environments by name, so a worker process builds its own from a picklable (name, kwargs) spec.

  make_env("alfworld", expert=True)          -> envs.alfworld.AlfWorldEnv
  make_env("textworld", quest_length=6)      -> envs.textworld_games.TextWorldEnv
  make_env("toy", num_rooms=5)               -> envs.toy.ToyEnv
  make_expert_env("textworld", max_steps=6)  -> one whose expert_action() works (demonstrations)
  make_env("webshop", human_goals=True)      -> envs.webshop.WebShopEnv
  make_env("tests.fakes:CrashingEnv")        -> any TextEnv class by "module:Class"
  task_list("alfworld", "valid_unseen")      -> the tasks of a split
  entry("alfworld").train_split              -> its default splits (train, eval)
  env_arguments("webshop")                   -> the keyword arguments its environment takes
  prompt_fields("webshop")                   -> the agent's prompt settings it brings
  check_env_config(config)                   -> ValueError for unknown env_kwargs, splits, task ids

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
  params: str = ""          # "module:Dataclass" whose fields the env's **params take (if any)
  prompt: str = ""          # "module:NAME", a dict of the agent's PromptConfig fields (if any)
  view: str = ""            # "module:function" (first observation, observation) -> (task, page)


# The one registry of environments: the trainer, the worker pool and the scripts all read it.
_REGISTRY = {
    "alfworld": EnvEntry("envs.alfworld:AlfWorldEnv", "envs.alfworld:alfworld_tasks",
                         "valid_train", ("valid_seen", "valid_unseen")),
    "textworld": EnvEntry("envs.textworld_games:TextWorldEnv",
                          "envs.textworld_games:textworld_tasks", "train", ("heldout",),
                          params="envs.textworld_games:GameParams"),
    "toy": EnvEntry("envs.toy:ToyEnv", "envs.toy:toy_tasks", "train", ("eval",)),
    "webshop": EnvEntry("envs.webshop:WebShopEnv", "envs.webshop:webshop_tasks", "train",
                        ("test",), prompt="envs.webshop:PROMPT",
                        view="envs.webshop:observation_view"),
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


def prompt_fields(name: str) -> dict:
  """The agent's `PromptConfig` fields that environment `name` sets (its instruction, its
  observation view); {} for one that keeps the defaults or is not registered."""
  ref = _REGISTRY[name].prompt if name in _REGISTRY else ""
  return dict(_load(ref)) if ref else {}


def observation_view(name: str) -> Callable[[str, str], tuple[str, str]]:
  """Environment `name`'s view of its observations for prompts: (first observation, observation)
  -> (task, page). ValueError naming the environments that have one otherwise."""
  if name not in _REGISTRY or not _REGISTRY[name].view:
    have = sorted(n for n, e in _REGISTRY.items() if e.view)
    raise ValueError(f"observation_view must be None or one of {have}, got {name!r}")
  return _load(_REGISTRY[name].view)


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
    like = f" (its {len(tasks)} ids are like {tasks[0].task_id!r})" if tasks else ""
    raise ValueError(f"train_task_ids: {len(missing)} of {len(ids)} are not tasks of "
                     f"{env_config.env}'s {split!r} split, e.g. {missing[0]!r}{like}")
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


def env_arguments(name: str) -> tuple[str, ...]:
  """The keyword arguments family `name`'s environment takes, sorted: its constructor's named
  ones, and the fields of the entry's `params` class when the constructor takes **params."""
  e = entry(name)
  params = inspect.signature(_load(e.env).__init__).parameters
  names = {k for k, p in params.items() if k != "self" and p.kind in (
      inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)}
  if e.params and any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
    names |= {f.name for f in dataclasses.fields(_load(e.params))}
  return tuple(sorted(names))


# What a task function or an environment constructor raises for a bad argument: a missing data
# folder (OSError), a wrong type (TypeError), a missing optional package (ImportError).
_BAD_ARGUMENT = (ValueError, TypeError, OSError, ImportError, KeyError)


def check_env_config(env_config) -> None:
  """Raises ValueError naming the first bad field of an `EnvConfig` (or a `TrainConfig`), before
  any work: an `env_kwargs` name the environment does not take (the known ones listed) or a value
  its constructor or task function refuses (e.g. a WebShop `data_dir` without the data files), a
  `train_split` or `eval_splits` the environment lacks, or `train_task_ids` not in the train
  split. Lists the splits' tasks (ALFWorld reads each task's json, no game; WebShop loads its
  catalog, as the run would next) and builds one environment instance (no game loaded).
  """
  name, kwargs = env_config.env, env_config.env_kwargs
  if not isinstance(kwargs, dict):
    raise ValueError(f"env_kwargs must be a dict (a JSON object), got {kwargs!r}")
  known = env_arguments(name)
  unknown = sorted(set(kwargs) - set(known))
  if unknown:
    raise ValueError(f"unknown env_kwargs {unknown} for the {name} environment; known: "
                     f"{', '.join(known)}")
  default = entry(name).train_split
  try:  # the environment's own arguments, on its default split
    make_env(name, **{"max_steps": env_config.max_steps, **kwargs}).close()
    task_list(name, default, **kwargs)
  except _BAD_ARGUMENT as e:
    raise ValueError(f"env_kwargs {kwargs} of {name}: {e}") from None
  split = env_config.train_split or default
  eval_splits = env_config.eval_splits or ()
  if not isinstance(eval_splits, (tuple, list)) or not all(isinstance(x, str) for x in eval_splits):
    raise ValueError(f"eval_splits must be None or split names, got {eval_splits!r}")
  for field, splits in (("train_split", (split,)), ("eval_splits", eval_splits)):
    for s in splits:
      try:
        tasks = task_list(name, s, **kwargs)
      except _BAD_ARGUMENT as e:
        raise ValueError(f"{field} {s!r} of {name}: {e}") from None
      if not tasks:
        raise ValueError(f"{field} {s!r} of {name} has no tasks")
  need = env_config.num_train_tasks
  if need is not None and (isinstance(need, bool) or not isinstance(need, int) or need < 1):
    raise ValueError(f"num_train_tasks must be None or an int >= 1, got {need!r}")
  training_tasks(env_config)  # the named train_task_ids are tasks of the train split
