"""PPO-clip policy loss with KL to a reference policy (device side, jittable, shardable).

The surrogate and its clip-higher and dual-clip variants follow verl's `compute_policy_loss`
(verl/trainer/ppo/core_algos.py), the KL estimators its `kl_penalty`, and the aggregation modes its
`agg_loss`, so numbers can be compared with verl and Tunix runs. Advantages are constants of the
loss: they pass through `stop_gradient`.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from salt_jax import _checks

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")
KL_ESTIMATORS = ("k1", "k2", "k3")

# As verl: the log-ratio is clamped before exp so a stale or corrupted log-prob cannot overflow,
# and k3 is clamped to +-10.
_LOG_RATIO_CLAMP = 20.0
_K3_CLAMP = 10.0


class PolicyLossMetrics(NamedTuple):
  """Scalars of one loss evaluation (masked means over response tokens)."""

  pg_loss: jax.Array          # the aggregated clipped surrogate
  kl: jax.Array               # token-mean KL estimate to the reference (0 without ref_logp)
  clip_fraction: jax.Array    # share of tokens where the clipped term was taken
  clip_fraction_lower: jax.Array  # share of tokens capped by the dual clip (A < 0)
  ratio_mean: jax.Array       # mean importance ratio pi / pi_old
  approx_kl_old: jax.Array    # token-mean 0.5 (logp - old_logp)^2: drift from the rollout policy


def kl_estimate(logp, ref_logp, estimator: str = "k3"):
  """Per-token KL(pi || pi_ref) estimate from sampled tokens (Schulman, 2020).

    k1 = logp - ref_logp
    k2 = 0.5 (logp - ref_logp)^2
    k3 = exp(ref_logp - logp) - (ref_logp - logp) - 1   (clamped to [-10, 10] as in verl)

  Args:
    logp, ref_logp: f32[...] log-probs of the same tokens under the policy and the reference.
    estimator: 'k1', 'k2' or 'k3'.
  Returns:
    f32[...] per-token estimates.
  """
  if estimator not in KL_ESTIMATORS:
    raise ValueError(f"kl_estimator must be one of {KL_ESTIMATORS}, got {estimator!r}")
  _checks.check_same_shape("logp", logp, "ref_logp", ref_logp)
  diff = logp - ref_logp
  if estimator == "k1":
    return diff
  if estimator == "k2":
    return 0.5 * jnp.square(diff)
  neg = jnp.clip(-diff, -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
  return jnp.clip(jnp.exp(neg) - neg - 1.0, -_K3_CLAMP, _K3_CLAMP)


def _check_loss_agg(mode: str) -> None:
  if mode not in LOSS_AGG_MODES:
    raise ValueError(f"loss_agg must be one of {LOSS_AGG_MODES}, got {mode!r}")


def aggregate(values, mask, mode: str = "token-mean"):
  """Reduce per-token values f32[B, L] to a scalar over the mask (verl's `agg_loss`).

    token-mean:          sum(v m) / sum(m) over the whole batch
    seq-mean-token-mean: mean over rows of (sum_t v m / sum_t m)
    seq-mean-token-sum:  mean over rows of sum_t v m

  Rows whose mask is all zero take no part (and a batch with no unmasked token gives 0, not NaN).
  """
  _check_loss_agg(mode)
  _checks.check_rank("values", values, 2)
  mask = _checks.as_mask("mask", mask, values).astype(values.dtype)
  masked = jnp.where(mask > 0, values, 0.0)
  if mode == "token-mean":
    return jnp.sum(masked) / jnp.maximum(jnp.sum(mask), 1.0)
  tokens = jnp.sum(mask, axis=-1)
  row_sum = jnp.sum(masked, axis=-1)
  row = row_sum / jnp.maximum(tokens, 1.0) if mode == "seq-mean-token-mean" else row_sum
  live = (tokens > 0).astype(values.dtype)
  return jnp.sum(row * live) / jnp.maximum(jnp.sum(live), 1.0)


def aggregate_weight(mask, mode: str = "token-mean"):
  """The weight of a batch in `aggregate` over a larger batch it is part of: f32[].

  aggregate(v, m, mode) over the rows of batches b_1..b_n equals
  sum_i w_i aggregate(v_i, m_i, mode) / sum_i w_i with w_i = aggregate_weight(m_i, mode):
  the unmasked tokens for 'token-mean', the rows with any unmasked token for the modes that
  average over sequences. Micro-batched gradients (`microbatched_value_and_grad`) use it.
  """
  _check_loss_agg(mode)
  _checks.check_rank("mask", mask, 2)
  m = jnp.asarray(mask) != 0
  if mode == "token-mean":
    return jnp.sum(m, dtype=jnp.float32)
  return jnp.sum(jnp.any(m, axis=-1), dtype=jnp.float32)


def rollout_is_weights(old_logp, rollout_logp, mask, threshold: float):
  """Truncated importance sampling weights (TIS; verl's rollout IS at token level, mode
  "truncate"): min(pi_old / pi_rollout, threshold) per token, where pi_old is the trainer's own
  log-prob of the sampled token and pi_rollout the sampler's (another engine or precision).
  They correct the policy gradient for the sampler's mismatch; 0 off the mask.

  Args:
    old_logp, rollout_logp: f32[B, L] log-probs of the sampled tokens under the trainer's and the
      sampler's policy.
    mask: bool or 0/1 [B, L].
    threshold: the truncation (> 0; verl recommends 1.5 to 5 at token level).
  Returns:
    f32[B, L] weights (constants: no gradient flows through them).
  """
  if not (threshold > 0 and math.isfinite(threshold)):
    raise ValueError(f"threshold must be > 0, got {threshold}")
  _checks.check_rank("old_logp", old_logp, 2)
  _checks.check_same_shape("old_logp", old_logp, "rollout_logp", rollout_logp)
  m = _checks.as_mask("mask", mask, old_logp)
  log_ratio = jnp.where(m, jnp.asarray(old_logp) - jnp.asarray(rollout_logp), 0.0)
  log_ratio = jnp.clip(jnp.nan_to_num(log_ratio, nan=0.0), -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
  return jax.lax.stop_gradient(jnp.where(m, jnp.minimum(jnp.exp(log_ratio), threshold), 0.0))


def policy_loss(logp, old_logp, advantages, mask, *, clip_eps=0.2, clip_eps_high=None,
                dual_clip=None, ref_logp=None, kl_coef=0.0, kl_estimator="k3",
                loss_agg="token-mean", is_weights=None):
  """PPO clipped surrogate loss (Schulman et al., 2017) with an optional KL penalty.

    r = exp(logp - old_logp)
    L_clip = -min(r A, clip(r, 1 - clip_eps, 1 + clip_eps_high) A)       (clip-higher: DAPO)
    for A < 0 with dual_clip = c: L = min(L_clip, -c A)                  (dual-clip PPO, as verl)
    with is_weights w: L = w L                                           (rollout IS, as verl)
    loss = agg(L) + kl_coef * agg(KL(pi || pi_ref))

  Args:
    logp: f32[B, L] log-probs of the response tokens under the policy being trained.
    old_logp: f32[B, L] their log-probs under the rollout policy.
    advantages: f32[B, L] per-token advantages, or f32[B] broadcast over tokens.
    mask: bool or 0/1 [B, L]; True on tokens that take part (the action's tokens).
    clip_eps: lower clip range epsilon.
    clip_eps_high: upper clip range (defaults to clip_eps).
    dual_clip: c > 1 caps the loss of negative-advantage tokens at c |A| (None: off).
    ref_logp: optional f32[B, L] reference-policy log-probs; needed when kl_coef > 0.
    kl_coef: weight of the KL penalty (GRPO's beta).
    kl_estimator: 'k1', 'k2' or 'k3' (see `kl_estimate`).
    loss_agg: 'token-mean', 'seq-mean-token-mean' or 'seq-mean-token-sum' (see `aggregate`).
    is_weights: optional f32[B, L] importance weights of the surrogate's tokens
      (`rollout_is_weights`), constants; the KL term is not weighted.
  Returns:
    (loss scalar, PolicyLossMetrics). Rows with an all-zero mask contribute nothing and never
    produce NaN, in the value or in the gradient.
  """
  _checks.check_rank("logp", logp, 2)
  _checks.check_same_shape("logp", logp, "old_logp", old_logp)
  _checks.check_same_shape("logp", logp, "mask", mask)
  if np.ndim(advantages) == 1:
    if np.shape(advantages)[0] != np.shape(logp)[0]:
      raise ValueError(
          f"advantages f32[B] must match the batch of logp {np.shape(logp)}, got "
          f"{np.shape(advantages)}")
    advantages = jnp.asarray(advantages)[:, None]
  else:
    _checks.check_same_shape("advantages", advantages, "logp", logp)
  if clip_eps <= 0:
    raise ValueError(f"clip_eps must be > 0, got {clip_eps}")
  clip_eps_high = clip_eps if clip_eps_high is None else clip_eps_high
  if clip_eps_high <= 0:
    raise ValueError(f"clip_eps_high must be > 0, got {clip_eps_high}")
  if dual_clip is not None and dual_clip <= 1.0:
    raise ValueError(f"dual_clip must be > 1 (verl uses 3.0), got {dual_clip}")
  if kl_coef < 0:
    raise ValueError(f"kl_coef must be >= 0, got {kl_coef}")
  if kl_coef > 0 and ref_logp is None:
    raise ValueError("kl_coef > 0 needs ref_logp")
  if ref_logp is not None:
    _checks.check_same_shape("logp", logp, "ref_logp", ref_logp)
  if is_weights is not None:
    _checks.check_same_shape("logp", logp, "is_weights", is_weights)

  m = _checks.as_mask("mask", mask, logp)
  # Padding positions may hold -inf or NaN log-probs: replace them before any arithmetic, so that
  # neither the value nor the gradient (a where after the fact still back-propagates NaN) sees them.
  logp = jnp.where(m, logp, 0.0)
  old_logp = jnp.where(m, old_logp, 0.0)
  adv = jnp.where(m, jax.lax.stop_gradient(jnp.broadcast_to(advantages, logp.shape)), 0.0)
  log_ratio = jnp.clip(logp - old_logp, -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
  ratio = jnp.exp(log_ratio)

  loss_unclipped = -adv * ratio
  loss_clipped = -adv * jnp.clip(ratio, 1.0 - clip_eps, 1.0 + clip_eps_high)
  loss_ppo = jnp.maximum(loss_unclipped, loss_clipped)
  clipped = loss_clipped > loss_unclipped
  if dual_clip is not None:
    loss_cap = -adv * dual_clip
    capped = (loss_ppo > loss_cap) & (adv < 0)
    loss_tok = jnp.where(adv < 0, jnp.minimum(loss_ppo, loss_cap), loss_ppo)
  else:
    capped = jnp.zeros_like(clipped)
    loss_tok = loss_ppo
  if is_weights is not None:
    loss_tok = loss_tok * jnp.where(m, jax.lax.stop_gradient(is_weights), 0.0)

  pg_loss = aggregate(loss_tok, m, loss_agg)
  token_mean = lambda x: aggregate(x.astype(jnp.float32), m, "token-mean")
  if ref_logp is not None:
    kl_tok = kl_estimate(logp, jnp.where(m, ref_logp, 0.0), kl_estimator)
    kl_loss = aggregate(kl_tok, m, loss_agg)
    kl_metric = token_mean(kl_tok)
  else:
    kl_loss = kl_metric = jnp.zeros((), jnp.float32)
  loss = pg_loss + kl_coef * kl_loss
  metrics = PolicyLossMetrics(
      pg_loss=pg_loss,
      kl=kl_metric,
      clip_fraction=token_mean(clipped),
      clip_fraction_lower=token_mean(capped),
      ratio_mean=token_mean(ratio),
      approx_kl_old=token_mean(0.5 * jnp.square(log_ratio)),
  )
  return loss, metrics



class ValueLossMetrics(NamedTuple):
  """Scalars of one value-loss evaluation (token means over the response tokens)."""

  value_loss: jax.Array       # the aggregated loss (0.5 x clipped squared error)
  value_clip_fraction: jax.Array  # share of tokens where the clipped error was the larger
  value_mean: jax.Array       # mean predicted value


def value_loss(values, old_values, returns, mask, *, value_clip=0.5, loss_agg="token-mean"):
  """A critic's clipped value loss (verl's `compute_value_loss`, Tunix's PPO critic):

    v_clipped = old_values + clip(values - old_values, -value_clip, value_clip)
    loss = 0.5 agg(max((values - returns)^2, (v_clipped - returns)^2))

  Args:
    values: f32[B, L] the critic's current values at the response tokens.
    old_values: f32[B, L] its values when the batch was scored (the rollout's).
    returns: f32[B, L] the regression targets (GAE advantages + old values).
    mask: bool or 0/1 [B, L], the tokens that take part.
    value_clip: how far a value may move from `old_values` before its error is clipped (verl's
      cliprange_value, 0.5); None: no clipping.
    loss_agg: as in `aggregate`.
  Returns:
    (loss scalar, ValueLossMetrics). Off-mask positions take no part, even when NaN.
  """
  _checks.check_rank("values", values, 2)
  for name, x in (("old_values", old_values), ("returns", returns), ("mask", mask)):
    _checks.check_same_shape("values", values, name, x)
  if value_clip is not None and not value_clip > 0:
    raise ValueError(f"value_clip must be None or > 0, got {value_clip}")
  m = _checks.as_mask("mask", mask, values)
  values = jnp.where(m, values, 0.0)
  old_values = jnp.where(m, old_values, 0.0)
  returns = jax.lax.stop_gradient(jnp.where(m, returns, 0.0))
  err = jnp.square(values - returns)
  if value_clip is None:
    err_max, clipped = err, jnp.zeros(err.shape, bool)
  else:
    v_clipped = old_values + jnp.clip(values - old_values, -value_clip, value_clip)
    err_clipped = jnp.square(v_clipped - returns)
    err_max, clipped = jnp.maximum(err, err_clipped), err_clipped > err
  token_mean = lambda x: aggregate(x.astype(jnp.float32), m, "token-mean")  # noqa: E731
  loss = 0.5 * aggregate(err_max, m, loss_agg)
  return loss, ValueLossMetrics(value_loss=loss, value_clip_fraction=token_mean(clipped),
                                value_mean=token_mean(values))
