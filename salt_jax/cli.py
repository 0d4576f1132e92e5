"""The command line of a training run: a flag per `TrainConfig` field, generated from its sections.

  python experiments/alfworld_grpo_salt.py --mesh=4x2 --group-size 8 --no-salt
  python experiments/alfworld_grpo_salt.py --recipe verl-agent --model ~/Qwen2.5-1.5B-Instruct
  python experiments/alfworld_grpo_salt.py --config gigpo --config mine.toml --lr 3e-6
  python experiments/alfworld_grpo_salt.py --config runs/x/config.json --out runs/y   # re-run
  salt-jax-train --env toy --tokenizer toy --iters 5                  # the console entry point

A field `foo_bar` is the flag `--foo-bar`; booleans come as `--salt` / `--no-salt`; dicts as JSON
(`--env-kwargs '{"num_rooms": 3}'`); tuples comma-separated (`--eval-splits a,b`); `none` sets an
optional field to None. A value comes from, later winning: the field's default, the script's
defaults (its config file, e.g. `salt_jax/configs/alfworld-cpu.toml`), `--recipe`
(`salt_jax.recipes`), each `--config` in order (a shipped config's name, a TOML file, or a run's
`<out>/config.json`: `salt_jax.configs`), then the flags given. Without `--out` a run gets a new
timestamped folder under the script's runs folder (with `--resume`, the newest one there).

Besides the config: `--log-level`; `--sft-warmstart` (with `--sft-steps`, `--sft-demos`,
`--sft-reasoning`), which behaviour-clones the environment's expert into the policy before RL
(`salt_jax.sft.warm_start`); and `--eval-only`, which evaluates the policy and trains nothing.

Evaluation follows the paper: with `--eval-every N` every N-th iteration plays `--num-eval-tasks`
tasks of each eval split greedily; the run's end prints, and writes to `<out>/eval_summary.json`,
each split's success (overall and per task type), score and valid actions averaged over its last
five evaluations.

This module imports no jax at module level, and sets jax's CPU device count (`use_cpu_devices`)
before any backend starts, so a `--mesh` larger than a CPU machine is simulated.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import os
import sys
import time
import typing
from typing import Any, Callable, Mapping, Optional, Sequence

from salt_jax import configs
from salt_jax.agent.reasoning import REASONERS
from salt_jax.config import (RENAMED_FIELDS, SECTIONS, TrainConfig, read_config_files,
                             script_defaults)
from salt_jax.recipes import RECIPES

# A run's evaluation by the paper's protocol (`metrics.eval_summary`), written by `report`; and
# the same for the one evaluation of --eval-only.
EVAL_SUMMARY_FILE = "eval_summary.json"
EVAL_ONLY_FILE = "eval_only.json"

# Flags that are not config fields, and their defaults (a script's config file may set them).
SCRIPT_DEFAULTS = configs.SCRIPT_DEFAULTS

# The experiment scripts' common CPU sizes (salt_jax/configs/cpu.toml), each script's own file
# extends.
CPU_SIZED = script_defaults("cpu")


def _field_type(section: type, name: str) -> tuple[Any, bool]:
  """(the field's value type, whether it is Optional)."""
  hint = typing.get_type_hints(section)[name]
  args = typing.get_args(hint)
  if typing.get_origin(hint) is typing.Union and type(None) in args:
    return next(a for a in args if a is not type(None)), True
  return hint, False


def _parse_value(kind, optional: bool, flag: str):
  """The argparse `type` function of a field."""
  def parse(text: str):
    if optional and text.strip().lower() == "none":
      return None
    if kind is dict:
      try:
        value = json.loads(text)
      except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"{flag} takes a JSON object: {e}") from None
      if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"{flag} takes a JSON object, got {text!r}")
      return value
    if kind is tuple:
      return tuple(s.strip() for s in text.split(",") if s.strip())
    return kind(text)
  parse.__name__ = getattr(kind, "__name__", str(kind))  # argparse names it in errors
  return parse


