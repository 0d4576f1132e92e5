"""Plain-Python/numpy references for the SALT core, written independently of the library code.

Loops and dicts, no vectorisation, so that each reads directly as its definition.
"""

from __future__ import annotations

import math

import numpy as np


def grpo(rewards, groups, normalize_std=True, eps=1e-6):
  out = []
  for i, r in enumerate(rewards):
    if not math.isfinite(r):
      out.append(0.0)
      continue
    members = [rewards[j] for j in range(len(rewards)) if groups[j] == groups[i]
               and math.isfinite(rewards[j])]
    n = len(members)
    mean = sum(members) / n
    if not normalize_std:
      out.append(r - mean)
      continue
    if n == 1:
      out.append(0.0)
      continue
    std = math.sqrt(sum((x - mean) ** 2 for x in members) / (n - 1))
    out.append((r - mean) / (std + eps))
  return np.array(out, np.float64)


def rloo(rewards, groups):
  out = []
  for i, r in enumerate(rewards):
    others = [rewards[j] for j in range(len(rewards)) if j != i and groups[j] == groups[i]
              and math.isfinite(rewards[j])]
    if not math.isfinite(r) or not others:
      out.append(0.0)
    else:
      out.append(r - sum(others) / len(others))
  return np.array(out, np.float64)


def _uid_members(scores, uid, traj_uid, cross_steps):
  """{uid: the scores of its statistics}: every row (cross steps) or one row per trajectory, as
  verl-agent's `compute_*_outcome_advantage` and GiGPO's `episode_norm_reward` collect them."""
  members, seen = {}, set()
  for i, s in enumerate(scores):
    if (uid[i], traj_uid[i]) in seen:
      continue
    members.setdefault(uid[i], []).append(s)
    if not cross_steps:
      seen.add((uid[i], traj_uid[i]))
  return members


def verl_agent_step_advantages(won, invalid, uid, traj_uid, algo, cross_steps,
                               win_reward=10.0, penalty=0.1, eps=1e-6):
  """verl-agent's step-row advantages, re-derived in loops (rows in batch order).

  Each row scores win_reward * won of its episode (`reward_manager/episode.py`) minus `penalty` when
  the row itself is invalid (`apply_invalid_action_penalty`). GRPO/RLOO statistics per `uid` over
  every row (compute_mean_std_cross_steps=True) or over each trajectory's first row (False), as
  `core_algos.compute_grpo_outcome_advantage` / `compute_rloo_outcome_advantage` collect them;
  every row is then scored against them. One deliberate difference: a group with a single
  statistics member gets 0 here where verl uses mean 0, std 1 (the raw score).
  """
  scores = [win_reward * float(w) - (penalty if bad else 0.0) for w, bad in zip(won, invalid)]
  members = _uid_members(scores, uid, traj_uid, cross_steps)
  out = []
  for i, s in enumerate(scores):
    m = members[uid[i]]
    n = len(m)
    if n < 2:
      out.append(0.0)
      continue
    mean = sum(m) / n
    if algo == "rloo":
      out.append(s * n / (n - 1) - mean * n / (n - 1))
    elif algo == "drgrpo":
      out.append(s - mean)
    else:
      std = math.sqrt(sum((x - mean) ** 2 for x in m) / (n - 1))
      out.append((s - mean) / (std + eps))
  return np.array(out, np.float64)


def merge_ids_exact(trajectories, group_ids, history):
  """Edge = (group, last min(h, t-1) pairs, a_t); ids by first appearance."""
  table = {}
  ids = []
  for traj, g in zip(trajectories, group_ids):
    for t in range(len(traj)):
      state = tuple(traj[max(0, t - history):t])
      key = (g, state, traj[t][0])
      if key not in table:
        table[key] = len(table)
      ids.append(table[key])
  return np.array(ids, np.int64)


def _state_text(pairs):
  if not pairs:
    return "[task start]"
  return "\n".join(f"action: {a}\nobservation: {o}" for a, o in pairs)


