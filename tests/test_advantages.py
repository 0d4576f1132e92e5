import jax
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import salt_jax
from salt_jax.sharding import batch_sharding, make_mesh
from tests import references as ref


@st.composite
def grouped_rewards(draw):
  sizes = draw(st.lists(st.integers(1, 16), min_size=1, max_size=6))
  groups = np.repeat(np.arange(len(sizes)), sizes)
  perm = draw(st.permutations(list(range(len(groups)))))
  groups = groups[np.asarray(perm, dtype=np.int64)]
  values = st.one_of(st.sampled_from([0.0, 1.0, -0.1]), st.floats(-5, 5, width=32))
  rewards = np.array(draw(st.lists(values, min_size=len(groups), max_size=len(groups))),
                     np.float32)
  return rewards, groups.astype(np.int32), len(sizes)


# Property tests pad every draw to one bucket (B = 96, 8 groups) with masked padding, so a single
# compiled program serves all examples and the padding path is exercised every time.
_BUCKET, _GROUPS = 96, 8
_grpo = jax.jit(salt_jax.grpo_advantages, static_argnums=2, static_argnames="normalize_std")
_rloo = jax.jit(salt_jax.rloo_advantages, static_argnums=2)


def _padded(rewards, groups):
  n = len(rewards)
  pad = _BUCKET - n
  return (np.concatenate([rewards, np.full(pad, 123.0, np.float32)]),
          np.concatenate([groups, np.zeros(pad, np.int32)]),
          np.arange(_BUCKET) < n)


@settings(max_examples=60, deadline=None)
@given(grouped_rewards(), st.booleans())
def test_grpo_matches_reference(data, normalize_std):
  rewards, groups, _ = data
  got = _grpo(*_padded(rewards, groups)[:2], _GROUPS, normalize_std=normalize_std,
              mask=_padded(rewards, groups)[2])
  want = ref.grpo(rewards.tolist(), groups.tolist(), normalize_std=normalize_std)
  np.testing.assert_allclose(got[:len(rewards)], want, rtol=1e-4, atol=1e-4)
  assert np.all(np.asarray(got[len(rewards):]) == 0.0)


@settings(max_examples=60, deadline=None)
@given(grouped_rewards())
def test_rloo_matches_reference(data):
  rewards, groups, _ = data
  r, g, m = _padded(rewards, groups)
  got = _rloo(r, g, _GROUPS, mask=m)
  np.testing.assert_allclose(got[:len(rewards)], ref.rloo(rewards.tolist(), groups.tolist()),
                             rtol=1e-5, atol=1e-5)
  assert np.all(np.asarray(got[len(rewards):]) == 0.0)


def test_grpo_known_values_and_unbiased_std():
  r = np.array([1.0, 0.0, 0.0, 0.0], np.float32)
  got = np.asarray(salt_jax.grpo_advantages(r, np.zeros(4, np.int32), 1))
  std = np.std(r, ddof=1)
  np.testing.assert_allclose(got, (r - 0.25) / (std + 1e-6), rtol=1e-6)
  np.testing.assert_allclose(got[0], 1.5, rtol=1e-5)  # 0.75 / 0.5


def test_group_of_one_gets_zero():
  r = np.array([3.0, 1.0, 2.0], np.float32)
  g = np.array([0, 1, 1], np.int32)
  assert salt_jax.grpo_advantages(r, g, 2)[0] == 0.0
  assert salt_jax.grpo_advantages(r, g, 2, normalize_std=False)[0] == 0.0
  assert salt_jax.rloo_advantages(r, g, 2)[0] == 0.0
  np.testing.assert_allclose(salt_jax.rloo_advantages(r, g, 2)[1:], [-1.0, 1.0])


def test_equal_rewards_give_zero_not_nan():
  r = np.ones(8, np.float32)
  g = np.zeros(8, np.int32)
  assert np.all(np.asarray(salt_jax.grpo_advantages(r, g, 1)) == 0.0)
  assert np.all(np.asarray(salt_jax.rloo_advantages(r, g, 1)) == 0.0)


@pytest.mark.parametrize("value, size", [(-0.4, 8), (-0.8, 8), (0.7, 8), (-0.3, 8), (9.7, 16),
                                         (9.9, 8), (0.1, 3), (1e6 + 0.1, 5)])
