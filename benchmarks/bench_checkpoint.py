"""How long a checkpoint save holds the training loop: orbax's asynchronous save against its
synchronous one, through the trainer's own `RunCheckpoints`.

The state is a policy's params and AdamW's two moments (f32), as a run saves it. Each save is
timed until it returns (what the loop waits for) and until its checkpoint is complete; the next
save waits for the previous one, so the loop is held again only when an iteration is shorter than
a write.

  python benchmarks/bench_checkpoint.py --params-mb 200 --repeats 3
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
import time

import jax
import numpy as np

from salt_jax.checkpoint import RunCheckpoints
from salt_jax.config import TrainConfig
from salt_jax.sharding import make_mesh, replicated


def make_state(params_mb: float, mesh) -> dict:
  """Params of `params_mb` MB in 8 f32 arrays, AdamW's two moments of the same shapes, a key."""
  n = max(1, int(params_mb * 2**20 / 4 / 8))
  put = lambda x: jax.device_put(x, replicated(mesh))  # noqa: E731
  rng = np.random.default_rng(0)
  params = {f"w{i}": put(rng.standard_normal(n, np.float32)) for i in range(8)}
  return {"params": params,
          "opt_state": {"mu": jax.tree.map(lambda x: x * 0.1, params),
                        "nu": jax.tree.map(lambda x: x * x, params)},
          "key": put(np.array([0, 1], np.uint32))}


def time_saves(async_checkpoint: bool, params_mb: float, repeats: int) -> tuple[float, float]:
  """Median seconds (save returns, checkpoint complete) over `repeats` saves."""
  returned, complete = [], []
  with tempfile.TemporaryDirectory() as out:
    cfg = dataclasses.replace(TrainConfig(out=out), async_checkpoint=async_checkpoint,
                              max_to_keep=1)
    ck = RunCheckpoints(cfg, make_mesh(cfg.mesh)).open()
    state = make_state(params_mb, ck.mesh)
    try:
      for step in range(repeats + 1):  # the first save also compiles the fingerprints
        t0 = time.perf_counter()
        ck.save(step, state, {"iteration": step})
        t1 = time.perf_counter()
        ck.wait()
        if step:
          returned.append(t1 - t0)
          complete.append(time.perf_counter() - t0)
    finally:
      ck.close()
  return float(np.median(returned)), float(np.median(complete))


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--params-mb", type=float, default=200.0, help="params size (MB, f32)")
  p.add_argument("--repeats", type=int, default=3)
  args = p.parse_args(argv)
  print(f"state: {3 * args.params_mb:.0f} MB (params + 2 AdamW moments), on {jax.devices()[0]}")
  for async_checkpoint in (False, True):
    returned, complete = time_saves(async_checkpoint, args.params_mb, args.repeats)
    print(f"{'async' if async_checkpoint else 'sync '}: save returns in {returned:.2f}s, "
          f"checkpoint complete in {complete:.2f}s")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
