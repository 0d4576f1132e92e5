"""Qwen2 / Llama-family causal LM in flax.nnx, numerically matching Hugging Face transformers.

RMSNorm, RoPE (HF's rotate_half convention), grouped-query attention, SwiGLU MLP, optional q/k/v
bias (Qwen2 yes, Llama / SmolLM2 no), tied or untied output head. Each projection is an `Einsum`
module whose weight `w` is stored in its einsum layout (q: [D, N, H], o: [N, H, D], MLP: [D, F] /
[F, D]); `loading.py` maps HF names onto them.

Shapes: B batch, L / T tokens, S cache slots, D hidden, V vocab, N query heads, K kv heads,
H head_dim, F MLP width, G = N // K queries per kv head.

Two entry points share one layer stack:
  * `model(input_ids, attention_mask, positions)`: full forward, logits f32[B, L, V].
  * `model.forward_cached(...)`: writes T new tokens into a KV cache at a traced `cache_index`
    and attends over the whole cache, so one compiled program serves every prefill of a bucketed
    length and one serves every decode step (T = 1).
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from salt_jax import _checks
from salt_jax.models.config import ModelConfig, default_attention_impl
from salt_jax.models.partitioning import ActivationSharding

# Finite, so a query with no valid key (a padding row) gets a uniform softmax instead of NaN.
_MASKED = -1e30
_INIT_STD = 0.02


class KVCache(NamedTuple):
  """Keys and values, one array per layer: k[i]: dtype[B, K, H, S] (post-RoPE keys, slots last),
  v[i]: dtype[B, K, S, H].

  Heads before slots, so attention reads each (row, kv head)'s block as it lies (with
  [B, S, K, H], XLA:CPU transposed the whole cache at every decode step). Keys put the slots last
  so that both products run along a contiguous slot or head axis: q.K as [G, H] x [H, S], p.V as
  [G, S] x [S, H]. 'cpu_chunked_sum' computes a decode step's as multiply-and-sum over the
  contiguous axis (see `Attention._attend_rows`); with [S, H] keys that reduction would be strided.
  One buffer per layer, so a layer reads its keys in place (slicing one [layers, ...] buffer
  copied them).
  """

  k: tuple[jax.Array, ...]
  v: tuple[jax.Array, ...]

  @property
  def shape(self) -> tuple[int, ...]:
    """(num_layers, B, K, S, H)."""
    return (len(self.v), *self.v[0].shape)

  def take_rows(self, rows: jax.Array, max_len: int) -> KVCache:
    """The cache of batch rows `rows` (i32[B']), its slots zero-padded up to max_len."""
    def grow(x, slot_axis):
      pad = [(0, 0)] * 4
      pad[slot_axis] = (0, max_len - x.shape[slot_axis])
      return jnp.pad(jnp.take(x, rows, axis=0), pad)
    return KVCache(tuple(grow(x, 3) for x in self.k), tuple(grow(x, 2) for x in self.v))


def rope_cos_sin(positions: jax.Array, head_dim: int, theta: float):
  """HF RoPE tables for integer positions i32[B, T] -> (cos, sin), each f32[B, T, H]."""
  # Same float32 recipe as transformers' default rope init, so angles agree to the last bit.
  inv_freq = 1.0 / (np.float32(theta) ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
  freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)
  emb = jnp.concatenate([freqs, freqs], axis=-1)
  return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
  """x[B, T, heads, H] rotated: x * cos + rotate_half(x) * sin, tables f32[B, T, H]."""
  half = x.shape[-1] // 2
  rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
  cos = cos[:, :, None, :].astype(x.dtype)
  sin = sin[:, :, None, :].astype(x.dtype)
  return x * cos + rotated * sin


def token_matmul(x: jax.Array, w: jax.Array, n_in: int, **kwargs) -> jax.Array:
  """Contracts x's last `n_in` axes with w's first `n_in` as one 2-d matmul over all tokens.

  x[*lead, *w.shape[:n_in]], w[*in, *out] -> [*lead, *out]; kwargs go to `jnp.matmul`. The
  flat token axis matters for training: an einsum over [B, T, ...] differentiates into weight
  gradients that contract two axes, for which XLA:CPU transposes whole [B*T, F] activations.
  """
  lead = x.shape[:x.ndim - n_in]
  k = math.prod(w.shape[:n_in])
  y = jnp.matmul(x.reshape(-1, k), w.reshape(k, -1), **kwargs)
  return y.reshape(*lead, *w.shape[n_in:])


# Bytes of one attention chunk's f32 scores on CPU: a few rows of [N, T, S] that stay in cache.
_ATTENTION_CHUNK_BYTES = 8 << 20


# Queries per block of causal self-attention on one CPU device (see `Attention.attend`).
_CAUSAL_QUERY_BLOCK = 256
# Queries per block of 'query_blocks' attention: a block's f32 scores are [B, N, 1024, S] where
# the whole square would be [B, N, T, S] (a 24,576-token row: 24 times smaller).
_QUERY_BLOCK = 1024
# Causal 'query_blocks' attention splits the blocks into this many runs of equal shapes, each one
# loop over its blocks attending the keys up to the run's last query: the compiler sees one block
# body per run rather than per block (a 64-layer model with 24 blocks a layer would be 1,536
# bodies), and the scores cost (runs + 1) / (2 runs) of the full square (5/8 at 4).
_QUERY_BLOCK_RUNS = 4


def _loops_over_batch(impl: str, shard: ActivationSharding) -> bool:
  """Whether attention runs sequential loops over rows and query blocks: a 'cpu_chunked*'
  implementation, on a batch that no mesh splits over several devices (a sequential loop over a
  sharded batch would serialize the devices). A one-device mesh (the trainer's 1x1) shards
  nothing, so the loops run there: without them a long prefill (ALFWorld: 8 rows x 4,096 tokens)
  holds every row's scores and masks at once."""
  one_device = shard.mesh is None or shard.mesh.devices.size == 1
  return impl.startswith("cpu_chunked") and one_device


def _attention_rows_per_chunk(batch: int, scores_per_row: int, loops: bool) -> int:
  """Rows of the batch that attend together: the whole batch unless `loops`, else the largest
  divisor of it whose f32 scores fit in `_ATTENTION_CHUNK_BYTES` (at least one row)."""
  if not loops:
    return batch
  rows = max(1, _ATTENTION_CHUNK_BYTES // (4 * scores_per_row))
  return max(d for d in range(1, min(rows, batch) + 1) if batch % d == 0)


def _normal(rngs: nnx.Rngs, shape, dtype):
  return nnx.initializers.normal(_INIT_STD)(rngs.params(), shape, dtype)


def _param(value, sharding_rule: str) -> nnx.Param:
  """A parameter that names the `ShardingRules` field placing it (`partitioning.specs_for_state`
  reads it from the variable's metadata)."""
  return nnx.Param(value, sharding_rule=sharding_rule)


class Einsum(nnx.Module):
  """A projection y = einsum(equation, x, w) that uses its weight `w` as stored.

  The equation's letters name the axes (T tokens, D hidden, N / K query / kv heads, H head_dim,
  F MLP width); its first operand is one token axis T and the contracted axes, so x's leading
  axes are flattened into T first and restored after (over [B, T, ...] the weight gradient would
  contract two axes, for which XLA:CPU transposes whole activations). The weight goes unreshaped
  into one `lax.dot_general` whose contracted axes keep the weight's order, which is what a LoRA
  library intercepting a module Param's contractions can wrap (qwix, as Tunix uses it:
  `salt_jax.models.lora` wraps each projection). `jnp.einsum` would contract the axes in
  alphabetical order: o_proj's 'TNH,NHD->TD' as (H, N), for which XLA:CPU transposes the weight
  at every call.
  """

  def __init__(self, equation: str, shape: tuple[int, ...], sharding_rule: str, *,
               rngs: nnx.Rngs, dtype, param_dtype):
    operands, out = equation.split("->")
    lhs, rhs = operands.split(",")
    if (len(rhs) != len(shape) or lhs[0] != out[0] or out[0] in rhs
        or out[1:] != "".join(c for c in rhs if c not in lhs)
        or any(c not in rhs for c in lhs[1:])):
      raise ValueError(f"equation {equation!r} must be 'T<contracted>,<weight axes>->T<kept>' "
                       f"over a weight of shape {shape}")
    self.equation = equation
    # Contracted axes in the weight's order, and where each sits in x's trailing axes.
    self.weight_axes = tuple(i for i, c in enumerate(rhs) if c in lhs)
    self.input_axes = tuple(1 + lhs[1:].index(rhs[i]) for i in self.weight_axes)
    self.w = _param(_normal(rngs, shape, param_dtype), sharding_rule)
    self.dtype = dtype

  def __call__(self, x: jax.Array) -> jax.Array:
    n = len(self.input_axes)
    lead = x.shape[:x.ndim - n]
    flat = x.reshape(-1, *x.shape[x.ndim - n:])
    y = jax.lax.dot_general(flat, self.w[...].astype(self.dtype),
                            ((self.input_axes, self.weight_axes), ((), ())))
    # In the compute dtype even when a LoRA library adds a float32 delta to the contraction.
    return y.astype(self.dtype).reshape(*lead, *y.shape[1:])


class RMSNorm(nnx.Module):
  """y = scale * x / sqrt(mean(x^2) + eps), statistics in f32 (as HF)."""

  def __init__(self, dim: int, eps: float, *, dtype, param_dtype):
    self.scale = _param(jnp.ones((dim,), param_dtype), "norm_d")
    self.eps = eps
    self.dtype = dtype

  def __call__(self, x: jax.Array) -> jax.Array:
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
    return self.scale[...].astype(self.dtype) * y.astype(self.dtype)


class Attention(nnx.Module):
  """Grouped-query self-attention with RoPE and optional q/k/v bias.

  `config.attention_impl` (resolved, not None) picks the program: see `ATTENTION_IMPLS`.
  """

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, dtype, param_dtype):
    c = config
    d, n, k, h = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim
    kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
    self.q_proj = Einsum("TD,DNH->TNH", (d, n, h), "q_weight_dnh", **kw)
    self.k_proj = Einsum("TD,DKH->TKH", (d, k, h), "kv_weight_dkh", **kw)
    self.v_proj = Einsum("TD,DKH->TKH", (d, k, h), "kv_weight_dkh", **kw)
    self.o_proj = Einsum("TNH,NHD->TD", (n, h, d), "o_weight_nhd", **kw)
    if c.attention_bias:
      self.q_bias = _param(jnp.zeros((n, h), param_dtype), "q_bias_nh")
      self.k_bias = _param(jnp.zeros((k, h), param_dtype), "kv_bias_kh")
      self.v_bias = _param(jnp.zeros((k, h), param_dtype), "kv_bias_kh")
    self.use_bias = c.attention_bias
    self.impl = c.attention_impl
    self.scale = c.head_dim ** -0.5
    self.dtype = dtype

  def project(self, x, cos, sin, shard: ActivationSharding):
    """x[B, T, D] -> q[B, T, N, H], k, v[B, T, K, H], RoPE applied to q and k."""
    dt = self.dtype
    q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
    if self.use_bias:
      q = q + self.q_bias[...].astype(dt)
      k = k + self.k_bias[...].astype(dt)
      v = v + self.v_bias[...].astype(dt)
    q, k, v = (shard(a, "act_btnh") for a in (q, k, v))
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

  def attend(self, q, k, v, mask, shard: ActivationSharding, *, causal: bool = False):
    """q[B, T, N, H] over keys k[B, K, H, S] and values v[B, K, S, H] where mask bool[B, T, S]
    -> out[B, T, D] (the KVCache's layouts).

    causal: the keys are the queries' own tokens (S == T) and mask is False above the diagonal,
      so a query never needs a later key.
    """
    t = q.shape[1]
    if self.impl == "query_blocks" and t > _QUERY_BLOCK:
      out = self._attend_query_blocks(q, k, v, mask, shard, causal)
    elif causal and t > _CAUSAL_QUERY_BLOCK and _loops_over_batch(self.impl, shard):
      # A block of queries at a time, over the keys up to the block's last one: about half the
      # score FLOPs of the full square, and a block's scores stay in cache.
      outs = []
      for lo in range(0, t, _CAUSAL_QUERY_BLOCK):
        hi = min(lo + _CAUSAL_QUERY_BLOCK, t)
        outs.append(self._attend_chunked(q[:, lo:hi], k[..., :hi], v[:, :, :hi],
                                         mask[:, lo:hi, :hi], shard))
      out = jnp.concatenate(outs, axis=1)
    else:
      out = self._attend_chunked(q, k, v, mask, shard)
    return self.o_proj(shard(out, "act_btnh"))

  def _attend_query_blocks(self, q, k, v, mask, shard: ActivationSharding, causal: bool):
    """`_attend_rows` over `_QUERY_BLOCK` queries at a time, each block under jax.checkpoint so
    that neither pass holds more than one block's scores (the batch stays whole: on a mesh each
    device runs its own rows' blocks). The whole blocks run as `_QUERY_BLOCK_RUNS` loops (one if
    not causal) over equal shapes, a causal run attending the keys up to its last query; a last
    partial block runs alone."""
    b, t, n, h = q.shape
    whole = t // _QUERY_BLOCK
    runs = min(_QUERY_BLOCK_RUNS if causal else 1, whole)
    edges = [_QUERY_BLOCK * (whole * i // runs) for i in range(runs + 1)]
    attend = jax.checkpoint(lambda *a: self._attend_rows(*a, shard))
    outs = []
    for lo, hi in zip(edges[:-1], edges[1:]):
      keys = hi if causal else v.shape[2]
      k_run, v_run = k[..., :keys], v[:, :, :keys]
      blocks = (hi - lo) // _QUERY_BLOCK
      # [blocks, B, block, ...]: lax.map runs over the leading axis.
      q_run = q[:, lo:hi].reshape(b, blocks, _QUERY_BLOCK, n, h).swapaxes(0, 1)
      mask_run = mask[:, lo:hi, :keys].reshape(b, blocks, _QUERY_BLOCK, keys).swapaxes(0, 1)
      out = jax.lax.map(lambda qm, kr=k_run, vr=v_run: attend(qm[0], kr, vr, qm[1]),
                        (q_run, mask_run))
      outs.append(out.swapaxes(0, 1).reshape(b, hi - lo, n, h))
    if edges[-1] < t:
      outs.append(attend(q[:, edges[-1]:], k, v, mask[:, edges[-1]:]))
    return jnp.concatenate(outs, axis=1)

  def _attend_chunked(self, q, k, v, mask, shard: ActivationSharding):
    """`_attend_rows`, a few rows of the batch at a time where that keeps scores in cache."""
    b, t, n, h = q.shape
    rows = _attention_rows_per_chunk(b, n * t * v.shape[2], _loops_over_batch(self.impl, shard))
    if rows == b:
      out = self._attend_rows(q, k, v, mask, shard)
    else:
      # A few rows at a time, so that their f32[rows, N, T, S] scores and probabilities stay in
      # cache; remat recomputes them in the backward pass instead of storing them all.
      split = lambda a: a.reshape(b // rows, rows, *a.shape[1:])  # noqa: E731
      chunk = jax.checkpoint(lambda args: self._attend_rows(*args, shard))
      out = jax.lax.map(chunk, tuple(split(a) for a in (q, k, v, mask))).reshape(b, t, n, h)
    return out

  def _attend_rows(self, q, k, v, mask, shard: ActivationSharding):
    """Softmax attention of q[B, T, N, H] over k[B, K, H, S], v[B, K, S, H] -> out[B, T, N, H]."""
    b, t, n, h = q.shape
    kv_heads, s = v.shape[1], v.shape[2]
    g = n // kv_heads
    # Queries of one kv head side by side, [B, K, G*T, H]: one plain batched matmul per (row,
    # kv head), which XLA:CPU runs faster than a 5-d einsum (prefill and decode).
    qg = q.reshape(b, t, kv_heads, g, h).transpose(0, 2, 3, 1, 4).reshape(b, kv_heads, g * t, h)
    # Multiply-and-sum along the contiguous H (keys) and S (values) axes: on some AVX2-only CPUs
    # a decode step's B*K products of [G, H] x [H, S] are too small for Eigen's batched dot.
    by_sum = t == 1 and self.impl == "cpu_chunked_sum"
    if by_sum:
      scores = jnp.sum(qg[..., None].astype(jnp.float32) * k[:, :, None].astype(jnp.float32),
                       axis=-2)
    else:
      scores = jnp.einsum("bkqh,bkhs->bkqs", qg, k, preferred_element_type=jnp.float32)
    scores = scores.reshape(b, kv_heads, g, t, s)
    scores = jnp.where(mask[:, None, None], scores * self.scale, _MASKED)
    probs = jax.nn.softmax(scores, axis=-1).astype(self.dtype).reshape(b, kv_heads, g * t, s)
    if by_sum:
      out = jnp.sum(probs[..., None].astype(jnp.float32) * v[:, :, None].astype(jnp.float32),
                    axis=-2).astype(self.dtype)
    else:
      out = jnp.einsum("bkqs,bksh->bkqh", probs, v)
    out = out.reshape(b, kv_heads, g, t, h)
    return out.transpose(0, 3, 1, 2, 4).reshape(b, t, n, h)


class MLP(nnx.Module):
  """SwiGLU: down(silu(gate(x)) * up(x))."""

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, dtype, param_dtype):
    d, f = config.hidden_size, config.intermediate_size
    kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
    self.gate_proj = Einsum("TD,DF->TF", (d, f), "ffw_weight_df", **kw)
    self.up_proj = Einsum("TD,DF->TF", (d, f), "ffw_weight_df", **kw)
    self.down_proj = Einsum("TF,FD->TD", (f, d), "ffw_weight_fd", **kw)

  def __call__(self, x, shard: ActivationSharding):
    hidden = shard(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x), "act_btf")
    return self.down_proj(hidden)


class DecoderLayer(nnx.Module):
  """Pre-norm block: x + attn(norm(x)), then + mlp(norm(.))."""

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, dtype, param_dtype):
    kw = dict(dtype=dtype, param_dtype=param_dtype)
    self.input_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, **kw)
    self.attn = Attention(config, rngs=rngs, **kw)
    self.post_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, **kw)
    self.mlp = MLP(config, rngs=rngs, **kw)

  def __call__(self, x, cos, sin, attn_mask, shard: ActivationSharding):
    """The full forward's layer: x dtype[B, T, D] -> the same, attending causally under
    attn_mask bool[B, T, T]."""
    q, k, v = self.attn.project(self.input_norm(x), cos, sin, shard)
    k, v = k.transpose(0, 2, 3, 1), v.transpose(0, 2, 1, 3)  # as `attend` takes them
    x = shard(x + self.attn.attend(q, k, v, attn_mask, shard, causal=True), "act_btd")
    return shard(x + self.mlp(self.post_norm(x), shard), "act_btd")


