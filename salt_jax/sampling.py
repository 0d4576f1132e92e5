"""A jitted KV-cache sampler for `salt_jax.models.CausalLM` (device side, host loop around it).

One call turns a ragged batch of prompts into new tokens, their log-probs and (given a decode
function) their text, stopping each row on an EOS id, on a stop string (an agent's `</action>`) or
after `max_new_tokens`.

Shapes are bucketed so one compiled program serves every turn of a rollout: the batch is padded to
a batch bucket with dummy rows that start finished, and prompts are LEFT-padded to a prompt bucket,
so every row's last prompt token sits in the same cache slot and all rows write each new token to
one shared `cache_index`. Only two choices change the program's structure and are static: greedy or
not, and whether top-k/top-p filter at all (64 passes over the vocabulary per step); temperature,
top-k, top-p, max_new_tokens and the key are traced values.

The cache holds W slots per row, W the smallest of `cache_buckets` that fits the call (at most
`max_cache_len`), since every decode step attends over all of them. The flow for a prompt bucket P:
  prefill: all P prompt slots are written to the cache in one forward pass, and the last one's
    logits give each row's first new token (decode step 0; the other positions' logits are never
    computed), rather than feeding the last prompt token as a separate first decode step. The
    prompt attends causally over its own P slots only, not the W - P that decoding will fill.
  decode: a `lax.while_loop` feeds one token per step from step 1 (new token i-1 goes into slot
    P-1+i) and samples the next; it exits as soon as every row is done. So `max_new_tokens` new
    tokens need P + max_new_tokens - 1 <= W.
With stop strings, the loop runs in chunks of `stop_check_every` steps and the host decodes the new
text between chunks, marking rows that produced a stop string as done (the loop state is donated
back to the device, so the cache is updated in place).

Continuing a conversation (`keep_cache=True`, then `continue_rows`): an agent's next prompt is
usually the previous prompt + the sampled response + a new user turn. A call with keep_cache=True
keeps its cache on the device; the next call may name, for each prompt, the kept row it extends.
The host checks that each prompt really starts with that row's cached tokens (prompt + response,
less the response's last token, which was never fed back), gathers those rows (jnp.take over the
batch axis) and prefills only the new suffixes, left-padded to a prompt bucket, into the slots
after the last slot any row wrote. Slots a row wrote that its returned response does not hold
(after a stop-string cut, or past its end) are masked out; RoPE positions are explicit, so the gap
is harmless. When any prompt cannot continue, or the suffix would overflow the cache, the call
falls back to a full prefill: same result, more work.

Repeated prompts: a call's equal prompts (a GRPO group's G copies of a task's first prompt, or
rows that a continuation leaves equal) are prefilled once, in the batch bucket of the distinct
prompts, and each copy's row gets that row's cache, mask and first logits (a gather on the
device) before it samples with its own key. Only a smaller batch bucket saves work, so calls
whose distinct prompts fill the same bucket prefill every row as before.

Prompts of different lengths (`split_lengths`): padding every row to the longest prompt's bucket
can double a full prefill's work. When it saves enough, the distinct prompts are prefilled in two
or three groups of similar length, each left-padded to its own bucket and written at the slot
that makes it end where the longest group ends (RoPE positions are explicit; slots before a row's
prompt are masked), then joined into one batch in the call's row order (a gather on the device)
to decode as before. Each group shape is one more compiled program, so only when the work saved
is worth it: on a tiny policy (as in the tests' toy runs) the programs cost more than the
padding.

Randomness: row r at step i draws with `fold_in(fold_in(key, r), i)`, so a prompt's sample depends
only on the key, its index in the list and the step, never on the batch bucket.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from salt_jax.compiles import xla_compile_seconds
from salt_jax.models import cost
from salt_jax.models.config import ModelConfig
from salt_jax.sharding import DATA_AXIS

_DEFAULT_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
FINISH_REASONS = ("eos", "stop", "length")


@dataclasses.dataclass
class SampleOutput:
  """What one `Sampler` call returns, one entry per prompt, in prompt order.

  Attributes:
    tokens: int32[n_i] new tokens, up to and including the EOS id or the token that completes a
      stop string.
    logprobs: f32[n_i] log-probs of those tokens under the distribution they were drawn from: the
      model's logits divided by the temperature, restricted by top-k then top-p and renormalized.
      Greedy decoding (and top_k=1) is a point mass, so these are 0.
    policy_logprobs: f32[n_i] log-probs of the same tokens under the raw model at temperature 1,
      untouched by temperature or filtering: log_softmax(logits)[token]. They equal a full forward
      pass over prompt + tokens, so they serve as the trainer's old log-probs.
    texts: decode_fn(tokens) per prompt, or None when no decode_fn was given.
    finish_reasons: 'eos', 'stop' or 'length' per prompt.
    num_steps: decode steps the loop ran (< max_new_tokens when every row finished early).
    reused_tokens: prompt tokens read from the kept cache instead of prefilled (0 unless the call
      continued the previous one).
    prefilled_tokens: prompt tokens this call ran through the model (a prompt that repeats an
      earlier one in the call is prefilled once; padding not counted).
    prefill_seconds: wall time from the call's start until its prompts were in the cache and
      the first tokens drawn (planning, the prefill program, a compile if it had to).
    decode_seconds: wall time from then until the new tokens were back on the host (both NaN
      from an engine that does not split its time).
    prefill_compile_seconds, decode_compile_seconds: the XLA compiles inside each of the two
      (`salt_jax.compiles`): a call with a new shape compiles its programs; NaN likewise.
    prefill_flops: model FLOPs of the prefilled tokens (`salt_jax.models.cost.forward_flops`:
      no padding, no masked attention); NaN for a model without a `ModelConfig`.
    decode_bytes: bytes the decode steps had to read (`salt_jax.models.cost.decode_bytes`: the
      weights once a step, each row's filled cache while it was live); NaN likewise.
  """

  tokens: list[np.ndarray]
  logprobs: list[np.ndarray]
  policy_logprobs: list[np.ndarray]
  texts: list[str] | None
  finish_reasons: list[str]
  num_steps: int = 0
  reused_tokens: int = 0
  prefilled_tokens: int = 0
  prefill_seconds: float = float("nan")
  decode_seconds: float = float("nan")
  prefill_compile_seconds: float = float("nan")
  decode_compile_seconds: float = float("nan")
  prefill_flops: float = float("nan")
  decode_bytes: float = float("nan")


class _Knobs(NamedTuple):
  """Traced sampling values: changing them never recompiles."""

  temperature: jax.Array  # f32[]
  top_p: jax.Array        # f32[] nucleus mass kept, in (0, 1]
  top_k: jax.Array        # i32[] tokens kept, in [1, V]
  max_new: jax.Array      # i32[]


class _Mode(NamedTuple):
  """Static sampling structure: one compiled decode program per distinct value."""

  greedy: bool
  filtered: bool  # top-k or top-p restricts the vocabulary (64 passes over the row a step)


class _LoopState(NamedTuple):
  """The decode loop's carry. B: batch bucket, S: cache length. The output columns are S wide
  though at most S - P + 1 steps fit after a prompt bucket P, so the decode program's shapes (and
  its compile) depend on (B, S) alone, whatever the prompt bucket."""

  cache: Any              # the model's KVCache pytree
  cache_mask: jax.Array   # bool[B, S] slots holding real tokens
  start: jax.Array        # i32[] slot written by decode step 0 (the last prompt token's)
  last_token: jax.Array   # i32[B] token fed at the next step
  last_pos: jax.Array     # i32[B] its position id
  step: jax.Array         # i32[] tokens generated so far (the next output column)
  done: jax.Array         # bool[B]
  lengths: jax.Array      # i32[B] tokens generated per row before it finished
  tokens: jax.Array       # i32[B, S]
  logprobs: jax.Array     # f32[B, S] under the sampling distribution
  policy_logprobs: jax.Array  # f32[B, S] under the raw model
  row_keys: jax.Array     # key[B] one PRNG key per row


class _Kept(NamedTuple):
  """A call's cache, kept for the next call to continue (keep_cache=True)."""

  cache: Any               # the model's KVCache, batch bucket rows
  cursor: int              # first slot that no row has written
  seqs: list[np.ndarray]   # per prompt: the tokens whose keys and values the cache holds, in order
  slots: np.ndarray        # bool[n, W]: the slots holding them (W: the cache's length)


