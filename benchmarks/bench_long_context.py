"""Training on long whole-history sequences on a CPU: causal query blocks against the full square.

The study's trajectories are 800 to 1,300 tokens (one sequence per trajectory, the whole
conversation), so their log-probs and PPO updates are attention-bound on a CPU. On one CPU device
`Attention.attend` runs causal self-attention 256 queries at a time over the keys up to the
block's end (about half the score FLOPs; a block's scores stay in cache). This script times
`token_logprobs` (the reference policy's pass) and its gradient (the update's) on the trainer's
default tiny policy, 8 rows a mini-batch as the study, with query blocks and with the full square
(the same code with the block size set past the length), alternating the two:

  python benchmarks/bench_long_context.py --lengths 1024 1536 2048 3072 --repeats 3
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
from flax import nnx

from salt_jax.logprobs import token_logprobs
from salt_jax.models import CausalLM, ModelConfig, qwen2
from salt_jax.models.build import TINY_POLICY

# The study's BPE has 646 tokens, rounded up to 704 by the trainer.
VOCAB = 704


def _compiled(graphdef, params, ids, mask, block: int, grad: bool):
  """A compiled pass with query blocks of `block` (the constant is read at trace time)."""
  qwen2._CAUSAL_QUERY_BLOCK = block  # pylint: disable=protected-access

  def logp_sum(p):
    return token_logprobs(nnx.merge(graphdef, p), ids, ids, mask).sum()

  fn = jax.jit(jax.grad(logp_sum) if grad else logp_sum)
  t0 = time.perf_counter()
  jax.block_until_ready(fn(params))
  return fn, time.perf_counter() - t0


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--lengths", type=int, nargs="+", default=[1024, 1536, 2048, 3072])
  p.add_argument("--rows", type=int, default=8)
  p.add_argument("--repeats", type=int, default=3)
  args = p.parse_args(argv)
  default_block = qwen2._CAUSAL_QUERY_BLOCK  # pylint: disable=protected-access
  graphdef, params = nnx.split(CausalLM(ModelConfig(vocab_size=VOCAB, eos_token_id=1,
                                                    **TINY_POLICY), rngs=nnx.Rngs(0)))
  print(f"rows {args.rows}, tiny policy {TINY_POLICY}, best of {args.repeats} (ms); compile (s)")
  print("| tokens | pass | full square | query blocks | speed-up | compile full / blocks |")
  print("|---|---|---|---|---|---|")
  for length in args.lengths:
    ids = jax.random.randint(jax.random.key(length), (args.rows, length), 0, VOCAB)
    mask = jnp.ones((args.rows, length), bool)
    for grad in (False, True):
      fns = {}
      for name, block in (("full", 1 << 30), ("blocks", default_block)):
        fns[name] = _compiled(graphdef, params, ids, mask, block, grad)
      qwen2._CAUSAL_QUERY_BLOCK = default_block  # pylint: disable=protected-access
      best = {name: float("inf") for name in fns}
      for _ in range(args.repeats):
        for name, (fn, _) in fns.items():
          t0 = time.perf_counter()
          jax.block_until_ready(fn(params))
          best[name] = min(best[name], time.perf_counter() - t0)
      print(f"| {length} | {'forward+backward' if grad else 'forward'} | "
            f"{1e3 * best['full']:.0f} | {1e3 * best['blocks']:.0f} | "
            f"{best['full'] / best['blocks']:.2f}x | "
            f"{fns['full'][1]:.1f} / {fns['blocks'][1]:.1f} |", flush=True)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
