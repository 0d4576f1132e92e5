"""What a pass of a `ModelConfig`'s decoder must cost: model FLOPs and bytes read.

These are the work a pass cannot avoid, not what a compiled program happens to do (padding,
masked attention slots and recomputation are not counted), so a measured time divided into them
gives the rate a phase achieved on the model's real work; over a machine's measured matmul rate
or read bandwidth, the fraction of its limit:
  prefill and training  FLOPs: 2 per multiply-add of every layer projection for each token,
                        causal attention (QK^T and AV of each token over its row's tokens so
                        far), the vocabulary projection only where logits are taken; a training
                        step (forward and backward) is 3 forward passes.
  decode                bytes: every weight once a step (whatever the batch) and each row's
                        filled cache slots.
"""

from __future__ import annotations

from collections.abc import Sequence

from salt_jax.models.config import ModelConfig

# A forward and a backward pass: the backward computes two products (the activations' and the
# weights' gradients) for each of the forward's.
TRAIN_PASSES = 3


def _layer_projection_params(config: ModelConfig) -> int:
  d, hd = config.hidden_size, config.head_dim
  q, kv = config.num_heads * hd, config.num_kv_heads * hd
  return d * (q + 2 * kv) + q * d + 3 * d * config.intermediate_size


def forward_flops(config: ModelConfig, lengths: Sequence[int], bases: Sequence[int] | None = None,
                  head_positions: int | None = None) -> float:
  """Model FLOPs of one forward pass over rows of `lengths[i]` new tokens each, row i's appended
  after `bases[i]` tokens already in its KV cache (default 0: whole sequences), with logits taken
  at `head_positions` positions in all (default: one a row, a sampler's prefill)."""
  if bases is None:
    bases = [0] * len(lengths)
  if len(bases) != len(lengths):
    raise ValueError(f"bases has {len(bases)} entries, lengths {len(lengths)}")
  if any(n < 0 for n in lengths) or any(b < 0 for b in bases):
    raise ValueError("lengths and bases must be >= 0")
  if head_positions is None:
    head_positions = sum(1 for n in lengths if n > 0)
  if head_positions < 0:
    raise ValueError(f"head_positions must be >= 0, got {head_positions}")
  q = config.num_heads * config.head_dim
  layers = config.num_layers
  tokens = sum(lengths)
  # Token t of a row (absolute position p = base + t) attends over p + 1 keys: QK^T and AV are
  # 2 FLOPs x q x (p + 1) each.
  keys = sum(n * b + n * (n + 1) / 2 for n, b in zip(lengths, bases))
  return (2.0 * layers * _layer_projection_params(config) * tokens
          + 2.0 * config.hidden_size * config.vocab_size * head_positions
          + layers * 4.0 * q * keys)


def train_flops(config: ModelConfig, lengths: Sequence[int], head_positions: int) -> float:
  """Model FLOPs of a training step (forward and backward) over whole rows of `lengths` tokens,
  logits at `head_positions` positions (the loss's)."""
  return TRAIN_PASSES * forward_flops(config, lengths, head_positions=head_positions)


def weight_bytes(config: ModelConfig, itemsize: int) -> float:
  """Bytes of the weights a decode step reads once: every layer's projections and norms, the
  final norm and the vocabulary projection (read once whether or not tied to the embedding)."""
  d = config.hidden_size
  per_layer = _layer_projection_params(config) + 2 * d
  return float((config.num_layers * per_layer + config.vocab_size * d + d) * itemsize)


def cache_bytes(config: ModelConfig, filled_slots: int, itemsize: int) -> float:
  """Bytes of keys and values in `filled_slots` cache slots (summed over rows)."""
  return float(2 * config.num_layers * config.num_kv_heads * config.head_dim * filled_slots
               * itemsize)


def decode_bytes(config: ModelConfig, prompt_lengths: Sequence[int],
                 new_tokens: Sequence[int], steps: int, weight_itemsize: int,
                 cache_itemsize: int) -> float:
  """Bytes a sampler's decode must read: the weights once for each of `steps` forward passes,
  and row i's filled cache at each pass that feeds one of its `new_tokens[i]` tokens (every
  token but its last, which is sampled and never fed back), over `prompt_lengths[i]` + the
  tokens fed before it."""
  if len(prompt_lengths) != len(new_tokens):
    raise ValueError(f"prompt_lengths has {len(prompt_lengths)} entries, new_tokens "
                     f"{len(new_tokens)}")
  slots = 0
  for p, n in zip(prompt_lengths, new_tokens):
    fed = max(int(n) - 1, 0)
    slots += fed * int(p) + fed * (fed + 1) // 2  # pass j reads p + j slots, j = 1..fed
  return (max(int(steps), 0) * weight_bytes(config, weight_itemsize)
          + cache_bytes(config, slots, cache_itemsize))
