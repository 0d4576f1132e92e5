"""PPO's learned critic: the policy's trunk with a scalar value head, and its two device programs.

The critic is what verl and Tunix build: a model of the policy's architecture, started from the
same weights (verl-agent's `critic.model.path` is the actor's), whose vocabulary head is replaced
by one linear output. Its parameters are a plain pytree

  {"trunk": the trained part of the policy's state (every parameter, or with LoRA the adapters),
   "head": {"kernel": f32[D], "bias": f32[]}}

merged into the policy's graph. With LoRA the critic's trunk is its own adapters on the policy's
frozen base (passed in as `frozen`, held once): a LoRA critic costs adapters, not a second model.
The vocabulary head of a full trunk copy is never read (values come from the hidden states).

  init_critic(params, hidden_size, key)                     -> critic params
  critic_values(graphdef, critic, ids, mask, positions, frozen) -> f32[B, L] values
  critic_programs(config, graphdef, tx, rows, shardings...) -> (values, critic_step), jitted
  critic_optimizer(config)                                  -> AdamW at config.critic_lr

A value is read where the policy's log-prob of a token is: at the position that predicts it (the
logits-aligned layout of `salt_jax.batching`), so V_t is the value of the state before token t.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from salt_jax.accumulate import microbatched_rows, microbatched_value_and_grad
from salt_jax.loss import ValueLossMetrics, aggregate_weight, value_loss
from salt_jax.update import finite_update


def init_critic(params, hidden_size: int, key: jax.Array) -> dict:
  """The critic's parameters at the start of a run: a copy of `params` (the policy's trained
  state: the same starting weights, as verl-agent's critic) and a new value head, its kernel
  N(0, 0.02^2) as Hugging Face initialises a token-classification head, its bias 0, float32."""
  head = {"kernel": 0.02 * jax.random.normal(key, (hidden_size,), jnp.float32),
          "bias": jnp.zeros((), jnp.float32)}
  return {"trunk": jax.tree.map(jnp.copy, params), "head": head}


def critic_values(graphdef, critic: dict, input_ids, attention_mask, positions, frozen=None):
  """f32[B, L]: the critic's value at every position (0 on padding)."""
  trunk = critic["trunk"]
  model = nnx.merge(graphdef, trunk) if frozen is None else nnx.merge(graphdef, trunk, frozen)
  hidden = model.hidden_states(input_ids, attention_mask=attention_mask, positions=positions)
  head = critic["head"]
  values = jnp.einsum("bld,d->bl", hidden.astype(jnp.float32), head["kernel"]) + head["bias"]
  return jnp.where(jnp.asarray(attention_mask).astype(bool), values, 0.0)


def critic_optimizer(config) -> optax.GradientTransformation:
  """AdamW at the constant `config.critic_lr` after global-norm clipping at
  `config.max_grad_norm` (verl's critic: constant lr 1e-5 in verl-agent, grad clip 1.0)."""
  return optax.chain(optax.clip_by_global_norm(config.max_grad_norm),
                     optax.adamw(config.critic_lr, weight_decay=config.weight_decay))


def critic_programs(config, graphdef, tx: optax.GradientTransformation, rows: int,
                    critic_shardings, opt_shardings):
  """The critic's two jitted programs over the policy `graphdef` (`update.update_programs`'s
  counterparts).

  Returns (values, critic_step):
    values(critic, input_ids, attention_mask, positions, frozen=None) -> f32[rows, L], in
      passes of `config.logprob_microbatch_rows` rows (default `config.microbatch_rows`).
    critic_step(critic, opt_state, mb, frozen=None) -> (critic, opt_state, metrics): one step of
      the clipped value loss (`loss.value_loss`, `config.value_clip`, aggregated as
      `config.loss_agg`) on mini-batch `mb` (input_ids, attention_mask, positions, loss_mask,
      old_values, returns: [rows, L]), micro-batched per `config.microbatch_rows`; donated, and
      left unchanged (metrics['skipped'] set) when the loss or gradient is not finite.
  """
  def batch_values(critic, mb, frozen):
    return critic_values(graphdef, critic, mb["input_ids"], mb["attention_mask"],
                         mb["positions"], frozen)

  value_rows = config.logprob_microbatch_rows or config.microbatch_rows
  values_in_passes = microbatched_rows(batch_values, rows // value_rows if value_rows else 1)

  def values(critic, ids, am, pos, frozen=None):
    return values_in_passes(critic, dict(input_ids=ids, attention_mask=am, positions=pos), frozen)

  def loss_fn(critic, mb, frozen):
    v = batch_values(critic, mb, frozen)
    return value_loss(v, mb["old_values"], mb["returns"], mb["loss_mask"],
                      value_clip=config.value_clip, loss_agg=config.loss_agg)

  def weight(mb):
    return aggregate_weight(mb["loss_mask"], config.loss_agg)

  def metric_weights(mb):
    tokens = aggregate_weight(mb["loss_mask"], "token-mean")
    return ValueLossMetrics(value_loss=weight(mb), value_clip_fraction=tokens, value_mean=tokens)

  micro = rows // config.microbatch_rows if config.microbatch_rows else 1
  grad_fn = microbatched_value_and_grad(loss_fn, micro, has_aux=True, weight_fn=weight,
                                        aux_weight_fn=metric_weights)

  def critic_step(critic, opt_state, mb, frozen=None):
    (loss, m), grads = grad_fn(critic, mb, frozen)
    critic, opt_state, gnorm, ok = finite_update(tx, grads, opt_state, critic, loss)
    out = dict(value_loss=m.value_loss, value_clip_fraction=m.value_clip_fraction,
               value_mean=m.value_mean, critic_grad_norm=gnorm, skipped=~ok)
    return critic, opt_state, out

  return jax.jit(values), jax.jit(critic_step, donate_argnums=(0, 1),
                                  out_shardings=(critic_shardings, opt_shardings, None))
