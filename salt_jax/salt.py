"""The SALT step on the device: average advantages over merged trajectory-graph edges.

`build_merge_ids` (host, `salt_jax.graph`) gives every step the id of its merged edge; `refine`
then replaces each step's advantage by the mean over the steps sharing its id. It is two
`segment_sum`s and two gathers: jittable, batch-shape polymorphic, and it runs with its inputs
sharded along a `data` mesh axis (Auto or Explicit axes).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from salt_jax import _checks


def _explicit_mesh_axes(x) -> bool:
  """True when `x` is traced under a mesh with Explicit axes (`jax.make_mesh`'s default).

  There `segment_sum` and gathers must be told their output sharding; under Auto axes (and
  without a mesh) XLA's propagation picks it.
  """
  try:
    sharding = jax.typeof(x).sharding
  except Exception:
    return False
  mesh = getattr(sharding, "mesh", None)
  types = getattr(mesh, "axis_types", ())
  return any(t == jax.sharding.AxisType.Explicit for t in types)


def refine(step_advantages, merge_ids, num_segments, mask=None):
  """SALT: each step gets the mean advantage of the (unmasked) steps in its merged edge.

    A'_i = sum_{j: id_j = id_i, mask_j} A_j / |{j: id_j = id_i, mask_j}|

  A step alone in its id keeps its advantage exactly; masked steps (padding, failed trajectories)
  return 0 and contribute nothing, even if their advantage is NaN. Ids outside
  [0, num_segments) are treated as masked.

  Args:
    step_advantages: f32[N], each step's advantage (its trajectory's group advantage).
    merge_ids: int32[N], merged-edge id of each step (`build_merge_ids(...).ids`).
    num_segments: static int >= 1, at least max(merge_ids) + 1 (`build_merge_ids(...).num_segments`,
      or a fixed bucket size to avoid recompiling).
    mask: optional bool or 0/1 [N]; False marks steps that take no part.
  Returns:
    f32[N] refined advantages.
  """
  _checks.check_rank("step_advantages", step_advantages, 1)
  _checks.check_rank("merge_ids", merge_ids, 1)
  _checks.check_same_shape("step_advantages", step_advantages, "merge_ids", merge_ids)
  _checks.check_integer("merge_ids", merge_ids)
  num_segments = _checks.check_static_count("num_segments", num_segments)
  adv = jnp.asarray(step_advantages, jnp.float32)
  ids = jnp.asarray(merge_ids, jnp.int32)
  valid = _checks.as_mask("mask", mask, adv) & (ids >= 0) & (ids < num_segments)
  adv = jnp.where(valid, adv, 0.0)  # where, not a product: a masked NaN must not leak in
  seg = jnp.where(valid, ids, num_segments)  # masked steps land in a dropped extra segment
  # One scatter of an [N, 2] payload (advantage, 1) and one gather, with indices promised in
  # bounds (seg is in [0, num_segments] by construction), so XLA emits no bounds checks and sums
  # and counts share one pass: the fastest form benchmarks/bench_salt.py found on CPU.
  payload = jnp.stack([adv, valid.astype(jnp.float32)], axis=-1)
  explicit = _explicit_mesh_axes(adv)
  sums = jax.ops.segment_sum(payload, seg, num_segments + 1, mode="promise_in_bounds",
                             out_sharding=P(None, None) if explicit else None)
  mean = sums[:, 0] / jnp.maximum(sums[:, 1], 1.0)
  gathered = mean.at[seg].get(mode="promise_in_bounds",
                              out_sharding=jax.typeof(seg).sharding if explicit else None)
  return jnp.where(valid, gathered, 0.0)


def token_advantages(step_advantages, token_step_ids):
  """Broadcast per-step advantages to the tokens of each step's action.

  One function serves both training layouts: `token_step_ids` holds, for every token, the flat
  (trajectory-major) index of the step whose action it belongs to, or -1 for tokens that take no
  part (prompt, observation, padding).
    * one row per step: the row's response tokens all carry that step's index;
    * one sequence per trajectory: each action's tokens carry their own step's index.

  Args:
    step_advantages: f32[N] per-step advantages (e.g. from `refine`).
    token_step_ids: int32[B, L] step index per token, -1 where masked.
  Returns:
    f32[B, L] per-token advantages, 0 where token_step_ids < 0 (or >= N).
  """
  _checks.check_rank("step_advantages", step_advantages, 1)
  _checks.check_rank("token_step_ids", token_step_ids, 2)
  _checks.check_integer("token_step_ids", token_step_ids)
  adv = jnp.asarray(step_advantages, jnp.float32)
  n = adv.shape[0]
  ids = jnp.asarray(token_step_ids, jnp.int32)
  live = (ids >= 0) & (ids < n)
  if n == 0:
    return jnp.zeros(ids.shape, jnp.float32)
  return jnp.where(live, adv[jnp.clip(ids, 0, n - 1)], 0.0)