def parser(defaults: Mapping[str, Any] = (), description: str = "salt-jax training run"
           ) -> argparse.ArgumentParser:
  """Every `TrainConfig` field as a flag, grouped by section, plus the script's own flags.

  Flags not given are absent from the parsed namespace (`argparse.SUPPRESS`), so `config_from`
  can tell them from defaults; `defaults` (field -> value) only changes the help text's default.
  """
  defaults = dict(defaults)
  p = argparse.ArgumentParser(description=description, argument_default=argparse.SUPPRESS)
  g = p.add_argument_group("run setup")
  g.add_argument("--config", action="append",
                 help="a config file: a shipped one's name "
                 f"({', '.join(configs.shipped())}), a .toml file, or a run's config.json; "
                 "its values replace the defaults and the recipe's. Repeat it to apply several "
                 "in order; flags given win")
  g.add_argument("--recipe", help=f"a named setting from salt_jax.recipes: "
                 f"{', '.join(sorted(RECIPES))} (flags given win)")
  g.add_argument("--log-level", choices=("debug", "info", "warning", "error"),
                 help="salt_jax's log: info = each phase, debug = each rollout turn and "
                 "mini-batch too (default: $SALT_JAX_LOG_LEVEL, else warning: one line an "
                 "iteration)")
  g.add_argument("--eval-only", action="store_true",
                 help="evaluate the policy (the model as given, or with --resume the run's last "
                 "checkpoint) greedily on the eval splits and stop: no training. Writes "
                 f"<out>/{EVAL_ONLY_FILE}")
  g.add_argument("--sft-warmstart", action="store_true",
                 help="behaviour-clone the env's expert into the policy first")
  for name in ("sft_steps", "sft_demos"):
    g.add_argument("--" + name.replace("_", "-"), type=int,
                   help=f"(default: {defaults.get(name, SCRIPT_DEFAULTS[name])}) "
                   + ("cloning steps" if name == "sft_steps" else "expert episodes to clone"))
  g.add_argument("--sft-reasoning", choices=sorted(REASONERS),
                 help=f"(default: {defaults.get('sft_reasoning', SCRIPT_DEFAULTS['sft_reasoning'])})"
                 " the demonstrations' <think> text: none, templated stand-in reasoning, or "
                 "the expert's sub-goal at each step (ALFWorld's tasks; salt_jax.agent.reasoning;"
                 " raise --max-new-tokens to fit it)")
  for section in SECTIONS:
    g = p.add_argument_group(section.__name__, section.__doc__)
    for f in dataclasses.fields(section):
      flag = "--" + f.name.replace("_", "-")
      old = [f"--{o.replace('_', '-')}" for o, new in RENAMED_FIELDS.items() if new == f.name]
      default = defaults.get(f.name, f.default if f.default is not dataclasses.MISSING
                             else f.default_factory())
      kind, optional = _field_type(section, f.name)
      text = f"{f.metadata.get('help', '')} (default: {default!r})"
      if kind is bool:
        g.add_argument(flag, *old, dest=f.name, action=argparse.BooleanOptionalAction, help=text)
      else:
        g.add_argument(flag, *old, dest=f.name, type=_parse_value(kind, optional, flag),
                       help=text, metavar=getattr(kind, "__name__", "X").upper())
  return p


def output_dir(out: Optional[str], resume: bool, root: str) -> str:
  """`out`, else a fresh timestamped run folder under `root` (so rerunning the same command never
  collides with an earlier run's checkpoints), or with `resume` the newest run there."""
  if out:
    return out
  if resume:
    runs = sorted(glob.glob(os.path.join(root, "*")))
    if not runs:
      raise SystemExit(f"error: --resume found no run under {root}; pass --out")
    return runs[-1]
  return os.path.join(root, time.strftime("%Y%m%d-%H%M%S"))


# Flags that choose the policy: with none of them given (nor set by a --config file), a script's
# `default_policy` applies.
POLICY_FLAGS = ("model", "init_params", "tokenizer", "tiny_policy")