class _Plan(NamedTuple):
  """How one call fills the cache: a suffix per distinct prompt written at `cursor` (host
  arrays). U: the batch bucket of the distinct prompts, B: of all prompts (U = B unless prompts
  repeat)."""

  # None (all three) on a plan in length groups, whose per-group arrays are in `groups`.
  tokens: np.ndarray | None       # i32[U, P] left-padded suffixes (whole prompts: full prefill)
  positions: np.ndarray | None    # i32[U, P] their position ids (0 on padding)
  suffix_mask: np.ndarray | None  # bool[U, P] True on real suffix tokens
  cursor: int              # slot of the suffix bucket's first column
  rows: np.ndarray | None  # i32[U] kept row each row continues; None: a full prefill
  keep: np.ndarray         # bool[U, W] kept slots each row attends to (none for a full prefill)
  reused: int              # prompt tokens read from the kept cache
  prefilled: int = 0       # prompt tokens prefilled (real, not padding)
  expand: np.ndarray | None = None  # i32[B] the prefilled row each prompt's row copies; None: U = B
  prefill_flops: float = float("nan")  # model FLOPs of the prefilled tokens
  # A full prefill in length groups (`Sampler(split_lengths=True)`): per group (tokens,
  # positions, suffix_mask, cursor), each left-padded to its own bucket and written so that
  # all end at the same slot, its rows put after the previous group's in buffers of
  # `joined_rows` rows (U); `gather` i32[B]: each output row's row in those buffers.
  # None: one group, the fields above.
  groups: tuple | None = None
  gather: np.ndarray | None = None
  joined_rows: int = 0


# A full prefill is split into length groups only when that saves at least this share of its
# padded positions (each group shape is one more compiled prefill).
_MIN_GROUP_SAVING = 0.15
# Three groups are searched (cubic in the prompts) up to this many distinct prompts; two beyond.
_MAX_THREE_GROUP_SEARCH = 64


# Batch buckets up to this many rows decode with `_few_rows_compiler_options`.
_FEW_ROWS = 32


def _few_rows_compiler_options(attention_impl: str | None) -> dict | None:
  """XLA options for decoding a few rows: plain (Eigen) dots instead of YNNPACK fusions under
  'cpu_chunked_sum' (a choice for some AVX2-only CPUs, `salt_jax.models.ATTENTION_IMPLS`), else
  none.

  A decode step multiplies a few rows by every weight matrix, streamed from L3; there Eigen's dots
  beat YNNPACK's on AVX2-only CPUs, while YNNPACK wins from 64 rows up and at every batch size
  where the CPU has AVX-512. Prefill and training always keep YNNPACK.
  """
  if attention_impl == "cpu_chunked_sum":
    return {"xla_cpu_experimental_ynn_fusion_type": ""}
  return None


