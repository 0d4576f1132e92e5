"""salt_jax.compiles: the process's XLA compile seconds, read as differences around a phase."""

import jax
import jax.numpy as jnp

from salt_jax.compiles import xla_compile_seconds


def test_a_new_program_adds_compile_seconds_and_a_cached_one_none():
  f = jax.jit(lambda x: jnp.tanh(x) * 3.0 + 1.0)
  x, y, z = jnp.arange(7.0), jnp.ones(7), jnp.arange(9.0)  # made before: each op compiles too
  c0 = xla_compile_seconds()
  f(x).block_until_ready()
  c1 = xla_compile_seconds()
  assert c1 > c0  # its first call compiled
  f(y).block_until_ready()  # same shape: the compiled program again
  assert xla_compile_seconds() == c1
  f(z).block_until_ready()  # a new shape compiles once more
  assert xla_compile_seconds() > c1
