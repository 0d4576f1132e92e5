"""This process's host memory, logged each iteration: what tells a leak from a large phase.

A long CPU run that is killed for memory needs to know whether the process grew (resident bytes
up from one iteration to the next) and whether what grew is jax arrays still referenced (live
arrays up) or memory the allocator holds (resident up, live arrays flat).
"""

from __future__ import annotations

import ctypes
import ctypes.util
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


def _glibc():
  try:
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    return libc if hasattr(libc, "malloc_trim") else None
  except OSError:
    return None


_LIBC = _glibc()


def release_free_memory() -> bool:
  """Hands the memory glibc's malloc holds free back to the OS (`malloc_trim(0)`); False where
  the C library is not glibc. An update's activation buffers are freed after each step, but
  glibc keeps most of them in its arenas, so a long run's resident memory climbs (half of a
  probe's 2.4 GB after steps at seven lengths came back this way) until the machine kills it."""
  if _LIBC is None:
    return False
  _LIBC.malloc_trim(0)
  return True
