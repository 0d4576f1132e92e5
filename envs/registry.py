"""Environments by name, so a worker process builds its own from a picklable (name, kwargs) spec.

  make_env("alfworld", expert=True)          -> envs.alfworld.AlfWorldEnv
  make_env("textworld", quest_length=6)      -> envs.textworld_games.TextWorldEnv
  make_env("toy", num_rooms=5)               -> envs.toy.ToyEnv
  make_env("webshop", human_goals=True)      -> envs.webshop.WebShopEnv
  task_list("alfworld", "valid_unseen")      -> the tasks of a split

Modules are imported on first use: a worker that plays the toy env never imports alfworld. Task
lists accept the env's own keyword arguments too (e.g. `data_dir`, `quest_length`) and ignore the
ones that only concern playing (`max_steps`, `expert`), so one kwargs dict can serve both calls.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any, Callable

from envs.base import Task, TextEnv


# name -> ("module:EnvClass", "module:task_function")
_REGISTRY = {
    "alfworld": ("envs.alfworld:AlfWorldEnv", "envs.alfworld:alfworld_tasks"),
    "textworld": ("envs.textworld_games:TextWorldEnv", "envs.textworld_games:textworld_tasks"),
    "toy": ("envs.toy:ToyEnv", "envs.toy:toy_tasks"),
    "webshop": ("envs.webshop:WebShopEnv", "envs.webshop:webshop_tasks"),
}


def names() -> tuple[str, ...]:
  return tuple(sorted(_REGISTRY))


def _load(ref: str) -> Callable:
  module, attr = ref.split(":")
  return getattr(importlib.import_module(module), attr)


def _entry(name: str) -> tuple[str, str]:
  if name not in _REGISTRY:
    raise ValueError(f"unknown environment {name!r}; known: {names()}")
  return _REGISTRY[name]


def make_env(name: str, **kwargs: Any) -> TextEnv:
  """A new environment instance of family `name` built with `kwargs`."""
  return _load(_entry(name)[0])(**kwargs)


def task_list(name: str, split: str, **kwargs: Any) -> list[Task]:
  """The tasks of `split` for family `name`.

  Splits: alfworld valid_train / valid_seen / valid_unseen (or any folder of `$ALFWORLD_DATA`);
  textworld train / heldout; toy any name; webshop train / test. Keyword arguments the task
  function does not take are dropped (they are the env's, e.g. `max_steps`), except that the task
  function's own must match.
  """
  fn = _load(_entry(name)[1])
  params = inspect.signature(fn).parameters
  if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
    # textworld_tasks takes GameParams fields through **params: keep those, drop env-only ones.
    env_only = set(inspect.signature(_load(_entry(name)[0]).__init__).parameters) - {"self", "params"}
    kept = {k: v for k, v in kwargs.items() if k not in env_only or k in params}
  else:
    kept = {k: v for k, v in kwargs.items() if k in params}
  return fn(split=split, **kept)