def merge_ids_embedding(trajectories, group_ids, history, embed, threshold):
  """Greedy clustering within groups, founders compared by cosine (or exact text equality)."""
  def cos(u, v):
    nu, nv = np.linalg.norm(u), np.linalg.norm(v)
    return 0.0 if nu == 0 or nv == 0 else min(1.0, float(u @ v / (nu * nv)))

  steps = []  # (flat index, group, state text, action)
  for traj, g in zip(trajectories, group_ids):
    for t in range(len(traj)):
      steps.append((len(steps), g, _state_text(traj[max(0, t - history):t]), traj[t][0]))
  clusters = {}  # group -> list of (founder state, founder action, label)
  labels = [None] * len(steps)
  next_label = 0
  for idx, g, s, a in steps:  # trajectory-major is group-major order within each group
    for fs, fa, lab in clusters.setdefault(g, []):
      s_ok = fs == s or cos(embed(s), embed(fs)) > threshold
      a_ok = fa == a or cos(embed(a), embed(fa)) > threshold
      if s_ok and a_ok:
        labels[idx] = lab
        break
    else:
      clusters[g].append((s, a, next_label))
      labels[idx] = next_label
      next_label += 1
  remap = {}
  return np.array([remap.setdefault(l, len(remap)) for l in labels], np.int64)


def refine(adv, ids, mask=None):
  mask = [True] * len(adv) if mask is None else list(mask)
  sums, counts = {}, {}
  for a, i, m in zip(adv, ids, mask):
    if m:
      sums[i] = sums.get(i, 0.0) + a
      counts[i] = counts.get(i, 0) + 1
  return np.array([sums[i] / counts[i] if m else 0.0 for i, m in zip(ids, mask)], np.float64)


def ppo_loss(logp, old, adv, mask, clip_low, clip_high, dual_clip, ref, kl_coef, kl_est, agg_mode,
             is_weights=None):
  """verl's compute_policy_loss + kl_penalty + agg_loss, element by element (with verl's rollout
  IS weights multiplying each token's surrogate when given)."""
  logp, old, adv, mask = (np.asarray(x, np.float64) for x in (logp, old, adv, mask))
  if adv.ndim == 1:
    adv = np.repeat(adv[:, None], logp.shape[1], axis=1)
  B, L = logp.shape
  tok = np.zeros((B, L))
  clipped = np.zeros((B, L))
  kl = np.zeros((B, L))
  for b in range(B):
    for t in range(L):
      if not mask[b, t]:
        continue
      r = math.exp(min(max(logp[b, t] - old[b, t], -20), 20))
      a = adv[b, t]
      l1 = -a * r
      l2 = -a * min(max(r, 1 - clip_low), 1 + clip_high)
      l = max(l1, l2)
      clipped[b, t] = float(l2 > l1)
      if dual_clip is not None and a < 0:
        l = min(l, -a * dual_clip)
      if is_weights is not None:
        l *= float(is_weights[b][t])
      tok[b, t] = l
      if ref is not None:
        d = logp[b, t] - ref[b, t]
        if kl_est == "k1":
          kl[b, t] = d
        elif kl_est == "k2":
          kl[b, t] = 0.5 * d * d
        else:
          x = min(max(-d, -20), 20)
          kl[b, t] = min(max(math.exp(x) - x - 1, -10), 10)

  def agg(v):
    if agg_mode == "token-mean":
      n = mask.sum()
      return (v * mask).sum() / n if n else 0.0
    rows = []
    for b in range(B):
      n = mask[b].sum()
      if n == 0:
        continue
      s = (v[b] * mask[b]).sum()
      rows.append(s / n if agg_mode == "seq-mean-token-mean" else s)
    return sum(rows) / len(rows) if rows else 0.0

  pg = agg(tok)
  kl_loss = agg(kl) if ref is not None else 0.0
  n = mask.sum()
  return pg + kl_coef * kl_loss, pg, (clipped * mask).sum() / max(n, 1)


def truncated_is_weights(old, rollout, mask, threshold):
  """verl's token-level rollout IS weights in truncate mode, element by element."""
  out = np.zeros(np.shape(old))
  for b in range(out.shape[0]):
    for t in range(out.shape[1]):
      if mask[b][t]:
        x = min(max(float(old[b][t]) - float(rollout[b][t]), -20.0), 20.0)
        out[b, t] = min(math.exp(x), threshold)
  return out


def gradient_changing_steps(merge_ids, sample_ids, advantages, atol=1e-6):
  """Steps in an edge where some distinct sample's mean advantage differs from the edge's mean."""
  edges = {}
  for i, e in enumerate(merge_ids):
    edges.setdefault(e, []).append(i)
  count = 0
  for members in edges.values():
    mean = sum(advantages[i] for i in members) / len(members)
    by_sample = {}
    for i in members:
      by_sample.setdefault(sample_ids[i], []).append(advantages[i])
    if any(not abs(sum(v) / len(v) - mean) <= atol for v in by_sample.values()):
      count += len(members)
  return count


# ---- GiGPO, re-derived in loops from verl-agent's gigpo/core_gigpo.py (uuids as ints) ----