@pytest.mark.parametrize("algo", ["grpo", "drgrpo", "rloo"])
def test_equal_rewards_that_do_not_round_exactly_give_exactly_zero(value, size, algo):
  # The float mean of such a group is not the value itself (eight -0.4s average to -0.39999998):
  # the advantage must still be exactly 0, in a batch beside groups that do have a signal.
  r = np.concatenate([np.full(size, value, np.float32), np.array([0.0, 10.0, 9.9], np.float32)])
  g = np.concatenate([np.zeros(size, np.int32), np.ones(3, np.int32)])
  fns = {"grpo": lambda *a, **k: salt_jax.grpo_advantages(*a, **k),
         "drgrpo": lambda *a, **k: salt_jax.grpo_advantages(*a, normalize_std=False, **k),
         "rloo": lambda *a, **k: salt_jax.rloo_advantages(*a, **k)}
  for out in (fns[algo](r, g, 2), jax.jit(fns[algo], static_argnums=2)(r, g, 2)):
    out = np.asarray(out)
    assert np.all(out[:size] == 0.0), out[:size]
    want = {"grpo": ref.grpo, "drgrpo": lambda *a: ref.grpo(*a, normalize_std=False),
            "rloo": ref.rloo}[algo](r[size:].tolist(), [1, 1, 1])
    np.testing.assert_allclose(out[size:], want, rtol=1e-5, atol=1e-5)


def test_nan_and_inf_rewards_are_left_out_and_counted():
  r = np.array([1.0, np.nan, 0.0, np.inf, 1.0], np.float32)
  g = np.zeros(5, np.int32)
  for fn in (salt_jax.grpo_advantages, salt_jax.rloo_advantages):
    out = np.asarray(fn(r, g, 1))
    assert np.all(np.isfinite(out))
    assert out[1] == 0.0 and out[3] == 0.0
  np.testing.assert_allclose(salt_jax.grpo_advantages(r, g, 1),
                             ref.grpo(r.tolist(), g.tolist()), rtol=1e-5)
  assert int(salt_jax.count_invalid_rewards(r)) == 2
  assert int(salt_jax.count_invalid_rewards(r, mask=[True, False, True, True, True])) == 1


def test_mask_and_out_of_range_groups_take_no_part():
  r = np.array([1.0, 0.0, 5.0, 7.0], np.float32)
  g = np.array([0, 0, 0, 9], np.int32)
  got = salt_jax.grpo_advantages(r, g, 1, mask=[True, True, False, True])
  want = ref.grpo([1.0, 0.0], [0, 0])
  np.testing.assert_allclose(got[:2], want, rtol=1e-6)
  assert got[2] == 0.0 and got[3] == 0.0


def test_empty_batch():
  out = salt_jax.grpo_advantages(np.zeros(0, np.float32), np.zeros(0, np.int32), 1)
  assert out.shape == (0,)


@pytest.mark.parametrize("fn", [salt_jax.grpo_advantages, salt_jax.rloo_advantages])
def test_bad_inputs(fn):
  r = np.zeros(4, np.float32)
  g = np.zeros(4, np.int32)
  with pytest.raises(ValueError, match="rank 1"):
    fn(r.reshape(2, 2), g.reshape(2, 2), 1)
  with pytest.raises(ValueError, match="same shape"):
    fn(r, g[:3], 1)
  with pytest.raises(ValueError, match="integer"):
    fn(r, g.astype(np.float32), 1)
  with pytest.raises(ValueError, match="num_groups"):
    fn(r, g, 0)
  with pytest.raises(ValueError, match="static"):
    jax.jit(lambda n: fn(r, g, n))(2)


def test_jit_and_sharded_equal_unsharded():
  rng = np.random.default_rng(0)
  r = rng.integers(0, 2, 64).astype(np.float32)
  g = np.repeat(np.arange(8), 8).astype(np.int32)
  mesh = make_mesh("4x2")
  sh = batch_sharding(mesh)
  for fn in (salt_jax.grpo_advantages, salt_jax.rloo_advantages):
    plain = np.asarray(fn(r, g, 8))
    jitted = jax.jit(fn, static_argnums=2)
    out = jitted(jax.device_put(r, sh), jax.device_put(g, sh), 8)
    np.testing.assert_allclose(out, plain, rtol=1e-6, atol=1e-6)
    assert out.sharding.spec == sh.spec


def test_stat_mask_scores_every_member_against_the_masked_statistics():
  r = np.array([1.0, 0.0, 5.0, 3.0], np.float32)
  g = np.zeros(4, np.int32)
  stat = np.array([True, True, False, False])
  # Statistics of {1, 0}: mean 0.5, std sqrt(0.5); members 5 and 3 are scored against them.
  want = (r - 0.5) / (np.sqrt(0.5) + 1e-6)
  np.testing.assert_allclose(salt_jax.grpo_advantages(r, g, 1, stat_mask=stat), want, rtol=1e-5)
  np.testing.assert_allclose(salt_jax.rloo_advantages(r, g, 1, stat_mask=stat),
                             (2 * r - 1.0) / 1.0, rtol=1e-6)
  # A group without statistics members has no baseline: 0.
  assert np.all(np.asarray(salt_jax.grpo_advantages(r, g, 1, stat_mask=np.zeros(4, bool))) == 0)
  with pytest.raises(ValueError, match="stat_mask"):
    salt_jax.grpo_advantages(r, g, 1, stat_mask=np.ones(3, bool))


