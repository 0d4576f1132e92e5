"""The iteration's phases between the rollout and the update, as functions of what they read.

  step_advantages(batch, config, mesh=...)     SALT's merge ids on the host, then one jitted
      program: the group estimator (or GAE over a critic's values) and SALT's refine
  minibatches(tb, rows, config, microbatched)  the token batch in mini-batches, each cut to the
      bucketed length of its own longest row (and its micro-batch plan)
  put(x, mesh), on_device(mb, mesh)            arrays onto the mesh, split over its data axis
  score_minibatches(program, weights, mbs, fields, frozen, mesh)   a log-prob or value pass
  recompute_old_logprobs(program, params, frozen, mbs, mesh, ...)  the policy's own old log-probs
  critic_values / fill_critic_batch            PPO: the critic's values in, GAE's targets out

`Trainer.iteration` runs them in this order around `state.update`. Each reads only its arguments
(no trainer), so a notebook or a test can run one phase alone.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from salt_jax import batching
from salt_jax import multihost
from salt_jax.advantages import ESTIMATORS
from salt_jax.graph import (build_merge_ids, cross_prompt_merges, gradient_changing_merges,
                            sample_ids)
from salt_jax.loss import rollout_is_weights
from salt_jax.sharding import DATA_AXIS, batch_sharding
from salt_jax.update import estimator_options, step_advantages_program

# What the log-prob program reads of a mini-batch.
LOGPROB_FIELDS = ("input_ids", "targets", "attention_mask", "positions", "logit_positions")
# What the critic's value program reads of a mini-batch.
VALUE_FIELDS = ("input_ids", "attention_mask", "positions")
# The token batch's fields a mini-batch carries.
_MINIBATCH_FIELDS = ("input_ids", "targets", "loss_mask", "token_step_ids", "old_logprobs",
                     "attention_mask", "positions")

# SALT's metrics in an iteration without merges (SALT off, or no step to merge).
NO_MERGE_METRICS = dict(merge_rate=float("nan"), cross_prompt_merges=0, gradient_changing_merges=0,
                        merged_steps=0, gradient_changing_share=float("nan"),
                        response_differing_merges=0)


def _untimed(_phase: str):
  return contextlib.nullcontext()


def merge_metrics(batch, merge, before: np.ndarray) -> dict:
  """SALT's merges and where they change the policy gradient: edges whose members are different
  (prompt, response) samples with different advantages (the same tokens share one gradient
  term); `response_differing_merges`: steps whose merged edge holds more than one response (what
  reasoning text makes common)."""
  merged = int(np.sum(np.bincount(merge.ids)[merge.ids] > 1))
  changing = gradient_changing_merges(merge.ids, sample_ids(batch.prompt_ids, batch.response_ids),
                                      before)
  return {"merge_rate": merge.merge_rate,
          "cross_prompt_merges": cross_prompt_merges(merge.ids, sample_ids(batch.prompt_ids)),
          "merged_steps": merged, "gradient_changing_merges": changing,
          "response_differing_merges": cross_prompt_merges(merge.ids,
                                                           sample_ids(batch.response_ids)),
          "gradient_changing_share": changing / merged if merged else float("nan")}


def put(x, mesh):
  """`x` on the mesh, its first axis split over the data axis (an array already there stays)."""
  return jax.device_put(x, batch_sharding(mesh, np.ndim(x)))


def on_device(mb: dict, mesh) -> dict:
  """A mini-batch's arrays on the mesh, split over its data axis (those already there stay)."""
  return {k: put(v, mesh) for k, v in mb.items()}


