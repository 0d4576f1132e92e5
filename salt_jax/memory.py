"""This process's host memory, logged each iteration: what tells a leak from a large phase.

A long CPU run that is killed for memory needs to know whether the process grew (resident bytes
up from one iteration to the next) and whether what grew is jax arrays still referenced (live
arrays up) or memory the allocator holds (resident up, live arrays flat). Besides freed buffers
that malloc keeps (`release_free_memory`), every compiled program stays resident
(`release_compiled_programs`).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
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


def total_bytes() -> float:
  """Bytes of the machine's physical memory; NaN where the OS does not report it."""
  try:
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
  except (ValueError, OSError, AttributeError):
    return float("nan")


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


def release_compiled_programs() -> None:
  """Drops every compiled program and trace this process holds (`jax.clear_caches`) and hands
  the freed memory back (`release_free_memory`); arrays are untouched, and the next call of a
  jitted function compiles again (or loads from the compilation cache). XLA keeps each compiled
  program's code resident, so a run that meets new shapes every iteration (prompt buckets,
  micro-batch lengths) grows by them (`benchmarks/bench_program_memory.py` measures how much)."""
  jax.clear_caches()
  gc.collect()
  release_free_memory()
