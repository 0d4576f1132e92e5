"""What the host CPU offers, for choosing between XLA:CPU kernel paths (host side).

Small decode-step matmuls (a few rows times every weight matrix) run fastest on different
kernels on different CPUs. jaxlib's Eigen dots are compiled for a fixed instruction set, while
YNNPACK (XLA:CPU's default for dots) picks AVX-512 kernels at run time where the CPU has them.
Measured on this project's 2-core machines (benchmark model, batch 16, 32 new greedy tokens):
  * AVX2 only: Eigen dots beat YNNPACK (2,238 vs 2,057 tok/s), and multiply-and-sum attention
    beat batched dots (attention 2.2 -> 0.9 ms a decode step).
  * AVX-512 (Zen 4): YNNPACK and batched attention dots were faster (about 10% at a 96-slot cache;
    at a 1,024-slot cache 307 vs 474 ms a call), see `salt_jax.sampling` and
    `salt_jax.models.qwen2.Attention`.
"""

from __future__ import annotations

import functools


@functools.cache
def has_avx512() -> bool:
  """True when the CPU reports AVX-512F (Linux /proc/cpuinfo; False where that is unreadable)."""
  try:
    with open("/proc/cpuinfo") as fh:
      for line in fh:
        if line.startswith("flags"):
          return "avx512f" in line.split()
  except OSError:
    pass
  return False
