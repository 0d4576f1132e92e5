"""GRPO / RLOO / Dr.GRPO + SALT on real ALFWorld tasks (the shipped valid_train split).

  python experiments/alfworld_grpo_salt.py                 # CPU-sized defaults, shows progress
  python experiments/alfworld_grpo_salt.py --mesh=4x2      # 8 simulated CPU devices if needed
  python experiments/alfworld_grpo_salt.py --model ~/Qwen2.5-1.5B-Instruct --group-size 8 \\
      --tasks-per-iter 16 --max-steps 50 --max-new-tokens 256 --iters 150   # the paper's shape
  python experiments/alfworld_grpo_salt.py --distributed --mesh 32x1 ...   # one per host (TPU pod,
      # SLURM: auto-detected), or --coordinator host0:1234 --num-processes 4 --process-id I

Without --model the policy is a tiny random-init Qwen2 (2 layers, d_model 64, tied embeddings)
over the offline Qwen2.5 tokenizer: it runs on a CPU in minutes but writes no valid action until
--sft-warmstart clones ALFWorld's handcoded expert first (or start from the policy
experiments/build_alfworld_policy.py clones, with --model). Flags -> `salt_jax.train.TrainConfig`;
see `python experiments/alfworld_grpo_salt.py --help`.

This file also holds the command line shared with textworld_grpo_salt.py and sft_warmstart.py.
Nothing here imports jax at module level: `prepare_devices` must set XLA_FLAGS first, so that a
`--mesh` larger than the machine is simulated with CPU devices.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import os
import re
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

CPU_DEFAULTS = dict(group_size=4, tasks_per_iter=2, iters=3, max_steps=6, max_new_tokens=32,
                    max_cache_len=4096, lr=1e-5, env_workers=1, minibatch_rows=4,
                    num_eval_tasks=4, out="runs/alfworld_grpo_salt", sft_demos=16, sft_steps=100)



def prepare_devices(mesh: str, num_processes: int = 1) -> None:
  """Before jax is imported: on a host without an accelerator, simulate this process's share of
  the D*M devices with CPU devices (all of them with one process).

  Raises SystemExit with a clear message for a malformed mesh string.
  """
  m = re.fullmatch(r"\s*(\d+)\s*[xX]\s*(\d+)\s*", mesh or "")
  if not m or int(m.group(1)) < 1 or int(m.group(2)) < 1:
    raise SystemExit(f"error: --mesh must look like DxM with D, M >= 1 (e.g. 4x2), got {mesh!r}")
  need = -(-int(m.group(1)) * int(m.group(2)) // max(1, num_processes))
  if "jax" in sys.modules:
    return  # too late to change the device count; make_mesh will say if it does not fit
  if need > 1 and not _has_accelerator():
    flag = f"--xla_force_host_platform_device_count={need}"
    flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "",
                   os.environ.get("XLA_FLAGS", "")).strip()
    os.environ["XLA_FLAGS"] = f"{flags} {flag}".strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    print(f"[salt-jax] no accelerator: simulating {need} CPU devices of the {mesh} mesh "
          f"(XLA_FLAGS={flag})", flush=True)


def _has_accelerator() -> bool:
  """A cheap look for a GPU or TPU without importing jax (which would fix the device count)."""
  if os.environ.get("JAX_PLATFORMS", "").strip().lower() in ("cpu",):
    return False
  if os.path.exists("/dev/nvidia0") or os.path.exists("/dev/accel0"):
    return True
  return any(n.startswith("vfio") for n in os.listdir("/dev")) if os.path.isdir("/dev") else False


def _bool_flag(p, name, default, help_):
  p.add_argument(f"--{name}", dest=name.replace("-", "_"), action="store_true", default=default,
                 help=help_)
  p.add_argument(f"--no-{name}", dest=name.replace("-", "_"), action="store_false")


def parser(env: str, defaults: dict) -> argparse.ArgumentParser:
  """The flags of one experiment script; `defaults` are its CPU-sized defaults."""
  d = defaults
  p = argparse.ArgumentParser(description=f"GRPO/RLOO/Dr.GRPO + SALT on {env} (salt-jax)")
  p.add_argument("--log-level", default=None, choices=("debug", "info", "warning", "error"),
                 help="salt_jax's log: info = each phase of setup and of an iteration, debug = "
                      "each rollout turn and mini-batch too (default: $SALT_JAX_LOG_LEVEL, else info)")
  p.add_argument("--mesh", default=d.get("mesh", "1x1"),
                 help="DxM device mesh ('data' x 'model'); simulated with CPU devices if needed")
  p.add_argument("--model", default=None,
                 help="a local Hugging Face folder; default: a tiny random-init Qwen2 policy")
  p.add_argument("--param-dtype", default="float32",
                 help="float32 (default: small AdamW steps survive) or bfloat16, for --model")
  p.add_argument("--tokenizer", default=d.get("tokenizer", "qwen25"),
                 help="qwen25 (offline Qwen2.5), toy, or a local folder (ignored with --model)")
  p.add_argument("--recipe", default=None,
                 help="a named setting from salt_jax.recipes, e.g. verl-agent (its values "
                 "replace these defaults; flags given explicitly win)")
  p.add_argument("--algo", default=d.get("algo", "grpo"), help="grpo, rloo or drgrpo")
  p.add_argument("--reward-scale", type=float, default=d.get("reward_scale", 1.0),
                 help="times the env's return (verl-agent: 10 per win)")
  p.add_argument("--invalid-action-penalty", type=float,
                 default=d.get("invalid_action_penalty", 0.1))
  p.add_argument("--penalty-scope", default=d.get("penalty_scope", "trajectory"),
                 help="trajectory (penalty folded into its reward) or step (on the invalid "
                 "step's own row, verl-agent)")
  p.add_argument("--invalid-step", default=d.get("invalid_step", "admissible"),
                 help="admissible (parser or env rejects it) or format (no parsable action, "
                 "verl-agent)")
  p.add_argument("--group-stats", default=d.get("group_stats", "trajectories"),
                 help="group statistics over trajectories or over step rows (steps, verl-agent)")
  _bool_flag(p, "salt", True, "SALT step-level advantages (default on)")
  p.add_argument("--history", type=int, default=d.get("history", 3),
                 help="SALT's state history h")
  p.add_argument("--group-size", type=int, default=d["group_size"])
  p.add_argument("--tasks-per-iter", type=int, default=d["tasks_per_iter"])
  p.add_argument("--iters", type=int, default=d["iters"])
  p.add_argument("--embedder", default="none",
                 help="none, minilm, or a local sentence-transformers folder (embedding merges)")
  p.add_argument("--lr", type=float, default=d.get("lr", 1e-6))
  p.add_argument("--kl-coef", type=float, default=d.get("kl_coef", 0.01))
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--out", default=None,
                 help=f"output folder (default: a new timestamped folder under {d['out']}; with "
                      "--resume, the newest one there)")
  p.add_argument("--resume", action="store_true", help="continue from the last checkpoint in --out")
  p.add_argument("--env-workers", type=int, default=d.get("env_workers", 1))
  p.add_argument("--max-steps", type=int, default=d["max_steps"])
  p.add_argument("--max-new-tokens", type=int, default=d["max_new_tokens"])
  p.add_argument("--max-cache-len", type=int, default=d["max_cache_len"])
  p.add_argument("--eval-every", type=int, default=d.get("eval_every", 0))
  p.add_argument("--num-eval-tasks", type=int, default=d.get("num_eval_tasks", 4))
  p.add_argument("--num-train-tasks", type=int, default=d.get("num_train_tasks"))
  p.add_argument("--layout", default=d.get("layout", "trajectory"),
                 help="trajectory (default) or step")
  p.add_argument("--history-window", type=int, default=d.get("history_window"),
                 help="prompt holds the last k steps (needs --layout step); default: whole history")
  p.add_argument("--minibatch-rows", type=int, default=d.get("minibatch_rows", 8))
  p.add_argument("--microbatch-rows", type=int, default=0,
                 help="rows per forward/backward pass, gradients accumulated over the "
                 "mini-batch (0: the whole mini-batch at once)")
  p.add_argument("--recompute-old-logprobs", action="store_true")
  p.add_argument("--schedule", default="constant", help="constant or cosine")
  p.add_argument("--warmup-steps", type=int, default=0)
  p.add_argument("--distributed", action="store_true",
                 help="join several processes (jax.distributed.initialize; without the next "
                 "three flags the cluster is auto-detected: TPU pod, SLURM, Open MPI)")
  p.add_argument("--coordinator", default=None, help="host:port of process 0 (implies "
                 "--distributed)")
  p.add_argument("--num-processes", type=int, default=None, help="processes in the run")
  p.add_argument("--process-id", type=int, default=None, help="this process's index")
  p.add_argument("--init-params", default=None,
                 help="an orbax params folder to start from (e.g. sft_warmstart.py's)")
  p.add_argument("--sft-warmstart", action="store_true",
                 help="behaviour-clone expert demonstrations first "
                 "(see experiments/sft_warmstart.py)")
  p.add_argument("--sft-steps", type=int, default=d.get("sft_steps", 200))
  p.add_argument("--sft-demos", type=int, default=d.get("sft_demos", 32),
                 help="expert episodes to clone")
  return p


def _recipe(name: str) -> dict:
  """salt_jax.recipes.RECIPES[name], read without importing jax (the package's __init__ does)."""
  import importlib.util  # pylint: disable=import-outside-toplevel
  path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "salt_jax",
                      "recipes.py")
  spec = importlib.util.spec_from_file_location("_salt_jax_recipes", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  if name not in module.RECIPES:
    raise SystemExit(f"error: unknown --recipe {name!r}; known: {sorted(module.RECIPES)}")
  return dict(module.RECIPES[name])


def output_dir(out, resume: bool, root: str) -> str:
  """--out, else a fresh timestamped run folder under `root` (so rerunning the same command never
  collides with an earlier run's checkpoints), or with --resume the newest run there."""
  if out:
    return out
  if resume:
    runs = sorted(glob.glob(os.path.join(root, "*")))
    if not runs:
      raise SystemExit(f"error: --resume found no run under {root}; pass --out")
    return runs[-1]
  return os.path.join(root, time.strftime("%Y%m%d-%H%M%S"))


def _trainer_or_exit(cfg):
  """A `Trainer` for `cfg`, or SystemExit with the reason a bad setting (or a --resume with
  other settings than the saved run's) gives, before any work."""
  from salt_jax.train import Trainer  # pylint: disable=import-outside-toplevel
  try:
    cfg.validate()
    return Trainer(cfg)
  except ValueError as e:
    raise SystemExit(f"error: {e}") from None


def main(env: str, defaults: dict, argv=None) -> int:
  """Parses flags, validates them before any work, optionally warm-starts, then trains."""
  args = parser(env, defaults).parse_args(argv)
  if args.recipe is not None:
    recipe = _recipe(args.recipe)
    args = parser(env, {**defaults, **recipe}).parse_args(argv)
  else:
    recipe = {}
  args.distributed = args.distributed or any(
      v is not None for v in (args.coordinator, args.num_processes, args.process_id))
  if args.distributed and args.sft_warmstart:
    raise SystemExit("error: --sft-warmstart runs in one process: run experiments/"
                     "sft_warmstart.py first and pass its params with --init-params")
  if args.distributed and not args.out:
    raise SystemExit("error: with several processes pass the same --out to each")
  args.out = output_dir(args.out, args.resume, defaults["out"])
  prepare_devices(args.mesh, args.num_processes or 1)
  from salt_jax import log  # pylint: disable=import-outside-toplevel  (after XLA_FLAGS is set)
  log.configure(args.log_level)
  # pylint: disable=import-outside-toplevel  (after XLA_FLAGS is set)
  from salt_jax.train import TrainConfig
  flags = dict(
      env=env, env_kwargs=dict(defaults.get("env_kwargs", {})), mesh=args.mesh, model=args.model,
      tokenizer=args.tokenizer, param_dtype=args.param_dtype, algo=args.algo, salt=args.salt,
      history=args.history,
      group_size=args.group_size, tasks_per_iter=args.tasks_per_iter, iters=args.iters,
      embedder=None if args.embedder == "none" else args.embedder, lr=args.lr,
      kl_coef=args.kl_coef, seed=args.seed, out=args.out, resume=args.resume,
      env_workers=args.env_workers, max_steps=args.max_steps, max_new_tokens=args.max_new_tokens,
      max_cache_len=args.max_cache_len, eval_every=args.eval_every,
      num_eval_tasks=args.num_eval_tasks, num_train_tasks=args.num_train_tasks,
      layout=args.layout, history_window=args.history_window,
      minibatch_rows=args.minibatch_rows, microbatch_rows=args.microbatch_rows,
      recompute_old_logprobs=args.recompute_old_logprobs,
      schedule=args.schedule, warmup_steps=args.warmup_steps,
      init_params=args.init_params, distributed=args.distributed, coordinator=args.coordinator,
      num_processes=args.num_processes, process_id=args.process_id,
      reward_scale=args.reward_scale, invalid_action_penalty=args.invalid_action_penalty,
      penalty_scope=args.penalty_scope, invalid_step=args.invalid_step,
      group_stats=args.group_stats)
  cfg = TrainConfig(**{**recipe, **flags})  # recipe values without a flag, then the flags
  from sft_warmstart import SFT_SUBDIR, warm_start
  sft_path = os.path.abspath(os.path.join(cfg.out, SFT_SUBDIR))  # as warm_start names it
  resumed_warm = args.sft_warmstart and args.resume and os.path.isdir(sft_path)
  if resumed_warm:  # a resumed run keeps its first warm start (and its saved init_params)
    cfg = dataclasses.replace(cfg, init_params=sft_path)
  trainer = _trainer_or_exit(cfg)  # forms the mesh: an impossible one fails here
  if args.sft_warmstart and not resumed_warm:
    path = warm_start(cfg, steps=args.sft_steps, num_demos=args.sft_demos)
    trainer.close()
    trainer = _trainer_or_exit(dataclasses.replace(cfg, init_params=path))
  with trainer:
    trainer.setup()
    print(f"[salt-jax] {env}: {len(trainer.task_sampler.tasks)} training tasks, mesh "
          f"{cfg.mesh}, algo {cfg.algo}, SALT {'on' if cfg.salt else 'off'}, out {cfg.out}",
          flush=True)
    trainer.run()
  print(f"[salt-jax] metrics: {os.path.join(cfg.out, 'metrics.jsonl')}", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main("alfworld", CPU_DEFAULTS))
