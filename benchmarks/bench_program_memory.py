"""Resident memory that each compiled program keeps, and what `jax.clear_caches` gives back.

A long run compiles a program for every new shape it meets (the sampler's prompt buckets and
row counts, the update's micro-batch lengths) and XLA keeps each one's code resident, so its
process grows iteration after iteration with its live arrays flat. This compiles `--programs`
forward passes of a SmolLM2-shaped model (`--layers` of them, random weights) at as many
shapes, one jitted function each, and reports the process's resident memory (after
`malloc_trim`) before, every few programs, and after `salt_jax.memory.release_compiled_programs`
(what the trainer does past `--clear-programs-above`):

  python benchmarks/bench_program_memory.py --layers 6 --programs 20
  python benchmarks/bench_program_memory.py --quick        # tiny shapes: checks the script
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from bench_decode_step import TINY  # noqa: E402
from bench_rollout_engines import SMOLLM2  # noqa: E402
from salt_jax import memory  # noqa: E402
from salt_jax.metrics import write_json  # noqa: E402
from salt_jax.models import CausalLM, ModelConfig  # noqa: E402


def resident_mib() -> float:
  memory.release_free_memory()
  return memory.resident_bytes() / 2**20


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--layers", type=int, default=6)
  p.add_argument("--programs", type=int, default=20)
  p.add_argument("--rows", type=int, default=2)
  p.add_argument("--quick", action="store_true")
  p.add_argument("--out", default=None, help="also write the figures here as JSON")
  args = p.parse_args(argv)
  shape = TINY if args.quick else SMOLLM2
  if args.quick:
    args.layers, args.programs = 2, 4
  model = CausalLM(ModelConfig(**{**shape, "num_layers": args.layers}), rngs=nnx.Rngs(0))
  graphdef, state = nnx.split(model)

  def forward(state, ids):
    return nnx.merge(graphdef, state)(ids).sum()

  out = {"layers": args.layers, "rows": args.rows, "start_mib": resident_mib(), "after": []}
  print(f"start: {out['start_mib']:.0f} MiB resident", flush=True)
  for i in range(args.programs):
    fn = jax.jit(forward)  # one function per shape, as a run's per-shape programs
    jax.block_until_ready(fn(state, jnp.ones((args.rows, 64 + 32 * i), jnp.int32)))
    if (i + 1) % 5 == 0 or i + 1 == args.programs:
      out["after"].append({"programs": i + 1, "mib": resident_mib()})
      print(f"{i + 1} programs: {out['after'][-1]['mib']:.0f} MiB", flush=True)
  compiled = out["after"][-1]["mib"]
  out["mib_per_program"] = (compiled - out["start_mib"]) / args.programs
  memory.release_compiled_programs()
  out["cleared_mib"] = resident_mib()
  print(f"{out['mib_per_program']:.1f} MiB a program; after release_compiled_programs: "
        f"{out['cleared_mib']:.0f} MiB ({compiled - out['cleared_mib']:.0f} MiB given back)")
  if args.out:
    write_json(args.out, out)
  return 0


if __name__ == "__main__":
  sys.exit(main())