def config_from(argv: Optional[Sequence[str]] = None, defaults: Mapping[str, Any] = (), *,
                default_policy: Optional[Callable[[], Mapping[str, Any]]] = None,
                runs_root: str = "runs/train", description: str = "salt-jax training run"
                ) -> tuple[TrainConfig, argparse.Namespace]:
  """(TrainConfig, the parsed flags) of a command line; SystemExit with the reason for a bad one.

  `defaults`: the script's values (config fields, `sft_steps`, `sft_demos`, `sft_reasoning`).
  `default_policy`: returns the values that play the script's own policy (its `model` folder and
  what it was trained with: tasks, prompts, lengths), used only when no flag in `POLICY_FLAGS`
  is given.
  Precedence: field default < `defaults` < `default_policy` < --recipe < each --config in
  order < flags. A config file that sets a policy field counts as a policy flag (a run's
  config.json sets them all).
  Validation of the values themselves is the config's (`TrainConfig.validate`), done by `main`
  before any work.
  """
  defaults = dict(defaults)
  args = parser(defaults, description).parse_args(argv)
  given = vars(args)
  names = {f.name for f in dataclasses.fields(TrainConfig)}
  values = {k: v for k, v in defaults.items() if k in names}
  from_files, script = {}, {}
  for name in given.get("config", []):
    try:
      more, more_script = read_config_files([name])
    except ValueError as e:
      raise SystemExit(f"error: --config {name}: {e}") from None
    from_files.update(more)
    script.update(more_script)
  if default_policy is not None and not any(k in given or k in from_files for k in POLICY_FLAGS):
    values.update(default_policy())
  if "recipe" in given:
    if given["recipe"] not in RECIPES:
      raise SystemExit(f"error: unknown --recipe {given['recipe']!r}; known: {sorted(RECIPES)}")
    values.update(RECIPES[given["recipe"]])
  values.update(from_files)
  values.update({k: v for k, v in given.items() if k in names})
  values["distributed"] = values.get("distributed", False) or any(
      values.get(k) is not None for k in ("coordinator", "num_processes", "process_id"))
  for name, default in SCRIPT_DEFAULTS.items():
    given.setdefault(name, script.get(name, defaults.get(name, default)))
  given.setdefault("sft_warmstart", False)
  given.setdefault("eval_only", False)
  for name in ("sft_steps", "sft_demos"):
    if given[name] < 1:
      raise SystemExit(f"error: --{name.replace('_', '-')} must be >= 1, got {given[name]}")
  if values["distributed"] and given["sft_warmstart"]:
    raise SystemExit("error: --sft-warmstart runs in one process: run experiments/"
                     "sft_warmstart.py first and pass its params with --init-params")
  if values["distributed"] and "out" not in given:
    raise SystemExit("error: with several processes pass the same --out to each")
  if "out" not in given and "out" not in from_files:
    values["out"] = output_dir(None, values.get("resume", False), runs_root)
  return TrainConfig(**values), args