class CausalLM(nnx.Module):
  """Qwen2 / Llama decoder with an output head.

  Args:
    config: the architecture and attention implementation; an `attention_impl` of None becomes
      `default_attention_impl()` here, once, so `model.config` always names one.
    rngs: initializers' randomness (weights N(0, 0.02), biases 0, norm scales 1).
    dtype: compute dtype of activations (and of the KV cache by default).
    param_dtype: storage dtype of parameters.

  `model.config` is the ModelConfig. Logits are always f32; `hidden_states` stays in `dtype`.
  After `partitioning.shard_model(model, mesh)` (or loading with a mesh) activations are
  constrained to split their batch over 'data'.
  """

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, dtype=jnp.float32,
               param_dtype=jnp.float32):
    if not isinstance(config, ModelConfig):
      raise ValueError(f"config must be a ModelConfig, got {type(config).__name__}")
    if config.attention_impl is None:
      config = dataclasses.replace(config, attention_impl=default_attention_impl())
    kw = dict(dtype=dtype, param_dtype=param_dtype)
    self.config = config
    self.dtype = dtype
    self.param_dtype = param_dtype
    self.embed_tokens = _param(_normal(rngs, (config.vocab_size, config.hidden_size),
                                       param_dtype), "emb_vd")
    self.layers = nnx.List([DecoderLayer(config, rngs=rngs, **kw)
                            for _ in range(config.num_layers)])
    self.final_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, **kw)
    if not config.tie_word_embeddings:
      self.lm_head = _param(_normal(rngs, (config.vocab_size, config.hidden_size),
                                    param_dtype), "lm_head_vd")
    self.activation_sharding = ActivationSharding()

  # ---- pieces shared by both forwards ----

  def lm_head_weight(self) -> jax.Array:
    """The output projection W[V, D] (the embedding when tied): logits = hidden @ W.T."""
    if self.config.tie_word_embeddings:
      return self.embed_tokens[...]
    return self.lm_head[...]

  def logits_from_hidden(self, hidden: jax.Array) -> jax.Array:
    """hidden[B, T, D] -> logits f32[B, T, V] (f32 accumulation even for bf16 weights)."""
    w = self.lm_head_weight().astype(self.dtype)
    logits = token_matmul(hidden.astype(self.dtype), w.T, 1, preferred_element_type=jnp.float32)
    return self.activation_sharding(logits, "logits_btv")

  def _embed(self, input_ids):
    x = jnp.take(self.embed_tokens[...], input_ids, axis=0).astype(self.dtype)
    return self.activation_sharding(x, "act_btd")

  def _check_ids(self, input_ids, attention_mask, positions):
    _checks.check_rank("input_ids", input_ids, 2)
    _checks.check_integer("input_ids", input_ids)
    mask = _checks.as_mask("attention_mask", attention_mask, input_ids)
    if positions is None:
      # Left padding: the first real token is position 0 whatever its column.
      positions = jnp.maximum(jnp.cumsum(mask.astype(jnp.int32), axis=-1) - 1, 0)
    else:
      _checks.check_same_shape("positions", positions, "input_ids", input_ids)
      _checks.check_integer("positions", positions)
    return jnp.asarray(input_ids, jnp.int32), mask, jnp.asarray(positions, jnp.int32)

  # ---- full forward ----

  def hidden_states(self, input_ids: jax.Array, attention_mask: jax.Array | None = None,
                    positions: jax.Array | None = None) -> jax.Array:
    """Final-norm hidden states dtype[B, L, D] for input_ids i32[B, L].

    Args:
      input_ids: i32[B, L] token ids.
      attention_mask: bool or 0/1 [B, L]; False marks padding (never attended to). None: all
        real.
      positions: i32[B, L] RoPE positions; None: cumsum(mask) - 1 clipped at 0 (left padding).

    Raises:
      ValueError: wrong rank, dtype or shape of any argument (at trace time).
    """
    ids, mask, positions = self._check_ids(input_ids, attention_mask, positions)
    length = ids.shape[1]
    causal = jnp.tril(jnp.ones((length, length), bool))
    attn_mask = causal[None] & mask[:, None, :]  # [B, T, S]: key s valid and s <= t
    cos, sin = rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta)
    shard = self.activation_sharding
    x = self._embed(ids)
    remat = self.config.remat_policy != "none"
    split_kept = self.config.remat_policy == "full_sequence_sharded"

    def run_layer(layer, *args):
      if not remat:
        return layer(*args, shard)
      # Under jax.grad only each layer's input is kept; the backward pass reruns the layer. The
      # layer goes in as plain arrays and is rebuilt inside: nnx.remat would refuse a layer whose
      # Variables were made at an outer trace level (e.g. a lax.map over log-prob passes).
      graphdef, state = nnx.split(layer)
      return jax.checkpoint(lambda st, *a: nnx.merge(graphdef, st)(*a, shard))(state, *args)

    for layer in self.layers:
      if split_kept:
        # The checkpoint keeps its input as laid out here: each device a slice of the sequence
        # (tensor-parallel devices would otherwise each keep the whole [B, T, D]).
        x = shard(x, "act_btd_kept")
      x = run_layer(layer, x, cos, sin, attn_mask)
    return self.final_norm(x)

  def __call__(self, input_ids: jax.Array, attention_mask: jax.Array | None = None,
               positions: jax.Array | None = None) -> jax.Array:
    """Logits f32[B, L, V] for input_ids i32[B, L]; arguments as in `hidden_states`."""
    return self.logits_from_hidden(self.hidden_states(input_ids, attention_mask, positions))

  # ---- KV-cache forward for sampling ----

  def init_cache(self, batch_size: int, max_len: int, dtype=None) -> KVCache:
    """Zeroed cache: per layer, k dtype[batch_size, K, H, max_len] and v dtype[batch_size, K,
    max_len, H] (dtype: the model's)."""
    for name, value in (("batch_size", batch_size), ("max_len", max_len)):
      if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    c = self.config
    b, k, s, h = int(batch_size), c.num_kv_heads, int(max_len), c.head_dim
    dtype = self.dtype if dtype is None else dtype
    # Each device allocates only its shard (None: the default device).
    zeros = lambda shape: tuple(  # noqa: E731
        jnp.zeros(shape, dtype, device=self.activation_sharding.sharding(shape, "cache_bk"))
        for _ in range(c.num_layers))
    return KVCache(zeros((b, k, h, s)), zeros((b, k, s, h)))

  def forward_cached(self, input_ids: jax.Array, positions: jax.Array, cache: KVCache,
                     cache_index: jax.Array, attention_mask_cache: jax.Array, *,
                     last_logits_only: bool = False,
                     fresh: bool = False) -> tuple[jax.Array, KVCache]:
    """Writes T tokens into the cache at `cache_index` and returns their logits.

    Args:
      input_ids: i32[B, T] the new tokens (a left-padded prompt for prefill, one token to decode).
      positions: i32[B, T] their RoPE positions.
      cache: KVCache of num_layers arrays each of keys [B, K, H, S] and values [B, K, S, H].
      cache_index: scalar int, may be traced: slot of the first of the T tokens, the same for
        all rows. Must satisfy cache_index + T <= S (checked when concrete; a traced index past
        the end would be clamped by dynamic_update_slice).
      attention_mask_cache: bool[B, S], which slots hold real tokens, including the T being
        written now. A token at slot s attends to valid slots <= s.
      last_logits_only: return logits f32[B, 1, V] of the last of the T tokens only (what a
        sampler needs after prefill; avoids f32[B, T, V] for a long prompt and a large vocab).
      fresh: no slot outside the T being written is valid for any row (a prompt's first
        prefill): the tokens attend causally among themselves alone, as in the full forward,
        rather than over all S slots (S also holds the slots decoding will fill: with a long
        `max_new_tokens` most of the prefill's attention would go to masked slots). Same logits.

    Returns:
      (logits f32[B, T, V] (or [B, 1, V]), the updated cache).

    Raises:
      ValueError: wrong shapes or dtypes, or a concrete cache_index out of range.
    """
    _checks.check_rank("input_ids", input_ids, 2)
    _checks.check_integer("input_ids", input_ids)
    _checks.check_same_shape("positions", positions, "input_ids", input_ids)
    _checks.check_integer("positions", positions)
    c = self.config
    b, t = input_ids.shape
    if not isinstance(cache, KVCache):
      raise ValueError(f"cache must be a KVCache, got {type(cache).__name__}")
    v_shapes = {tuple(a.shape) for a in cache.v}
    k_shapes = {tuple(a.shape) for a in cache.k}
    if (len(cache.k) != len(cache.v) or not cache.k or len(v_shapes) != 1
        or len(min(v_shapes)) != 4
        or k_shapes != {(*a.shape[:2], a.shape[3], a.shape[2]) for a in cache.v}):
      raise ValueError(f"cache must hold equal numbers of same-shaped keys [B, K, H, S] and values "
                       f"[B, K, S, H], got shapes {[a.shape for a in cache.k]} and "
                       f"{[a.shape for a in cache.v]}")
    n_layers, (cb, ck, s, ch) = len(cache.v), cache.v[0].shape
    if (n_layers, cb, ck, ch) != (c.num_layers, b, c.num_kv_heads, c.head_dim):
      raise ValueError(f"cache shape {cache.shape} does not fit batch {b} and this model "
                       f"({c.num_layers} layers, {c.num_kv_heads} kv heads, head_dim "
                       f"{c.head_dim})")
    if t > s:
      raise ValueError(f"cannot write {t} tokens into a cache of {s} slots")
    if jnp.shape(attention_mask_cache) != (b, s):
      raise ValueError(f"attention_mask_cache must have shape {(b, s)} (batch, cache slots), "
                       f"got {jnp.shape(attention_mask_cache)}")
    if jnp.ndim(cache_index) != 0:
      raise ValueError(f"cache_index must be a scalar, got shape {jnp.shape(cache_index)}")
    _checks.check_integer("cache_index", cache_index)
    if not isinstance(cache_index, jax.core.Tracer):
      idx = int(cache_index)
      if idx < 0 or idx + t > s:
        raise ValueError(f"cache_index {idx} + {t} tokens exceeds the cache's {s} slots")
    index = jnp.asarray(cache_index, jnp.int32)
    key_mask = jnp.asarray(attention_mask_cache).astype(bool)

    if fresh:  # the T new tokens' own [T, T] causal square, under their slots' validity
      new_mask = jax.lax.dynamic_slice_in_dim(key_mask, index, t, axis=1)
      attn_mask = jnp.tril(jnp.ones((t, t), bool))[None] & new_mask[:, None, :]
    else:
      slots = jnp.arange(s, dtype=jnp.int32)
      query_slots = index + jnp.arange(t, dtype=jnp.int32)
      attn_mask = (slots[None, :] <= query_slots[:, None])[None] & key_mask[:, None, :]
    cos, sin = rope_cos_sin(jnp.asarray(positions, jnp.int32), c.head_dim, c.rope_theta)
    shard = self.activation_sharding
    zero = jnp.zeros((), jnp.int32)
    new_k, new_v = [], []
    x = self._embed(jnp.asarray(input_ids, jnp.int32))
    for i, layer in enumerate(self.layers):
      q, k, v = layer.attn.project(layer.input_norm(x), cos, sin, shard)
      # Write only the T new slots of layer i; the rest of the buffer is untouched (in place
      # when the caller donates the cache).
      keys, values = (
          shard(jax.lax.dynamic_update_slice(buf, new.transpose(perm).astype(buf.dtype), start),
                "cache_bk")
          for buf, new, perm, start in (
              (cache.k[i], k, (0, 2, 3, 1), (zero, zero, zero, index)),
              (cache.v[i], v, (0, 2, 1, 3), (zero, zero, index, zero))))
      new_k.append(keys)
      new_v.append(values)
      if fresh:  # the new keys and values as the full forward's layer takes them (rounded
        # to the cache's dtype, as a read from the cache would give them)
        keys = k.transpose(0, 2, 3, 1).astype(keys.dtype)
        values = v.transpose(0, 2, 1, 3).astype(values.dtype)
      last_only = last_logits_only and i == len(self.layers) - 1
      if last_only:
        # Past the last layer's keys and values only the last token matters: its query, its
        # attention and its MLP (the other T - 1 tokens' would be computed and thrown away).
        q, x, attn_mask = q[:, -1:], x[:, -1:], attn_mask[:, -1:]
      x = shard(x + layer.attn.attend(q, keys.astype(self.dtype), values.astype(self.dtype),
                                      attn_mask, shard, causal=fresh and not last_only),
                "act_btd")
      x = shard(x + layer.mlp(layer.post_norm(x), shard), "act_btd")
    logits = self.logits_from_hidden(self.final_norm(x))
    return logits, KVCache(tuple(new_k), tuple(new_v))
