"""Behaviour-cloning warm start: clone the environment's expert into the policy, save its params.

  python experiments/sft_warmstart.py --env toy --steps 150
  python experiments/sft_warmstart.py --env alfworld --demos 32 --out runs/alfworld_sft

The saved params (`<out>/sft_params`, an orbax tree) start an RL run through
`TrainConfig.init_params`, or directly with `--sft-warmstart` on the RL scripts. The policy and
prompts are built exactly as the RL trainer builds them, so the cloned tokens are the ones the
agent loop will ask for.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

SFT_SUBDIR = "sft_params"


def warm_start(cfg, *, steps: int = 200, num_demos: int = 32, lr: float = 3e-3,
               rows: int = 8, group_by_length: bool = False) -> str:
  """Clones expert episodes of `cfg`'s env into `cfg`'s policy; returns the saved params' folder.

  Args:
    cfg: a `salt_jax.train.TrainConfig` (env, tokenizer, policy, prompt layout, max_steps, seed).
    steps, lr, rows: behaviour-cloning optimizer steps, peak learning rate, sequences per step.
    num_demos: expert episodes (tasks of the training split, cycled with new env seeds).
    group_by_length: draw demos of similar lengths together (`SFTConfig.group_by_length`).
  """
  # pylint: disable=import-outside-toplevel  (jax only after the caller set XLA_FLAGS)
  from flax import nnx

  from envs.registry import make_env, task_list
  from salt_jax import sft, train
  from salt_jax.agent.prompts import env_prompt_config
  from salt_jax.sharding import make_mesh

  t0 = time.perf_counter()
  mesh = make_mesh(cfg.mesh)
  tok = train._build_tokenizer(cfg)  # pylint: disable=protected-access
  model = train.build_policy(cfg, tok, mesh)
  if cfg.init_params is not None:
    nnx.update(model, train.load_params(cfg.init_params, nnx.state(model)))
  env_kw = dict(cfg.env_kwargs, max_steps=cfg.max_steps)
  if cfg.env != "toy":
    env_kw["expert"] = True
  env = make_env(cfg.env, **env_kw)
  split = cfg.train_split or train.ENV_TRAIN_SPLIT[cfg.env]
  task_kw = dict(cfg.env_kwargs)
  if cfg.num_train_tasks is not None:
    task_kw["num_tasks"] = cfg.num_train_tasks
  tasks = task_list(cfg.env, split, **task_kw)
  # Only as many episodes as asked: the tasks in order, with new env seeds once they run out
  # (an ALFWorld episode costs seconds, so playing every task first would be wasted).
  seeds = range(-(-num_demos // len(tasks)))
  demos = sft.collect_demos(env, tasks[:num_demos], seeds=seeds, max_steps=cfg.max_steps,
                            only_won=False)[:num_demos]
  env.close()
  won = sum(d.won for d in demos)
  print(f"[sft] {len(demos)} expert episodes ({won} won within {cfg.max_steps} steps, "
        f"{sum(len(d.actions) for d in demos)} steps) in {time.perf_counter() - t0:.1f}s",
        flush=True)
  pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
  batch = sft.demo_token_batch(demos, tok, pad_id=pad,
                               prompt_config=env_prompt_config(cfg.env,
                                                               history_window=cfg.history_window),
                               layout=cfg.layout, min_length=cfg.min_seq_len,
                               max_length=cfg.max_cache_len)
  before = sft.nll(model, batch)
  t1 = time.perf_counter()
  sft.behaviour_clone(model, batch, sft.SFTConfig(
      steps=steps, rows=rows, lr=lr, seed=cfg.seed, min_length=cfg.min_seq_len,
      group_by_length=group_by_length), log_every=max(1, steps // 5))
  after = sft.nll(model, batch)
  path = os.path.abspath(os.path.join(cfg.out, SFT_SUBDIR))
  train.save_params(path, nnx.state(model))
  print(f"[sft] demo NLL {before:.3f} -> {after:.3f} nats/token over {batch.num_loss_tokens} "
        f"tokens, {steps} steps in {time.perf_counter() - t1:.1f}s; saved {path}", flush=True)
  return path


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--env", default="toy", help="toy, alfworld, textworld or webshop")
  p.add_argument("--mesh", default="1x1")
  p.add_argument("--tokenizer", default=None, help="default: toy for toy, else qwen25")
  p.add_argument("--model", default=None, help="a local Hugging Face folder (default: tiny policy)")
  p.add_argument("--steps", type=int, default=200)
  p.add_argument("--demos", type=int, default=32)
  p.add_argument("--lr", type=float, default=3e-3)
  p.add_argument("--max-steps", type=int, default=None, help="default: 6 (toy), 8 otherwise")
  p.add_argument("--max-cache-len", type=int, default=4096)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--group-by-length", action="store_true",
                 help="draw demos of similar lengths together (less padding, faster steps)")
  p.add_argument("--out", default=None)
  args = p.parse_args(argv)
  from alfworld_grpo_salt import prepare_devices  # pylint: disable=import-outside-toplevel
  prepare_devices(args.mesh)
  from salt_jax.train import TrainConfig  # pylint: disable=import-outside-toplevel
  cfg = TrainConfig(env=args.env, mesh=args.mesh, model=args.model,
                    tokenizer=args.tokenizer or ("toy" if args.env == "toy" else "qwen25"),
                    max_steps=args.max_steps or (6 if args.env == "toy" else 8),
                    max_cache_len=args.max_cache_len, seed=args.seed,
                    out=args.out or f"runs/{args.env}_sft")
  try:
    cfg.validate()
  except ValueError as e:
    raise SystemExit(f"error: {e}") from None
  warm_start(cfg, steps=args.steps, num_demos=args.demos, lr=args.lr,
             group_by_length=args.group_by_length)
  return 0


if __name__ == "__main__":
  sys.exit(main())
