"""Micro-batching: one batch's loss and gradient, or its per-row outputs, computed micro-batch by
micro-batch.

  microbatched_value_and_grad(fun, n, weight_fn=...)  gradient accumulation over n micro-batches
  grad_accumulator(fun, weight_fn=...)                the same as init/add/result, any shapes
  microbatched_rows(fun, n)                           a per-row function in n sequential passes

A PPO mini-batch of long agent trajectories may not fit in memory as one forward and backward
pass, and even where it fits, smaller passes can be faster: on CPU a large batch's activations
are fresh pages every step, while a micro-batch's live set is small and reused inside one
`lax.scan`. The result is the whole batch's, not an average of micro-batch losses:
each micro-batch's loss and gradient are weighted by its share of the batch's aggregate (its
tokens for a token mean, its live rows for a mean over sequences: `salt_jax.aggregate_weight`),
as MaxText and newer verl weight by global token counts.

`microbatched_rows` does the same for a forward pass (the log-prob phases): each pass's
temporaries are freed before the next, so peak memory is one micro-batch's.

Rows go to micro-batches round-robin (row r to micro-batch r % n), so rows split over the mesh's
'data' axis in contiguous blocks stay spread over every device in each micro-batch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


def _split(batch, num_microbatches: int):
  """Every leaf [R, ...] -> [n, R / n, ...], micro-batch i holding rows i, i + n, i + 2n, ..."""
  leaves, _ = jax.tree.flatten_with_path(batch)
  if not leaves:
    raise ValueError("batch has no arrays to split into micro-batches")
  rows = None
  for path, x in leaves:
    shape = np.shape(x)
    if not shape:
      raise ValueError(f"batch leaf {jax.tree_util.keystr(path)} is a scalar; every leaf needs "
                       "a leading row axis (pass per-batch values as extra arguments)")
    if rows is None:
      rows = shape[0]
    elif shape[0] != rows:
      raise ValueError(f"batch leaf {jax.tree_util.keystr(path)} has {shape[0]} rows, others "
                       f"{rows}")
  if rows % num_microbatches:
    raise ValueError(f"{rows} rows do not split into {num_microbatches} equal micro-batches")

  def split(x):
    x = jnp.asarray(x)
    return jnp.swapaxes(x.reshape(rows // num_microbatches, num_microbatches, *x.shape[1:]), 0, 1)
  return jax.tree.map(split, batch)


def _unsplit(out, num_microbatches: int):
  """The inverse of `_split`: every leaf [n, R / n, ...] -> [R, ...] in the original row order."""
  def unsplit(x):
    return jnp.swapaxes(x, 0, 1).reshape(x.shape[1] * num_microbatches, *x.shape[2:])
  return jax.tree.map(unsplit, out)


def _check_count(num_microbatches) -> int:
  if not isinstance(num_microbatches, (int, np.integer)) or isinstance(num_microbatches, bool) \
      or num_microbatches < 1:
    raise ValueError(f"num_microbatches must be an int >= 1, got {num_microbatches!r}")
  return int(num_microbatches)


def microbatched_rows(fun: Callable, num_microbatches: int) -> Callable:
  """`fun` over a batch's rows, run as `num_microbatches` sequential passes (`lax.map`).

  Args:
    fun: fun(params, batch, *args) -> a pytree of arrays [R', ...] with one leading row per row
      of `batch` (R' = the rows `fun` was given), rows independent of each other (a forward pass).
    num_microbatches: n >= 1; every leaf of `batch` is split on its leading (row) axis into n
      micro-batches, as in `microbatched_value_and_grad`. 1 is `fun` itself.

  Returns:
    f(params, batch, *args) -> fun(params, batch, *args), row for row, with one micro-batch's
    temporaries live at a time.

  Raises (when f is called or traced):
    ValueError: num_microbatches < 1, a scalar leaf, leaves with different row counts, or rows
      not divisible by num_microbatches.
  """
  n = _check_count(num_microbatches)
  if n == 1:
    return fun

  def f(params, batch, *args):
    return _unsplit(jax.lax.map(lambda mb: fun(params, mb, *args), _split(batch, n)), n)

  return f


class GradSums(NamedTuple):
  """Running sums over micro-batches i: loss = sum_i w_i loss_i, grads = sum_i w_i grad_i,
  weight = sum_i w_i (w_i the micro-batch's `weight_fn`); aux and aux_weight the same with the
  aux weights, per aux value (None without aux). Micro-batches of weight 0 add nothing."""

  loss: jax.Array
  grads: Any
  weight: jax.Array
  aux: Any = None
  aux_weight: Any = None


class GradAccumulator(NamedTuple):
  """Gradient accumulation as three pure functions (jit each, or run them inside one program):

    init(params, batch, *args) -> GradSums of zeros (shapes traced from `batch`, not computed)
    add(sums, params, batch, *args) -> sums with `batch`'s weighted value and gradient added
    result(sums) -> (loss, grads) or ((loss, aux), grads): the weighted means
  """

  init: Callable
  add: Callable
  result: Callable


def grad_accumulator(fun: Callable, *, weight_fn: Callable, aux_weight_fn: Callable | None = None,
                     has_aux: bool = False) -> GradAccumulator:
  """The batch aggregate's value and gradient summed one micro-batch at a time, for micro-batches
  of any shapes (`microbatched_value_and_grad` runs it over equal ones in one `lax.scan`; the
  trainer over micro-batches each cut to its own rows' length, one program per length).

  Args: as `microbatched_value_and_grad`'s (weight_fn returns the one micro-batch's weight).
  The result is sum_i w_i value_i / sum_i w_i; a total weight of 0 gives loss 0 and zero
  gradients; a NaN in a micro-batch of positive weight reaches the result.

  Raises (when add is traced): ValueError when weight_fn does not return one scalar, or
  aux_weight_fn neither one scalar nor a tree shaped like aux.
  """
  aux_weight_fn = weight_fn if aux_weight_fn is None else aux_weight_fn
  grad_fn = jax.value_and_grad(fun, has_aux=has_aux)

  def weighted(x, w):
    return jnp.where(w > 0, x * w.astype(x.dtype), jnp.zeros_like(x))

  def aux_weights(batch, aux):
    aw = aux_weight_fn(batch)
    if isinstance(aw, (jax.Array, np.ndarray, float, int)):
      aw = jax.tree.map(lambda _: aw, aux)  # one weight for every aux value
    elif jax.tree.structure(aw) != jax.tree.structure(aux):
      raise ValueError(f"aux_weight_fn must return one scalar or a tree shaped like aux "
                       f"({jax.tree.structure(aux)}), got {jax.tree.structure(aw)}")
    return jax.tree.map(lambda w: _scalar_weight("aux_weight_fn", w), aw)

  def add(sums: GradSums, params, batch, *args) -> GradSums:
    out, g = grad_fn(params, batch, *args)
    loss, aux = out if has_aux else (out, None)
    w = _scalar_weight("weight_fn", weight_fn(batch))
    new = sums._replace(loss=sums.loss + weighted(loss, w),
                        grads=jax.tree.map(lambda t, x: t + weighted(x, w), sums.grads, g),
                        weight=sums.weight + w)
    if has_aux:
      aw = aux_weights(batch, aux)
      new = new._replace(
          aux=jax.tree.map(lambda t, x, a: t + weighted(x, a), sums.aux, aux, aw),
          aux_weight=jax.tree.map(lambda t, a: t + a, sums.aux_weight, aw))
    return new

  def init(params, batch, *args) -> GradSums:
    out_shape, grad_shape = jax.eval_shape(grad_fn, params, batch, *args)
    loss_shape, aux_shape = out_shape if has_aux else (out_shape, None)
    zeros = lambda t: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), t)  # noqa: E731
    zero = jnp.zeros((), jnp.float32)
    return GradSums(zeros(loss_shape), zeros(grad_shape), zero,
                    zeros(aux_shape) if has_aux else None,
                    jax.tree.map(lambda _: zero, aux_shape) if has_aux else None)

  def result(sums: GradSums):
    def mean(x, w):
      return x / jnp.maximum(w, jnp.finfo(jnp.float32).tiny).astype(x.dtype)
    loss = mean(sums.loss, sums.weight)
    grads = jax.tree.map(lambda g: mean(g, sums.weight), sums.grads)
    if not has_aux:
      return loss, grads
    return (loss, jax.tree.map(mean, sums.aux, sums.aux_weight)), grads

  return GradAccumulator(init, add, result)


def _scalar_weight(name: str, w) -> jax.Array:
  w = jnp.asarray(w, jnp.float32)
  if w.shape != ():
    raise ValueError(f"{name} must return one scalar per micro-batch, got shape {w.shape}")
  return w


def microbatched_value_and_grad(fun: Callable, num_microbatches: int, *,
                                weight_fn: Callable, aux_weight_fn: Callable | None = None,
                                has_aux: bool = False) -> Callable:
  """`jax.value_and_grad(fun, has_aux=has_aux)` of a batch aggregate, one micro-batch at a time.

  Args:
    fun: fun(params, batch, *args) -> loss (or (loss, aux) with has_aux), where `loss` is the
      batch's aggregate (a mean over its tokens or rows). Differentiated in params.
    num_microbatches: n >= 1; every leaf of `batch` is split on its leading (row) axis into n
      micro-batches. 1 is plain `jax.value_and_grad`.
    weight_fn: weight_fn(micro_batch) -> f32[], the micro-batch's weight in the batch aggregate;
      for `salt_jax.aggregate(v, mask, mode)`, `lambda mb: aggregate_weight(mb["mask"], mode)`.
    aux_weight_fn: the same for `aux` (default weight_fn): one scalar for every aux value, or a
      pytree of scalars shaped like aux, one per value (a loss that is a mean over sequences
      beside metrics that are token means).
    has_aux: whether fun returns (loss, aux); aux is a pytree of arrays.

  Returns:
    f(params, batch, *args) -> (loss, grads) or ((loss, aux), grads), equal (up to float
    rounding) to jax.value_and_grad(fun, has_aux)(params, batch, *args): loss and grads are
    sum_i w_i value_i / sum_i w_i (`grad_accumulator`, in one `lax.scan`). A micro-batch of
    weight 0 adds nothing (not even a NaN of its own); a batch of total weight 0 gives loss 0
    and zero gradients. A NaN in a micro-batch of positive weight reaches the result, for the
    caller's non-finite guard to see.

  Raises (when f is called or traced):
    ValueError: num_microbatches < 1, a scalar leaf, leaves with different row counts, rows
      not divisible by num_microbatches, or weights that are not one scalar per micro-batch.
  """
  n = _check_count(num_microbatches)
  if n == 1:
    return jax.value_and_grad(fun, has_aux=has_aux)
  acc = grad_accumulator(fun, weight_fn=weight_fn, aux_weight_fn=aux_weight_fn, has_aux=has_aux)

  def f(params, batch, *args) -> Any:
    mbs = _split(batch, n)
    first = jax.tree.map(lambda x: x[0], mbs)
    sums, _ = jax.lax.scan(lambda s, mb: (acc.add(s, params, mb, *args), None),
                           acc.init(params, first, *args), mbs)
    return acc.result(sums)

  return f
