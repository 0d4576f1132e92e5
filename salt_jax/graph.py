"""The trajectory graph on the host: which steps of a group are the same edge.

SALT (step 3 of the method) builds one graph per group of trajectories sampled for the same task.
The state before step t is the last h (action, observation) pairs (the whole prefix when t <= h,
the task alone at t = 1); a step is the edge (state, action). Edges equal across the group are
merged, and `salt_jax.refine` then averages advantages within each merged edge on the device.

This module only computes ids: plain Python and numpy, no accelerator. Exact mode interns every
text once in a dict (exact string equality, no hash collisions) and then works on integer arrays,
so its cost is one dict look-up per string plus a few `np.unique` calls over N steps.
"""

from __future__ import annotations

import dataclasses
import gc
import itertools
import operator
from typing import Callable, Hashable, Optional, Sequence

import numpy as np

Trajectory = Sequence[tuple[str, str]]
Embedder = Callable[[list[str]], np.ndarray]

_NO_PAIR = -1  # the state slot before the first step: shorter states never equal longer ones


@dataclasses.dataclass(frozen=True)
class MergeIds:
  """Merged-edge ids of all steps, numbered trajectory-major.

  ids: int32[N], dense ids in [0, num_segments), numbered in order of first appearance.
  num_segments: number of distinct (merged) edges; pass it to `refine` as its static size.
  merge_rate: (N - num_segments) / N, the share of insertions that found their edge already in the
    graph (0.0 when N = 0).
  step_counts: int32[num_trajectories], steps per trajectory (offsets for trajectory-major order).
  """

  ids: np.ndarray
  num_segments: int
  merge_rate: float
  step_counts: np.ndarray

  @property
  def num_steps(self) -> int:
    return int(self.ids.shape[0])


def _validate_arguments(trajectories, group_ids, history, threshold):
  if isinstance(history, bool) or not isinstance(history, (int, np.integer)) or history < 1:
    raise ValueError(f"history must be an int >= 1, got {history!r}")
  if not (isinstance(threshold, (int, float, np.floating)) and 0.0 < float(threshold) <= 1.0):
    raise ValueError(f"threshold must be in (0, 1], got {threshold!r}")
  if isinstance(trajectories, (str, bytes)):
    raise ValueError("trajectories must be a sequence of trajectories, got a string")
  trajectories = list(trajectories)
  group_ids = list(group_ids)
  if len(trajectories) != len(group_ids):
    raise ValueError(f"got {len(trajectories)} trajectories but {len(group_ids)} group ids")
  for g in group_ids:
    try:
      hash(g)
    except TypeError as e:
      raise ValueError(f"group ids must be hashable, got {g!r}") from e
  return trajectories, group_ids


def _bad_step_error(trajectories) -> ValueError:
  """Slow path, taken only once a batch is known to be malformed: name the first bad step."""
  for i, traj in enumerate(trajectories):
    if isinstance(traj, (str, bytes)):
      return ValueError(
          f"trajectory {i} must be a sequence of (action, observation) pairs, got a string")
    for t, step in enumerate(traj):
      if (not isinstance(step, (tuple, list)) or len(step) != 2
          or type(step[0]) is not str or type(step[1]) is not str):
        return ValueError(
            f"trajectory {i} step {t} must be an (action, observation) pair of str, got {step!r}")
  return ValueError("malformed trajectories")