def use_cpu_devices(mesh: str, num_processes: Optional[int] = None) -> None:
  """Gives jax's CPU backend this process's share of the mesh's D*M devices (all of them with one
  process), before any backend starts. On a machine with an accelerator jax uses that instead
  and the CPU count is unused; once a backend has started (jax already used in this process) the
  count stays as it is and `make_mesh` says whether the mesh fits."""
  from salt_jax.sharding import parse_mesh_shape  # pylint: disable=import-outside-toplevel
  data, model = parse_mesh_shape(mesh)
  need = -(-data * model // max(1, num_processes or 1))
  if need <= 1:
    return
  import jax  # pylint: disable=import-outside-toplevel
  try:
    jax.config.update("jax_num_cpu_devices", need)
  except RuntimeError:
    pass  # backends already started (e.g. in a notebook): the mesh check reports a misfit


def main(argv: Optional[Sequence[str]] = None, defaults: Mapping[str, Any] = (), *,
         default_policy: Optional[Callable[[], Mapping[str, Any]]] = None,
         runs_root: str = "runs/train", description: str = "salt-jax training run") -> int:
  """Parses flags (`config_from`), validates them before any work, optionally warm-starts, then
  trains."""
  cfg, args = config_from(argv, defaults, default_policy=default_policy, runs_root=runs_root,
                          description=description)
  from salt_jax.sharding import parse_mesh_shape  # pylint: disable=import-outside-toplevel
  try:
    parse_mesh_shape(cfg.mesh)
  except ValueError as e:
    raise SystemExit(f"error: --{e}") from None
  use_cpu_devices(cfg.mesh, cfg.num_processes)
  # pylint: disable=import-outside-toplevel  (after the device count is set)
  from salt_jax import log
  from salt_jax import runlock
  from salt_jax import sft
  from salt_jax.train import Trainer
  # The console holds one line an iteration; each phase's INFO lines with --log-level info.
  log.configure(getattr(args, "log_level", None) or os.environ.get(log.ENV_VAR) or "warning")

  def trainer_or_exit(c):
    try:  # Trainer validates the config first (now that it lists tasks and reads config.json)
      return Trainer(c)  # then forms the mesh, locks --out, refuses a resume with changed settings
    except ValueError as e:
      raise SystemExit(f"error: {e}") from None

  sft_path = os.path.abspath(os.path.join(cfg.out, sft.SFT_SUBDIR))  # as warm_start names it
  resumed_warm = args.sft_warmstart and cfg.resume and os.path.isdir(sft_path)
  if resumed_warm:  # a resumed run keeps its first warm start (and its saved init_params)
    cfg = dataclasses.replace(cfg, init_params=sft_path)
  trainer = trainer_or_exit(cfg)
  if args.sft_warmstart and not resumed_warm:
    with runlock.RunLock(cfg.out):  # the folder stays locked from one trainer to the next
      path = sft.warm_start(cfg, steps=args.sft_steps, num_demos=args.sft_demos,
                            reasoning=args.sft_reasoning)
      trainer.close()
      trainer = trainer_or_exit(dataclasses.replace(cfg, init_params=path))
  with trainer:
    trainer.setup()
    if args.eval_only:
      row = {"iteration": trainer.iteration_index - 1, **trainer.evaluate()}
      if trainer.process_index == 0:
        report_eval([row], os.path.join(cfg.out, EVAL_ONLY_FILE))
      return 0
    print(f"[salt-jax] {cfg.env}: {len(trainer.task_sampler.tasks)} training tasks, mesh "
          f"{cfg.mesh}, algo {cfg.algo}, SALT {'on' if cfg.salt else 'off'}, out {cfg.out}",
          flush=True)
    trainer.run()
    if trainer.process_index == 0:
      report(cfg.out)
  return 0


def report(out: str) -> None:
  """The end of a run on the console: its success at the start and at the end, its time, and
  where its metrics and curves are (`<out>/curves.png`, drawn by `salt_jax.plot`)."""
  # pylint: disable=import-outside-toplevel
  from salt_jax import metrics as metrics_lib
  from salt_jax import plot
  path = os.path.join(out, plot.METRICS_FILE)
  rows = metrics_lib.read_jsonl(path) if os.path.isfile(path) else []
  for line in metrics_lib.run_summary(rows):
    print(f"[salt-jax] {line}", flush=True)
  report_eval(rows, os.path.join(out, EVAL_SUMMARY_FILE))
  curves = os.path.join(out, plot.CURVES_FILE)
  try:
    plot.plot_runs({os.path.basename(os.path.normpath(out)): rows}, curves)
    drawn = f", curves {curves}"
  except ImportError:
    drawn = " (no curves: `pip install matplotlib`, then `python -m salt_jax.plot RUN`)"
  print(f"[salt-jax] metrics {path}{drawn}", flush=True)


def report_eval(rows, path: str, *, last: int = 5) -> None:
  """Prints the evaluations in `rows` by the paper's protocol (each split's last `last` averaged:
  `metrics.eval_summary`) and writes them to `path`; nothing when no row holds one."""
  from salt_jax import metrics as metrics_lib  # pylint: disable=import-outside-toplevel
  summary = metrics_lib.eval_summary(rows, last=last)
  if not summary:
    return
  for line in metrics_lib.eval_summary_lines(summary):
    print(f"[salt-jax] {line}", flush=True)
  metrics_lib.write_json(path, summary)
  print(f"[salt-jax] evaluation {path}", flush=True)


def console_main() -> int:
  """The `salt-jax-train` entry point: `main` with the fields' own defaults."""
  return main(sys.argv[1:])
