"""One training state: what the update changes, what a checkpoint saves and what a resume restores.

  TrainState(params, opt_state, key, critic=None, critic_opt_state=None)   a pytree
  TrainState.checkpoint_tree() / TrainState.from_checkpoint_tree(tree)     the saved form
  create(config, model, mesh) -> StateSetup       the initial state, its optimizer, the reference
  build_programs(config, setup, rows)             the jitted log-prob, value and step programs
  update_step(programs, state, minibatch, step_adv, frozen, train_policy)  one optimizer step
  update(programs, state, minibatches, step_adv, key, frozen, epochs=...) -> (state, metrics)
      an iteration's steps over shuffled mini-batches, its metrics read once

As PureJaxRL's `runner_state` and MaxText's `train_state`: the trainer holds one `TrainState`, puts
it on the mesh, passes it to the update and gets a new one back, and saves it. `params` are the
trained parameters (all of them, or the LoRA adapters alone); the frozen rest (a LoRA base) is not
part of it: the policy module holds it once, it is never donated, differentiated or saved (its
fingerprints are), and it goes to every program beside the state.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from salt_jax import multihost
from salt_jax.advantages import ESTIMATORS
from salt_jax.critic import critic_optimizer, critic_programs, init_critic
from salt_jax.log import progress_bar
from salt_jax.models import lora
from salt_jax.sharding import on_mesh, replicated
from salt_jax.update import lr_schedule, microbatch_programs, optimizer, update_programs

logger = logging.getLogger(__name__)


class TrainState(NamedTuple):
  """The trained state of a run (a pytree of device arrays).

  params: the trained parameters (an nnx.State: every parameter, or the LoRA adapters).
  opt_state: their optimizer's state (its step count is the schedule's position).
  key: the run's PRNG key (typed), split at every iteration.
  critic, critic_opt_state: PPO's value model and its optimizer state; None without a critic.
  """

  params: Any
  opt_state: Any
  key: jax.Array
  critic: Any = None
  critic_opt_state: Any = None

  def checkpoint_tree(self) -> dict:
    """The saved form: a dict of arrays (the key as its raw data; no critic entries without
    one), the layout every checkpoint of the project has."""
    tree = {"params": self.params, "opt_state": self.opt_state,
            "key": jax.random.key_data(self.key)}
    if self.critic is not None:
      tree.update(critic=self.critic, critic_opt_state=self.critic_opt_state)
    return tree

  @classmethod
  def from_checkpoint_tree(cls, tree: dict) -> "TrainState":
    """The state `checkpoint_tree` saved."""
    return cls(tree["params"], tree["opt_state"], jax.random.wrap_key_data(tree["key"]),
               tree.get("critic"), tree.get("critic_opt_state"))


class UpdatePrograms(NamedTuple):
  """The jitted step programs `update_step` runs (`update.update_programs`' train_step and
  `critic.critic_programs`' critic_step; critic_step None without a critic; microbatch: the
  policy step as `update.microbatch_programs`, used instead of train_step when given)."""

  train_step: Callable
  critic_step: Optional[Callable] = None
  microbatch: Any = None


# The mini-batch fields the critic's step reads (its regression target and old values are its
# alone: the policy's step never sees them).
CRITIC_FIELDS = ("input_ids", "attention_mask", "positions", "loss_mask", "old_values", "returns")
_CRITIC_ONLY = ("old_values", "returns")
# Mini-batch fields whose second axis is not the sequence: a micro-batch takes their rows only.
ROW_FIELDS = ("logit_positions",)


def update_step(programs: UpdatePrograms, state: TrainState, minibatch: dict, step_adv,
                frozen=None, *, train_policy: bool = True,
                plan=None) -> tuple[TrainState, dict, dict]:
  """One mini-batch's optimizer steps on `state`: the critic's (with a critic), then the
  policy's (unless `train_policy` is False: the critic's warm-up).

  minibatch: dict of device arrays [rows, L] (`phases.minibatches`, filled by the log-prob and
    advantage phases; its `ROW_FIELDS` are [rows, K]); step_adv: the padded step advantages (a
    critic's per-token ones are in the mini-batch). Both programs donate what they update:
    `state`'s arrays are consumed.
  plan: with `programs.microbatch`, the mini-batch's micro-batches as [(row indices, length)]
    (`batching.microbatch_plan`): each is taken from the mini-batch on the device, cut to its
    length, and its gradient added; one optimizer step follows.
  Returns (new state, the policy step's metrics or {}, the critic step's metrics or {}); the
  metrics stay on the device (read them once per iteration).
  """
  critic, critic_opt, critic_out = state.critic, state.critic_opt_state, {}
  if programs.critic_step is not None and critic is not None:
    critic, critic_opt, critic_out = programs.critic_step(
        critic, critic_opt, {k: minibatch[k] for k in CRITIC_FIELDS}, frozen)
  params, opt_state, out = state.params, state.opt_state, {}
  if train_policy:
    policy_batch = {k: v for k, v in minibatch.items() if k not in _CRITIC_ONLY}
    if programs.microbatch is None:
      params, opt_state, out = programs.train_step(params, opt_state, policy_batch, step_adv,
                                                   frozen)
    else:
      if not plan:
        raise ValueError("micro-batch programs need the mini-batch's plan of micro-batches")
      micro = programs.microbatch
      parts = [{k: v[rows] if k in ROW_FIELDS else v[rows, :length]
                for k, v in policy_batch.items()} for rows, length in plan]
      sums = micro.grad_init(params, parts[0], step_adv, frozen)
      for part in parts:
        sums = micro.grad_add(sums, params, part, step_adv, frozen)
      params, opt_state, out = micro.apply_grads(params, opt_state, sums)
  return state._replace(params=params, opt_state=opt_state, critic=critic,
                        critic_opt_state=critic_opt), out, critic_out


# ------------------------------------------------------------------ building and updating the state

# The critic's update metrics (algo ppo), NaN in an iteration that took no critic step.
CRITIC_METRICS = ("value_loss", "value_clip_fraction", "value_mean", "critic_grad_norm")
# The policy step's metrics, NaN in an iteration that took no policy step.
POLICY_METRICS = ("loss", "grad_norm", "kl", "clip_fraction", "pg_loss", "ratio_mean",
                  "approx_kl_old", "entropy")


class StateSetup(NamedTuple):
  """What `create` builds from a policy module: the state and what is held beside it.

  graphdef: the policy's structure (`nnx.merge(graphdef, params, frozen)` is the policy).
  trainable: the nnx filter of `state.params` (`lora.trained_filter`).
  frozen: the rest of the policy (a LoRA base; empty without LoRA), never trained or saved.
  ref_params: a copy of the initial `params`: the KL reference.
  tx, schedule: the policy's optimizer and its learning-rate schedule; critic_tx the critic's
    (None without a critic).
  """

  state: TrainState
  graphdef: Any
  trainable: Any
  frozen: Any
  ref_params: Any
  tx: Any
  schedule: Callable
  critic_tx: Any = None


def create(config, model, mesh) -> StateSetup:
  """The initial state of a run of `config` over `model` (an nnx policy already on `mesh`).

  With PPO's estimator the critic is the policy's trained state copied with a new value head
  (`salt_jax.critic`) and its own optimizer; with LoRA its own adapters on the same frozen base.
  The key lives on the mesh like every other piece of state, so a checkpoint restores it there
  (a key on one device meets the params on all of them in the sampler); orbax saves only arrays
  on the global mesh in a multi-process run.
  """
  trainable = lora.trained_filter(model)
  graphdef, params, frozen = nnx.split(model, trainable, ...)
  # The reference is the initial policy: with LoRA the base with its initial adapters (B = 0,
  # the adapters off), so only the adapters are copied.
  ref_params = jax.tree.map(jnp.copy, params)
  schedule = lr_schedule(config)
  tx = optimizer(config, schedule)
  critic = critic_opt_state = critic_tx = None
  if ESTIMATORS[config.algo].critic:
    critic_tx = critic_optimizer(config)
    critic = on_mesh(init_critic(params, model.config.hidden_size,
                                 jax.random.key(config.seed + 1)), mesh)
    critic_opt_state = on_mesh(critic_tx.init(critic), mesh)
  key = jax.random.wrap_key_data(jax.device_put(
      jax.random.key_data(jax.random.key(config.seed)), replicated(mesh)))
  state = TrainState(params=params, opt_state=on_mesh(tx.init(params), mesh), key=key,
                     critic=critic, critic_opt_state=critic_opt_state)
  return StateSetup(state, graphdef, trainable, frozen, ref_params, tx, schedule, critic_tx)


def build_programs(config, setup: StateSetup, rows: int) -> tuple[Callable, Optional[Callable],
                                                             UpdatePrograms]:
  """The jitted programs over mini-batches of `rows` rows, compiled for `setup.state`'s
  shardings: (log-probs, the critic's values or None, the update's `UpdatePrograms`)."""
  def shard_of(tree):
    return jax.tree.map(lambda x: x.sharding, tree)

  st = setup.state
  logprobs, train_step = update_programs(config, setup.graphdef, setup.tx, rows,
                                         shard_of(st.params), shard_of(st.opt_state))
  values = critic_step = None
  if st.critic is not None:
    values, critic_step = critic_programs(config, setup.graphdef, setup.critic_tx, rows,
                                          shard_of(st.critic), shard_of(st.critic_opt_state))
  microbatch = None
  if config.microbatch_lengths == "own":
    microbatch = microbatch_programs(config, setup.graphdef, setup.tx, shard_of(st.params),
                                     shard_of(st.opt_state))
  return logprobs, values, UpdatePrograms(train_step, critic_step, microbatch)


def no_update_metrics(critic: bool) -> dict:
  """The update metrics of an iteration that took no optimizer step."""
  return {**{k: float("nan") for k in POLICY_METRICS}, "skipped_updates": 0, "num_updates": 0,
          **_critic_metrics([], critic)}


def _critic_metrics(outs: list[dict], critic: bool) -> dict:
  """The critic's update metrics, averaged over its finite steps (NaN without a critic step),
  and how many of its steps were skipped as not finite; {} without a critic."""
  if not critic:
    return {}
  kept = [o for o in outs if not bool(o["skipped"])]
  m = {k: float(np.mean([float(o[k]) for o in kept])) if kept else float("nan")
       for k in CRITIC_METRICS}
  return {**m, "critic_skipped_updates": len(outs) - len(kept)}


def update(programs: UpdatePrograms, state: TrainState, minibatches: list[dict], step_adv, key,
           frozen=None, *, epochs: int = 1, plans: Optional[list] = None,
           train_policy: bool = True, progress: bool = False) -> tuple[TrainState, dict]:
  """An iteration's optimizer steps: `epochs` passes of `update_step` over the mini-batches
  (device arrays) that hold a trained token, in a fresh order each pass
  (`jax.random.permutation` of `key`).

  Returns the new state and the metrics: the policy step's averaged over its finite steps (a
  NaN/inf mini-batch is skipped by the step and not averaged), `num_updates` (optimizer steps
  taken), `skipped_updates`, and with a critic its own (`CRITIC_METRICS`,
  `critic_skipped_updates`). The metrics are read from the device once, after the last step, so
  no mini-batch waits for the host.
  """
  live = np.flatnonzero(multihost.to_host(jnp.stack([jnp.any(mb["loss_mask"])
                                                     for mb in minibatches]))
                        if minibatches else [])
  perms = multihost.to_host(jax.vmap(lambda k: jax.random.permutation(k, len(live)))(
      jax.random.split(key, epochs)))
  order = [int(live[j]) for perm in perms for j in perm]
  plans = plans or [None] * len(minibatches)
  outs, critic_outs = [], []
  with progress_bar(order, desc="update", enabled=progress, unit="batch") as bar:
    for i in bar:
      state, out, critic_out = update_step(programs, state, minibatches[i], step_adv, frozen,
                                           train_policy=train_policy, plan=plans[i])
      if critic_out:
        critic_outs.append(critic_out)
      if out:
        outs.append(out)
  outs, critic_outs = jax.device_get((outs, critic_outs))
  critic_m = _critic_metrics(critic_outs, state.critic is not None)
  sums: dict[str, float] = {}
  n = skipped = 0
  for i, out in zip(order, outs):
    logger.debug("update: mini-batch %d, loss %.4f%s", i, float(out.get("loss", np.nan)),
                 " (skipped: not finite)" if bool(out["skipped"]) else "")
    if bool(out["skipped"]):
      skipped += 1
      continue
    n += 1
    for k, v in out.items():
      if k != "skipped":
        sums[k] = sums.get(k, 0.0) + float(v)
  if not n:
    return state, {**no_update_metrics(state.critic is not None), "skipped_updates": skipped,
                   **critic_m}
  return state, {**{k: v / n for k, v in sums.items()}, "skipped_updates": skipped,
                 "num_updates": n, **critic_m}
