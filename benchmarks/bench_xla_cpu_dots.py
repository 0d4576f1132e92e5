"""XLA:CPU's matmul rate by dtype under its library flags: can jax use the CPU's bf16 units?

On a CPU with AMX (or AVX-512 bf16) torch multiplies bf16 several times faster than f32; jax's
default XLA:CPU code does not. XLA has flags that hand dots to oneDNN, XNNPACK or YNNPACK; this
runs one jitted matmul per (flag set, dtype, shape) in a fresh process each (the flags are read
once, when the backend starts) and prints GFLOP/s (best of --repeats after a compiling call) and
the largest difference from a float64 numpy product, relative to its largest value. torch's rate
on the same shapes is the reference line.

Shapes: SmolLM2's prefill MLP ([8 x 641, 576] x [576, 1536]), an update micro-batch's (2 rows of
576 tokens: [1152, 576] x [576, 1536]), its decode step at 8 rows ([8, 576] x [576, 1536]) and a
2048 square.

With --decode-rows, instead: a decode step's weight reads by batch size. Each call multiplies
[rows, 576] by 90 distinct [576, 1536] f32 matrices (SmolLM2's 30 layers x 3 MLP-sized
projections, 318 MB, far larger than the caches), so every weight comes from memory as in a
decode step; it prints ms a call, the weights' bytes over that time and GFLOP/s, in jax (per flag
set) and torch.

  python benchmarks/bench_xla_cpu_dots.py
  python benchmarks/bench_xla_cpu_dots.py --json out.json --repeats 10
  python benchmarks/bench_xla_cpu_dots.py --decode-rows 1,8,16,64 --flag-sets default
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_gpu import best_seconds  # noqa: E402  (best of timed calls after a first one)

FLAG_SETS = {
    "default": "",
    "onednn dot fusion": "--xla_cpu_experimental_onednn_fusion_type=dot",
    "onednn custom call": "--xla_cpu_use_onednn=true "
                          "--xla_cpu_experimental_onednn_custom_call=true",
    "xnnpack dot fusion": "--xla_cpu_experimental_xnn_fusion_type=dot",
    "ynnpack dot fusion": "--xla_cpu_experimental_ynn_fusion_type=dot",
}
SHAPES = {"prefill": (5128, 576, 1536), "update": (1152, 576, 1536), "decode": (8, 576, 1536),
          "square": (2048, 2048, 2048)}

CHILD = r"""
import json, sys, time
import numpy as np
import jax, jax.numpy as jnp
dtype, (m, k, n), repeats = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
rng = np.random.default_rng(0)
a, b = rng.standard_normal((m, k)), rng.standard_normal((k, n))
want = a @ b
x, y = jnp.asarray(a, dtype), jnp.asarray(b, dtype)
f = jax.jit(lambda x, y: x @ y)
got = np.asarray(f(x, y).block_until_ready(), np.float64)
best = float("inf")
for _ in range(repeats):
  t0 = time.perf_counter()
  f(x, y).block_until_ready()
  best = min(best, time.perf_counter() - t0)
print(json.dumps({"gflops": 2 * m * k * n / best / 1e9,
                  "rel_err": float(np.abs(got - want).max() / np.abs(want).max())}))
"""


# A decode step's projections: `rows` tokens through STREAM_MATRICES weights of [576, 1536].
STREAM_MATRICES, STREAM_SHAPE = 90, (576, 1536)

CHILD_STREAM = r"""
import json, sys, time
import numpy as np
import jax, jax.numpy as jnp
rows, (k, n), count, repeats = (int(sys.argv[1]), json.loads(sys.argv[2]), int(sys.argv[3]),
                                int(sys.argv[4]))
rng = np.random.default_rng(0)
ws = [jnp.asarray(rng.standard_normal((k, n)), jnp.float32) for _ in range(count)]
x = jnp.ones((rows, k), jnp.float32)

@jax.jit
def f(ws, x):
  acc = jnp.zeros((rows, 8), jnp.float32)
  for w in ws:  # each product's first columns summed: every weight is read, little is written
    acc = acc + (x @ w)[:, :8]
  return acc

f(ws, x).block_until_ready()
best = float("inf")
for _ in range(repeats):
  t0 = time.perf_counter()
  f(ws, x).block_until_ready()
  best = min(best, time.perf_counter() - t0)