def _intern_steps(trajectories) -> tuple[np.ndarray, np.ndarray]:
  """(pair id, action id) of every step, trajectory-major; ids < N, equal iff the texts are equal.

  This runs every iteration over every step, so it uses C-level passes only: one dict look-up
  per (action, observation) pair (hashing the pair hashes, and caches, both strings) and one per
  action. setdefault with a counter gives each distinct key the counter value of its first
  occurrence: unique per key, though not dense. Types are checked on the distinct keys only.
  """
  if any(isinstance(t, (str, bytes)) for t in trajectories):
    raise _bad_step_error(trajectories)
  flat = list(itertools.chain.from_iterable(trajectories))
  n = len(flat)
  if not n:
    return np.zeros(0, np.int64), np.zeros(0, np.int64)
  if set(map(type, flat)) - {tuple, list} or set(map(len, flat)) != {2}:
    raise _bad_step_error(trajectories)
  pairs: dict = {}
  try:
    pair = np.fromiter(map(pairs.setdefault, flat, itertools.count()), np.int64, n)
  except TypeError:  # list steps are unhashable: take them as tuples
    flat = list(map(tuple, flat))
    pairs.clear()
    pair = np.fromiter(map(pairs.setdefault, flat, itertools.count()), np.int64, n)
  if set(map(type, itertools.chain.from_iterable(pairs))) != {str}:
    raise _bad_step_error(trajectories)
  actions: dict = {}
  action = np.fromiter(
      map(actions.setdefault, map(operator.itemgetter(0), flat), itertools.count()), np.int64, n)
  return pair, action


def _dense_ids_by_first_appearance(keys: np.ndarray) -> np.ndarray:
  """int keys[N] -> ids in [0, #distinct), numbered by first appearance."""
  _, first, inverse = np.unique(keys, return_index=True, return_inverse=True)
  rank = np.empty(first.shape[0], np.int64)
  rank[np.argsort(first, kind="stable")] = np.arange(first.shape[0])
  return rank[inverse.reshape(-1)]


_KEY_LIMIT = 1 << 62


def _fold_keys(columns: Sequence[tuple[np.ndarray, int]]) -> np.ndarray:
  """Exact int64 keys of rows of non-negative int columns, each given with a bound (values < it).

  Mixed-radix packing (key * bound + column) is exact and costs one multiply-add per column; only
  when the next column would overflow int64 is the key re-numbered densely (one np.unique), so
  the common case sorts nothing.
  """
  key, bound = columns[0][0].astype(np.int64), max(int(columns[0][1]), 1)
  for col, size in columns[1:]:
    size = max(int(size), 1)
    if bound * size >= _KEY_LIMIT:
      uniq, key = np.unique(key, return_inverse=True)
      key, bound = key.reshape(-1).astype(np.int64), max(uniq.shape[0], 1)
    key = key * size + col
    bound *= size
  return key


@dataclasses.dataclass(frozen=True)
class _Steps:
  """All steps flattened trajectory-major, with texts interned to ints."""

  group: np.ndarray      # int64[N] dense group index
  action: np.ndarray     # int64[N] id of a_t (< N, equal iff the action texts are equal)
  pair: np.ndarray       # int64[N] id of the (a_t, o_t) pair
  t: np.ndarray          # int64[N] 0-based step index within its trajectory
  step_counts: np.ndarray


def _flatten(trajectories, group_ids) -> _Steps:
  step_counts = np.fromiter(map(len, trajectories), np.int64, len(trajectories))
  n = int(step_counts.sum())
  groups: dict = {}
  group_index = np.fromiter(
      map(groups.setdefault, group_ids, itertools.count()), np.int64, len(group_ids))
  pair, act = _intern_steps(trajectories)
  starts = np.cumsum(step_counts) - step_counts
  t = np.arange(n, dtype=np.int64) - np.repeat(starts, step_counts)
  group = np.repeat(group_index, step_counts)
  return _Steps(group, act, pair, t, step_counts)


def _state_columns(steps: _Steps, history: int) -> list[np.ndarray]:
  """Column k (k = 1..h) holds the pair id k steps back, or _NO_PAIR before the trajectory start."""
  n = steps.t.shape[0]
  cols = []
  for k in range(1, history + 1):
    prev = np.full(n, _NO_PAIR, np.int64)
    has = steps.t >= k
    prev[has] = steps.pair[np.flatnonzero(has) - k]
    cols.append(prev)
  return cols