def gigpo_discounted_returns(step_rewards, traj_uid, gamma):
  """`compute_step_discounted_returns`: per trajectory (rows in batch order), from its end."""
  out = [0.0] * len(step_rewards)
  for t in dict.fromkeys(traj_uid):
    rows = [i for i in range(len(step_rewards)) if traj_uid[i] == t]
    running = 0.0
    for i in reversed(rows):
      running = step_rewards[i] + gamma * running
      out[i] = running
  return out


def gigpo_episode_norm(scores, uid, traj_uid, remove_std, eps=1e-6, cross_steps=True):
  """`episode_norm_reward`: statistics per uid over every row (cross steps) or one per
  trajectory; a uid with one score: mean 0, std 1."""
  members = _uid_members(scores, uid, traj_uid, cross_steps)
  out = []
  for i, s in enumerate(scores):
    m = members[uid[i]]
    if len(m) == 1:
      mean, std = 0.0, 1.0
    else:
      mean = sum(m) / len(m)
      std = math.sqrt(sum((x - mean) ** 2 for x in m) / (len(m) - 1))
    out.append(s - mean if remove_std else (s - mean) / (std + eps))
  return out


def gigpo_step_groups(anchor_obs, uid, similarity=None):
  """`build_step_group`: within each uid, identical observations (or greedy clusters by difflib
  ratio >= similarity) share a step group."""
  import difflib  # pylint: disable=import-outside-toplevel
  groups, next_id = [None] * len(anchor_obs), 0
  for u in dict.fromkeys(uid):
    rows = [i for i in range(len(anchor_obs)) if uid[i] == u]
    clusters = []  # [representative, rows]
    for i in rows:
      for c in clusters:
        same = (anchor_obs[i] == c[0] if similarity is None else
                difflib.SequenceMatcher(None, anchor_obs[i], c[0]).ratio() >= similarity)
        if same:
          c[1].append(i)
          break
      else:
        clusters.append([anchor_obs[i], [i]])
    for _, members in clusters:
      for i in members:
        groups[i] = next_id
      next_id += 1
  return groups


def gigpo_step_norm(step_returns, step_groups, remove_std, eps=1e-6):
  """`step_norm_reward`: against each step group's mean (and std); a group of one: its own
  mean, std 1 (so 0)."""
  out = []
  for i, r in enumerate(step_returns):
    m = [step_returns[j] for j in range(len(step_returns)) if step_groups[j] == step_groups[i]]
    mean = sum(m) / len(m)
    std = 1.0 if len(m) == 1 else math.sqrt(sum((x - mean) ** 2 for x in m) / (len(m) - 1))
    out.append(r - mean if remove_std else (r - mean) / (std + eps))
  return out


def verl_gae(token_level_rewards, values, response_mask, gamma, lam):
  """verl's `compute_gae_advantage_return` (core_algos.py) as a loop over positions and rows:
  masked positions carry the next value and advantage through; returns = A + V; unwhitened."""
  rows, length = np.shape(token_level_rewards)
  adv = np.zeros((rows, length))
  for b in range(rows):
    next_value, last_gae = 0.0, 0.0
    for t in reversed(range(length)):
      delta = token_level_rewards[b][t] + gamma * next_value - values[b][t]
      gae = delta + gamma * lam * last_gae
      if response_mask[b][t]:
        next_value, last_gae = values[b][t], gae
      adv[b][t] = last_gae
  return adv, adv + np.asarray(values, np.float64)


def verl_masked_whiten(values, mask):
  """verl's `masked_whiten`: (x - mean) / sqrt(var + 1e-8), mean and unbiased var over the mask."""
  picked = [float(v) for v, m in zip(np.ravel(values), np.ravel(mask)) if m]
  mean = sum(picked) / len(picked)
  var = sum((x - mean) ** 2 for x in picked) / (len(picked) - 1)
  return (np.asarray(values, np.float64) - mean) / math.sqrt(var + 1e-8)


def verl_value_loss(vpreds, returns, old_values, mask, cliprange_value):
  """verl's `compute_value_loss` with token-mean aggregation: 0.5 x the masked mean of
  max((v - R)^2, (clip(v, old - c, old + c) - R)^2), and the share of tokens clipped."""
  total, clipped, count = 0.0, 0, 0
  for v, r, o, m in zip(np.ravel(vpreds), np.ravel(returns), np.ravel(old_values), np.ravel(mask)):
    if not m:
      continue
    vc = min(max(v, o - cliprange_value), o + cliprange_value)
    e1, e2 = (v - r) ** 2, (vc - r) ** 2
    total += max(e1, e2)
    clipped += e2 > e1
    count += 1
  return 0.5 * total / count, clipped / count
