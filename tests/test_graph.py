import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import salt_jax
from salt_jax.graph import state_text
from tests import references as ref

ACTIONS = ["go to desk 1", "take pen 1", "open drawer 2", "look", "put pen 1 in drawer 2"]
OBS = ["You see a pen.", "Nothing happens.", "The drawer is open.", "You arrive at desk 1."]


@st.composite
def groups_of_trajectories(draw):
  """Several groups of 1..16 trajectories of 0..60 steps from small vocabularies, so that equal
  prefixes, repeated actions and loops are common."""
  num_groups = draw(st.integers(1, 3))
  trajectories, group_ids = [], []
  for g in range(num_groups):
    for _ in range(draw(st.integers(1, 16))):
      n = draw(st.integers(0, 60))
      acts = draw(st.lists(st.sampled_from(ACTIONS[:3]), min_size=n, max_size=n))
      obs = draw(st.lists(st.sampled_from(OBS[:2]), min_size=n, max_size=n))
      trajectories.append(list(zip(acts, obs)))
      group_ids.append(f"task-{g}")
  return trajectories, group_ids


@settings(max_examples=80, deadline=None)
@given(groups_of_trajectories(), st.integers(1, 5))
def test_exact_ids_match_reference(data, history):
  trajectories, group_ids = data
  got = salt_jax.build_merge_ids(trajectories, group_ids, history=history)
  want = ref.merge_ids_exact(trajectories, group_ids, history)
  np.testing.assert_array_equal(got.ids, want)
  assert got.ids.dtype == np.int32
  n = len(want)
  assert got.num_segments == (len(set(want.tolist())) if n else 0)
  assert got.merge_rate == pytest.approx((n - got.num_segments) / n if n else 0.0)
  np.testing.assert_array_equal(got.step_counts, [len(t) for t in trajectories])


def test_paper_example_root_shared_and_divergence():
  # Two trajectories share their first two steps and then diverge; the third is identical to the
  # first, so all its steps merge.
  a = [("go to desk 1", "You arrive at desk 1."), ("take pen 1", "You pick up the pen."),
       ("go to drawer 1", "The drawer is closed.")]
  b = a[:2] + [("look", "You are in a room.")]
  m = salt_jax.build_merge_ids([a, b, a], ["t", "t", "t"], history=3)
  np.testing.assert_array_equal(m.ids, [0, 1, 2, 0, 1, 3, 0, 1, 2])
  assert m.num_segments == 4
  assert m.merge_rate == pytest.approx(5 / 9)


def test_identical_trajectories_merge_rate():
  traj = [(f"a{t}", f"o{t}") for t in range(10)]
  for g in (1, 4, 8):
    m = salt_jax.build_merge_ids([traj] * g, [0] * g)
    assert m.merge_rate == pytest.approx((g - 1) / g)


def test_loop_within_one_trajectory_merges_with_history_one():
  loop = [("look", "room")] * 4
  m = salt_jax.build_merge_ids([loop], [0], history=1)
  # t=1 is the root state; t=2..4 all have state (look, room) and action look: one edge.
  np.testing.assert_array_equal(m.ids, [0, 1, 1, 1])


def test_t_less_than_history_uses_whole_prefix():
  # Same last pair but different prefixes: with h=1 they merge, with h=2 they do not.
  x = [("a", "o"), ("b", "p"), ("c", "q")]
  y = [("z", "w"), ("b", "p"), ("c", "q")]
  m1 = salt_jax.build_merge_ids([x, y], [0, 0], history=1)
  m2 = salt_jax.build_merge_ids([x, y], [0, 0], history=2)
  np.testing.assert_array_equal(m1.ids, [0, 1, 2, 3, 4, 2])
  np.testing.assert_array_equal(m2.ids, [0, 1, 2, 3, 4, 5])


def test_different_groups_never_merge():
  traj = [("a", "o"), ("b", "p")]
  m = salt_jax.build_merge_ids([traj, traj], ["task-1", "task-2"])
  np.testing.assert_array_equal(m.ids, [0, 1, 2, 3])
  assert m.merge_rate == 0.0


def test_empty_inputs():
  m = salt_jax.build_merge_ids([], [])
  assert m.ids.shape == (0,) and m.num_segments == 0 and m.merge_rate == 0.0
  m = salt_jax.build_merge_ids([[], [("a", "o")], []], [0, 0, 0])
  np.testing.assert_array_equal(m.ids, [0])
  np.testing.assert_array_equal(m.step_counts, [0, 1, 0])


@pytest.mark.parametrize("kwargs, match", [
    ({"history": 0}, "history"),
    ({"history": -2}, "history"),
    ({"history": 1.5}, "history"),
    ({"threshold": 0.0}, "threshold"),
    ({"threshold": 1.2}, "threshold"),
])
def test_bad_arguments(kwargs, match):
  with pytest.raises(ValueError, match=match):
    salt_jax.build_merge_ids([[("a", "o")]], [0], **kwargs)


def test_bad_shapes_and_steps():
  with pytest.raises(ValueError, match="2 trajectories but 1 group"):
    salt_jax.build_merge_ids([[("a", "o")], []], [0])
  with pytest.raises(ValueError, match="pair"):
    salt_jax.build_merge_ids([[("a", "o", "x")]], [0])
  with pytest.raises(ValueError, match="pair"):
    salt_jax.build_merge_ids([[("a", None)]], [0])
  with pytest.raises(ValueError, match="string"):
    salt_jax.build_merge_ids(["abc"], [0])
  with pytest.raises(ValueError, match="hashable"):
    salt_jax.build_merge_ids([[("a", "o")]], [[0]])


