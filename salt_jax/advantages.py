"""Critic-free group advantages (device side, jittable, shardable along the batch).

Every function takes one scalar reward per member and the member's group id (the task it was
sampled for) and returns one advantage per member. A member is a trajectory (its outcome reward;
every step then shares its advantage) or a step row (verl-agent's form: each row scores the episode
reward minus its own invalid-action penalty, and `stat_mask` says which rows make up the group's
statistics). SALT then refines the per-step advantages.

Defined results for degenerate input, so a long run never crashes or silently trains on NaN:
  * a group whose rewards are all equal gets exactly 0 (no float residue of its mean);
  * a group of one trajectory gets advantage 0 (nothing to compare against; verl gives the raw
    reward there);
  * a trajectory whose reward is NaN/inf, whose `mask` is False, or whose group id is outside
    [0, num_groups) gets advantage 0 and is left out of its group's statistics. The trainer counts
    such trajectories (`salt_jax.count_invalid_rewards`) and logs them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from salt_jax import _checks


def _group_stats(rewards, group_ids, num_groups, mask, stat_mask):
  """Per-member (valid, group, reward, group count, group total) for the estimators below.

  valid members get an advantage; those also in `stat_mask` make up their group's statistics.
  Rewards are taken relative to their group's smallest statistics member: advantages do not change
  under a shift, and a group whose rewards are all equal then sums exact zeros, so it gets exactly
  0 (the float mean of eight 9.7s need not be 9.7, and std + eps made that rounding large).
  """
  _checks.check_rank("rewards", rewards, 1)
  _checks.check_rank("group_ids", group_ids, 1)
  _checks.check_same_shape("rewards", rewards, "group_ids", group_ids)
  _checks.check_integer("group_ids", group_ids)
  num_groups = _checks.check_static_count("num_groups", num_groups)
  rewards = jnp.asarray(rewards, jnp.float32)
  group_ids = jnp.asarray(group_ids, jnp.int32)
  valid = (_checks.as_mask("mask", mask, rewards) & jnp.isfinite(rewards)
           & (group_ids >= 0) & (group_ids < num_groups))
  member = valid & _checks.as_mask("stat_mask", stat_mask, rewards)
  # Segment num_groups collects what belongs to no group; it is never read back as a group's.
  group = jnp.where(valid, group_ids, num_groups)
  seg = jnp.where(member, group_ids, num_groups)
  low = jax.ops.segment_min(jnp.where(member, rewards, jnp.inf), seg, num_groups + 1)
  count = jax.ops.segment_sum(member.astype(jnp.float32), seg, num_groups + 1)
  # A valid member of a group without statistics members has no baseline: it gets 0 below.
  valid = valid & (count[group] > 0)
  r = jnp.where(valid, rewards - low[group], 0.0)
  total = jax.ops.segment_sum(jnp.where(member, r, 0.0), seg, num_groups + 1)
  return valid, member, group, seg, r, count, total


def grpo_advantages(rewards, group_ids, num_groups, *, normalize_std=True, eps=1e-6, mask=None,
                    stat_mask=None):
  """GRPO group-normalised advantages (Shao et al., 2024, DeepSeekMath).

    A_i = (R_i - mean_g(R)) / (std_g(R) + eps),  std unbiased (ddof=1) as in verl and Tunix.

  With `normalize_std=False` this is Dr.GRPO (Liu et al., 2025): A_i = R_i - mean_g(R).

  Args:
    rewards: f32[B], one reward per member: a trajectory's outcome, or a step row's score.
    group_ids: int32[B], the group (task) of each member, in [0, num_groups).
    num_groups: static int, the number of groups.
    normalize_std: divide by the group's standard deviation (GRPO) or not (Dr.GRPO).
    eps: added to the standard deviation.
    mask: optional bool[B]; False marks padding that takes no part.
    stat_mask: optional bool[B]; the members whose rewards make up their group's mean and std
      (default: all). The others still get (R_i - mean_g) / (std_g + eps) from those statistics:
      verl-agent's step rows with `compute_mean_std_cross_steps=False` count one row per
      trajectory in the statistics and score every row.
  Returns:
    f32[B] advantages; exactly 0 for a group whose statistics members' rewards are all equal
    (and for its other members with that same reward), 0 for a group with fewer than two
    statistics members and for invalid members (see the module docstring).
  """
  valid, member, group, seg, r, count, total = _group_stats(rewards, group_ids, num_groups, mask,
                                                            stat_mask)
  mean = total / jnp.maximum(count, 1.0)
  centred = jnp.where(valid & (count[group] > 1), r - mean[group], 0.0)
  if not normalize_std:
    return centred
  sq = jax.ops.segment_sum(jnp.where(member, centred * centred, 0.0), seg, count.shape[0])
  std = jnp.sqrt(sq / jnp.maximum(count - 1.0, 1.0))
  return jnp.where(valid, centred / (std[group] + eps), 0.0)


def rloo_advantages(rewards, group_ids, num_groups, *, mask=None, stat_mask=None):
  """REINFORCE leave-one-out advantages (Ahmadian et al., 2024).

    A_i = R_i - mean_{j in g, j != i} R_j = (n R_i - sum_g R) / (n - 1).

  Args:
    rewards: f32[B], one reward per member (trajectory outcome or step-row score).
    group_ids: int32[B] in [0, num_groups).
    num_groups: static int.
    mask: optional bool[B]; False marks padding that takes no part.
    stat_mask: optional bool[B]; the n members whose rewards form each group's sum (default: all).
      A member outside it gets (n R_i - sum_g R) / (n - 1) all the same, as verl-agent scores
      every step row.
  Returns:
    f32[B]; 0 for a group with fewer than two statistics members and for invalid members.
  """
  valid, _, group, _, r, count, total = _group_stats(rewards, group_ids, num_groups, mask,
                                                     stat_mask)
  n = count[group]
  return jnp.where(valid & (n > 1.0), (n * r - total[group]) / jnp.maximum(n - 1.0, 1.0), 0.0)


def drgrpo_advantages(rewards, group_ids, num_groups, *, mask=None, stat_mask=None):
  """Dr.GRPO (Liu et al., 2025): A_i = R_i - mean_g(R), GRPO without the std division."""
  return grpo_advantages(rewards, group_ids, num_groups, normalize_std=False, mask=mask,
                         stat_mask=stat_mask)


# The advantage estimators by name: fn(rewards, group_ids, num_groups, *, mask, stat_mask) -> f32[B].
# A new estimator is one function here and one entry; the trainer and its --algo flag read this.
ESTIMATORS = {
    "grpo": grpo_advantages,
    "rloo": rloo_advantages,
    "drgrpo": drgrpo_advantages,
}


def count_invalid_rewards(rewards, mask=None):
  """Number of (unmasked) rewards that are NaN or inf: the trainer logs this every iteration."""
  rewards = jnp.asarray(rewards)
  return jnp.sum(_checks.as_mask("mask", mask, rewards) & ~jnp.isfinite(rewards))
