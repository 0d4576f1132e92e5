"""Behaviour-cloning warm start: clone the environment's expert into the policy, save its params.

  python experiments/sft_warmstart.py --env toy --steps 150
  python experiments/sft_warmstart.py --env alfworld --demos 32 --out runs/alfworld_sft
  python experiments/sft_warmstart.py --env toy --reasoning templated   # stand-in <think> text
  python experiments/sft_warmstart.py --env alfworld --model M --lora-rank 8  # adapters, merged

The saved params (`<out>/sft_params`, an orbax tree; `salt_jax.sft.warm_start`) start an RL run through
`TrainConfig.init_params`, or directly with `--sft-warmstart` on the RL scripts. The policy and
prompts are built exactly as the RL trainer builds them, so the cloned tokens are the ones the
agent loop will ask for.
"""

import argparse
import sys

from salt_jax.agent.reasoning import REASONERS
from salt_jax.config import DEFAULT_LORA_TARGETS
from salt_jax.cli import use_cpu_devices


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
  p.add_argument("--reasoning", choices=sorted(REASONERS), default="none",
                 help="the demonstrations' <think> text (salt_jax.agent.reasoning)")
  p.add_argument("--group-by-length", action="store_true",
                 help="draw demos of similar lengths together (less padding, faster steps)")
  p.add_argument("--lora-rank", type=int, default=0,
                 help="clone into LoRA adapters of this rank over the frozen model (0: every "
                 "parameter); the saved params have the adapters merged in")
  p.add_argument("--lora-alpha", type=float, default=None, help="default: the rank")
  p.add_argument("--lora-targets", default=DEFAULT_LORA_TARGETS,
                 help="regex over projection paths (default: all seven projections)")
  p.add_argument("--out", default=None)
  args = p.parse_args(argv)
  if args.steps < 1 or args.demos < 1 or not args.lr > 0:
    p.error(f"--steps and --demos must be >= 1 and --lr > 0, got {args.steps}, {args.demos}, "
            f"{args.lr}")
  # pylint: disable=import-outside-toplevel  (the device count is set before jax starts)
  from salt_jax.sharding import parse_mesh_shape
  try:
    parse_mesh_shape(args.mesh)
  except ValueError as e:
    p.error(f"--{e}")
  use_cpu_devices(args.mesh)
  from salt_jax.config import TrainConfig
  from salt_jax.runlock import RunInUse
  from salt_jax.sft import warm_start
  cfg = TrainConfig(env=args.env, mesh=args.mesh, model=args.model,
                    tokenizer=args.tokenizer or ("toy" if args.env == "toy" else "qwen25"),
                    max_steps=args.max_steps or (6 if args.env == "toy" else 8),
                    max_cache_len=args.max_cache_len, seed=args.seed,
                    lora_rank=args.lora_rank, lora_alpha=args.lora_alpha,
                    lora_targets=args.lora_targets, out=args.out or f"runs/{args.env}_sft")
  try:
    cfg.validate()
  except ValueError as e:
    raise SystemExit(f"error: {e}") from None
  try:
    warm_start(cfg, steps=args.steps, num_demos=args.demos, lr=args.lr,
               group_by_length=args.group_by_length, reasoning=args.reasoning)
  except RunInUse as e:  # another process trains in --out
    raise SystemExit(f"error: {e}") from None
  return 0


if __name__ == "__main__":
  sys.exit(main())