print(json.dumps({"seconds": best}))
"""


def _child(script: str, argv: list, flags: str) -> dict:
  """Runs `script` in a fresh python with XLA_FLAGS=flags; its last stdout line as JSON."""
  env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
  p = subprocess.run([sys.executable, "-c", script, *argv],
                     env=env, capture_output=True, text=True, timeout=900, check=False)
  if p.returncode != 0:
    return {"error": (p.stderr.strip().splitlines() or ["?"])[-1][:200]}
  return json.loads(p.stdout.strip().splitlines()[-1])


def run_jax(flags: str, dtype: str, shape, repeats: int) -> dict:
  return _child(CHILD, [dtype, json.dumps(shape), str(repeats)], flags)


def stream_figures(rows: int, seconds: float) -> dict:
  """ms a call, GB/s of weights read and GFLOP/s of a streamed decode call."""
  k, n = STREAM_SHAPE
  return {"rows": rows, "ms": seconds * 1e3,
          "weight_gb_per_s": STREAM_MATRICES * k * n * 4 / seconds / 1e9,
          "gflops": 2 * rows * k * n * STREAM_MATRICES / seconds / 1e9}


def stream_torch(rows: int, repeats: int) -> float:
  import torch  # pylint: disable=import-outside-toplevel
  ws = [torch.randn(*STREAM_SHAPE) for _ in range(STREAM_MATRICES)]
  x = torch.ones(rows, STREAM_SHAPE[0])

  def call():
    acc = torch.zeros(rows, 8)
    for w in ws:
      acc = acc + (x @ w)[:, :8]
    return acc
  return best_seconds(call, repeats)


def decode_main(args) -> int:
  rows_out = []
  for rows in (int(r) for r in args.decode_rows.split(",")):
    for name in ["torch", *args.flag_sets.split(",")]:
      if name == "torch":
        got = {"seconds": stream_torch(rows, args.repeats)}
      else:
        got = _child(CHILD_STREAM, [str(rows), json.dumps(STREAM_SHAPE), str(STREAM_MATRICES),
                                    str(args.repeats)], FLAG_SETS[name])
      if "seconds" not in got:
        print(f"rows {rows:3d} {name:20s} error: {got['error']}", flush=True)
        continue
      row = {"flags": name, **stream_figures(rows, got["seconds"])}
      rows_out.append(row)
      print(f"rows {rows:3d} {name:20s} {row['ms']:6.1f} ms  {row['weight_gb_per_s']:5.1f} GB/s "
            f"of weights  {row['gflops']:5.0f} GFLOP/s", flush=True)
  if args.json:
    with open(args.json, "w", encoding="utf-8") as f:
      json.dump({"date": time.strftime("%Y-%m-%d"), "cpu_count": os.cpu_count(),
                 "decode": rows_out}, f, indent=1)
  return 0


def run_torch(dtype: str, shape, repeats: int) -> dict:
  import torch  # pylint: disable=import-outside-toplevel
  m, k, n = shape
  x = torch.randn(m, k, dtype=getattr(torch, dtype))
  y = torch.randn(k, n, dtype=getattr(torch, dtype))
  x @ y
  best = float("inf")
  for _ in range(repeats):
    t0 = time.perf_counter()
    x @ y
    best = min(best, time.perf_counter() - t0)
  return {"gflops": 2 * m * k * n / best / 1e9}


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--repeats", type=int, default=5)
  ap.add_argument("--flag-sets", default=",".join(FLAG_SETS),
                  help=f"comma-separated, of: {', '.join(FLAG_SETS)}")
  ap.add_argument("--shapes", default=",".join(SHAPES))
  ap.add_argument("--json", default=None)
  ap.add_argument("--decode-rows", default=None,
                  help="comma-separated batch sizes: time a decode step's streamed weight reads")
  args = ap.parse_args(argv)
  if args.decode_rows:
    return decode_main(args)
  rows = []
  for shape_name in args.shapes.split(","):
    shape = SHAPES[shape_name]
    for dtype in ("float32", "bfloat16"):
      for name in ["torch", *args.flag_sets.split(",")]:
        got = (run_torch(dtype, shape, args.repeats) if name == "torch"
               else run_jax(FLAG_SETS[name], dtype, shape, args.repeats))
        rows.append({"shape": shape_name, "dtype": dtype, "flags": name, **got})
        rate = f"{got['gflops']:8.0f} GFLOP/s" if "gflops" in got else f"error: {got['error']}"
        err = f"  rel. err {got['rel_err']:.1e}" if "rel_err" in got else ""
        print(f"{shape_name:8s} {dtype:9s} {name:20s} {rate}{err}", flush=True)
  if args.json:
    with open(args.json, "w", encoding="utf-8") as f:
      json.dump({"date": time.strftime("%Y-%m-%d"), "cpu_count": os.cpu_count(), "rows": rows},
                f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
