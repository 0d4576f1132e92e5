"""What the host CPU offers, for choosing between XLA:CPU kernel paths (host side).

Small decode-step matmuls (a few rows times every weight matrix) run fastest on different
kernels on different CPUs. jaxlib's Eigen dots are compiled for a fixed instruction set, while
YNNPACK (XLA:CPU's default for dots) picks AVX-512 kernels at run time where the CPU has them. So
`salt_jax.models.default_attention_impl` names, for an AVX2-only CPU, Eigen dots for the
sampler's few-row decode and multiply-and-sum decode attention ('cpu_chunked_sum'), and where the
CPU has AVX-512, YNNPACK and batched attention dots ('cpu_chunked').
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
