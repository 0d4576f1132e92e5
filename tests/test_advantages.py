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
