"""Advantage estimators (device side, jittable, shardable along the batch): critic-free group
advantages, and GAE over a learned critic's values (PPO).

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

from typing import Any, Callable, NamedTuple, Optional

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


class EstimatorInputs(NamedTuple):
  """What a registered advantage estimator reads: one entry per step row (N rows; padding rows
  have `mask` False). A pytree, so it goes into a jitted program whole.

  rewards: f32[N], each row's reward as the run's recipe shapes it (`salt_jax.rewards`).
  group_ids: int32[N], the row's group (task) in [0, num_groups).
  mask: bool[N], False on padding rows.
  stat_mask: bool[N], the rows that make up their group's statistics.
  traj_ids: int32[N], the row's trajectory.
  step_index: int32[N], the row's 0-based step within its trajectory.
  merge_ids: int32[N], SALT's merged-edge ids (`build_merge_ids`); zeros when SALT is off.
  anchor_ids, step_returns: optional int32/f32[N] for GiGPO (its anchor-state groups and
    discounted step returns); None otherwise.
  token_rewards, token_values, token_mask, token_step_ids: optional [S, T] for an estimator over
    a critic's values (`Estimator.critic`): the response tokens of S GAE sequences in order (one
    per step row, or a trajectory's steps one after another; `batching.gae_sequences`), each
    step's reward on its last token, the critic's value at each token, which slots hold a token,
    and the step each belongs to (-1 in padding); None otherwise.
  """

  rewards: Any
  group_ids: Any
  mask: Any
  stat_mask: Any
  traj_ids: Any
  step_index: Any
  merge_ids: Any
  anchor_ids: Optional[Any] = None
  step_returns: Optional[Any] = None
  token_rewards: Optional[Any] = None
  token_values: Optional[Any] = None
  token_mask: Optional[Any] = None
  token_step_ids: Optional[Any] = None


GIGPO_MODES = ("mean_std_norm", "mean_norm")


def gigpo_advantages(rewards, group_ids, num_groups, step_returns, anchor_ids, *,
                     mode="mean_std_norm", step_advantage_w=1.0, eps=1e-6, mask=None,
                     stat_mask=None):
  """GiGPO (Feng et al., 2025, "Group-in-Group Policy Optimization"), as verl-agent computes it
  (`gigpo/core_gigpo.py`): A = A_episode + step_advantage_w * A_step.

    A_episode: each row's score against its task group's statistics rows (GRPO's form; mode
      "mean_std_norm" divides by the unbiased std + eps, "mean_norm" does not). A group with a
      single statistics row is scored against mean 0 and std 1, as verl-agent does (its raw
      score; `grpo_advantages` gives such a group 0).
    A_step: each row's discounted step return against the other rows of its anchor group (the
      rows of one task group that acted in the same state), the same normalisation; an anchor
      group of one row gets 0.

  Args:
    rewards: f32[B], each step row's score (`salt_jax.rewards.row_rewards`, undiscounted).
    group_ids: int32[B] in [0, num_groups), the task group.
    num_groups: static int.
    step_returns: f32[B], each row's discounted return R_t = r_t + gamma R_{t+1}
      (`salt_jax.rewards.step_returns`).
    anchor_ids: int32[B] in [0, B), the row's anchor-state group (`salt_jax.rewards.anchor_ids`;
      ids are global, so an anchor never spans two task groups).
    mode: "mean_std_norm" (verl-agent's ALFWorld script) or "mean_norm" (its WebShop script).
    step_advantage_w: the step advantage's weight (1.0 in verl-agent).
    eps: added to each std.
    mask, stat_mask: as in `grpo_advantages`; stat_mask chooses the episode statistics' rows,
      every valid row of an anchor group makes up its statistics.
  Returns:
    f32[B]; 0 for invalid rows (masked, NaN score); a row whose step return is not finite gets
    its episode advantage alone.
  """
  if mode not in GIGPO_MODES:
    raise ValueError(f"mode must be one of {GIGPO_MODES}, got {mode!r}")
  normalize = mode == "mean_std_norm"
  episode = grpo_advantages(rewards, group_ids, num_groups, normalize_std=normalize, eps=eps,
                            mask=mask, stat_mask=stat_mask)
  valid, _, group, _, _, count, _ = _group_stats(rewards, group_ids, num_groups, mask, stat_mask)
  raw = jnp.asarray(rewards, jnp.float32)
  alone = valid & (count[group] == 1)
  episode = jnp.where(alone, raw / (1.0 + eps) if normalize else raw, episode)
  _checks.check_same_shape("step_returns", step_returns, "rewards", rewards)
  # A row without a valid score takes no part in its anchor group either.
  step = grpo_advantages(step_returns, anchor_ids, max(1, jnp.shape(rewards)[0]),
                         normalize_std=normalize, eps=eps, mask=valid)
  return episode + step_advantage_w * step


def _finite_sequences(token_rewards, values, mask):
  """bool[S, 1]: the sequences whose rewards and values are finite at every token of `mask`."""
  bad = mask & ~(jnp.isfinite(token_rewards) & jnp.isfinite(values))
  return ~jnp.any(bad, axis=-1, keepdims=True)


def gae_advantages(token_rewards, values, mask, *, gamma=1.0, lam=1.0):
  """Generalized advantage estimation (Schulman et al., 2016) over token sequences, as verl's
  `compute_gae_advantage_return` computes it (Tunix's `compute_gae_advantages` is the same scan):

    delta_t = r_t + gamma V_next - V_t,   A_t = delta_t + gamma lam A_next,   returns = A + V

  scanned from the last position back; a position off `mask` (an observation or prompt token
  between two responses, or padding) carries V_next and A_next through unchanged, so a sequence
  of several responses bootstraps from one response's first token to the previous response's
  last. Unwhitened (`masked_whiten` is the caller's choice).

  Args:
    token_rewards: f32[S, T], each position's reward (verl: the step's score on its last token).
    values: f32[S, T], the critic's value at each position.
    mask: bool[S, T], the response tokens (the positions that get an advantage).
    gamma, lam: the discount and GAE's lambda, per position (verl-agent: 1.0 and 1.0).
  Returns:
    (advantages, returns), f32[S, T], 0 off the mask. A sequence whose rewards or values are not
    finite somewhere on its mask gets advantage 0 and returns equal to its values (0 where those
    are not finite), so it neither moves the policy nor trains the critic.
  """
  adv, returns, _ = _gae_with_finite(token_rewards, values, mask, gamma, lam)
  return adv, returns


def _gae_with_finite(token_rewards, values, mask, gamma, lam):
  """`gae_advantages`'s (advantages, returns) and bool[S, T]: the mask's tokens of the sequences
  whose rewards and values are finite (those GAE scored)."""
  _checks.check_rank("token_rewards", token_rewards, 2)
  _checks.check_same_shape("values", values, "token_rewards", token_rewards)
  mask = _checks.as_mask("mask", mask, token_rewards)
  if not (0.0 <= gamma <= 1.0 and 0.0 <= lam <= 1.0):
    raise ValueError(f"gamma and lam must be in [0, 1], got {gamma} and {lam}")
  rewards = jnp.asarray(token_rewards, jnp.float32)
  values = jnp.asarray(values, jnp.float32)
  ok = _finite_sequences(rewards, values, mask)
  rewards = jnp.where(ok & mask, rewards, 0.0)
  v = jnp.where(ok & mask, values, 0.0)

  def back(carry, xs):
    next_value, next_adv = carry
    r, value, m = xs
    adv = r + gamma * next_value - value + gamma * lam * next_adv
    carry = (jnp.where(m, value, next_value), jnp.where(m, adv, next_adv))
    return carry, carry[1]

  zeros = jnp.zeros(rewards.shape[:1], jnp.float32)
  _, adv = jax.lax.scan(back, (zeros, zeros), (rewards.T, v.T, mask.T), reverse=True)
  adv = jnp.where(mask, adv.T, 0.0)
  returns = jnp.where(mask, jnp.where(ok, adv + v, jnp.nan_to_num(values, nan=0.0, posinf=0.0,
                                                                   neginf=0.0)), 0.0)
  return adv, returns, mask & ok


def masked_whiten(x, mask, eps=1e-8):
  """(x - mean) / sqrt(var + eps) over the positions of `mask`, var unbiased (verl's
  `masked_whiten`); 0 off the mask. One position, or none: 0 (verl raises)."""
  _checks.check_same_shape("mask", mask, "x", x)
  mask = jnp.asarray(mask).astype(bool)
  x = jnp.asarray(x, jnp.float32)
  n = jnp.sum(mask, dtype=jnp.float32)
  mean = jnp.sum(jnp.where(mask, x, 0.0)) / jnp.maximum(n, 1.0)
  centred = jnp.where(mask, x - mean, 0.0)
  var = jnp.sum(centred * centred) / jnp.maximum(n - 1.0, 1.0)
  return centred * jax.lax.rsqrt(var + eps)


def _over_rewards(fn) -> Callable[[EstimatorInputs, int], jax.Array]:
  """A group estimator of (rewards, group_ids, num_groups, *, mask, stat_mask) as a registry
  entry."""
  def estimator(inputs: EstimatorInputs, num_groups: int) -> jax.Array:
    return fn(inputs.rewards, inputs.group_ids, num_groups, mask=inputs.mask,
              stat_mask=inputs.stat_mask)
  estimator.__name__ = estimator.__qualname__ = fn.__name__
  estimator.__doc__ = fn.__doc__
  return estimator


def _gigpo(inputs: EstimatorInputs, num_groups: int, *, gigpo_mode: str = "mean_std_norm",
           step_advantage_w: float = 1.0) -> jax.Array:
  """`gigpo_advantages` over the named inputs (anchor ids and step returns filled by the host)."""
  return gigpo_advantages(inputs.rewards, inputs.group_ids, num_groups, inputs.step_returns,
                          inputs.anchor_ids, mode=gigpo_mode, step_advantage_w=step_advantage_w,
                          mask=inputs.mask, stat_mask=inputs.stat_mask)


def _gae(inputs: EstimatorInputs, num_groups: int, *, gamma: float = 1.0,
         gae_lambda: float = 1.0) -> tuple[jax.Array, jax.Array]:
  """PPO's advantages from a critic, as verl computes them: `gae_advantages` over the GAE
  sequences, whitened over every response token of the batch; and the critic's returns."""
  del num_groups  # a critic's baseline needs no groups
  adv, returns, scored = _gae_with_finite(inputs.token_rewards, inputs.token_values,
                                          inputs.token_mask, gamma, gae_lambda)
  return masked_whiten(adv, scored), returns


class Estimator(NamedTuple):
  """A registered advantage estimator.

  fn: fn(inputs: EstimatorInputs, num_groups, **options) -> f32[N], one advantage per row; with
    `critic`, -> (advantages, returns), f32[S, T] per token of the GAE sequences.
  options: the `TrainConfig` fields it takes as keyword arguments (static in its program).
  needs: the optional `EstimatorInputs` fields it reads; the host fills those
    (`batching.estimator_inputs`, and `batching.gae_sequences` for a critic's).
  critic: it reads a learned critic's values: the trainer keeps and trains a critic for it, and
    its advantages are per token.
  """

  fn: Callable[..., Any]
  options: tuple[str, ...] = ()
  needs: tuple[str, ...] = ()
  critic: bool = False


# The advantage estimators by name. A new estimator is one function of the inputs and one entry
# here; the trainer's --algo and its advantage program (`update.step_advantages`) read this.
ESTIMATORS: dict[str, Estimator] = {
    "grpo": Estimator(_over_rewards(grpo_advantages)),
    "rloo": Estimator(_over_rewards(rloo_advantages)),
    "drgrpo": Estimator(_over_rewards(drgrpo_advantages)),
    "gigpo": Estimator(_gigpo, options=("gigpo_mode", "step_advantage_w"),
                       needs=("step_returns", "anchor_ids")),
    "ppo": Estimator(_gae, options=("gamma", "gae_lambda"),
                     needs=("token_rewards", "token_values", "token_mask", "token_step_ids"),
                     critic=True),
}


def count_invalid_rewards(rewards, mask=None):
  """Number of (unmasked) rewards that are NaN or inf: the trainer logs this every iteration."""
  rewards = jnp.asarray(rewards)
  return jnp.sum(_checks.as_mask("mask", mask, rewards) & ~jnp.isfinite(rewards))