class BagOfLettersEmbedder:
  """A deterministic test embedder: letter counts, so near-identical strings have cosine near 1."""

  def __init__(self):
    self.calls = []

  def __call__(self, texts):
    self.calls.append(list(texts))
    out = np.zeros((len(texts), 27))
    for i, s in enumerate(texts):
      for ch in s.lower():
        out[i, ord(ch) - 97 if "a" <= ch <= "z" else 26] += 1
    return out

  def one(self, s):
    return self([s])[0]


@settings(max_examples=40, deadline=None)
# Thresholds away from the cosines small integer count vectors hit exactly (1/2, 2/3, ...), so
# that float rounding in either implementation cannot decide a comparison.
@given(groups_of_trajectories(), st.integers(1, 4), st.sampled_from([0.55, 0.83, 0.97, 1.0]))
def test_embedding_ids_match_reference(data, history, threshold):
  trajectories, group_ids = data
  emb = BagOfLettersEmbedder()
  got = salt_jax.build_merge_ids(trajectories, group_ids, history=history, embedder=emb,
                                 threshold=threshold)
  want = ref.merge_ids_embedding(trajectories, group_ids, history, emb.one, threshold)
  np.testing.assert_array_equal(got.ids, want)


def test_embedding_merges_paraphrases_and_embeds_each_text_once():
  emb = BagOfLettersEmbedder()
  a = [("go to desk 1", "you see a pen"), ("take pen", "done")]
  b = [("go to desk 2", "you see a pen"), ("take pen", "done")]
  exact = salt_jax.build_merge_ids([a, b], [0, 0], history=1)
  merged = salt_jax.build_merge_ids([a, b], [0, 0], history=1, embedder=emb, threshold=0.8)
  assert exact.num_segments == 4
  np.testing.assert_array_equal(merged.ids, [0, 1, 0, 1])
  assert len(emb.calls) == 1
  texts = emb.calls[0]
  assert len(texts) == len(set(texts))
  assert state_text([]) in texts and "take pen" in texts


def test_threshold_one_still_joins_exactly_equal_texts():
  emb = BagOfLettersEmbedder()
  traj = [("a", "o"), ("b", "p")]
  m = salt_jax.build_merge_ids([traj, traj], [0, 0], embedder=emb, threshold=1.0)
  np.testing.assert_array_equal(m.ids, [0, 1, 0, 1])


@pytest.mark.parametrize("bad, match", [
    (lambda xs: np.zeros((len(xs) + 1, 4)), "shape"),
    (lambda xs: np.zeros((len(xs),)), "shape"),
    (lambda xs: np.full((len(xs), 4), np.nan), "non-finite"),
    (lambda xs: np.full((len(xs), 4), np.inf), "non-finite"),
    (lambda xs: np.array([["x"] * 4] * len(xs)), "numbers"),
])
def test_bad_embedder_output(bad, match):
  with pytest.raises(ValueError, match=match):
    salt_jax.build_merge_ids([[("a", "o")]], [0], embedder=bad)


def test_zero_vectors_only_join_on_exact_text():
  zero = lambda xs: np.zeros((len(xs), 3))
  m = salt_jax.build_merge_ids([[("a", "o")], [("a", "o")], [("b", "o")]], [0, 0, 0],
                               embedder=zero)
  np.testing.assert_array_equal(m.ids, [0, 0, 1])


def test_cross_prompt_merges():
  ids = np.array([0, 0, 1, 1, 2])
  assert salt_jax.cross_prompt_merges(ids, np.array([7, 7, 3, 4, 5])) == 2
  assert salt_jax.cross_prompt_merges(ids, np.array([7, 7, 3, 3, 5])) == 0
  assert salt_jax.cross_prompt_merges(np.zeros(0, int), np.zeros(0, int)) == 0
  with pytest.raises(ValueError, match="same length"):
    salt_jax.cross_prompt_merges(ids, ids[:3])


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(0, 3), st.sampled_from([0.0, 1.0, -0.5])),
                max_size=30))
def test_gradient_changing_merges_matches_reference(steps):
  ids = np.array([s[0] for s in steps], np.int64)
  samples = np.array([s[1] for s in steps], np.int64)
  adv = np.array([s[2] for s in steps], np.float32)
  assert salt_jax.gradient_changing_merges(ids, samples, adv) == ref.gradient_changing_steps(
      ids.tolist(), samples.tolist(), adv.tolist())


def test_gradient_changing_merges_cases():
  ids = np.array([0, 0, 1, 1, 2, 3, 3])
  # Edge 0: one sample, different advantages (identical gradient terms: no change); edge 1: two
  # samples, equal advantages (no change); edge 3: two samples, different advantages (change).
  samples = np.array([5, 5, 6, 7, 8, 9, 10])
  adv = np.array([1.0, -1.0, 0.5, 0.5, 2.0, 1.0, -1.0])
  assert salt_jax.gradient_changing_merges(ids, samples, adv) == 2
  adv_nan = adv.copy()
  adv_nan[2] = np.nan
  assert salt_jax.gradient_changing_merges(ids, samples, adv_nan) == 4
  assert salt_jax.gradient_changing_merges(np.zeros(0, int), np.zeros(0, int), np.zeros(0)) == 0
  with pytest.raises(ValueError, match="same length"):
    salt_jax.gradient_changing_merges(ids, samples[:3], adv)
  with pytest.raises(ValueError, match="same length"):
    salt_jax.gradient_changing_merges(ids, samples, adv[:2])
