"""The generated command line (`salt_jax.cli`) and the config's sections and file round trip."""

import dataclasses
import json
import os
import subprocess
import sys

import pytest

from salt_jax import cli
from salt_jax.config import SECTIONS, TrainConfig, parse_overrides, section_of
from salt_jax.recipes import RECIPES

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOY = dict(env="toy", env_kwargs={"num_rooms": 3}, tokenizer="toy", group_size=4,
           tasks_per_iter=2, num_train_tasks=4, max_steps=4, max_new_tokens=24,
           max_cache_len=512, env_workers=0, lr=3e-4, minibatch_rows=4, iters=1, seed=3,
           progress=False, tensorboard=False)


def _flag_dests(parser) -> set:
  return {a.dest for a in parser._actions}  # pylint: disable=protected-access


def test_every_field_has_a_flag_and_one_section():
  fields = [f.name for f in dataclasses.fields(TrainConfig)]
  assert len(fields) == len(set(fields)) == sum(len(dataclasses.fields(s)) for s in SECTIONS)
  assert set(fields) <= _flag_dests(cli.parser())
  for name in fields:
    assert name in {f.name for f in dataclasses.fields(section_of(name))}
  with pytest.raises(KeyError):
    section_of("no_such_field")


def test_flags_parse_to_the_fields_types(tmp_path):
  cfg, args = cli.config_from([
      "--group-size", "6", "--lr", "3e-4", "--no-salt", "--env-kwargs", '{"num_rooms": 3}',
      "--eval-splits", "valid_seen, valid_unseen", "--prompt-history", "2", "--layout", "step",
      "--clip-eps-high", "none", "--embedder", "none", "--out", str(tmp_path / "r"),
      "--sft-warmstart"])
  assert (cfg.group_size, cfg.lr, cfg.salt, cfg.env_kwargs, cfg.eval_splits, cfg.prompt_history,
          cfg.layout, cfg.clip_eps_high, cfg.embedder, cfg.out) == (
              6, 3e-4, False, {"num_rooms": 3}, ("valid_seen", "valid_unseen"), 2, "step", None,
              None, str(tmp_path / "r"))
  assert args.sft_warmstart and (args.sft_steps, args.sft_demos) == (200, 32)
  for bad in (["--group-size", "x"], ["--env-kwargs", "[1]"], ["--env-kwargs", "{"],
              ["--no-such-flag"]):
    with pytest.raises(SystemExit):
      cli.config_from(bad)


def test_values_in_order_defaults_recipe_config_flags(tmp_path):
  saved = dataclasses.replace(TrainConfig(**TOY), lr=2e-5, group_size=5, out=str(tmp_path / "a"))
  path = tmp_path / "config.json"
  path.write_text(json.dumps(saved.to_json()))
  script = dict(cli.CPU_SIZED, env="alfworld", max_steps=6)
  # script defaults, then the recipe over them
  cfg, _ = cli.config_from(["--recipe", "verl-agent", "--out", "x"], script)
  assert (cfg.max_steps, cfg.group_size, cfg.lr) == (50, 8, RECIPES["verl-agent"]["lr"])
  # a config file over the recipe: the saved run again, whole
  cfg, _ = cli.config_from(["--recipe", "verl-agent", "--config", str(path)], script)
  assert cfg == saved
  # flags given win over all
  cfg, _ = cli.config_from(["--config", str(path), "--group-size", "3", "--out", "b"], script)
  assert cfg == dataclasses.replace(saved, group_size=3, out="b")
  # no --out, no config: a new timestamped folder under the script's runs folder
  cfg, _ = cli.config_from([], script, runs_root=str(tmp_path / "runs"))
  assert os.path.dirname(cfg.out) == str(tmp_path / "runs")
  with pytest.raises(SystemExit, match="no run under"):
    cli.config_from(["--resume"], script, runs_root=str(tmp_path / "none"))


