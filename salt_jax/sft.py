"""Behaviour cloning (SFT) warm start on expert / walkthrough demonstrations.

A small policy trained from scratch never writes `<action>` tags, so every step is invalid, every
reward equal and every group advantage zero: RL has nothing to learn from. Cloning the environment's
expert first fixes the format (and some of the play), and is the paper's SFT baseline.

Demonstrations are rendered exactly as the agent loop renders its prompts
(`salt_jax.agent.Prompter`, whole-history or windowed), with the response
`<think></think><action>{a}</action>`: the tokens the policy must learn to write, ending where the
rollout's stop string `</action>` ends generation. The demonstrations carry no reasoning.
The loss is the token-mean negative log-likelihood of the response tokens only.
"""

from __future__ import annotations

import dataclasses
import zlib
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from envs.base import Task
from salt_jax import batching
from salt_jax.agent.prompts import PromptConfig, Prompter
from salt_jax.logprobs import token_logprobs

RESPONSE_FORMAT = "<think></think><action>{action}</action>"


@dataclasses.dataclass(frozen=True)
class Demo:
  """One expert episode: `steps[t] = (observation seen, admissible actions, action taken)`."""

  task: Task
  first_observation: str
  first_admissible: Optional[tuple[str, ...]]
  actions: tuple[str, ...]
  observations: tuple[str, ...]  # the env's reply to each action
  admissible: tuple[Optional[tuple[str, ...]], ...]  # admissible after each action
  won: bool


def play_expert(env, task: Task, seed: int = 0, max_steps: int = 50, *, epsilon: float = 0.0,
                rng: Optional[np.random.Generator] = None) -> Demo:
  """Plays `task` with the environment's expert (or `optimal_actions` where the env has one).

  epsilon: the chance, at each step, of a uniformly drawn admissible action in place of the
    expert's (a noisy expert; the expert then replans from where that led, so the env needs
    `expert_action()`). Cloning such episodes gives a weaker warm start, one that knows the format
    and the admissible actions of each state but picks the right one only part of the time: room
    for RL to raise success. rng draws the deviations (default: seeded by `seed` and the task id).
  """
  if not 0.0 <= epsilon <= 1.0:
    raise ValueError(f"epsilon must be in [0, 1], got {epsilon}")
  if epsilon > 0 and not hasattr(env, "expert_action"):
    raise ValueError("epsilon > 0 needs an env with expert_action() (the expert replans)")
  if rng is None:
    rng = np.random.default_rng([int(seed), zlib.crc32(task.task_id.encode("utf-8"))])
  first = env.reset(task, seed)
  plan = (iter(env.optimal_actions(task))
          if epsilon == 0 and hasattr(env, "optimal_actions") else None)
  actions, obs, adm, won = [], [], [], False
  admissible = first.admissible_actions
  for _ in range(max_steps):
    if epsilon > 0 and admissible and rng.random() < epsilon:
      a = admissible[int(rng.integers(len(admissible)))]
    else:
      a = next(plan, None) if plan is not None else env.expert_action()
    if a is None:
      break
    r = env.step(a)
    actions.append(a)
    obs.append(r.observation)
    adm.append(r.admissible_actions)
    admissible = r.admissible_actions
    won = won or r.won
    if r.done:
      break
  return Demo(task, first.observation, first.admissible_actions, tuple(actions), tuple(obs),
              tuple(adm), won)


def collect_demos(env, tasks: Sequence[Task], seeds: Sequence[int] = (0,),
                  max_steps: int = 50, only_won: bool = True, epsilon: float = 0.0) -> list[Demo]:
  """Expert episodes for every (task, seed); the seed may change the prompt (listing order) and
  draws a noisy expert's deviations (`epsilon`, see `play_expert`; keep only_won=False there, or
  the kept episodes are biased towards the lucky ones)."""
  demos = [play_expert(env, t, s, max_steps, epsilon=epsilon) for t in tasks for s in seeds]
  return [d for d in demos if d.won or not only_won]


def demo_texts(demos: Sequence[Demo]) -> list[str]:
  """Every observation and admissible-action list of the episodes (a tokenizer's corpus; the
  expert's actions are among the admissible ones)."""
  texts = []
  for d in demos:
    texts += [d.first_observation, " ".join(d.first_admissible or ()), *d.observations]
    texts += [" ".join(a or ()) for a in d.admissible]
  return texts


