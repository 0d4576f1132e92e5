"""Config files: settings a run names, applied in order, each a table of `TrainConfig` fields.

  python experiments/alfworld_grpo_salt.py --config verl-agent --model ~/Qwen2.5-1.5B-Instruct
  python experiments/alfworld_grpo_salt.py --config gigpo --config mine.toml --lr 3e-6
  python experiments/alfworld_grpo_salt.py --config runs/x/config.json --out runs/y  # re-run

A name without a folder or a dot is a file shipped in this folder (`<name>.toml`): the recipes
(`verl-agent`, `verl-agent-webshop`, `gigpo`, `gigpo-webshop`, `ppo`: published settings, each
value with its source) and the experiment scripts' CPU defaults (`cpu`, `alfworld-cpu`, ...).
Anything else is a path to a `.toml` file, or to a run's `<out>/config.json`.

A TOML file holds the fields it changes, field = value, and may start from other files:
`extends = ["name or path", ...]`, applied first, in order (a path relative to the file's
folder). Besides fields it may set the scripts' own settings (`SCRIPT_KEYS`). TOML has no null:
leave a field out to keep its default, or set an optional field to none with its flag
(`--clip-eps-high none`). A JSON file is a whole config, as a run saves it
(`TrainConfig.to_json`): every field, those it lacks at their defaults, so it runs its run
again. Fields renamed since a file was written are read under their new names.

This module reads the files; `salt_jax.config.read_config_files` turns them into fields (and
`script_defaults` into a script's defaults). It imports no jax.
"""

from __future__ import annotations

import json
import os
import tomllib
from typing import Any, Iterable

FOLDER = os.path.dirname(os.path.abspath(__file__))
SUFFIXES = (".toml", ".json")
# The experiment scripts' settings that are not config fields (`salt_jax.cli`'s --sft-* flags),
# and their defaults.
SCRIPT_DEFAULTS = dict(sft_steps=200, sft_demos=32, sft_reasoning="none")
SCRIPT_KEYS = tuple(SCRIPT_DEFAULTS)
# The shipped files that reproduce a published setting (`salt_jax.recipes`).
RECIPE_NAMES = ("verl-agent", "verl-agent-webshop", "gigpo", "gigpo-webshop", "ppo")


def shipped() -> list[str]:
  """The names of the config files shipped here."""
  return sorted(f[:-len(".toml")] for f in os.listdir(FOLDER) if f.endswith(".toml"))


def path_of(name: str, relative_to: str = "") -> str:
  """The file a name stands for: a shipped config's, else `name` as a path (relative to the
  folder `relative_to` when given and `name` is relative). ValueError for an unknown name."""
  if os.sep not in name and "/" not in name and "." not in name:
    if name not in shipped():
      raise ValueError(f"no config named {name!r}; shipped: {', '.join(shipped())} (or give a "
                       ".toml or .json path)")
    return os.path.join(FOLDER, name + ".toml")
  if not name.endswith(SUFFIXES):
    raise ValueError(f"a config file is .toml or .json, not {name!r}")
  return os.path.join(relative_to, name) if relative_to else name


def _read(path: str) -> dict:
  try:
    with open(path, "rb") as f:
      data = tomllib.load(f) if path.endswith(".toml") else json.load(f)
  except OSError as e:
    raise ValueError(f"cannot read {path}: {e.strerror or e}") from None
  except (tomllib.TOMLDecodeError, json.JSONDecodeError, UnicodeDecodeError) as e:
    raise ValueError(f"{path} is not valid {path.rsplit('.', 1)[-1].upper()}: {e}") from None
  if not isinstance(data, dict):
    raise ValueError(f"{path} holds {type(data).__name__}, not a table of fields")
  return data


def read(names: Iterable[str]) -> list[tuple[str, dict[str, Any]]]:
  """The files `names` stand for, each after the files it extends: (path, its table without
  `extends`), in the order they apply. ValueError naming the file for an unknown name, an
  unreadable file, a bad `extends` or a cycle of them. What the keys mean is
  `salt_jax.config.read_config_files`'s to check."""
  out = []

  def visit(name: str, relative_to: str, chain: tuple[str, ...]) -> None:
    path = os.path.abspath(path_of(name, relative_to))
    if path in chain:
      raise ValueError(f"config files extend each other in a cycle: "
                       f"{' -> '.join(chain + (path,))}")
    data = _read(path)
    if path.endswith(".toml"):
      bases = data.pop("extends", [])
      if isinstance(bases, str):
        bases = [bases]
      if not isinstance(bases, list) or not all(isinstance(b, str) for b in bases):
        raise ValueError(f"{path}: extends is a list of config names or paths, got {bases!r}")
      for base in bases:
        visit(base, os.path.dirname(path), chain + (path,))
    out.append((path, data))

  for name in names:
    visit(name, "", ())
  return out