def test_config_file_round_trip_and_bad_files(tmp_path):
  cfg = TrainConfig(**TOY, eval_splits=("eval",), tiny_policy={"num_layers": 1})
  assert TrainConfig.from_json(json.loads(json.dumps(cfg.to_json()))) == cfg
  with pytest.raises(ValueError, match="unknown config fields: bogus"):
    TrainConfig.from_json({**cfg.to_json(), "bogus": 1})
  assert TrainConfig.from_json({**cfg.to_json(), "bogus": 1}, ignore_unknown=True) == cfg
  bad = tmp_path / "bad.json"
  bad.write_text("{not json")
  for path in (bad, tmp_path / "missing.json"):
    with pytest.raises(SystemExit, match="--config"):
      cli.config_from(["--config", str(path)])


def test_process_flags_imply_distributed_and_need_an_out():
  cfg, _ = cli.config_from(["--coordinator", "h:1", "--num-processes", "2", "--process-id", "1",
                            "--out", "x"])
  assert cfg.distributed and (cfg.coordinator, cfg.num_processes, cfg.process_id) == ("h:1", 2, 1)
  with pytest.raises(SystemExit, match="same --out"):
    cli.config_from(["--num-processes", "2"])


def test_cli_imports_no_jax_and_sets_the_cpu_device_count():
  code = ("import sys; from salt_jax import cli; assert 'jax' not in sys.modules, 'jax imported'; "
          "cli.use_cpu_devices('4x2'); import jax; print(len(jax.devices('cpu')))")
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                     env=env, cwd=ROOT, check=False)
  assert p.returncode == 0, p.stderr[-2000:]
  assert p.stdout.strip() == "8"


def test_a_runs_saved_config_reruns_it(tmp_path, capsys, salt_jax_logger_restored, monkeypatch):
  """One toy iteration from flags, then the same run again from its config.json: the same
  config, and the same first iteration's rollout. Each run ends with its summary and curves;
  the phases' INFO lines are left out unless asked for."""
  monkeypatch.delenv("SALT_JAX_LOG_LEVEL", raising=False)
  first = str(tmp_path / "first")
  flags = [f"--{k.replace('_', '-')}={json.dumps(v) if isinstance(v, dict) else v}"
           for k, v in TOY.items() if not isinstance(v, bool)]
  assert cli.main([*flags, "--no-progress", "--no-tensorboard", f"--out={first}"]) == 0
  captured = capsys.readouterr()
  assert " INFO " not in captured.err
  printed = captured.out.splitlines()
  assert printed[-3].startswith("[salt-jax] success, iteration 1: ")
  assert printed[-2].startswith("[salt-jax] 1 iterations in ")
  curves = os.path.join(first, "curves.png")
  metrics = os.path.join(first, "metrics.jsonl")
  assert printed[-1] == f"[salt-jax] metrics {metrics}, curves {curves}"
  assert os.path.getsize(curves) > 0
  again = str(tmp_path / "again")
  assert cli.main(["--config", os.path.join(first, "config.json"), f"--out={again}"]) == 0
  cfgs = [TrainConfig.load(os.path.join(d, "config.json")) for d in (first, again)]
  assert cfgs[0] == dataclasses.replace(TrainConfig(**TOY), out=first)
  assert cfgs[1] == dataclasses.replace(cfgs[0], out=again)
  rows = []
  for d in (first, again):
    with open(os.path.join(d, "metrics.jsonl"), encoding="utf-8") as f:
      rows.append(json.loads(f.readline()))
  for key in ("success_rate", "num_steps", "valid_action_ratio", "response_tokens"):
    assert rows[0][key] == rows[1][key], key


def test_renamed_fields_read_under_their_old_names(tmp_path):
  cfg = TrainConfig.from_json({"history": 2, "history_window": 1, "layout": "step"})
  assert (cfg.salt_history, cfg.prompt_history) == (2, 1)
  cfg, _ = cli.config_from(["--history", "4", "--history-window", "2", "--out", "x"])
  assert (cfg.salt_history, cfg.prompt_history) == (4, 2)
  # a checkpoint whose saved config has the old names resumes, and is compared under the new ones
  from salt_jax.checkpoint import RunCheckpoints  # pylint: disable=import-outside-toplevel
  run = tmp_path / "run"
  cfg = TrainConfig(out=str(run), resume=True)
  old = {"salt_history": "history", "prompt_history": "history_window"}
  saved = {old.get(k, k): v for k, v in RunCheckpoints(cfg, None).compared_config().items()}
  assert "history" in saved and "salt_history" not in saved
  meta = run / "checkpoints" / "1" / "meta"
  meta.mkdir(parents=True)
  (meta / "metadata").write_text(json.dumps({"iteration": 1, "config": saved}))
  RunCheckpoints(cfg, None).check_start()
  with pytest.raises(ValueError, match="salt_history: saved 3, now 5"):
    RunCheckpoints(dataclasses.replace(cfg, salt_history=5), None).check_start()