def demo_steps(demos: Sequence[Demo], tokenizer, prompt_config: PromptConfig = PromptConfig(),
               response_format: str = RESPONSE_FORMAT) -> tuple[list, list, np.ndarray]:
  """Per-step (prompt ids, response ids) as the agent loop would have produced them.

  Returns:
    (prompt_ids [int32[P_k]], response_ids [int32[R_k]], step_traj_ids int32[N]), steps in
    trajectory-major order.
  """
  prompter = Prompter(tokenizer, prompt_config)
  prompts, responses, trajs = [], [], []
  for i, d in enumerate(demos):
    conv = prompter.start(d.first_observation, d.first_admissible)
    for t, a in enumerate(d.actions):
      resp = prompter.encode(response_format.format(action=a))
      prompts.append(np.asarray(conv.prompt_ids, np.int32))
      responses.append(np.asarray(resp, np.int32))
      trajs.append(i)
      if t + 1 < len(d.actions):
        conv.advance(resp, a, d.observations[t], d.admissible[t])
  return prompts, responses, np.asarray(trajs, np.int32)


def demo_token_batch(demos: Sequence[Demo], tokenizer, *, pad_id: int,
                     prompt_config: PromptConfig = PromptConfig(), layout: str = "trajectory",
                     response_format: str = RESPONSE_FORMAT, **kwargs) -> batching.TokenBatch:
  """The demonstrations as a `TokenBatch` (loss mask = the response tokens), in either layout."""
  if layout not in ("trajectory", "step"):
    raise ValueError(f"layout must be 'trajectory' or 'step', got {layout!r}")
  prompts, responses, trajs = demo_steps(demos, tokenizer, prompt_config, response_format)
  zeros = [np.zeros(len(r), np.float32) for r in responses]
  if layout == "trajectory":
    return batching.trajectory_sequences(prompts, responses, zeros, trajs, pad_id=pad_id, **kwargs)
  return batching.step_rows(prompts, responses, zeros, pad_id=pad_id, step_traj_ids=trajs,
                            **kwargs)


def _nll(model, input_ids, targets, loss_mask, attention_mask, positions, chunk_size):
  """Token-mean NLL over loss_mask. All arrays [B, L]."""
  logp = token_logprobs(model, input_ids, targets, attention_mask, positions=positions,
                        chunk_size=chunk_size)
  m = loss_mask.astype(jnp.float32)
  return -jnp.sum(logp * m) / jnp.maximum(jnp.sum(m), 1.0)


def _rows(batch: batching.TokenBatch, idx: np.ndarray, min_length: int) -> tuple:
  """Rows idx of the batch, cut to the bucketed length of their longest (`trimmed_length`)."""
  length = batching.trimmed_length(batch.attention_mask[idx], min_length)
  return tuple(a[idx, :length] for a in (batch.input_ids, batch.targets, batch.loss_mask,
                                          batch.attention_mask, batch.positions))


def _epoch_order(rng: np.random.Generator, live: np.ndarray, lengths: np.ndarray, rows: int,
                 group_by_length: bool) -> list[int]:
  """One epoch of row indices, each of `live` once; consecutive `rows` make a draw.

  group_by_length: as Hugging Face's Trainer does, shuffle, sort each run of 16 draws' rows by
  length (longest first) and shuffle the order of the full draws, so a draw's rows have similar
  lengths and little padding (a trailing partial draw stays last and fills from the next epoch).
  """
  perm = rng.permutation(live)
  if not group_by_length:
    return perm.tolist()
  mega = rows * 16
  runs = [perm[s:s + mega] for s in range(0, len(perm), mega)]
  ordered = np.concatenate([r[np.argsort(-lengths[r], kind="stable")] for r in runs])
  full = len(ordered) // rows
  draws = [ordered[i * rows:(i + 1) * rows] for i in rng.permutation(full)]
  return np.concatenate(draws + [ordered[full * rows:]]).tolist()