def length_buckets(shortest: int, longest: int, per_doubling: int = 1) -> list[int]:
  """Lengths to pad prompts (or caches) to: from `shortest` up to `longest`, each doubling of
  length split into `per_doubling` equal steps (rounded up to a multiple of 8 from 64 on).

  One compiled prefill serves each bucket, so the count stays bounded (per_doubling a doubling),
  while a length past `shortest` is padded by at most 1/per_doubling of itself: 1 doubles
  (16, 32, 64, ...: up to half the work is padding), 8 pads by at most 12.5%.
  `shortest` is always included, even past `longest`.
  """
  if shortest < 1 or per_doubling < 1:
    raise ValueError(f"length_buckets needs shortest >= 1 and per_doubling >= 1, got "
                     f"{shortest}, {per_doubling}")
  out = [shortest]
  base = shortest
  while base * 2 <= longest or (per_doubling > 1 and base < longest):
    step = -(-base // per_doubling)
    if base >= 64:
      step = -(-step // 8) * 8
    out.extend(x for x in range(base + step, 2 * base, step) if x <= longest)
    base *= 2
    if base <= longest:
      out.append(base)
  return out


def _batch_sizes(name: str, sizes: Sequence[int]) -> tuple[int, ...]:
  """`sizes` sorted, as a tuple; a ValueError naming `name` when it is empty or not positive."""
  out = tuple(sorted(int(b) for b in sizes))
  if not out or out[0] < 1:
    raise ValueError(f"{name} must be positive sizes, got {sizes}")
  return out


def _bucket(n: int, buckets: Sequence[int]) -> int | None:
  """Smallest bucket >= n, or None."""
  fits = [b for b in buckets if b >= n]
  return min(fits) if fits else None


def _argmax(x: jax.Array) -> jax.Array:
  """jnp.argmax over the last axis (first index of the max; a NaN counts as the max), as i32.

  Written as a max, then the smallest index that holds it: two plain reductions that XLA:CPU
  vectorizes, where it does not vectorize argmax's (value, index) pair reduction.
  """
  hit = (x == jnp.max(x, axis=-1, keepdims=True)) | jnp.isnan(x)
  index = jnp.arange(x.shape[-1], dtype=jnp.int32)
  return jnp.min(jnp.where(hit, index, x.shape[-1]), axis=-1)


def _float_order_keys(x: jax.Array) -> jax.Array:
  """uint32 keys in the order of the float32 values x (radix sort's keys: a negative float's
  bits flipped, a positive one's sign bit set); x holds no -0.0 (add 0.0 first)."""
  u = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
  return jnp.where(u >> 31 == 1, ~u, u | jnp.uint32(1 << 31))


def _float_of_order_key(key: jax.Array) -> jax.Array:
  """The float32 whose `_float_order_keys` key is `key`."""
  u = jnp.where(key >> 31 == 1, key ^ jnp.uint32(1 << 31), ~key)
  return jax.lax.bitcast_convert_type(u, jnp.float32)


def _largest_key(lo: jax.Array, hi: jax.Array, holds: Callable) -> jax.Array:
  """Per row, the largest uint32 key K in [lo, hi) with holds(K) (a [B, 1] bool of a [B, 1]
  key), for `holds` true at lo, false at hi and monotone between: 32 halvings of [lo, hi)."""
  def halve(_, bounds):
    lo, hi = bounds
    mid = lo + (hi - lo) // 2
    ok = holds(mid) & (hi - lo > 1)
    return jnp.where(ok, mid, lo), jnp.where(ok | (hi - lo <= 1), hi, mid)
  return jax.lax.fori_loop(0, 32, halve, (lo, hi))[0]


def _filter_cutoff(z: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
  """f32[B, 1]: per row of z (f32[B, V]) the smallest value top-k then top-p keep (keep z >=
  it; ties at it are all kept).

  As a descending sort would give it (top-k: the k largest by rank; top-p: the shortest prefix
  of those whose softmax mass, over the k, reaches top_p), found without sorting: the k-th largest
  value and then the nucleus' last value by bisection over the values' order keys, each step a
  count or a masked sum over the row (64 in all), where a sort of the whole vocabulary per row
  per step costs several times more on a CPU (docs/performance.md, "A decode step, split").
  """
  z = z + 0.0  # -0.0 -> +0.0: equal floats, one key
  keys = _float_order_keys(z)
  lo = jnp.min(keys, axis=-1, keepdims=True)
  hi = jnp.max(keys, axis=-1, keepdims=True) + 1
  k = jnp.minimum(top_k, z.shape[-1])
  kth = _largest_key(lo, hi, lambda c: jnp.sum(keys >= c, axis=-1, keepdims=True) >= k)
  kth_value = _float_of_order_key(kth)
  # The top-k softmax's normalizer, over exactly k entries (ties at the k-th value count up to k).
  top = jnp.max(z, axis=-1, keepdims=True)
  e = jnp.exp(z - top)
  above = keys > kth
  total = (jnp.sum(jnp.where(above, e, 0.0), axis=-1, keepdims=True)
           + (k - jnp.sum(above, axis=-1, keepdims=True)) * jnp.exp(kth_value - top))

  def mass_reaches(c):
    mass = jnp.where(c == kth, total, jnp.sum(jnp.where(keys >= c, e, 0.0), axis=-1,
                                                  keepdims=True))
    return mass >= top_p * total
  nucleus = _float_of_order_key(_largest_key(kth, hi, mass_reaches))
  return jnp.where(top_p >= 1.0, kth_value, nucleus)


def _choose(logits, row_keys, step, knobs: _Knobs, mode: _Mode):
  """Picks one token per row.

  Args:
    logits: f32[B, V] next-token logits.
    row_keys: key[B] per-row keys (folded with the step here).
    step: i32[] decode step.
    knobs, mode: sampling values and structure.
  Returns:
    (tokens i32[B], logprobs f32[B] under the sampling distribution, policy_logprobs f32[B] under
    the raw model).
  """
  logits = logits.astype(jnp.float32)
  raw = jax.nn.log_softmax(logits, axis=-1)
  if mode.greedy:
    tok = _argmax(logits)
    lp = jnp.zeros(tok.shape, jnp.float32)  # a point mass
  else:
    z = logits / knobs.temperature
    if mode.filtered:
      z = jnp.where(z < _filter_cutoff(z, knobs.top_k, knobs.top_p), -jnp.inf, z)
    policy = jax.nn.log_softmax(z, axis=-1)
    keys = jax.vmap(jax.random.fold_in, (0, None))(row_keys, step)
    gumbel = jax.vmap(lambda k: jax.random.gumbel(k, z.shape[-1:], jnp.float32))(keys)
    tok = _argmax(policy + gumbel)  # Gumbel-max: a draw from policy
    lp = jnp.take_along_axis(policy, tok[:, None], axis=-1)[:, 0]
  plp = jnp.take_along_axis(raw, tok[:, None], axis=-1)[:, 0]
  return tok, lp, plp


def check_request(prompts, max_new_tokens, temperature, top_p, top_k, stop_strings, decode_fn,
                  *, vocab_size: int | None = None) -> None:
  """Raises ValueError naming the first bad argument of a sampling call (any rollout engine's):
  prompts a non-empty list of non-empty token-id lists (ids in [0, vocab_size) when given),
  max_new_tokens an int >= 1, temperature >= 0, top_p in (0, 1], top_k an int >= 0, stop
  strings non-empty strings with a decode_fn to find them."""
  if not isinstance(prompts, (list, tuple)) or len(prompts) == 0:
    raise ValueError("prompts must be a non-empty list of token-id lists")
  for i, p in enumerate(prompts):
    if len(p) == 0:
      raise ValueError(f"prompt {i} is empty; every prompt needs at least one token")
    if min(p) < 0 or (vocab_size is not None and max(p) >= vocab_size):
      raise ValueError(f"prompt {i} holds a token id outside [0, {vocab_size})")
  if isinstance(max_new_tokens, bool) or int(max_new_tokens) != max_new_tokens \
      or max_new_tokens < 1:
    raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
  if not np.isfinite(temperature) or temperature < 0:
    raise ValueError(f"temperature must be >= 0 (0 means greedy), got {temperature}")
  if not 0.0 < top_p <= 1.0:
    raise ValueError(f"top_p must be in (0, 1], got {top_p}")
  if isinstance(top_k, bool) or int(top_k) != top_k or top_k < 0:
    raise ValueError(f"top_k must be an int >= 0 (0: off), got {top_k!r}")
  if isinstance(stop_strings, str):
    raise ValueError("stop_strings must be a sequence of strings, not one string")
  if any(not s for s in stop_strings):
    raise ValueError("stop_strings must not contain an empty string")
  if stop_strings and decode_fn is None:
    raise ValueError("stop_strings need a decode_fn (token ids -> text) to be detected")


class Sampler:
  """Samples from a `CausalLM` with a KV cache; one compiled program per (batch, prompt) bucket.

  Example:
    sampler = Sampler(model, eos_token_ids=[tok.eos_token_id], pad_token_id=tok.pad_token_id,
                      max_cache_len=2048)
    out = sampler(prompts, jax.random.key(0), max_new_tokens=256, temperature=1.0,
                  stop_strings=("</action>",), decode_fn=tok.decode)

  The sampler holds the model's own nnx.Variables, so a model updated in place (an nnx.Optimizer
  step, nnx.update) is sampled as it is now, without recompiling; after changing the model's
  structure (e.g. `shard_model`), call `refresh()`.
  """

  def __init__(self, model: nnx.Module, *, eos_token_ids: Sequence[int], pad_token_id: int,
               max_cache_len: int, prompt_buckets: Sequence[int] | None = None,
               batch_buckets: Sequence[int] = _DEFAULT_BATCH_BUCKETS,
               cache_buckets: Sequence[int] | None = None,
               cache_dtype=None, mesh: jax.sharding.Mesh | None = None,
               stop_check_every: int = 16, share_prompts: bool = True,
               split_lengths: bool = True, split_min_flops: float = 1e11,
               prefill_batch_buckets: Sequence[int] | None = None):
    """Args:
      model: a `CausalLM` (anything with `init_cache` and `forward_cached` as there).
      eos_token_ids: ids that end a row (the EOS token is kept in the output).
      pad_token_id: id used for left padding and for dummy rows.
      max_cache_len: S, cache slots per row; prompt bucket + max_new_tokens - 1 must fit.
      prompt_buckets: prompt lengths to pad to; default `length_buckets(16, S, 8)` (at most
        12.5% padding past 16 tokens).
      batch_buckets: batch sizes to pad to; past the largest, the batch is padded to a multiple
        of it. With a mesh, each bucket is rounded up to a multiple of the 'data' axis size.
      cache_buckets: cache lengths W a call allocates: the smallest that holds its prompts and
        max_new_tokens (a continued cache grows into a larger one). Every decode step attends
        over all W slots, so a short rollout in a long `max_cache_len` should not pay for the
        whole of it. Default: `length_buckets(128, S, 4)`, and max_cache_len.
      cache_dtype: KV cache dtype (default: the model's).
      mesh: ('data', 'model') mesh to split prompts and the loop state over 'data'; default: the
        mesh the model was sharded onto (`shard_model`), if any.
      stop_check_every: decode steps between host checks for stop strings.
      share_prompts: prompts of one call that are identical (a GRPO group's G copies of a task's
        first prompt) are prefilled once and their cache rows copied; each row still samples with
        its own key, so the output is the same as without sharing (up to float rounding).
      split_lengths: a full prefill of prompts of very different lengths (ALFWorld's step
        prompts run from about 450 to 1,300 tokens) runs in two or three groups of similar
        length, each padded to its own bucket, when that saves at least 15% of the padded
        positions; the groups are joined into one batch to decode. Not for calls that keep
        their cache. Same output (up to float rounding).
      split_min_flops: ...and when the positions it saves cost at least this many FLOPs (2 per
        parameter a position): about a second of a CPU's matmuls, what compiling a group's
        program costs, so a tiny policy's prefills are never split. The same bar gates
        `prefill_batch_buckets`.
      prefill_batch_buckets: row counts a full prefill (or a length group) may pad its distinct
        prompts to instead of the call's `batch_buckets`, where the rows that saves cost at
        least `split_min_flops`: a prefill's work grows with its rows, a decode step's hardly
        (it reads every weight whatever the rows), so the decode keeps the coarser buckets and
        their fewer programs. Default: `length_buckets(1, 512, 2)` (1, 2, 3, 4, 6, 8, 12, ...).
    """
    eos = tuple(int(t) for t in np.atleast_1d(np.asarray(eos_token_ids, dtype=np.int64)))
    if not eos:
      raise ValueError("eos_token_ids must name at least one token id")
    if max_cache_len < 2:
      raise ValueError(f"max_cache_len must be >= 2, got {max_cache_len}")
    if stop_check_every < 1:
      raise ValueError(f"stop_check_every must be >= 1, got {stop_check_every}")
    self.eos_token_ids = eos
    self.pad_token_id = int(pad_token_id)
    self.max_cache_len = int(max_cache_len)
    if prompt_buckets is None:
      prompt_buckets = length_buckets(16, self.max_cache_len, 8)
    self.prompt_buckets = tuple(sorted(int(b) for b in prompt_buckets))
    if not self.prompt_buckets or self.prompt_buckets[0] < 1:
      raise ValueError(f"prompt_buckets must be positive lengths, got {prompt_buckets}")
    self._mesh = mesh
    if cache_buckets is None:
      cache_buckets = length_buckets(128, self.max_cache_len, 4)
    self.cache_buckets = tuple(sorted({min(int(b), self.max_cache_len) for b in cache_buckets}
                                      | {self.max_cache_len}))
    if self.cache_buckets[0] < 2:
      raise ValueError(f"cache_buckets must be lengths >= 2, got {cache_buckets}")
    self.batch_buckets = _batch_sizes("batch_buckets", batch_buckets)
    self.prefill_batch_buckets = _batch_sizes(
        "prefill_batch_buckets",
        length_buckets(1, 512, 2) if prefill_batch_buckets is None else prefill_batch_buckets)
    self.cache_dtype = cache_dtype
    self.stop_check_every = int(stop_check_every)
    self.share_prompts = bool(share_prompts)
    self.split_lengths = bool(split_lengths)
    self.split_min_flops = float(split_min_flops)
    self.model = model
    self.num_traces = 0  # bumped each time a program is traced: a test hook for "no recompile"
    self.refresh()

  def refresh(self) -> None:
    """Re-reads the model's structure; call it after changing the model's static attributes.

    The sampler splits the model once: the state it keeps holds the model's own nnx.Variables,
    so in-place parameter updates (an nnx.Optimizer step, nnx.update) are seen by every call
    without any work here. Changing static structure (e.g. `shard_model`, which sets the model's
    activation sharding) needs a refresh, which also drops the compiled programs and any kept
    cache.
    """
    self._graphdef, self._state = nnx.split(self.model)
    self._position_flops = 2 * sum(int(np.prod(x.shape))
                                   for x in jax.tree.leaves(nnx.state(self.model, nnx.Param)))
    self._kept: _Kept | None = None
    # The graphdef is closed over rather than passed as a static argument, so no call pays for
    # hashing it. The loop state (cache included) is donated to each decode chunk, so XLA
    # updates it in place.
    self._prefill = jax.jit(functools.partial(self._prefill_impl, self._graphdef),
                            static_argnames=("mode",))
    self._prefill_rows = jax.jit(functools.partial(self._prefill_rows_impl, self._graphdef),
                                 donate_argnums=(1,))
    self._joined_init = jax.jit(functools.partial(self._joined_init_impl, self._graphdef),
                                static_argnames=("rows", "width"))
    self._join_groups = jax.jit(self._join_groups_impl, static_argnames=("mode",))
    decode = functools.partial(self._decode_impl, self._graphdef)
    self._decode = jax.jit(decode, static_argnames=("mode",), donate_argnums=(1,))
    few = _few_rows_compiler_options(
        getattr(getattr(self.model, "config", None), "attention_impl", None))
    self._decode_few_rows = self._decode if few is None else jax.jit(
        decode, static_argnames=("mode",), donate_argnums=(1,), compiler_options=few)

  def clear_cache(self) -> None:
    """Frees the cache a keep_cache=True call kept (a call that does not keep one frees it too)."""
    self._kept = None

  # ---------------------------------------------------------------- device programs

  @property
  def mesh(self) -> jax.sharding.Mesh | None:
    if self._mesh is not None:
      return self._mesh
    return getattr(getattr(self.model, "activation_sharding", None), "mesh", None)

  def _constrain_batch(self, x):
    """Splits a per-row array over 'data' (no-op without a mesh)."""
    if self.mesh is None or jnp.ndim(x) == 0:
      return x
    spec = P(DATA_AXIS, *([None] * (jnp.ndim(x) - 1)))
    return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, spec))

  def _prefill_impl(self, graphdef, state, kept_cache, rows, keep, tokens, positions,
                    suffix_mask, cursor, expand, n_real, key, knobs: _Knobs, *, mode: _Mode):
    """Writes the suffixes to the cache at `cursor` and samples each row's first new token.

    A full prefill is the case with no kept cache: a fresh cache, cursor 0, whole prompts.

    Args:
      graphdef: the model's static nnx.GraphDef.
      state: its nnx.State.
      kept_cache: the previous call's KVCache to continue, or None for a fresh cache.
      rows: i32[B] the kept row each row continues (None with kept_cache None).
      keep: bool[B, W] kept slots each row attends to, all before `cursor` (all False with
        kept_cache None); W is the cache length of this call, at least the kept cache's.
      tokens: i32[B, P] left-padded suffixes.
      positions: i32[B, P] position ids (0 on padding).
      suffix_mask: bool[B, P] True on real suffix tokens.
      cursor: i32[] slot of the first suffix column (traced: no recompile as a rollout grows).
      expand: i32[B'] the row of `tokens` each output row copies (its cache, mask and first
        logits), or None for one output row per row of `tokens`.
      n_real: i32[] prompts in the output batch; rows from n_real on are padding and start done.
      key: the call's PRNG key.
      knobs, mode: as for `_decode_impl`.
    Returns:
      _LoopState after step 0: the first new token sampled and queued for slot cursor + P.
    """
    self.num_traces += 1
    p = tokens.shape[1]
    s = keep.shape[1]
    model = nnx.merge(graphdef, state)
    if kept_cache is None:
      cache = model.init_cache(tokens.shape[0], s, dtype=self.cache_dtype)
    else:
      cache = kept_cache.take_rows(rows, s)  # the continued rows, grown to this call's length
    keep = self._constrain_batch(keep)
    cache_mask = self._constrain_batch(
        jax.lax.dynamic_update_slice(keep, suffix_mask, (0, cursor)))
    logits, cache = model.forward_cached(tokens, positions, cache, cursor, cache_mask,
                                         last_logits_only=True, fresh=kept_cache is None)
    logits, last_token, last_pos = logits[:, -1], tokens[:, -1], positions[:, -1]
    if expand is not None:  # repeated prompts: copy the one prefilled row to each of them
      cache, cache_mask, logits, last_token, last_pos = self._take_rows(
          expand, cache, cache_mask, logits, last_token, last_pos)
    return self._first_step(cache, cache_mask, logits, last_token, last_pos, cursor + p - 1,
                            n_real, key, knobs, mode)

  def _take_rows(self, rows, cache, cache_mask, *per_row):
    """The cache, its mask and each per-row array at batch rows `rows` (i32[B'])."""
    return (cache.take_rows(rows, cache_mask.shape[1]),
            *(self._constrain_batch(jnp.take(x, rows, axis=0)) for x in (cache_mask, *per_row)))

  def _first_step(self, cache, cache_mask, logits, last_token, last_pos, start, n_real, key,
                  knobs: _Knobs, mode: _Mode) -> _LoopState:
    """The loop state once the prompts are in the cache: decode step 0 samples each row's first
    token from the last prompt position's logits (f32[B, V]); `start` is that position's slot,
    and rows from n_real on are padding that starts done."""
    b, s = cache_mask.shape
    loop = _LoopState(
        cache=cache,
        cache_mask=cache_mask,
        start=jnp.asarray(start, jnp.int32),
        last_token=last_token,
        last_pos=last_pos,
        step=jnp.int32(0),
        done=self._constrain_batch(jnp.arange(b) >= n_real),
        lengths=self._constrain_batch(jnp.zeros((b,), jnp.int32)),
        tokens=self._constrain_batch(jnp.full((b, s), self.pad_token_id, jnp.int32)),
        logprobs=self._constrain_batch(jnp.zeros((b, s), jnp.float32)),
        policy_logprobs=self._constrain_batch(jnp.zeros((b, s), jnp.float32)),
        row_keys=jax.vmap(jax.random.fold_in, (None, 0))(key, jnp.arange(b, dtype=jnp.uint32)),
    )
    return self._advance(loop, logits, cache, cache_mask, knobs, mode)

  def _prefill_rows_impl(self, graphdef, state, joined, offset, tokens, positions, suffix_mask,
                         cursor):
    """One length group of a full prefill: its prompts (left-padded to the group's bucket P_g)
    written at `cursor` of a fresh cache as wide as `joined`'s, so that they end at the same
    slot as every other group's, then put at rows `offset`.. of `joined` (`_joined_init`'s buffers,
    donated), which every group fills in turn. So a group's program depends on its own shape
    and the call's, and the join's on the call's only, not on how its prompts were grouped."""
    self.num_traces += 1
    model = nnx.merge(graphdef, state)
    b, width = tokens.shape[0], joined[1].shape[1]
    cache = model.init_cache(b, width, dtype=self.cache_dtype)
    cache_mask = jax.lax.dynamic_update_slice(jnp.zeros((b, width), bool), suffix_mask,
                                              (0, cursor))
    logits, cache = model.forward_cached(tokens, positions, cache, cursor, cache_mask,
                                         last_logits_only=True, fresh=True)

    def put(big, small):
      return jax.lax.dynamic_update_slice_in_dim(big, small.astype(big.dtype), offset, axis=0)
    cache = type(cache)(*(tuple(put(a, x) for a, x in zip(big, small))
                          for big, small in zip(joined[0], cache)))
    part = (cache_mask, logits[:, -1], tokens[:, -1], positions[:, -1])
    return (cache, *(self._constrain_batch(put(a, x)) for a, x in zip(joined[1:], part)))

  def _joined_init_impl(self, graphdef, state, *, rows: int, width: int):
    """Empty buffers for a grouped prefill's `rows` rows: (cache of `width` slots, cache_mask,
    last logits f32[rows, V], last tokens, last positions)."""
    self.num_traces += 1
    model = nnx.merge(graphdef, state)
    cache = model.init_cache(rows, width, dtype=self.cache_dtype)
    return (cache, *(self._constrain_batch(x) for x in (
        jnp.zeros((rows, width), bool), jnp.zeros((rows, model.config.vocab_size), jnp.float32),
        jnp.zeros((rows,), jnp.int32), jnp.zeros((rows,), jnp.int32))))

  def _join_groups_impl(self, joined, gather, start, n_real, key, knobs: _Knobs, *,
                        mode: _Mode) -> _LoopState:
    """The length groups' prefills (`_prefill_rows_impl`'s buffers) as one batch: gathered into
    the call's row order (`gather`: i32[B], each output row's row in the buffers; repeated
    prompts name the same one), and decode step 0."""
    self.num_traces += 1
    cache, cache_mask, logits, last_token, last_pos = self._take_rows(gather, *joined)
    return self._first_step(cache, cache_mask, logits, last_token, last_pos, start, n_real, key,
                            knobs, mode)

  def _advance(self, c: _LoopState, logits, cache, cache_mask, knobs: _Knobs,
               mode: _Mode) -> _LoopState:
    """Step c.step's bookkeeping once its token went in: samples the next token from `logits`
    (f32[B, V]), records it for the rows still live and queues it to be fed."""
    tok, lp, plp = _choose(logits, c.row_keys, c.step, knobs, mode)
    live = ~c.done
    tok = jnp.where(live, tok, self.pad_token_id)
    col = (0, c.step)
    eos = jnp.asarray(self.eos_token_ids, jnp.int32)
    done = c.done | jnp.isin(tok, eos) | (c.step + 1 >= knobs.max_new)
    return _LoopState(
        cache=cache,
        cache_mask=cache_mask,
        start=c.start,
        last_token=tok,
        last_pos=c.last_pos + 1,
        step=c.step + 1,
        done=done,
        lengths=c.lengths + live.astype(jnp.int32),
        tokens=jax.lax.dynamic_update_slice(c.tokens, tok[:, None], col),
        logprobs=jax.lax.dynamic_update_slice(c.logprobs, jnp.where(live, lp, 0.0)[:, None], col),
        policy_logprobs=jax.lax.dynamic_update_slice(
            c.policy_logprobs, jnp.where(live, plp, 0.0)[:, None], col),
        row_keys=c.row_keys,
    )

  def _decode_impl(self, graphdef, state, loop: _LoopState, knobs: _Knobs, stop_at, *,
                   mode: _Mode):
    """Runs decode steps until `stop_at` tokens exist or every row is done.

    Args:
      graphdef, state: the model, split.
      loop: _LoopState (donated).
      knobs: traced sampling values.
      stop_at: i32[] run while step < stop_at (<= max_new).
      mode: static _Mode.
    Returns:
      The advanced _LoopState.
    """
    self.num_traces += 1
    model = nnx.merge(graphdef, state)

    def cond(c: _LoopState):
      return (c.step < stop_at) & ~jnp.all(c.done)

    def body(c: _LoopState):
      slot = c.start + c.step
      mask = jax.lax.dynamic_update_slice(c.cache_mask, jnp.ones((c.done.shape[0], 1), bool),
                                          (0, slot))
      logits, cache = model.forward_cached(c.last_token[:, None], c.last_pos[:, None], c.cache,
                                           slot, mask)
      return self._advance(c, logits[:, -1], cache, mask, knobs, mode)

    return jax.lax.while_loop(cond, body, loop)

  # ---------------------------------------------------------------- host side

  def _pad_batch(self, n: int, buckets: Sequence[int] | None = None) -> int:
    """Batch bucket for n prompts (of `buckets`, default `batch_buckets`), a multiple of the
    mesh's 'data' size."""
    buckets = self.batch_buckets if buckets is None else buckets
    b = _bucket(n, buckets)
    if b is None:
      top = buckets[-1]
      b = -(-n // top) * top
    data = 1 if self.mesh is None else int(self.mesh.shape[DATA_AXIS])
    return -(-b // data) * data

  def _prefill_batch(self, n: int, bucket: int) -> int:
    """Rows that prefill n distinct prompts at prompt bucket `bucket`: the finer
    `prefill_batch_buckets` where the rows they save cost at least `split_min_flops`, else the
    call's batch bucket."""
    coarse, fine = self._pad_batch(n), self._pad_batch(n, self.prefill_batch_buckets)
    if fine < coarse and (coarse - fine) * bucket * self._position_flops >= self.split_min_flops:
      return fine
    return coarse

  def _prompt_bucket(self, longest: int, max_new_tokens: int) -> int:
    """Smallest prompt bucket that holds the longest prompt and leaves room to generate."""
    room = self.max_cache_len - max_new_tokens + 1  # the largest prompt bucket that still fits
    if longest > room:
      raise ValueError(
          f"a prompt of {longest} tokens plus max_new_tokens={max_new_tokens} needs "
          f"{longest + max_new_tokens - 1} cache slots, but max_cache_len={self.max_cache_len}")
    b = _bucket(longest, [x for x in self.prompt_buckets if x <= room])
    return room if b is None else b  # one extra shape per max_new_tokens, still compiled once

  def _put(self, x):
    if self.mesh is None or x is None:
      return x  # jit moves numpy inputs itself
    spec = P(DATA_AXIS, *([None] * (np.ndim(x) - 1)))
    return jax.device_put(x, NamedSharding(self.mesh, spec))

  def _layout(self, suffixes: Sequence[Sequence[int]], bases: Sequence[int], bucket: int,
              bb: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Left-pads suffixes to [bb, bucket]; suffix i's positions start at bases[i].

    Returns (tokens, positions, suffix_mask). Dummy rows get one real-looking token so their
    attention is never empty; they start done.
    """
    tokens = np.full((bb, bucket), self.pad_token_id, np.int32)
    positions = np.zeros((bb, bucket), np.int32)
    mask = np.zeros((bb, bucket), bool)
    for i, (x, base) in enumerate(zip(suffixes, bases)):
      l = len(x)
      tokens[i, bucket - l:] = np.asarray(x, np.int32)
      positions[i, bucket - l:] = base + np.arange(l, dtype=np.int32)
      mask[i, bucket - l:] = True
    mask[len(suffixes):, -1] = True
    return tokens, positions, mask

  def _cache_len(self, need: int, at_least: int = 0) -> int:
    """Cache length for a call that writes up to slot `need` - 1 (a bucket, >= at_least)."""
    return max(_bucket(need, self.cache_buckets), at_least)

  @property
  def _cost_config(self) -> ModelConfig | None:
    """The model's ModelConfig, what its work is counted from (None: another model kind, whose
    work is reported as NaN)."""
    config = getattr(self.model, "config", None)
    return config if isinstance(config, ModelConfig) else None

  def _prefill_flops(self, lengths, bases=None) -> float:
    """Model FLOPs of prefilling suffixes of `lengths` after `bases` cached tokens."""
    config = self._cost_config
    return float("nan") if config is None else cost.forward_flops(config, lengths, bases)

  def _decode_bytes(self, prompts, lengths, steps: int) -> float:
    """Bytes this call's decode had to read (`cost.decode_bytes`)."""
    config = self._cost_config
    if config is None:
      return float("nan")
    weights = jnp.dtype(getattr(self.model, "param_dtype", jnp.float32)).itemsize
    cache = jnp.dtype(self.cache_dtype or getattr(self.model, "dtype", jnp.float32)).itemsize
    return cost.decode_bytes(config, [len(p) for p in prompts], lengths, steps - 1, weights,
                             cache)

  def _plan_full(self, prompts, bb: int, max_new_tokens: int) -> _Plan:
    pb = self._prompt_bucket(max(len(p) for p in prompts), max_new_tokens)
    tokens, positions, mask = self._layout(prompts, [0] * len(prompts), pb, bb)
    keep = np.zeros((bb, self._cache_len(pb + max_new_tokens - 1)), bool)
    return _Plan(tokens, positions, mask, cursor=0, rows=None, keep=keep, reused=0,
                 prefilled=int(sum(len(p) for p in prompts)),
                 prefill_flops=self._prefill_flops([len(p) for p in prompts]))

  def _plan_continuation(self, prompts, continue_rows, kept: _Kept, bb: int,
                         max_new_tokens: int) -> _Plan | None:
    """A plan that prefills only what each prompt adds to its kept row, or None when a prompt
    does not extend its row or the suffixes would overflow the cache."""
    suffixes, bases = [], []
    for p, r in zip(prompts, continue_rows):
      seq = None if r is None else kept.seqs[r]
      if seq is None or len(p) <= len(seq) or not np.array_equal(
          np.asarray(p[:len(seq)], np.int64), seq):
        return None
      suffixes.append(p[len(seq):])
      bases.append(len(seq))
    sb = _bucket(max(len(x) for x in suffixes), self.prompt_buckets)
    if sb is None or kept.cursor + sb - 1 + max_new_tokens > self.max_cache_len:
      return None  # a full prefill packs the rows into the cache again
    tokens, positions, mask = self._layout(suffixes, bases, sb, bb)
    n = len(prompts)
    rows = np.zeros(bb, np.int32)  # dummy rows gather row 0 and attend to none of it
    rows[:n] = np.asarray(continue_rows, np.int32)
    width = kept.slots.shape[1]
    keep = np.zeros((bb, self._cache_len(kept.cursor + sb - 1 + max_new_tokens, width)), bool)
    keep[:n, :width] = kept.slots[rows[:n]]
    return _Plan(tokens, positions, mask, cursor=kept.cursor, rows=rows, keep=keep,
                 reused=int(sum(bases)), prefilled=int(sum(len(x) for x in suffixes)),
                 prefill_flops=self._prefill_flops([len(x) for x in suffixes], bases))

  def _length_groups(self, prompts, bu: int,
                     max_new_tokens: int) -> list[tuple[np.ndarray, int]] | None:
    """Two or three groups of the prompts by length, shortest first, each (its prompts' indices,
    its prompt bucket) to be prefilled in its own batch at that bucket, when that runs at least
    `_MIN_GROUP_SAVING` fewer padded positions than one batch of `bu` rows at the longest
    prompt's bucket and those positions' FLOPs reach `split_min_flops`; the groups' batches
    hold at most `bu` rows in all (decode runs on the call's batch). None when no split saves
    that much."""
    n = len(prompts)
    lengths = np.asarray([len(p) for p in prompts])
    order = np.argsort(lengths, kind="stable")
    bucket = [self._prompt_bucket(int(lengths[order[k - 1]]), max_new_tokens)
              for k in range(1, n + 1)]  # the bucket of the k shortest prompts

    def cost(bounds):
      rows = [self._prefill_batch(b - a, bucket[b - 1]) for a, b in zip(bounds, bounds[1:])]
      if sum(rows) > bu:
        return None
      return sum(r * bucket[b - 1] for r, (_, b) in zip(rows, zip(bounds, bounds[1:])))

    splits = [(0, k, n) for k in range(1, n)]
    if n <= _MAX_THREE_GROUP_SEARCH:
      splits += [(0, a, b, n) for a in range(1, n - 1) for b in range(a + 1, n)]
    whole = bu * bucket[-1]
    most = min((1.0 - _MIN_GROUP_SAVING) * whole,
               whole - self.split_min_flops / max(self._position_flops, 1))
    best, best_cost = None, most
    for bounds in splits:
      c = cost(bounds)
      if c is not None and c <= best_cost:
        best, best_cost = bounds, c
    if best is None:
      return None
    return [(order[a:b], bucket[b - 1]) for a, b in zip(best, best[1:])]

  def _plan_groups(self, prompts, groups, expand, bu: int, bb: int,
                   max_new_tokens: int) -> _Plan:
    """A full prefill of the distinct `prompts` in length `groups` (`_length_groups`, which
    keeps their rows within `bu`), all ending at the slot of the longest group's bucket, then
    gathered to the call's `bb` rows (`expand`: each row's distinct prompt, None: one row
    each)."""
    top = max(pb for _, pb in groups)
    width = self._cache_len(top + max_new_tokens - 1)
    parts, where, offset = [], np.zeros(len(prompts), np.int32), 0
    for g, pb in groups:
      rows = self._prefill_batch(len(g), pb)
      tokens, positions, mask = self._layout([prompts[i] for i in g], [0] * len(g), pb, rows)
      parts.append((tokens, positions, mask, top - pb))
      where[g] = offset + np.arange(len(g))
      offset += rows
    gather = np.zeros(bb, np.int32)  # dummy rows copy row 0 and start done
    source = np.arange(len(prompts)) if expand is None else expand
    gather[:len(source)] = where[source]
    return _Plan(tokens=None, positions=None, suffix_mask=None, cursor=0, rows=None,
                 keep=np.zeros((bb, width), bool), reused=0,
                 prefilled=int(sum(len(p) for p in prompts)), groups=tuple(parts),
                 gather=gather, joined_rows=bu,
                 prefill_flops=self._prefill_flops([len(p) for p in prompts]))

  def _plan(self, prompts, continue_rows, kept: _Kept | None, bb: int,
            max_new_tokens: int, keep_cache: bool = False) -> _Plan:
    """The call's plan: prefill each distinct prompt once (continuing its kept row where it
    can), then copy its row to every prompt that repeats it (`expand`). A full prefill pads its
    rows to the bucket `_prefill_batch` picks and, when its cache is not kept, may run in length
    groups (`_length_groups`)."""
    index, order = {}, []  # distinct prompt -> its plan row; each one's first occurrence
    expand = np.zeros(bb, np.int32)  # dummy rows copy row 0 and start done
    for i, p in enumerate(prompts):
      key = tuple(p) if self.share_prompts else i
      if key not in index:
        index[key] = len(order)
        order.append(i)
      expand[i] = index[key]
    distinct = [prompts[i] for i in order]
    if continue_rows is not None and kept is not None:
      bu = self._pad_batch(len(distinct))
      if bu == bb:  # no smaller batch to prefill: one program shape fewer without the copy
        plan = self._plan_continuation(prompts, continue_rows, kept, bb, max_new_tokens)
      else:
        plan = self._plan_continuation(distinct, [continue_rows[i] for i in order], kept, bu,
                                       max_new_tokens)
      if plan is not None:
        return plan._replace(expand=None if bu == bb else expand)
    bu = self._prefill_batch(len(distinct), self._prompt_bucket(
        max(len(p) for p in distinct), max_new_tokens))
    if bu == bb:
      distinct, expand = list(prompts), None
    groups = (self._length_groups(distinct, bu, max_new_tokens)
              if self.split_lengths and not keep_cache and len(distinct) > 1 else None)
    if groups is not None:
      return self._plan_groups(distinct, groups, expand, bu, bb, max_new_tokens)
    return self._plan_full(distinct, bu, max_new_tokens)._replace(expand=expand)

  def _validate(self, prompts, max_new_tokens, temperature, top_p, top_k, stop_strings,
                decode_fn, continue_rows, keep_cache):
    check_request(prompts, max_new_tokens, temperature, top_p, top_k, stop_strings, decode_fn,
                  vocab_size=getattr(getattr(self.model, "config", None), "vocab_size", None))
    for i, p in enumerate(prompts):
      if len(p) >= self.max_cache_len:
        raise ValueError(f"prompt {i} has {len(p)} tokens, which does not leave room in "
                         f"max_cache_len={self.max_cache_len}")
    if not isinstance(keep_cache, bool):
      raise ValueError(f"keep_cache must be a bool, got {keep_cache!r}")
    if continue_rows is None:
      return
    if isinstance(continue_rows, (str, bytes)) or len(continue_rows) != len(prompts):
      raise ValueError(f"continue_rows must give one kept row (or None) per prompt: "
                       f"{len(prompts)} entries")
    kept = len(self._kept.seqs) if self._kept is not None else None
    for i, r in enumerate(continue_rows):
      if r is None:
        continue
      if isinstance(r, bool) or not isinstance(r, (int, np.integer)) or r < 0 \
          or (kept is not None and r >= kept):
        raise ValueError(f"continue_rows[{i}] = {r!r} is not a kept row index "
                         f"(the last call kept {kept} rows)")

  def __call__(self, prompts: Sequence[Sequence[int]], key: jax.Array, *, max_new_tokens: int,
               temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0,
               greedy: bool = False, stop_strings: Sequence[str] = (),
               decode_fn: Callable[[list[int]], str] | None = None,
               continue_rows: Sequence[int | None] | None = None,
               keep_cache: bool = False) -> SampleOutput:
    """Samples up to `max_new_tokens` new tokens for each prompt.

    Args:
      prompts: ragged token-id lists, each non-empty.
      key: a PRNG key; the same key gives the same output.
      max_new_tokens: at most this many new tokens per prompt (>= 1).
      temperature: divides the logits; 0 means greedy.
      top_p: nucleus mass to keep, in (0, 1]; 1 keeps all.
      top_k: keep only the k most likely tokens; 0 keeps all.
      greedy: argmax decoding (ignores temperature, top_p, top_k and the key).
      stop_strings: a row stops at the first token whose decoded text completes one of these.
      decode_fn: token ids -> text (e.g. a tokenizer's decode); needed for stop strings and texts.
      continue_rows: per prompt, the index (in the previous call's prompt list) of the kept row
        whose prompt + response this prompt extends, or None. When every prompt extends its row
        and the cache has room, only the new suffixes are prefilled; otherwise the call does a
        full prefill. The output is the same either way (up to float rounding). The kept keys
        and values are those of the model at the previous call: do not continue across a
        parameter update.
      keep_cache: keep this call's cache on the device so the next call can continue it (it is
        freed by the next call, or `clear_cache`).
    Returns:
      SampleOutput, one entry per prompt.
    """
    stop_strings = tuple(stop_strings)
    if isinstance(prompts, np.ndarray):  # a rectangular batch: one prompt per row
      prompts = list(prompts)
    self._validate(prompts, max_new_tokens, temperature, top_p, top_k, stop_strings, decode_fn,
                   continue_rows, keep_cache)
    t_start, c_start = time.perf_counter(), xla_compile_seconds()
    kept, self._kept = self._kept, None  # freed once this call is done with it
    max_new_tokens = int(max_new_tokens)
    n = len(prompts)
    greedy = bool(greedy) or temperature == 0
    vocab = getattr(getattr(self.model, "config", None), "vocab_size", None)
    k = int(top_k)
    k_filters = k > 0 and (vocab is None or k < vocab)
    mode = _Mode(greedy=greedy, filtered=not greedy and (k_filters or top_p < 1.0))

    bb = self._pad_batch(n)
    plan = self._plan(prompts, continue_rows, kept, bb, max_new_tokens, keep_cache)
    # numpy scalars: jit takes them as traced values without a device dispatch each.
    knobs = _Knobs(temperature=np.float32(max(temperature, 1e-6)), top_p=np.float32(top_p),
                   top_k=np.int32(k if k_filters else np.iinfo(np.int32).max),
                   max_new=np.int32(max_new_tokens))

    state = self._state
    if plan.groups is not None:
      joined, offset = self._joined_init(state, rows=plan.joined_rows,
                                         width=plan.keep.shape[1]), 0
      for tokens, positions, mask, cursor in plan.groups:
        joined = self._prefill_rows(state, joined, np.int32(offset), self._put(tokens),
                                    self._put(positions), self._put(mask), np.int32(cursor))
        offset += tokens.shape[0]
      loop = self._join_groups(joined, self._put(plan.gather),
                               np.int32(plan.groups[0][3] + plan.groups[0][0].shape[1] - 1),
                               np.int32(n), key, knobs, mode=mode)
    else:
      loop = self._prefill(state, None if plan.rows is None else kept.cache,
                           self._put(plan.rows), self._put(plan.keep), self._put(plan.tokens),
                           self._put(plan.positions), self._put(plan.suffix_mask),
                           np.int32(plan.cursor), self._put(plan.expand), np.int32(n), key,
                           knobs, mode=mode)
    del kept  # the gathered rows are all this call needs
    jax.block_until_ready(loop.step)  # the split of the call's time between its two phases
    t_prefilled, c_prefilled = time.perf_counter(), xla_compile_seconds()

    stopped = np.zeros(bb, bool)
    decode = self._decode_few_rows if bb <= _FEW_ROWS else self._decode
    if not stop_strings:
      loop = decode(state, loop, knobs, np.int32(max_new_tokens), mode=mode)
    else:
      step = 0
      while step < max_new_tokens:
        stop_at = min(step + self.stop_check_every, max_new_tokens)
        loop = decode(state, loop, knobs, np.int32(stop_at), mode=mode)
        toks, lengths, done = jax.device_get((loop.tokens, loop.lengths, loop.done))
        step = stop_at
        if done.all():
          break
        for i in range(n):
          if not done[i] and _find_stop(decode_fn(toks[i, :lengths[i]].tolist()), stop_strings):
            stopped[i] = True
        if stopped.any():
          new_done = done | stopped  # a device array, so the whole loop state can be donated
          loop = loop._replace(done=jnp.asarray(new_done) if self.mesh is None
                               else self._put(new_done))

    toks, lp, plp, lengths, steps = jax.device_get(
        (loop.tokens, loop.logprobs, loop.policy_logprobs, loop.lengths, loop.step))
    t_decoded, c_decoded = time.perf_counter(), xla_compile_seconds()
    out = SampleOutput(tokens=[], logprobs=[], policy_logprobs=[],
                       texts=[] if decode_fn is not None else None, finish_reasons=[],
                       num_steps=int(steps), reused_tokens=plan.reused,
                       prefilled_tokens=plan.prefilled,
                       prefill_seconds=t_prefilled - t_start,
                       decode_seconds=t_decoded - t_prefilled,
                       prefill_compile_seconds=c_prefilled - c_start,
                       decode_compile_seconds=c_decoded - c_prefilled,
                       prefill_flops=plan.prefill_flops,
                       decode_bytes=self._decode_bytes(prompts, lengths[:n], int(steps)))
    eos = np.asarray(self.eos_token_ids)
    for i in range(n):
      m = int(lengths[i])
      row = toks[i, :m]
      reason = "eos" if m and np.isin(row[-1], eos) else "length"
      if stop_strings:
        cut = _stop_cut(row, stop_strings, decode_fn)
        if cut is not None:
          m, reason = cut, "stop"
      out.tokens.append(np.asarray(toks[i, :m], np.int32))
      out.logprobs.append(np.asarray(lp[i, :m], np.float32))
      out.policy_logprobs.append(np.asarray(plp[i, :m], np.float32))
      out.finish_reasons.append(reason)
      if decode_fn is not None:
        out.texts.append(decode_fn(out.tokens[-1].tolist()))
    if keep_cache:
      self._kept = self._keep(loop.cache, plan, prompts, out.tokens, int(steps))
    return out

  def _keep(self, cache, plan: _Plan, prompts, responses, steps: int) -> _Kept:
    """What the cache holds after a call: per row, its kept slots, then the suffix and the
    response, less the response's last token (sampled, never fed back). Slots written past a
    returned response (a stop-string cut, a finished row) are not kept."""
    n = len(prompts)
    start = plan.cursor + plan.tokens.shape[1] - 1  # slot of decode step 0
    source = np.arange(n) if plan.expand is None else plan.expand[:n]  # each row's plan row
    slots = plan.keep[source].copy()
    seqs = []
    for i in range(n):
      suffix_len = int(plan.suffix_mask[source[i]].sum())
      slots[i, start + 1 - suffix_len:start + len(responses[i])] = True
      seqs.append(np.concatenate([np.asarray(prompts[i], np.int32), responses[i]])[:-1])
    return _Kept(cache=cache, cursor=start + steps, seqs=seqs, slots=slots)


def _find_stop(text: str, stop_strings: Sequence[str]) -> bool:
  return any(s in text for s in stop_strings)


def _stop_cut(row: np.ndarray, stop_strings: Sequence[str],
              decode_fn: Callable[[list[int]], str]) -> int | None:
  """Shortest prefix length whose decoded text holds a stop string, or None.

  Text only grows as tokens are added, so "holds a stop string" is monotone in the prefix length
  and a binary search needs O(log n) decodes.
  """
  ids = row.tolist()
  if not _find_stop(decode_fn(ids), stop_strings):
    return None
  lo, hi = 1, len(ids)
  while lo < hi:
    mid = (lo + hi) // 2
    if _find_stop(decode_fn(ids[:mid]), stop_strings):
      hi = mid
    else:
      lo = mid + 1
  return lo
