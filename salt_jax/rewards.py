"""Reward shaping on the host: what each step row of a rollout scores under a run's recipe, and
which rows make up their group's statistics (`TrainConfig.reward_scale`, `penalty_scope`,
`gamma`, `group_stats`; the named settings are in `salt_jax.recipes`).

A `RolloutBatch` records what happened (environment rewards, invalid steps, outcomes); these
functions turn it into the numbers an advantage estimator reads (`batching.estimator_inputs`).
Two forms of a row's reward: the trajectory's outcome reward R on every row (the invalid-step
penalty folded into the trajectory), or verl-agent's (`reward_manager/episode.py`,
`apply_invalid_action_penalty` in `verl/trainer/ppo/ray_trainer.py`): every row scores the scaled
episode reward (10 x won there) and an invalid step loses the penalty on its own row only.
"""

from __future__ import annotations

import difflib
import itertools

import numpy as np

PENALTY_SCOPES = ("trajectory", "step")
GROUP_STATS = ("trajectories", "steps")
GAE_SCOPES = ("step", "trajectory")


def row_rewards(batch, reward_scale: float = 1.0, penalty_scope: str = "trajectory",
                gamma: float = 1.0) -> np.ndarray:
  """f32[N]: each step row of `batch` (a `RolloutBatch`) scored for step-row group advantages.

  penalty_scope "trajectory": the trajectory's reward_scale * returns - penalty * num_invalid on
    every row (with reward_scale 1, its `outcome_rewards`);
  "step": reward_scale * returns on every row, minus the penalty on each invalid row alone
    (verl-agent's rows: reward_scale 10, an outcome env's returns = won).
  gamma < 1 discounts the return part by the steps after the row, gamma ** (T - 1 - t) for step
    t of T (GiGPO's step returns for an outcome reward, process_reward_t + gamma ** (T - 1 - t) *
    outcome: a detour earns an early step less than the direct way); the penalty is not
    discounted. gamma 1: every row the whole return (verl-agent's GRPO and RLOO).
  Rows of failed trajectories score 0.
  """
  if penalty_scope not in PENALTY_SCOPES:
    raise ValueError(f"penalty_scope must be one of {PENALTY_SCOPES}, got {penalty_scope!r}")
  if not 0.0 < gamma <= 1.0:
    raise ValueError(f"gamma must be in (0, 1], got {gamma}")
  t = batch.step_traj_ids
  steps_after = batch.num_steps[t].astype(np.float64) - 1.0 - batch.step_index
  base = reward_scale * batch.returns.astype(np.float64)[t] * gamma ** steps_after
  if penalty_scope == "trajectory":
    rows = base - (batch.invalid_action_penalty * batch.num_invalid)[t]
  else:
    rows = base + batch.step_invalid_penalty
  return np.where(batch.failed[t], 0.0, rows).astype(np.float32)


def stat_rows(batch, group_stats: str = "trajectories") -> np.ndarray:
  """bool[N]: the rows of `batch` whose rewards make up their group's statistics: "steps", all of
  them (verl-agent's compute_mean_std_cross_steps=True); "trajectories", each trajectory's first
  row (one vote per trajectory, as its outcome reward would give)."""
  if group_stats not in GROUP_STATS:
    raise ValueError(f"group_stats must be one of {GROUP_STATS}, got {group_stats!r}")
  if group_stats == "steps":
    return np.ones(batch.num_total_steps, bool)
  return batch.step_index == 0


def step_returns(batch, reward_scale: float = 1.0, gamma: float = 1.0) -> np.ndarray:
  """f32[N]: GiGPO's step returns R_t = r_t + gamma R_{t+1} over each trajectory's scaled
  environment rewards r_t = reward_scale * step reward, then the invalid-step penalty off each
  invalid row (verl-agent's `compute_step_discounted_returns`, then its
  `apply_invalid_action_penalty` on `step_rewards`). Rows of failed trajectories score 0."""
  if not 0.0 < gamma <= 1.0:
    raise ValueError(f"gamma must be in (0, 1], got {gamma}")
  r = reward_scale * batch.step_rewards.astype(np.float64)
  out = np.zeros(batch.num_total_steps, np.float64)
  off = batch.traj_step_offsets
  for i in range(batch.num_trajectories):
    running = 0.0
    for k in range(off[i + 1] - 1, off[i] - 1, -1):
      running = r[k] + gamma * running
      out[k] = running
  out += batch.step_invalid_penalty
  return np.where(batch.failed[batch.step_traj_ids], 0.0, out).astype(np.float32)


def step_rewards(batch, reward_scale: float = 1.0) -> np.ndarray:
  """f32[N]: each step's own reward, reward_scale * the environment's step reward minus the
  invalid-step penalty on an invalid step (what PPO's trajectory-scope GAE puts on the step's
  last token: a trajectory's rewards sum to its scaled return minus its penalties). Rows of
  failed trajectories score 0."""
  r = reward_scale * batch.step_rewards.astype(np.float64) + batch.step_invalid_penalty
  return np.where(batch.failed[batch.step_traj_ids], 0.0, r).astype(np.float32)


def state_observations(batch) -> list:
  """Each step's current raw observation (what the environment showed when the action was
  chosen): the first observation for a trajectory's step 0, else the previous step's."""
  out, off = [], batch.traj_step_offsets
  for i in range(batch.num_trajectories):
    if off[i + 1] > off[i]:
      out.append(batch.first_observations[i])
      out.extend(batch.observations[off[i]:off[i + 1] - 1])
  return out


def anchor_ids(batch, similarity: float = 1.0) -> np.ndarray:
  """int32[N]: GiGPO's anchor-state groups (verl-agent's `build_step_group`): within each task
  group, the rows whose current observation (`state_observations`) is the same. Ids are global,
  numbered in order of first appearance, so an anchor never spans two task groups.

  similarity < 1: verl-agent's similarity mode: each observation joins the first cluster of its
  task group whose first observation it matches with `difflib` ratio >= similarity, else starts
  one.
  """
  if not 0.0 < similarity <= 1.0:
    raise ValueError(f"similarity must be in (0, 1], got {similarity}")
  ids = np.zeros(batch.num_total_steps, np.int32)
  new_id = itertools.count()  # global, in order of first appearance
  exact: dict = {}  # (task group, observation) -> id
  clusters: dict = {}  # task group -> [(representative observation, id)]
  for k, (group, obs) in enumerate(zip(batch.step_group_ids.tolist(), state_observations(batch))):
    if similarity >= 1.0:
      if (group, obs) not in exact:
        exact[(group, obs)] = next(new_id)
      ids[k] = exact[(group, obs)]
      continue
    mine = clusters.setdefault(group, [])
    found = next((cid for rep, cid in mine
                  if difflib.SequenceMatcher(None, obs, rep).ratio() >= similarity), None)
    if found is None:
      found = next(new_id)
      mine.append((obs, found))
    ids[k] = found
  return ids