def _exact_ids(steps: _Steps, history: int) -> np.ndarray:
  """Edge key (group, pair_{t-1}, ..., pair_{t-h}, a_t) -> dense ids by first appearance."""
  n = steps.t.shape[0]
  # +1: _NO_PAIR becomes 0, keeping the columns non-negative; pair and action ids are < n.
  state = [(col + 1, n + 1) for col in _state_columns(steps, history)]
  key = _fold_keys([(steps.group, int(steps.group.max()) + 1), *state, (steps.action, n)])
  return _dense_ids_by_first_appearance(key)


def state_text(pairs: Sequence[tuple[str, str]]) -> str:
  """The text of a state (the last h (action, observation) pairs) as the embedder sees it."""
  if not pairs:
    return "[task start]"
  return "\n".join(f"action: {a}\nobservation: {o}" for a, o in pairs)


def _unit_rows(vectors: np.ndarray) -> np.ndarray:
  """Rows scaled to unit norm; a zero row stays zero (cosine 0 with everything)."""
  norms = np.linalg.norm(vectors, axis=1, keepdims=True)
  return np.divide(vectors, norms, out=np.zeros_like(vectors), where=norms > 0)


def _embed_distinct(embedder: Embedder, texts: list[str]) -> np.ndarray:
  if not texts:
    return np.zeros((0, 1), np.float64)
  out = np.asarray(embedder(list(texts)))
  if out.ndim != 2 or out.shape[0] != len(texts):
    raise ValueError(
        f"embedder must return an array of shape [{len(texts)}, d] for {len(texts)} texts, "
        f"got shape {out.shape}")
  if not np.issubdtype(out.dtype, np.number):
    raise ValueError(f"embedder must return numbers, got dtype {out.dtype}")
  out = out.astype(np.float64)
  if not np.all(np.isfinite(out)):
    raise ValueError("embedder returned non-finite values (NaN or inf)")
  return out


def _embedding_ids(trajectories, steps: _Steps, history: int, embedder: Embedder,
                   threshold: float) -> np.ndarray:
  """Greedy clustering within each group: a step joins the first earlier cluster whose founding
  step has state cosine > threshold and action cosine > threshold (or exactly equal texts)."""
  n = steps.t.shape[0]
  # Exact state ids (texts interned) decide exact equality; state texts are rendered once each.
  state_key = _fold_keys([(col + 1, n + 1) for col in _state_columns(steps, history)])
  state_key = _dense_ids_by_first_appearance(state_key) if n else state_key
  flat_pairs = [p for tr in trajectories for p in tr]
  state_texts: dict[int, str] = {}
  for i in range(n):
    k = int(state_key[i])
    if k not in state_texts:
      t = int(steps.t[i])
      state_texts[k] = state_text(flat_pairs[i - min(history, t):i])
  action_key = _dense_ids_by_first_appearance(steps.action) if n else steps.action
  action_texts: dict[int, str] = {}
  for i in range(n):
    action_texts.setdefault(int(action_key[i]), flat_pairs[i][0])
  # Embed each distinct text once, states and actions in one call.
  distinct = list(dict.fromkeys([*state_texts.values(), *action_texts.values()]))
  row = {s: j for j, s in enumerate(distinct)}
  vectors = _embed_distinct(embedder, distinct)
  state_row = np.array([row[state_texts[int(k)]] for k in range(len(state_texts))], np.int64)
  action_row = np.array([row[action_texts[int(k)]] for k in range(len(action_texts))], np.int64)
  unit = _unit_rows(vectors)

  ids = np.empty(n, np.int64)
  next_id = 0
  order = np.argsort(steps.group, kind="stable")  # group-major, trajectory-major inside a group
  bounds = np.flatnonzero(np.diff(steps.group[order])) + 1
  for members in np.split(order, bounds) if n else []:
    s_rows = state_row[state_key[members]]
    a_rows = action_row[action_key[members]]
    # Cosines within the group only: memory stays O(group steps^2), not O(all texts^2).
    # Clipped: rounding must not lift a cosine above 1, where threshold 1.0 means exact text only.
    s_sim = np.clip(unit[s_rows] @ unit[s_rows].T, -1.0, 1.0)
    a_sim = np.clip(unit[a_rows] @ unit[a_rows].T, -1.0, 1.0)
    s_key, a_key = state_key[members], action_key[members]
    founders: list[int] = []  # positions (within the group) of cluster founders
    cluster_of_founder: list[int] = []
    for j in range(members.shape[0]):
      if founders:
        f = np.asarray(founders)
        same_state = (s_sim[j, f] > threshold) | (s_key[f] == s_key[j])
        same_action = (a_sim[j, f] > threshold) | (a_key[f] == a_key[j])
        hit = np.flatnonzero(same_state & same_action)
        if hit.size:
          ids[members[j]] = cluster_of_founder[hit[0]]
          continue
      founders.append(j)
      cluster_of_founder.append(next_id)
      ids[members[j]] = next_id
      next_id += 1
  return _dense_ids_by_first_appearance(ids) if n else ids