def _inputs(rng, n=24, groups=3, pad=5):
  rewards = rng.normal(size=n + pad).astype(np.float32)
  return salt_jax.advantages.EstimatorInputs(
      rewards=rewards, group_ids=rng.integers(0, groups, n + pad).astype(np.int32),
      mask=np.arange(n + pad) < n, stat_mask=rng.random(n + pad) < 0.7,
      traj_ids=np.repeat(np.arange((n + pad) // 4 + 1), 4)[:n + pad].astype(np.int32),
      step_index=np.tile(np.arange(4), (n + pad) // 4 + 1)[:n + pad].astype(np.int32),
      merge_ids=rng.integers(0, 10, n + pad).astype(np.int32))


def test_registry_entries_read_named_inputs_as_their_functions():
  """Each registered estimator, given the named inputs, is its function of (rewards, group ids)
  under the same masks; the trainer's program runs it and SALT over `merge_ids`."""
  from salt_jax.advantages import ESTIMATORS  # pylint: disable=import-outside-toplevel
  from salt_jax.update import step_advantages_program  # pylint: disable=import-outside-toplevel
  x = _inputs(np.random.default_rng(0))
  direct = {"grpo": salt_jax.grpo_advantages, "rloo": salt_jax.rloo_advantages,
            "drgrpo": salt_jax.advantages.drgrpo_advantages}
  assert set(ESTIMATORS) == {*direct, "gigpo", "ppo"}
  for name, fn in direct.items():
    want = fn(x.rewards, x.group_ids, 3, mask=x.mask, stat_mask=x.stat_mask)
    np.testing.assert_array_equal(ESTIMATORS[name].fn(x, 3), want)
    before, after = step_advantages_program(name, 3, 10, True)(x)[:2]
    np.testing.assert_allclose(before, want, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(after, salt_jax.refine(want, x.merge_ids, 10, x.mask), rtol=1e-6,
                               atol=1e-7)
  with pytest.raises(ValueError, match="unknown algo"):
    step_advantages_program("gae", 3, 10, True)


def test_a_new_estimator_is_one_function_and_one_entry(monkeypatch):
  """An estimator that reads more than rewards (here: each row's step within its trajectory and
  optional step returns) needs one function and one registry entry: the config accepts its name
  and the trainer's program runs it."""
  from salt_jax.advantages import ESTIMATORS  # pylint: disable=import-outside-toplevel
  from salt_jax.config import TrainConfig  # pylint: disable=import-outside-toplevel
  from salt_jax.update import step_advantages_program  # pylint: disable=import-outside-toplevel

  def later_steps_count_less(inputs, num_groups):
    base = salt_jax.grpo_advantages(inputs.rewards, inputs.group_ids, num_groups,
                                    mask=inputs.mask, stat_mask=inputs.stat_mask)
    return base * 0.5 ** inputs.step_index + inputs.step_returns

  monkeypatch.setitem(ESTIMATORS, "discounted_test",
                      salt_jax.advantages.Estimator(later_steps_count_less))
  TrainConfig(algo="discounted_test").validate()
  x = _inputs(np.random.default_rng(1))
  x = x._replace(step_returns=np.linspace(0.0, 1.0, x.rewards.shape[0], dtype=np.float32))
  before = step_advantages_program("discounted_test", 3, 10, False)(x).before
  grpo = salt_jax.grpo_advantages(x.rewards, x.group_ids, 3, mask=x.mask, stat_mask=x.stat_mask)
  np.testing.assert_allclose(before, grpo * 0.5 ** x.step_index + x.step_returns, rtol=1e-6,
                             atol=1e-7)


def _gigpo_case(rng, n=40, groups=3, pad=4):
  """Rows of `groups` task groups with repeated observations (anchors of one to several rows,
  some singletons), unequal group sizes, an all-equal group (group 2: every score 10)."""
  group = np.sort(rng.integers(0, groups, n))
  scores = np.where(group == 2, 10.0, rng.choice([10.0, 9.9, 0.0, -0.1], n))
  returns = rng.normal(size=n) * 3
  obs = [f"room {rng.integers(0, 4)}" for _ in range(n)]
  anchors = ref.gigpo_step_groups(obs, group.tolist())
  pad_to = lambda a, dt: np.concatenate([np.asarray(a, dt), np.zeros(pad, dt)])  # noqa: E731
  return (scores, group, returns, anchors,
          dict(rewards=pad_to(scores, np.float32), group_ids=pad_to(group, np.int32),
               step_returns=pad_to(returns, np.float32), anchor_ids=pad_to(anchors, np.int32),
               mask=np.arange(n + pad) < n))


@pytest.mark.parametrize("mode", ["mean_std_norm", "mean_norm"])
@pytest.mark.parametrize("w", [1.0, 0.5])
def test_gigpo_matches_verl_agents_loops(mode, w):
  """`gigpo_advantages` against verl-agent's episode_norm_reward + w * step_norm_reward over
  build_step_group's anchors, re-derived in loops: singleton anchors, an all-equal group, groups
  of different sizes; padding rows get 0."""
  rng = np.random.default_rng(3)
  scores, group, returns, anchors, x = _gigpo_case(rng)
  remove_std = mode == "mean_norm"
  want = (np.array(ref.gigpo_episode_norm(scores.tolist(), group.tolist(),
                                          list(range(len(scores))), remove_std))
          + w * np.array(ref.gigpo_step_norm(returns.tolist(), anchors, remove_std)))
  got = salt_jax.advantages.gigpo_advantages(
      x["rewards"], x["group_ids"], 3, x["step_returns"], x["anchor_ids"], mode=mode,
      step_advantage_w=w, mask=x["mask"])
  n = len(scores)
  np.testing.assert_allclose(got[:n], want, rtol=1e-4, atol=1e-4)
  assert np.all(np.asarray(got[n:]) == 0)
  singletons = [i for i in range(n) if anchors.count(anchors[i]) == 1]
  assert singletons  # the case has some: their step part is exactly 0
  episode_only = salt_jax.advantages.gigpo_advantages(
      x["rewards"], x["group_ids"], 3, x["step_returns"], x["anchor_ids"], mode=mode,
      step_advantage_w=0.0, mask=x["mask"])
  np.testing.assert_array_equal(np.asarray(got)[singletons], np.asarray(episode_only)[singletons])
  assert np.all(np.asarray(episode_only)[:n][group == 2] == 0.0)  # all-equal group: exactly 0


def test_gigpo_degenerate_inputs():
  """A group of one row is scored against mean 0 and std 1 (verl-agent's rule); a NaN score
  gets 0 and stays out of the statistics; a NaN step return drops only the step part; bad
  shapes and modes raise."""
  gigpo = salt_jax.advantages.gigpo_advantages
  one = gigpo(np.array([10.0]), np.array([0]), 1, np.array([3.0]), np.array([0]))
  np.testing.assert_allclose(one, [10.0 / (1 + 1e-6)], rtol=1e-6)
  np.testing.assert_allclose(gigpo(np.array([10.0]), np.array([0]), 1, np.array([3.0]),
                                   np.array([0]), mode="mean_norm"), [10.0])
  r = np.array([10.0, np.nan, 0.0, 10.0], np.float32)
  g = np.zeros(4, np.int32)
  ret = np.array([1.0, 2.0, np.nan, 1.0], np.float32)
  a = np.array([0, 0, 1, 0], np.int32)
  got = np.asarray(gigpo(r, g, 1, ret, a))
  episode = np.asarray(salt_jax.grpo_advantages(r, g, 1))
  assert got[1] == 0.0 and np.all(np.isfinite(got))
  np.testing.assert_allclose(got[2], episode[2], rtol=1e-6)  # NaN return: episode part alone
  np.testing.assert_allclose(got[[0, 3]], episode[[0, 3]], rtol=1e-6)  # equal returns: step 0
  with pytest.raises(ValueError, match="mode"):
    gigpo(r, g, 1, ret, a, mode="std")
  with pytest.raises(ValueError, match="step_returns"):
    gigpo(r, g, 1, ret[:3], a)
  empty = gigpo(np.zeros(0, np.float32), np.zeros(0, np.int32), 1, np.zeros(0, np.float32),
                np.zeros(0, np.int32))
  assert empty.shape == (0,)


def test_gigpo_sharded_over_a_mesh_equals_one_device():
  """GiGPO's program with its rows split over the mesh's data axis: the same advantages."""
  rng = np.random.default_rng(4)
  scores, group, returns, anchors, x = _gigpo_case(rng, n=60, pad=4)
  mesh = make_mesh("4x2")
  sh = batch_sharding(mesh)
  args = (x["rewards"], x["group_ids"], 3, x["step_returns"], x["anchor_ids"])
  plain = np.asarray(salt_jax.advantages.gigpo_advantages(*args))
  jitted = jax.jit(salt_jax.advantages.gigpo_advantages, static_argnums=2)
  out = jitted(*(a if i == 2 else jax.device_put(a, sh) for i, a in enumerate(args)))
  np.testing.assert_allclose(out, plain, rtol=1e-5, atol=1e-5)
  assert out.sharding.spec == sh.spec