def test_parse_overrides_reads_literals_and_refuses_what_is_not_an_override():
  got = parse_overrides(["lr=3e-4", "group_size=4", 'env_kwargs={"num_rooms": 2}',
                         "tokenizer=toy", 'model="a=b.gguf"', "salt=False"])
  assert got == {"lr": 3e-4, "group_size": 4, "env_kwargs": {"num_rooms": 2}, "tokenizer": "toy",
                 "model": "a=b.gguf", "salt": False}
  assert parse_overrides([]) == {}
  with pytest.raises(ValueError, match="FIELD=VALUE"):
    parse_overrides(["lr"])
  with pytest.raises(ValueError, match="not a TrainConfig field"):
    parse_overrides(["learning_rate=1e-3"])


def test_eval_every_and_eval_only(tmp_path, capsys, salt_jax_logger_restored, monkeypatch):
  """A toy run that evaluates every iteration ends with each split's evaluation by the paper's
  protocol (its last evaluations averaged) in <out>/eval_summary.json; --eval-only on its last
  checkpoint reproduces the last evaluation exactly and trains nothing, and --eval-only on the
  untrained policy evaluates it after 0 iterations, leaving no checkpoint behind."""
  monkeypatch.delenv("SALT_JAX_LOG_LEVEL", raising=False)
  run = str(tmp_path / "run")
  flags = [f"--{k.replace('_', '-')}={json.dumps(v) if isinstance(v, dict) else v}"
           for k, v in TOY.items() if not isinstance(v, bool)]
  flags += ["--no-progress", "--no-tensorboard", "--eval-every=1", "--num-eval-tasks=4"]
  assert cli.main([*flags, "--iters=2", f"--out={run}"]) == 0
  printed = capsys.readouterr().out.splitlines()
  evals = [line for line in printed if line.startswith("[salt-jax] eval eval (")]
  assert len(evals) == 1 and evals[0].startswith(
      "[salt-jax] eval eval (mean of the last 2 evaluations, after iterations 1, 2, 4 tasks, "
      "greedy): success ")
  with open(os.path.join(run, "metrics.jsonl"), encoding="utf-8") as f:
    rows = [json.loads(line) for line in f]
  with open(os.path.join(run, cli.EVAL_SUMMARY_FILE), encoding="utf-8") as f:
    summary = json.load(f)["eval"]
  assert summary["after_iterations"] == [1, 2] and summary["num_tasks"] == 4
  assert summary["success_rate"] == pytest.approx(
      (rows[0]["eval/eval/success_rate"] + rows[1]["eval/eval/success_rate"]) / 2)
  assert set(summary["success_rate_by_type"]) == {"walk", "key-door"}

  assert cli.main([*flags, "--iters=2", f"--out={run}", "--resume", "--eval-only"]) == 0
  with open(os.path.join(run, cli.EVAL_ONLY_FILE), encoding="utf-8") as f:
    again = json.load(f)["eval"]
  assert again["after_iterations"] == [2]
  for key in ("success_rate", "score", "valid_action_ratio"):
    assert again[key] == rows[1][f"eval/eval/{key}"], key
  with open(os.path.join(run, "metrics.jsonl"), encoding="utf-8") as f:
    assert [json.loads(line) for line in f] == rows  # nothing trained or logged

  fresh = str(tmp_path / "fresh")
  assert cli.main([*flags, f"--out={fresh}", "--eval-only"]) == 0
  printed = capsys.readouterr().out.splitlines()
  assert printed[-2].startswith("[salt-jax] eval eval (after 0 iterations, 4 tasks, greedy)")
  with open(os.path.join(fresh, cli.EVAL_ONLY_FILE), encoding="utf-8") as f:
    assert json.load(f)["eval"]["after_iterations"] == [0]
  assert not os.path.exists(os.path.join(fresh, "checkpoints")) or not os.listdir(
      os.path.join(fresh, "checkpoints"))