def nll(model, batch: batching.TokenBatch, *, rows_per_call: int = 16, chunk_size: int = 256,
        min_length: int = 64) -> float:
  """Mean NLL (nats per response token) of `batch` under `model` (a `CausalLM`); each call's rows
  cut to their own bucketed length (at least min_length)."""
  graphdef, state = nnx.split(model)

  @jax.jit
  def sums(state, ids, tg, lm, am, pos):
    m = nnx.merge(graphdef, state)
    logp = token_logprobs(m, ids, tg, am, positions=pos, chunk_size=chunk_size)
    w = lm.astype(jnp.float32)
    return -jnp.sum(logp * w), jnp.sum(w)

  total = count = 0.0
  n = batch.input_ids.shape[0]
  for s in range(0, n, rows_per_call):
    idx = np.arange(s, s + rows_per_call) % n  # wrap-around fill keeps one shape; masked below
    ids, tg, lm, am, pos = _rows(batch, idx, min_length)
    lm = lm & (np.arange(s, s + rows_per_call) < n)[:, None]
    a, c = sums(state, ids, tg, lm, am, pos)
    total += float(a)
    count += float(c)
  return total / max(count, 1.0)


@dataclasses.dataclass(frozen=True)
class SFTConfig:
  """steps: optimizer steps; rows: sequences per step; lr, weight_decay, max_grad_norm: AdamW.

  Each draw is cut to the bucketed length of its longest row (at least min_length).
  group_by_length: draw rows of similar lengths together (`_epoch_order`); off by default, since it
  changes which rows share a step.
  """

  steps: int = 200
  rows: int = 8
  lr: float = 3e-3
  weight_decay: float = 0.0
  max_grad_norm: float = 1.0
  warmup_steps: int = 10
  seed: int = 0
  chunk_size: int = 256
  min_length: int = 64
  group_by_length: bool = False

  def __post_init__(self):
    if self.steps < 1 or self.rows < 1 or self.min_length < 1:
      raise ValueError(f"SFTConfig.steps, rows and min_length must be >= 1, got {self.steps}, "
                       f"{self.rows}, {self.min_length}")
    if not self.lr > 0:
      raise ValueError(f"SFTConfig.lr must be > 0, got {self.lr}")


def behaviour_clone(model, batch: batching.TokenBatch, config: SFTConfig = SFTConfig(),
                    log_every: int = 0) -> list[float]:
  """Trains `model` (a `CausalLM`, updated in place) to maximize the demo responses' likelihood.

  Rows are drawn without replacement per epoch (numpy RNG from config.seed), `config.rows` a step.
  Returns the training loss of every step.
  """
  if batch.num_loss_tokens == 0:
    raise ValueError("the demonstration batch has no response tokens to clone")
  sched = optax.warmup_cosine_decay_schedule(0.0, config.lr, max(config.warmup_steps, 1),
                                             max(config.steps, config.warmup_steps + 1))
  tx = optax.chain(optax.clip_by_global_norm(config.max_grad_norm),
                   optax.adamw(sched, weight_decay=config.weight_decay))
  graphdef, state = nnx.split(model)
  opt_state = tx.init(state)

  @jax.jit
  def step(state, opt_state, ids, tg, lm, am, pos):
    def loss_fn(s):
      return _nll(nnx.merge(graphdef, s), ids, tg, lm, am, pos, config.chunk_size)
    loss, grads = jax.value_and_grad(loss_fn)(state)
    updates, opt_state = tx.update(grads, opt_state, state)
    return optax.apply_updates(state, updates), opt_state, loss

  # Only rows with response tokens; the last draw of an epoch fills from the next, so every step
  # has `rows` rows (one compiled shape per length bucket).
  live = np.flatnonzero(batch.loss_mask.any(axis=1))
  lengths = batch.attention_mask.sum(axis=1)
  rng = np.random.default_rng(config.seed)
  order: list[int] = []
  losses = []
  for i in range(config.steps):
    while len(order) < config.rows:
      order.extend(_epoch_order(rng, live, lengths, config.rows, config.group_by_length))
    idx, order = np.asarray(order[:config.rows]), order[config.rows:]
    state, opt_state, loss = step(state, opt_state, *_rows(batch, idx, config.min_length))
    losses.append(float(loss))
    if log_every and (i + 1) % log_every == 0:
      print(f"sft step {i + 1}/{config.steps} nll={losses[-1]:.4f}", flush=True)
  nnx.update(model, state)
  return losses
