"""Tests for salt_jax.models.cost: a pass's model FLOPs against XLA's own count, and the
continuation, training and decode forms against their definitions written out."""

import jax
import jax.numpy as jnp
import pytest

from salt_jax.models import ModelConfig, cost, load_state_dict
from salt_jax.models.loading import random_state_dict

# Tied embeddings, so the parameters are what a decode step reads (the embedding is the head).
CONFIG = ModelConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2,
                     num_heads=4, num_kv_heads=2, head_dim=16, tie_word_embeddings=True,
                     attention_bias=True)


def test_forward_flops_match_xlas_count_of_the_forward_pass():
  """XLA counts the full forward as compiled: the head at every position and attention over the
  whole square (not halved by the causal mask); ours counts one head row and the causal half."""
  model = load_state_dict(CONFIG, random_state_dict(CONFIG), dtype="float32")
  n = 32
  ids = jnp.ones((1, n), jnp.int32)
  xla = jax.jit(lambda ids: model(ids)).lower(ids).compile().cost_analysis()
  xla = xla[0] if isinstance(xla, list) else xla
  d, v, layers = CONFIG.hidden_size, CONFIG.vocab_size, CONFIG.num_layers
  q = CONFIG.num_heads * CONFIG.head_dim
  ours = cost.forward_flops(CONFIG, [n]) + 2 * d * v * (n - 1) + layers * 2 * q * n * (n - 1)
  assert ours == pytest.approx(xla["flops"], rel=0.1)
  params = sum(x.size for x in jax.tree.leaves(model))
  assert cost.weight_bytes(CONFIG, 4) == pytest.approx(4 * params, rel=0.01)


def test_a_continued_prefill_costs_the_difference_of_the_whole_ones():
  """A suffix of n tokens after b cached ones costs what b + n tokens cost beyond b tokens (its
  attention reads the cached keys), with its own head rows."""
  f = lambda lengths, bases=None, head=0: cost.forward_flops(  # noqa: E731
      CONFIG, lengths, bases, head_positions=head)
  for n, b in ((1, 0), (5, 7), (40, 100)):
    assert f([n], [b]) == pytest.approx(f([b + n]) - f([b]))
  # rows add up; the default head is one row each (an empty suffix has none)
  assert f([3, 4], [2, 0], 5) == pytest.approx(f([3], [2], 2) + f([4], [0], 3))
  head = 2 * CONFIG.hidden_size * CONFIG.vocab_size
  assert cost.forward_flops(CONFIG, [3, 0, 4]) == pytest.approx(f([3, 0, 4]) + 2 * head)
  assert cost.train_flops(CONFIG, [9, 4], 6) == pytest.approx(3 * f([9, 4], head=6))
  assert cost.forward_flops(CONFIG, []) == 0.0


def test_decode_bytes_count_each_pass_as_written_out():
  prompts, new, steps = [7, 3, 12], [4, 1, 6], 5
  per_slot = cost.cache_bytes(CONFIG, 1, 2)
  want = steps * cost.weight_bytes(CONFIG, 4)
  for p, n in zip(prompts, new):
    for j in range(1, n):  # the pass feeding the row's j-th token reads p + j slots
      want += (p + j) * per_slot
  assert cost.decode_bytes(CONFIG, prompts, new, steps, 4, 2) == pytest.approx(want)
  assert cost.decode_bytes(CONFIG, [5], [0], 0, 4, 4) == 0.0
  assert cost.cache_bytes(CONFIG, 10, 2) == 2 * CONFIG.num_layers * CONFIG.num_kv_heads \
      * CONFIG.head_dim * 10 * 2


@pytest.mark.parametrize("call, match", [
    (lambda: cost.forward_flops(CONFIG, [3, 4], [0]), "bases has 1"),
    (lambda: cost.forward_flops(CONFIG, [-1]), ">= 0"),
    (lambda: cost.forward_flops(CONFIG, [2], [-3]), ">= 0"),
    (lambda: cost.forward_flops(CONFIG, [2], head_positions=-1), "head_positions"),
    (lambda: cost.decode_bytes(CONFIG, [1, 2], [3], 1, 4, 4), "prompt_lengths has 2"),
])
def test_bad_inputs_raise(call, match):
  with pytest.raises(ValueError, match=match):
    call()