def build_merge_ids(trajectories: Sequence[Trajectory], group_ids: Sequence[Hashable], *,
                    history: int = 3, embedder: Optional[Embedder] = None,
                    threshold: float = 0.8) -> MergeIds:
  """Merged-edge ids for SALT's trajectory graph (host side, numpy).

  Step t (1-indexed) of a trajectory is the edge (group, state, a_t) with
  state = the last min(history, t - 1) (action, observation) pairs before step t, so all
  trajectories of a group share the root state at t = 1. Steps of different groups never merge.

  Exact mode (embedder=None): equal edges get one id, wherever they occur, also twice within one
  trajectory (a loop). Embedding mode: within each group, steps are taken in trajectory-major
  order and each joins the first earlier cluster whose founding step has state cosine > threshold
  and action cosine > threshold (exactly equal texts always join), else founds a new cluster.

  Args:
    trajectories: a sequence of trajectories, each a sequence of (action, observation) str pairs.
      Empty trajectories are allowed (0 steps).
    group_ids: one hashable per trajectory (the task it was sampled for).
    history: h >= 1, the number of (action, observation) pairs that make a state (3 in the paper).
    embedder: optional callable list[str] -> float array [n, d] (e.g.
      `salt_jax.embedders.SentenceEmbedder`); each distinct state and action text is embedded once.
    threshold: cosine threshold in (0, 1] for embedding merges.
  Returns:
    MergeIds with ids int32[N] (N = total steps, trajectory-major), dense and numbered in order of
    first appearance; num_segments; merge_rate = (N - num_segments) / N.
  Raises:
    ValueError: history < 1, threshold outside (0, 1], lengths that disagree, a step that is not a
      (str, str) pair, or an embedder that returns the wrong shape or non-finite values.
  """
  trajectories, group_ids = _validate_arguments(trajectories, group_ids, history, threshold)
  # This runs every iteration over thousands of steps and allocates many small containers but no
  # reference cycles; pausing the cyclic collector spares a full-heap pass (jax's heap is large).
  paused = gc.isenabled()
  gc.disable()
  try:
    return _build(trajectories, group_ids, int(history), embedder, float(threshold))
  finally:
    if paused:
      gc.enable()


def _build(trajectories, group_ids, history, embedder, threshold) -> MergeIds:
  steps = _flatten(trajectories, group_ids)
  n = steps.t.shape[0]
  if n == 0:
    ids = np.zeros(0, np.int64)
  elif embedder is None:
    ids = _exact_ids(steps, history)
  else:
    ids = _embedding_ids(trajectories, steps, history, embedder, threshold)
  num_segments = int(ids.max()) + 1 if n else 0
  return MergeIds(
      ids=ids.astype(np.int32),
      num_segments=num_segments,
      merge_rate=(n - num_segments) / n if n else 0.0,
      step_counts=steps.step_counts.astype(np.int32),
  )