def step_advantages(batch, config, *, mesh, embedder=None, times: Callable = _untimed,
                    tb: Optional[batching.TokenBatch] = None, mbs: Optional[list] = None,
                    rows: int = 0, critic_values: Optional[Callable[[], np.ndarray]] = None
                    ) -> tuple[np.ndarray, np.ndarray, Any, dict]:
  """(before, after) SALT as f32[steps] on the host, the padded device array of `after` for
  the update, and SALT's (and the critic's) metrics.

  With a critic's estimator (PPO) `critic_values()` scores the token batch `tb` (its
  mini-batches `mbs` of `rows` rows, which then carry each token's `advantages`, `returns` and
  `old_values` for the update); `before` / `after` are each step's mean token advantage.
  `times(phase)` times the phases 'salt', 'advantage' and 'values'.
  """
  critic = ESTIMATORS[config.algo].critic
  if critic and (tb is None or mbs is None or critic_values is None):
    raise ValueError(f"algo {config.algo!r} scores the token batch with its critic: pass tb "
                     "and mbs")
  data_size = int(mesh.shape[DATA_AXIS])
  nsteps = batch.num_total_steps
  # padded to a power of two (a multiple of the data axis) so the program compiles rarely
  n_pad = -(-batching.bucket_length(nsteps, 64) // data_size) * data_size
  merge, segments = None, 1
  with times("salt"):
    if config.salt:
      trajs, groups = batch.trajectories_for_salt()
      merge = build_merge_ids(trajs, groups, history=config.salt_history, embedder=embedder,
                              threshold=config.embed_threshold)
      segments = batching.bucket_length(merge.num_segments, 64)
  with times("advantage"):
    program = step_advantages_program(config.algo, config.tasks_per_iter, segments, config.salt,
                                      estimator_options(config))
    inputs = batching.estimator_inputs(batch, config, n_pad,
                                       None if merge is None else merge.ids)
  m = {}
  if critic:
    with times("values"):
      values = critic_values()
    with times("advantage"):
      seqs = batching.gae_sequences(batch, tb, config, row_multiple=data_size)
      inputs = inputs._replace(token_rewards=seqs.rewards, token_values=seqs.gather(values),
                               token_mask=seqs.mask, token_step_ids=seqs.step_ids)
  with times("advantage"):
    out = jax.block_until_ready(program(jax.tree.map(lambda x: put(x, mesh), inputs)))
  if critic:
    m.update(fill_critic_batch(tb, mbs, rows, seqs, values, out))
  host_before = multihost.to_host(out.before)[:nsteps]
  host_after = multihost.to_host(out.after)[:nsteps]
  with times("salt"):
    m.update(merge_metrics(batch, merge, host_before) if config.salt else NO_MERGE_METRICS)
  if inputs.anchor_ids is not None:  # GiGPO: steps whose state another step of the task shared
    anchors = inputs.anchor_ids[:nsteps]
    m["anchored_steps"] = int(np.sum(np.bincount(anchors)[anchors] > 1))
  return host_before, host_after, out.after, m


def minibatches(tb: batching.TokenBatch, rows: int, config,
                microbatched: bool = False) -> tuple[list[dict], list]:
  """Mini-batches of `rows` rows (padding rows have an all-False mask), each cut to the
  bucketed length of its own longest row: attention costs the square of the length, and one
  long trajectory (an ALFWorld heat task beside 4-step ones) would otherwise set it for all.

  Returns (mini-batches as dicts of host arrays, their plans): with `microbatched` (the
  update's micro-batches of `config.microbatch_rows`, each of its own length) each plan is
  `batching.microbatch_plan`'s, else None.
  """
  n = tb.input_ids.shape[0]
  out, plans = [], []
  micro = config.microbatch_rows or rows
  for s in range(0, n, rows):
    mask = tb.attention_mask[s:s + rows]
    length = batching.trimmed_length(mask, config.min_seq_len)
    mb = {f: getattr(tb, f)[s:s + rows, :length] for f in _MINIBATCH_FIELDS}
    # Only the trained tokens' log-probs are read: the rest are never projected to the vocab.
    mb["logit_positions"] = batching.logit_positions(mb["loss_mask"], config.min_seq_len)
    out.append(mb)
    plans.append(batching.microbatch_plan(mask[:, :length], micro, config.min_seq_len)
                 if microbatched else None)
  return out, plans


def score_minibatches(program, weights, mbs: list[dict], fields, frozen, mesh,
                      to_host: bool = True) -> list:
  """`program(weights, *mb[fields], frozen)` for every mini-batch, read back to the host
  (`to_host`) after all are dispatched, so the device never waits on the host."""
  res = [program(weights, *(put(mb[f], mesh) for f in fields), frozen) for mb in mbs]
  return [multihost.to_host(r) for r in res] if to_host else res


def recompute_old_logprobs(program, params, frozen, mbs: list[dict], mesh, *, engine: bool,
                           threshold: Optional[float]) -> dict:
  """Replaces each device mini-batch's old log-probs (the sampler's) with the policy's own
  (`program`, the log-prob program, under `params`), keeping the sampler's as
  `rollout_logprobs` for truncated IS (`threshold`: `rollout_is_threshold`).

  Returns the metrics: with a separate `engine` the mean |engine's - trainer's log-prob| over
  the trained tokens and KL(engine || trainer) per token, estimated on the engine's tokens with
  k3 = exp(r) - 1 - r, r = trainer's - engine's log-prob (unbiased, never negative: held at 0
  against rounding; r clipped to +-20 as verl's); with truncated IS the mean weight and the
  share of weights cut.
  """
  # per mini-batch, on device: sum |delta|, tokens, sum k3, sum of IS weights, weights cut
  sums = []
  passes = score_minibatches(program, params, mbs, LOGPROB_FIELDS, frozen, mesh, to_host=False)
  for mb, lp in zip(mbs, passes):
    mask = mb["loss_mask"].astype(bool)
    sampled = mb["old_logprobs"]
    r = jnp.clip(lp - sampled, -20.0, 20.0)
    row = [jnp.sum(jnp.where(mask, jnp.abs(lp - sampled), 0.0)), jnp.sum(mask),
           jnp.sum(jnp.where(mask, jnp.maximum(jnp.expm1(r) - r, 0.0), 0.0))]
    if threshold is not None:  # the update's IS weights, as `policy_loss` will apply them
      mb["rollout_logprobs"] = sampled
      w = rollout_is_weights(lp, sampled, mask, threshold)
      row += [jnp.sum(jnp.where(mask, w, 0.0)), jnp.sum(mask & (w >= threshold))]
    mb["old_logprobs"] = jnp.where(mask, lp, 0.0)
    sums.append(row)
  # One read for all (a collective when the batch spans several processes).
  totals = np.sum(multihost.to_host(jnp.stack([jnp.stack(r).astype(jnp.float32) for r in sums]))
                  .astype(np.float64), axis=0)
  m, count = {}, totals[1]
  if engine:
    m["engine_logprob_abs_diff"] = totals[0] / count if count else float("nan")
    m["engine_kl"] = totals[2] / count if count else float("nan")
  if threshold is not None:
    m["rollout_is/mean"] = totals[3] / count if count else float("nan")
    m["rollout_is/truncated_fraction"] = totals[4] / count if count else float("nan")
  return {k: float(v) for k, v in m.items()}


def critic_values(program, critic, frozen, mbs: list[dict], shape: tuple, rows: int,
                  mesh) -> np.ndarray:
  """f32[B, L] (`shape`, the token batch's) on the host: the critic's value at every position,
  mini-batch by mini-batch of `rows` rows (each cut to its own length, as `minibatches` cuts
  them)."""
  values = np.zeros(shape, np.float32)
  for i, r in enumerate(score_minibatches(program, critic, mbs, VALUE_FIELDS, frozen, mesh)):
    values[i * rows:(i + 1) * rows, :r.shape[1]] = r
  return values


def fill_critic_batch(tb, mbs, rows: int, seqs, values, out) -> dict:
  """Puts each token's advantage, return and old value (PPO) into the mini-batches; returns
  the critic's batch metrics: mean value and return over the trained tokens, and the share of
  the returns' variance the values explain (verl's vf_explained_var)."""
  shape = tb.input_ids.shape
  advantages = seqs.scatter(multihost.to_host(out.token_advantages), shape)
  returns = seqs.scatter(multihost.to_host(out.returns), shape)
  for i, mb in enumerate(mbs):
    cut, length = slice(i * rows, (i + 1) * rows), mb["input_ids"].shape[1]
    mb["advantages"] = advantages[cut, :length]
    mb["returns"] = returns[cut, :length]
    mb["old_values"] = values[cut, :length]
  mask = tb.loss_mask
  v, r = values[mask].astype(np.float64), returns[mask].astype(np.float64)
  explained = 1.0 - np.var(r - v) / np.var(r) if v.size > 1 and np.var(r) > 0 else float("nan")
  return {"critic/values_mean": float(v.mean()) if v.size else float("nan"),
          "critic/returns_mean": float(r.mean()) if r.size else float("nan"),
          "critic/explained_variance": float(explained)}
