"""salt_jax.memory: resident bytes and live jax arrays, against what the test allocates."""

import gc
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from salt_jax.memory import (live_array_bytes, release_compiled_programs, release_free_memory,
                             resident_bytes, total_bytes)
from salt_jax.sharding import make_mesh


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="Linux only")
def test_resident_bytes_grows_with_a_touched_allocation():
  before = resident_bytes()
  block = np.ones(64 * 2**20 // 8)  # 64 MiB, every page written
  assert resident_bytes() - before > 48 * 2**20
  del block


def test_live_arrays_count_each_array_and_each_stored_copy():
  gc.collect()
  n0, b0 = live_array_bytes()
  x = jnp.zeros((1000, 250), jnp.float32)  # 1,000,000 bytes
  n1, b1 = live_array_bytes()
  assert (n1 - n0, b1 - b0) == (1, 1_000_000)
  mesh = make_mesh("2x1")  # tests run with 8 CPU devices (conftest)
  replicated = jax.device_put(x, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
  split = jax.device_put(x, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data")))
  n2, b2 = live_array_bytes()
  assert (n2 - n1, b2 - b1) == (2, 2_000_000 + 1_000_000)  # two copies, then two halves
  y = jnp.ones((500,), jnp.float32)
  y.delete()  # a deleted (or donated) array holds nothing
  assert live_array_bytes() == (n2, b2)
  del x, replicated, split


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="Linux only")
def test_released_memory_leaves_the_process():
  """Many mid-sized blocks (below glibc's mmap threshold, so from its heap) freed: glibc keeps
  most of their pages until `malloc_trim`; releasing them lowers the resident bytes."""
  blocks = [np.ones(8_000) for _ in range(4_000)]  # 4,000 x 64 kB (glibc's mmap threshold is
  # at least 128 kB): 256 MB, every page written
  keep = blocks[-1]  # a live block at the heap's top: freeing the rest cannot shrink the heap
  del blocks
  gc.collect()
  before = resident_bytes()
  if not release_free_memory():
    pytest.skip("not glibc")
  assert resident_bytes() < before - 100 * 2**20
  del keep


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="Linux only")
def test_total_bytes_is_the_machines_memory():
  with open("/proc/meminfo", encoding="ascii") as f:
    kib = int(next(line for line in f if line.startswith("MemTotal:")).split()[1])
  assert total_bytes() == pytest.approx(kib * 1024, rel=0.01)  # the kernel's count, to rounding
  assert resident_bytes() < total_bytes()


def test_released_programs_compile_again_and_arrays_stay():
  """After `release_compiled_programs` a jitted function holds no compiled program; its next
  call compiles again and gives the same result; arrays made before are still there."""
  f = jax.jit(lambda x: jnp.sin(x) * 2)
  x = jnp.arange(8.0)
  first = f(x)
  assert f._cache_size() == 1  # pylint: disable=protected-access
  release_compiled_programs()
  assert f._cache_size() == 0  # pylint: disable=protected-access
  np.testing.assert_array_equal(f(x), first)
  assert f._cache_size() == 1  # pylint: disable=protected-access
  np.testing.assert_array_equal(np.asarray(x), np.arange(8.0))
