"""This process's host memory, logged each iteration: what tells a leak from a large phase.

A long CPU run that is killed for memory needs to know whether the process grew (resident bytes
up from one iteration to the next) and whether what grew is jax arrays still referenced (live
arrays up) or memory the allocator holds (resident up, live arrays flat).
"""

from __future__ import annotations

import math
import os

import jax


def resident_bytes() -> float:
  """Bytes of this process now resident in memory (Linux's /proc/self/statm); NaN where that
  file does not exist (macOS, Windows)."""
  try:
    with open("/proc/self/statm", encoding="ascii") as f:
      pages = int(f.read().split()[1])
  except (OSError, ValueError, IndexError):
    return float("nan")
  return float(pages * os.sysconf("SC_PAGE_SIZE"))


def live_array_bytes() -> tuple[int, float]:
  """(count, bytes) of the jax arrays this process holds: every live array's shards on this
  process's devices (a replicated array counts once per device, as it is stored)."""
  count, total = 0, 0
  for a in jax.live_arrays():
    if a.is_deleted():
      continue
    count += 1
    # From the sharding alone: reading the shards' data would make arrays of them.
    shard = math.prod(a.sharding.shard_shape(a.shape)) * a.dtype.itemsize
    total += shard * len(a.sharding.addressable_devices)
  return count, float(total)