def _same_length(merge_ids, name, other) -> tuple[np.ndarray, np.ndarray]:
  merge_ids = np.asarray(merge_ids).reshape(-1)
  other = np.asarray(other).reshape(-1)
  if merge_ids.shape != other.shape:
    raise ValueError(f"merge_ids and {name} must have the same length, got {merge_ids.shape} and "
                     f"{other.shape}")
  return merge_ids, other


def sample_ids(*token_lists) -> np.ndarray:
  """An int per step, equal iff the steps' token sequences are all equal (`token_lists` are
  parallel lists of int arrays: prompts alone, or prompts and responses)."""
  seen: dict = {}
  return np.array([seen.setdefault(tuple(np.asarray(t, np.int32).tobytes() for t in ts),
                                   len(seen)) for ts in zip(*token_lists)], np.int32)


def cross_prompt_merges(merge_ids: np.ndarray, prompt_ids: np.ndarray) -> int:
  """How many steps were merged into an edge whose other members saw a different model prompt.

  Prompts alone do not say whether SALT changes learning: merged steps with one prompt but
  different responses (a reasoning policy's different <think> text before the same action) have
  different gradient terms too. `gradient_changing_merges` counts what does change it.

  Args:
    merge_ids: int[N] merged-edge ids (`MergeIds.ids`).
    prompt_ids: int[N] an id of each step's exact model input (equal ids = identical prompts).
  Returns:
    The number of steps whose merged edge holds more than one distinct prompt.
  """
  merge_ids, prompt_ids = _same_length(merge_ids, "prompt_ids", prompt_ids)
  if merge_ids.size == 0:
    return 0
  pairs = np.unique(np.stack([merge_ids, prompt_ids], 1).astype(np.int64), axis=0)
  prompts_per_edge = np.bincount(pairs[:, 0] - pairs[:, 0].min())
  return int(np.sum(prompts_per_edge[merge_ids - pairs[:, 0].min()] > 1))


def gradient_changing_merges(merge_ids: np.ndarray, sample_ids: np.ndarray,
                             advantages: np.ndarray, *, atol: float = 1e-6) -> int:
  """How many steps sit in a merged edge whose averaging changes the summed policy gradient.

  The policy gradient sums A_i * grad log pi(y_i | x_i) over steps i. Steps with the same prompt
  tokens x and response tokens y (one sample id) share one gradient term, so after SALT gives
  every member of edge e the edge's mean advantage, the sum is unchanged iff, for each distinct
  sample s in e, the mean advantage of s's members already equals e's mean (gradient terms of
  different samples taken as independent). Identical responses in one prompt leave the gradient
  as GRPO's; different <think> text before the same action, or different prompts, change it
  wherever the members' advantages differ.

  Args:
    merge_ids: int[N] merged-edge ids (`MergeIds.ids`).
    sample_ids: int[N] an id of each step's (prompt tokens, response tokens): equal iff both are.
    advantages: f[N] the step advantages before SALT.
    atol: advantages closer than this count as equal.
  Returns:
    The number of steps in edges where some distinct sample's mean advantage differs from the
    edge's mean (0 for N = 0). NaN advantages count as differing.
  """
  merge_ids, sample_ids = _same_length(merge_ids, "sample_ids", sample_ids)
  _, advantages = _same_length(merge_ids, "advantages", advantages)
  if merge_ids.size == 0:
    return 0
  _, edge = np.unique(merge_ids, return_inverse=True)
  pairs, pair = np.unique(np.stack([edge, np.unique(sample_ids, return_inverse=True)[1]], 1),
                          axis=0, return_inverse=True)
  adv = advantages.astype(np.float64)
  edge_mean = np.bincount(edge, adv) / np.bincount(edge)
  pair_mean = np.bincount(pair.reshape(-1), adv) / np.bincount(pair.reshape(-1))
  differs = ~(np.abs(pair_mean - edge_mean[pairs[:, 0]]) <= atol)
  edge_changed = np.bincount(pairs[:, 0], differs, minlength=edge_mean.size) > 0
  return int(np.sum(edge_changed[edge]))
