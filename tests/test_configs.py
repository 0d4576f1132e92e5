"""Config files a run names, applied in order (salt_jax.configs, config.read_config_files), and
the command line's --config."""

import dataclasses
import json
import os

import pytest

from salt_jax import cli, configs
from salt_jax.config import TrainConfig, read_config_files, script_defaults
from salt_jax.recipes import NAMES, RECIPES

FIELDS = {f.name for f in dataclasses.fields(TrainConfig)}


def test_every_shipped_file_loads_into_a_valid_config():
  assert set(NAMES) <= set(configs.shipped()) and {"cpu", "alfworld-cpu"} <= set(configs.shipped())
  for name in configs.shipped():
    fields, script = read_config_files([name])
    assert fields and set(fields) <= FIELDS and set(script) <= set(configs.SCRIPT_KEYS), name
    TrainConfig(**fields)  # every value a field takes
  for name in NAMES:  # a recipe is its file's fields; the ALFWorld ones validate as they are
    assert RECIPES[name] == read_config_files([name])[0]
  TrainConfig.from_recipe("verl-agent").validate()


def test_extends_apply_first_and_later_files_win(tmp_path):
  cpu, _ = read_config_files(["cpu"])
  alf, script = read_config_files(["alfworld-cpu"])
  assert {k: v for k, v in alf.items() if k not in cpu} and alf["lr"] == 3e-4 != cpu["lr"]
  assert all(alf[k] == v for k, v in cpu.items() if k not in ("group_size", "tasks_per_iter",
                                                               "iters", "lr", "env_workers",
                                                               "minibatch_rows"))
  assert script == {"sft_demos": 16, "sft_steps": 100}
  assert script_defaults("alfworld-cpu") == {**alf, **script}
  # A file of one's own: a relative extends, a renamed field, a list read as a tuple.
  (tmp_path / "sub").mkdir()
  (tmp_path / "sub" / "base.toml").write_text('extends = "gigpo"\nhistory = 5\nlr = 2e-6\n')
  (tmp_path / "mine.toml").write_text(
      'extends = ["sub/base.toml"]\nlr = 3e-6\neval_splits = ["valid_seen"]\n'
      'env_kwargs = {num_rooms = 2}\nsft_reasoning = "templated"\n')
  fields, script = read_config_files(["verl-agent", str(tmp_path / "mine.toml")])
  assert fields == {**RECIPES["gigpo"], "salt_history": 5, "lr": 3e-6,
                    "eval_splits": ("valid_seen",), "env_kwargs": {"num_rooms": 2}}
  assert script == {"sft_reasoning": "templated"}
  assert read_config_files(["ppo", "verl-agent"])[0] == RECIPES["verl-agent"] | {
      k: v for k, v in RECIPES["ppo"].items() if k not in RECIPES["verl-agent"]}


def test_a_runs_config_json_is_a_whole_config(tmp_path):
  saved = dataclasses.replace(TrainConfig(env="toy", lr=2e-5), salt_history=4)
  data = saved.to_json()
  data["history"] = data.pop("salt_history")  # as a run saved before the rename wrote it
  del data["group_size"]  # a field the run's version did not have: its default
  path = tmp_path / "config.json"
  path.write_text(json.dumps(data))
  fields, _ = read_config_files(["verl-agent", str(path)])
  assert TrainConfig(**fields) == saved


@pytest.mark.parametrize("write, name, match", [
    (None, "no-such-recipe", "no config named 'no-such-recipe'; shipped: alfworld-cpu"),
    (None, "settings.yaml", "is .toml or .json"),
    (None, "missing.toml", "cannot read"),
    ("lr = ", "bad.toml", "is not valid TOML"),
    ("{not json", "bad.json", "is not valid JSON"),
    ("[1, 2]", "list.json", "holds list, not a table"),
    ('{"bogus": 1}', "unknown.json", "unknown config fields: bogus"),
    ("bogus = 1\nlr = 1e-6", "unknown.toml", "unknown.toml: unknown config fields: bogus"),
    ("extends = 3", "ext.toml", "extends is a list of config names"),
    ('extends = ["cycle.toml"]', "cycle.toml", "extend each other in a cycle"),
    ('lr = 1e-6\nmax_steps = "many"', "typed.toml", None),  # a wrong type: validate's to say
])
def test_bad_files_are_refused_naming_the_file(tmp_path, write, name, match):
  path = name if "." not in name else str(tmp_path / name)  # a bare name is a shipped file's
  if write is not None:
    with open(path, "w", encoding="utf-8") as f:
      f.write(write)
  if match is None:
    with pytest.raises(ValueError, match="max_steps"):
      TrainConfig(**read_config_files([path])[0]).validate()
    return
  with pytest.raises(ValueError, match=match):
    read_config_files([path])
  with pytest.raises(SystemExit, match=f"--config {path}: "):
    cli.config_from(["--config", path, "--out", "x"])


def test_command_line_applies_config_files_in_order_then_flags(tmp_path):
  mine = tmp_path / "mine.toml"
  mine.write_text("group_size = 6\nlr = 3e-6\nsft_steps = 7\n")
  policy = {"tokenizer": "toy", "tiny_policy": {"num_layers": 1}}
  script = dict(cli.CPU_SIZED, env="alfworld", max_steps=6)
  cfg, args = cli.config_from(["--config", "gigpo", "--config", str(mine), "--lr", "4e-6",
                               "--out", "x"], script, default_policy=lambda: policy)
  want = dataclasses.replace(TrainConfig(**{**script_fields(script), **policy,
                                            **RECIPES["gigpo"]}),
                             group_size=6, lr=4e-6, out="x")
  assert cfg == want and args.sft_steps == 7 and args.sft_demos == 16
  # --config NAME of a recipe is --recipe NAME; flags still win
  assert cli.config_from(["--recipe", "gigpo", "--out", "x"], script)[0] == cli.config_from(
      ["--config", "gigpo", "--out", "x"], script)[0]
  # a file that picks the policy replaces the script's own, as a --tokenizer flag would
  mine.write_text('tokenizer = "qwen2.5"\n')
  cfg, _ = cli.config_from(["--config", str(mine), "--out", "x"], script,
                           default_policy=lambda: policy)
  assert cfg.tokenizer == "qwen2.5" and cfg.tiny_policy == TrainConfig().tiny_policy
  # without --out: a config file's out, else a new folder under the script's runs folder
  cfg, _ = cli.config_from(["--config", "verl-agent"], script, runs_root=str(tmp_path / "runs"))
  assert os.path.dirname(cfg.out) == str(tmp_path / "runs")


def script_fields(script):
  return {k: v for k, v in script.items() if k in FIELDS}
