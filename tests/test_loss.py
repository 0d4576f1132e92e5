import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import salt_jax
from salt_jax.sharding import batch_sharding, make_mesh
from tests import references as ref


def _batch(seed, b=6, l=9, adv_rank=2):
  rng = np.random.default_rng(seed)
  logp = rng.normal(-1.0, 0.5, (b, l)).astype(np.float32)
  old = (logp + rng.normal(0, 0.4, (b, l))).astype(np.float32)  # ratios well outside 1 +- 0.2
  refp = (logp + rng.normal(0, 0.3, (b, l))).astype(np.float32)
  adv = rng.normal(size=(b, l) if adv_rank == 2 else (b,)).astype(np.float32)
  mask = rng.random((b, l)) > 0.3
  mask[1] = False  # an all-zero row
  return logp, old, adv, mask, refp


CASES = list(itertools.product(
    ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"],
    [(0.2, None, None), (0.2, 0.28, None), (0.2, None, 3.0)],
    [("k1", 0.0), ("k1", 0.1), ("k2", 0.05), ("k3", 0.04)],
    [1, 2],
))


@pytest.mark.parametrize("agg, clip, kl, adv_rank", CASES)
def test_policy_loss_matches_verl_reference(agg, clip, kl, adv_rank):
  logp, old, adv, mask, refp = _batch(len(agg) + adv_rank, adv_rank=adv_rank)
  clip_eps, clip_high, dual = clip
  est, coef = kl
  loss, metrics = salt_jax.policy_loss(
      logp, old, adv, mask, clip_eps=clip_eps, clip_eps_high=clip_high, dual_clip=dual,
      ref_logp=refp, kl_coef=coef, kl_estimator=est, loss_agg=agg)
  want, want_pg, want_clipfrac = ref.ppo_loss(
      logp, old, adv, mask, clip_eps, clip_high or clip_eps, dual, refp, coef, est, agg)
  np.testing.assert_allclose(loss, want, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(metrics.pg_loss, want_pg, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(metrics.clip_fraction, want_clipfrac, rtol=1e-5)
  assert 0.0 < float(metrics.clip_fraction) < 1.0


def test_kl_estimators_known_values():
  logp = jnp.array([-1.0, -2.0])
  refp = jnp.array([-1.5, -1.0])
  np.testing.assert_allclose(salt_jax.kl_estimate(logp, refp, "k1"), [0.5, -1.0])
  np.testing.assert_allclose(salt_jax.kl_estimate(logp, refp, "k2"), [0.125, 0.5])
  np.testing.assert_allclose(salt_jax.kl_estimate(logp, refp, "k3"),
                             [np.exp(-0.5) + 0.5 - 1, np.exp(1.0) - 1.0 - 1], rtol=1e-6)
  assert np.all(np.asarray(salt_jax.kl_estimate(logp, logp, "k3")) == 0)


def test_ratio_one_is_plain_policy_gradient():
  logp, _, adv, mask, _ = _batch(3)
  loss, metrics = salt_jax.policy_loss(logp, logp, adv, mask)
  m = mask.astype(np.float64)
  np.testing.assert_allclose(loss, -(adv * m).sum() / m.sum(), rtol=1e-5)
  assert float(metrics.clip_fraction) == 0.0 and float(metrics.ratio_mean) == pytest.approx(1.0)


def test_gradient_is_finite_with_garbage_in_masked_positions():
  logp, old, adv, mask, refp = _batch(5)
  logp = np.where(mask, logp, -np.inf).astype(np.float32)
  old = np.where(mask, old, np.nan).astype(np.float32)
  refp = np.where(mask, refp, np.inf).astype(np.float32)
  adv = np.where(mask, adv, np.nan).astype(np.float32)
  for agg in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum"):
    f = lambda lp: salt_jax.policy_loss(lp, old, adv, mask, ref_logp=refp, kl_coef=0.1,
                                        dual_clip=3.0, loss_agg=agg)[0]
    value, grad = jax.value_and_grad(f)(jnp.asarray(logp))
    assert np.isfinite(value)
    assert np.all(np.isfinite(grad))
    assert np.all(np.asarray(grad)[~mask] == 0.0)


def test_all_zero_mask_gives_zero_not_nan():
  logp, old, adv, _, refp = _batch(7)
  mask = np.zeros_like(logp, dtype=bool)
  for agg in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum"):
    loss, metrics = salt_jax.policy_loss(logp, old, adv, mask, ref_logp=refp, kl_coef=0.1,
                                         loss_agg=agg)
    assert float(loss) == 0.0
    assert all(np.isfinite(np.asarray(x)) for x in metrics)


def test_zero_rows_do_not_change_the_loss():
  logp, old, adv, mask, refp = _batch(11)
  kw = dict(ref_logp=refp, kl_coef=0.1, loss_agg="seq-mean-token-mean")
  base, _ = salt_jax.policy_loss(logp, old, adv, mask, **kw)
  pad = lambda x, v: np.concatenate([x, np.full((3, x.shape[1]), v, x.dtype)])
  padded, _ = salt_jax.policy_loss(pad(logp, 0.0), pad(old, 0.0), pad(adv, 9.0),
                                   pad(mask, False), ref_logp=pad(refp, 0.0), kl_coef=0.1,
                                   loss_agg="seq-mean-token-mean")
  np.testing.assert_allclose(padded, base, rtol=1e-6)


def test_advantages_are_not_differentiated():
  logp, old, adv, mask, _ = _batch(2)
  g = jax.grad(lambda a: salt_jax.policy_loss(logp, old, a, mask)[0])(jnp.asarray(adv))
  assert np.all(np.asarray(g) == 0.0)


@pytest.mark.parametrize("kwargs, match", [
    (dict(loss_agg="mean"), "loss_agg"),
    (dict(kl_estimator="k4", ref_logp=np.zeros((2, 3), np.float32)), "kl_estimator"),
    (dict(kl_coef=0.1), "ref_logp"),
    (dict(kl_coef=-1.0, ref_logp=np.zeros((2, 3), np.float32)), "kl_coef"),
    (dict(clip_eps=0.0), "clip_eps"),
    (dict(clip_eps_high=-0.1), "clip_eps_high"),
    (dict(dual_clip=1.0), "dual_clip"),
    (dict(ref_logp=np.zeros((2, 4), np.float32)), "same shape"),
])
def test_bad_arguments(kwargs, match):
  z = np.zeros((2, 3), np.float32)
  with pytest.raises(ValueError, match=match):
    salt_jax.policy_loss(z, z, z, np.ones((2, 3)), **kwargs)


def test_bad_shapes():
  z = np.zeros((2, 3), np.float32)
  with pytest.raises(ValueError, match="rank 2"):
    salt_jax.policy_loss(z[0], z[0], z[0], z[0])
  with pytest.raises(ValueError, match="same shape"):
    salt_jax.policy_loss(z, z[:, :2], z, z)
  with pytest.raises(ValueError, match="same shape"):
    salt_jax.policy_loss(z, z, z, z[:1])
  with pytest.raises(ValueError, match="batch"):
    salt_jax.policy_loss(z, z, np.zeros(3, np.float32), z)
  with pytest.raises(ValueError, match="same shape"):
    salt_jax.policy_loss(z, z, z[:, :1], z)


def test_sharded_loss_and_grad_equal_unsharded():
  logp, old, adv, mask, refp = _batch(13, b=8, l=16)
  fn = jax.jit(jax.value_and_grad(
      lambda lp, o, a, m, r: salt_jax.policy_loss(lp, o, a, m, ref_logp=r, kl_coef=0.05,
                                                  dual_clip=3.0)[0]))
  want, want_grad = fn(logp, old, adv, mask, refp)
  mesh = make_mesh("4x2")
  sh = batch_sharding(mesh, ndim=2)
  with jax.set_mesh(mesh):
    got, grad = fn(*(jax.device_put(x, sh) for x in (logp, old, adv, mask, refp)))
  np.testing.assert_allclose(got, want, rtol=1e-5)
  np.testing.assert_allclose(grad, want_grad, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("agg, dual", [("token-mean", None), ("seq-mean-token-sum", 3.0)])
def test_truncated_importance_sampling_matches_verl(agg, dual):
  """Rollout IS in verl's token-level truncate mode: min(pi_old / pi_rollout, T) weighs each
  token's surrogate (after the dual clip), not the KL term; the weights are constants."""
  logp, old, adv, mask, refp = _batch(7)
  rollout = (old + np.random.default_rng(1).normal(0, 0.5, old.shape)).astype(np.float32)
  w = salt_jax.rollout_is_weights(old, rollout, mask, 2.0)
  want_w = ref.truncated_is_weights(old, rollout, mask, 2.0)
  np.testing.assert_allclose(w, want_w, rtol=1e-6)
  assert float(jnp.max(w)) == 2.0 and 0.0 < float(jnp.min(jnp.where(mask, w, 9.0))) < 1.0
  loss, metrics = salt_jax.policy_loss(logp, old, adv, mask, dual_clip=dual, ref_logp=refp,
                                       kl_coef=0.05, loss_agg=agg, is_weights=w)
  want, want_pg, _ = ref.ppo_loss(logp, old, adv, mask, 0.2, 0.2, dual, refp, 0.05, "k3", agg,
                                  is_weights=want_w)
  np.testing.assert_allclose(loss, want, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(metrics.pg_loss, want_pg, rtol=1e-5, atol=1e-6)
  # Weights of 1 are no weights; no gradient reaches the weights.
  plain, _ = salt_jax.policy_loss(logp, old, adv, mask, loss_agg=agg)
  ones, _ = salt_jax.policy_loss(logp, old, adv, mask, loss_agg=agg,
                                 is_weights=np.ones_like(logp))
  np.testing.assert_allclose(ones, plain, rtol=1e-6)
  g = jax.grad(lambda ww: salt_jax.policy_loss(logp, old, adv, mask, is_weights=ww)[0])(w)
  assert not np.any(np.asarray(g))


def test_truncated_importance_sampling_bad_inputs():
  logp, old, _, mask, _ = _batch(8)
  garbage = np.where(mask, old, np.nan).astype(np.float32)  # NaN off the mask: weight 0 there
  w = np.asarray(salt_jax.rollout_is_weights(garbage, garbage, mask, 3.0))
  assert np.all(np.isfinite(w)) and np.all(w[~mask] == 0) and np.all(w[mask] == 1.0)
  for bad in (0.0, -1.0, float("nan"), float("inf")):
    with pytest.raises(ValueError, match="threshold must be > 0"):
      salt_jax.rollout_is_weights(old, old, mask, bad)
  with pytest.raises(ValueError, match="rollout_logp"):
    salt_jax.rollout_is_weights(old, old[:, :-1], mask, 2.0)
  with pytest.raises(ValueError, match="is_weights"):
    salt_jax.policy_loss(logp, old, np.zeros(logp.shape[0]), mask, is_weights=old[:-1])
