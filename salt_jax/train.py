"""The training iteration: rollout -> step advantages -> SALT -> PPO-clip updates.

One `Trainer.iteration()` does, in order (each phase timed, as in the paper's cost breakdown):

  rollout      `rollout.collect`: G trajectories for each of `tasks_per_iter` tasks, one row per
               step. Failed (crashed) trajectories are counted and dropped.
  advantage    grpo / rloo / drgrpo over the step rows of each group: each row's reward
               (`RolloutBatch.row_rewards`: the trajectory's outcome, or verl-agent's episode
               reward minus the row's own penalty) against its group's statistics (over one row
               per trajectory, or over all step rows: `group_stats`).
  salt         (SALT on) `build_merge_ids` on the host over `trajectories_for_salt()`, `refine`
               on the device; step advantages -> per-token advantages via `token_advantages`.
  old_logprob  from the sampler (`policy_logprobs`), or recomputed with the current params
               (`recompute_old_logprobs`).
  ref_logprob  log-probs under the frozen initial policy (the KL reference).
  update       PPO-clip (+ KL to the reference) over shuffled mini-batches, AdamW with global-norm
               clipping and a warmup + constant / cosine schedule. A mini-batch whose loss or
               gradient is not finite is skipped (params and optimizer state untouched) and counted.
               When every step advantage is 0 there is nothing to learn: the log-prob and update
               phases are skipped (`num_updates` 0).

then logs metrics (`metrics.jsonl`, TensorBoard) and saves an orbax checkpoint (params, optimizer
state, reference params, PRNG key, task sampler position, iteration). A checkpoint is complete or
absent (orbax writes a temporary folder and renames it), and the log is cut back to the restored
iteration on resume, so a run killed at any moment resumes as if it had never stopped; the save
time is logged with the next iteration (`time/checkpoint`). A resume puts every array on this
run's mesh (of any shape), refuses changed settings before any work (`salt_jax.checkpoint`), and
passes over a damaged checkpoint (unreadable, or arrays that differ from their saved
fingerprints) for the previous one. SALT on or off changes only the advantages: the PRNG stream,
task order, env seeds and every other computation are the same.

With several processes (`TrainConfig.distributed`, `salt_jax.multihost`) each plays its share of
the tasks and every later phase runs on the gathered global batch, on a mesh over all processes.

Shapes are bucketed so each jitted function compiles once per bucket: trajectories are padded to
tasks_per_iter * G, steps and merged-edge counts to powers of two, token rows to `minibatch_rows`
and their length to a power of two or 1.5 times one (`batching.bucket_length`).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import math
import os
import time
import warnings
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding

import salt_jax
from salt_jax import batching
from salt_jax import checkpoint
from salt_jax import metrics as metrics_lib
from salt_jax import log as log_lib
from salt_jax import multihost
from salt_jax.agent.prompts import env_prompt_config
from salt_jax.logprobs import token_logprobs, token_logprobs_and_entropy
from salt_jax.loss import aggregate
from salt_jax.recipes import RECIPES
from salt_jax.rollout import GROUP_STATS, INVALID_STEP_MODES, PENALTY_SCOPES, SamplingParams, collect
from salt_jax.sharding import DATA_AXIS, batch_sharding, make_mesh, parse_mesh_shape, replicated

ALGOS = ("grpo", "rloo", "drgrpo")
SCHEDULES = ("constant", "cosine")
LAYOUTS = ("trajectory", "step")
ENV_EVAL_SPLITS = {"alfworld": ("valid_seen", "valid_unseen"), "textworld": ("heldout",),
                   "toy": ("eval",), "webshop": ("test",)}
PARAM_DTYPES = ("float32", "bfloat16")
ENV_TRAIN_SPLIT = {"alfworld": "valid_train", "textworld": "train", "toy": "train",
                   "webshop": "train"}

# SALT's metrics in an iteration without merges (SALT off, or no step to merge).
NO_MERGE_METRICS = dict(merge_rate=float("nan"), cross_prompt_merges=0, gradient_changing_merges=0,
                        merged_steps=0, gradient_changing_share=float("nan"))

# The default small policy: Qwen2 architecture, random init, the tokenizer's vocabulary.
TINY_POLICY = dict(hidden_size=64, intermediate_size=256, num_layers=2, num_heads=4,
                   num_kv_heads=2, head_dim=16, tie_word_embeddings=True)


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """Everything one run needs; `validate()` checks it before any work.

  Environment: env ('alfworld', 'textworld', 'toy', 'webshop'), env_kwargs, train_split /
    eval_splits (None: the env's defaults), num_train_tasks (None: all), num_eval_tasks,
    eval_every (0: off), env_workers (0: in-process), max_steps.
  Policy: model (a local Hugging Face folder; None: the tiny random Qwen2 `TINY_POLICY`),
    tokenizer ('qwen25': the offline Qwen2.5 tokenizer; 'toy': `toy_chat_tokenizer`; or a local
    folder; a model folder brings its own), tiny_policy (overrides of TINY_POLICY), init_params
    (an orbax folder of params to start from, e.g. an SFT warm start), param_dtype (parameters and
    compute of a `model` checkpoint: 'float32' by default, since AdamW's small steps round away
    on bf16 weights; or 'bfloat16').
  Rollout: group_size G, tasks_per_iter, max_new_tokens, temperature, top_p, top_k,
    history_window (None: whole conversation), max_cache_len, prompt_bucket_min (smallest sampler
    prompt bucket), invalid_action_penalty, invalid_step ('admissible': the parser or the env
    rejects the action; 'format': verl-agent's, no parsable action).
  Advantages: algo ('grpo', 'rloo', 'drgrpo'), reward_scale (times the env's return),
    penalty_scope ('trajectory': the invalid-action penalty folded into the trajectory's reward;
    'step': on the invalid step's own row, verl-agent's), group_stats ('trajectories': one vote
    per trajectory; 'steps': over the group's step rows, verl-agent's), salt, history (h),
    embedder (None / 'minilm' / a local sentence-transformers folder), embed_threshold.
    `salt_jax.recipes` holds named sets of these (`from_recipe`).
  Update: layout ('trajectory': one sequence per trajectory; 'step': one row per step),
    recompute_old_logprobs, lr, weight_decay, warmup_steps, schedule, max_grad_norm, clip_eps,
    clip_eps_high, dual_clip, kl_coef, kl_estimator, loss_agg, ppo_epochs, minibatch_rows,
    microbatch_rows (0: a mini-batch in one forward and backward pass; else rows per pass, the
    gradients accumulated to the mini-batch's: a divisor of minibatch_rows and a multiple of the
    mesh's data axis), min_seq_len, logprob_chunk.
  Run: iters, seed, mesh ('DxM'), out, resume, checkpoint_every, max_to_keep, tensorboard,
    progress.
  Processes (`salt_jax.multihost`): distributed (join several processes with
    `jax.distributed.initialize`; coordinator 'host:port', num_processes and process_id, each
    None: auto-detected from a TPU pod's / SLURM's environment). Each process plays its share of
    the tasks; the mesh spans all processes' devices; only process 0 writes logs.
  """

  env: str = "alfworld"
  env_kwargs: dict = dataclasses.field(default_factory=dict)
  train_split: Optional[str] = None
  eval_splits: Optional[tuple] = None
  num_train_tasks: Optional[int] = None
  num_eval_tasks: int = 8
  eval_every: int = 0
  env_workers: int = 1
  max_steps: int = 50

  model: Optional[str] = None
  tokenizer: str = "qwen25"
  tiny_policy: dict = dataclasses.field(default_factory=dict)
  init_params: Optional[str] = None
  param_dtype: str = "float32"

  group_size: int = 8
  tasks_per_iter: int = 16
  max_new_tokens: int = 256
  temperature: float = 1.0
  top_p: float = 1.0
  top_k: int = 0
  history_window: Optional[int] = None
  max_cache_len: int = 8192
  prompt_bucket_min: int = 128
  invalid_action_penalty: float = 0.1
  invalid_step: str = "admissible"

  algo: str = "grpo"
  reward_scale: float = 1.0
  penalty_scope: str = "trajectory"
  group_stats: str = "trajectories"
  salt: bool = True
  history: int = 3
  embedder: Optional[str] = None
  embed_threshold: float = 0.8

  layout: str = "trajectory"
  recompute_old_logprobs: bool = False
  lr: float = 1e-6
  weight_decay: float = 0.01
  warmup_steps: int = 0
  schedule: str = "constant"
  max_grad_norm: float = 1.0
  clip_eps: float = 0.2
  clip_eps_high: Optional[float] = None
  dual_clip: Optional[float] = None
  kl_coef: float = 0.01
  kl_estimator: str = "k3"
  loss_agg: str = "token-mean"
  ppo_epochs: int = 1
  minibatch_rows: int = 8
  microbatch_rows: int = 0
  min_seq_len: int = 64
  logprob_chunk: int = 256

  iters: int = 100
  seed: int = 0
  mesh: str = "1x1"
  out: str = "runs/default"
  resume: bool = False
  checkpoint_every: int = 1
  max_to_keep: int = 2
  tensorboard: bool = True
  progress: bool = True

  distributed: bool = False
  coordinator: Optional[str] = None
  num_processes: Optional[int] = None
  process_id: Optional[int] = None

  def validate(self) -> None:
    """Raises ValueError naming the first bad field (called before any work)."""
    def need(ok, msg):
      if not ok:
        raise ValueError(msg)
    def pos_int(name, lo=1):
      v = getattr(self, name)
      need(isinstance(v, int) and not isinstance(v, bool) and v >= lo,
           f"{name} must be an int >= {lo}, got {v!r}")
    need(self.env in ENV_TRAIN_SPLIT, f"unknown env {self.env!r}; known: {sorted(ENV_TRAIN_SPLIT)}")
    need(self.algo in ALGOS, f"unknown algo {self.algo!r}; expected one of {ALGOS}")
    need(self.schedule in SCHEDULES, f"unknown schedule {self.schedule!r}; expected {SCHEDULES}")
    need(self.layout in LAYOUTS, f"unknown layout {self.layout!r}; expected one of {LAYOUTS}")
    need(self.kl_estimator in salt_jax.loss.KL_ESTIMATORS,
         f"unknown kl_estimator {self.kl_estimator!r}")
    need(self.loss_agg in salt_jax.loss.LOSS_AGG_MODES, f"unknown loss_agg {self.loss_agg!r}")
    for name in ("group_size", "tasks_per_iter", "max_steps", "max_new_tokens", "history",
                 "iters", "ppo_epochs", "minibatch_rows", "min_seq_len", "logprob_chunk",
                 "checkpoint_every", "max_to_keep", "num_eval_tasks", "prompt_bucket_min"):
      pos_int(name)
    for name in ("env_workers", "eval_every", "warmup_steps", "top_k", "seed", "microbatch_rows"):
      pos_int(name, 0)
    need(self.group_size >= 2,
         f"group_size {self.group_size} gives {self.algo} no baseline: each trajectory is its "
         "own group, so every advantage is 0 and nothing is learned; use group_size >= 2")
    need(self.microbatch_rows == 0 or self.minibatch_rows % self.microbatch_rows == 0,
         f"microbatch_rows ({self.microbatch_rows}) must divide minibatch_rows "
         f"({self.minibatch_rows})")
    need(self.max_cache_len > self.max_new_tokens + 16,
         f"max_cache_len ({self.max_cache_len}) must exceed max_new_tokens "
         f"({self.max_new_tokens}) + 16 to leave room for a prompt")
    need(math.isfinite(self.lr) and self.lr > 0, f"lr must be > 0, got {self.lr}")
    need(self.kl_coef >= 0, f"kl_coef must be >= 0, got {self.kl_coef}")
    need(self.param_dtype in PARAM_DTYPES,
         f"param_dtype must be one of {PARAM_DTYPES}, got {self.param_dtype!r}")
    need(self.clip_eps > 0, f"clip_eps must be > 0, got {self.clip_eps}")
    need(self.temperature > 0, f"temperature must be > 0, got {self.temperature}")
    need(0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}")
    need(self.invalid_action_penalty >= 0, "invalid_action_penalty must be >= 0")
    need(self.invalid_step in INVALID_STEP_MODES,
         f"invalid_step must be one of {INVALID_STEP_MODES}, got {self.invalid_step!r}")
    need(self.penalty_scope in PENALTY_SCOPES,
         f"penalty_scope must be one of {PENALTY_SCOPES}, got {self.penalty_scope!r}")
    need(self.group_stats in GROUP_STATS,
         f"group_stats must be one of {GROUP_STATS}, got {self.group_stats!r}")
    need(math.isfinite(self.reward_scale) and self.reward_scale > 0,
         f"reward_scale must be > 0, got {self.reward_scale}")
    need(self.embedder in (None, "none", "minilm") or os.path.isdir(self.embedder),
         f"embedder must be None, 'minilm' or a local sentence-transformers folder, got "
         f"{self.embedder!r}")
    need(0 < self.embed_threshold <= 1, f"embed_threshold must be in (0, 1], got "
         f"{self.embed_threshold}")
    need(self.history_window is None or self.history_window >= 0,
         f"history_window must be None or >= 0, got {self.history_window}")
    need(not (self.layout == "trajectory" and self.history_window is not None),
         "layout 'trajectory' (one sequence per trajectory) needs whole-history prompts; "
         "use layout='step' with a history_window")
    need(self.model is None or os.path.isdir(self.model),
         f"--model {self.model!r} is not a local folder (Hugging Face hub ids are not fetched)")
    need(self.init_params is None or os.path.isdir(self.init_params),
         f"init_params {self.init_params!r} is not a folder")
    need(self.model is not None or self.tokenizer in ("qwen25", "toy")
         or os.path.isdir(self.tokenizer),
         f"tokenizer must be 'qwen25', 'toy' or a local folder, got {self.tokenizer!r}")
    parse_mesh_shape(self.mesh)  # the string; whether the devices exist is checked at setup
    if self.coordinator is not None or self.num_processes is not None \
        or self.process_id is not None:
      need(self.distributed, "coordinator / num_processes / process_id need distributed=True")
    multihost.check_coordinator(self.coordinator)
    if self.num_processes is not None:
      pos_int("num_processes")
      need(self.process_id is None or (isinstance(self.process_id, int)
                                       and 0 <= self.process_id < self.num_processes),
           f"process_id must be in [0, {self.num_processes}), got {self.process_id!r}")

  def to_json(self) -> dict:
    return json.loads(json.dumps(dataclasses.asdict(self), default=str))

  @classmethod
  def from_recipe(cls, name: str, **overrides) -> "TrainConfig":
    """The config of `salt_jax.recipes.RECIPES[name]`, with `overrides` on top."""
    if name not in RECIPES:
      raise ValueError(f"unknown recipe {name!r}; known: {sorted(RECIPES)}")
    return cls(**{**RECIPES[name], **overrides})


logger = logging.getLogger(__name__)

# ----------------------------------------------------------------------------- task sampling


class TaskSampler:
  """Training tasks in a seeded random order, reshuffled each epoch; its state is two ints."""

  def __init__(self, tasks, seed: int):
    if not tasks:
      raise ValueError("no training tasks")
    self.tasks = list(tasks)
    self.seed = int(seed)
    self.epoch = 0
    self.pos = 0

  def _order(self) -> np.ndarray:
    return np.random.default_rng([self.seed, self.epoch]).permutation(len(self.tasks))

  def next(self, n: int) -> list:
    out, order = [], self._order()
    while len(out) < n:
      if self.pos >= len(self.tasks):
        self.epoch, self.pos = self.epoch + 1, 0
        order = self._order()
      out.append(self.tasks[int(order[self.pos])])
      self.pos += 1
    return out

  def state(self) -> dict:
    return {"epoch": self.epoch, "pos": self.pos}

  def restore(self, state: dict) -> None:
    self.epoch, self.pos = int(state["epoch"]), int(state["pos"])


# ----------------------------------------------------------------------------- helpers


def _stats(x: np.ndarray, prefix: str) -> dict:
  x = np.asarray(x, np.float64)
  if x.size == 0:
    return {f"{prefix}/{k}": float("nan") for k in ("mean", "std", "abs_mean")}
  return {f"{prefix}/mean": float(x.mean()), f"{prefix}/std": float(x.std()),
          f"{prefix}/abs_mean": float(np.abs(x).mean())}


def skipped_groups(step_adv: np.ndarray, step_group_ids: np.ndarray) -> int:
  """Groups (with >= 1 step) whose step advantages are all 0: they give no policy gradient."""
  live = np.unique(step_group_ids)
  return int(live.size - np.unique(step_group_ids[step_adv != 0]).size)


def advantage_inputs(batch, config: TrainConfig, size: int) -> tuple:
  """(row_rewards f32, group_ids int32, row_mask bool, stat_rows bool), each [size]: the step rows
  of `batch` (`RolloutBatch.row_rewards`, `stat_rows`) as `config` scores them, padded with masked
  rows to `size` >= the number of steps."""
  n = batch.num_total_steps
  if size < n:
    raise ValueError(f"size ({size}) must be >= the number of steps ({n})")
  pad = lambda x, dtype: np.concatenate([np.asarray(x, dtype), np.zeros(size - n, dtype)])  # noqa: E731
  return (pad(batch.row_rewards(config.reward_scale, config.penalty_scope), np.float32),
          pad(batch.step_group_ids, np.int32), pad(np.ones(n, bool), bool),
          pad(batch.stat_rows(config.group_stats), bool))


def group_advantages(algo: str, row_rewards, group_ids, row_mask, stat_rows, num_groups: int):
  """Step-row advantages of `algo` ('grpo', 'rloo', 'drgrpo'); jittable (num_groups static)."""
  if algo == "rloo":
    return salt_jax.rloo_advantages(row_rewards, group_ids, num_groups, mask=row_mask,
                                    stat_mask=stat_rows)
  if algo in ("grpo", "drgrpo"):
    return salt_jax.grpo_advantages(row_rewards, group_ids, num_groups,
                                    normalize_std=algo == "grpo", mask=row_mask,
                                    stat_mask=stat_rows)
  raise ValueError(f"unknown algo {algo!r}; expected one of {ALGOS}")


def _token_ids(*token_lists) -> np.ndarray:
  """An int per step, equal iff the steps' token sequences are all equal (`token_lists` are
  parallel lists of int arrays: prompts alone, or prompts and responses)."""
  seen: dict = {}
  return np.array([seen.setdefault(tuple(np.asarray(t, np.int32).tobytes() for t in ts),
                                   len(seen)) for ts in zip(*token_lists)], np.int32)


def _build_tokenizer(config: TrainConfig):
  if config.model is not None and os.path.exists(os.path.join(config.model, "tokenizer.json")):
    return _tokenizer(config.model)
  if config.tokenizer == "toy" and config.env != "toy":
    return _tokenizer("toy", config.env, json.dumps(config.env_kwargs, sort_keys=True))
  return _tokenizer(config.tokenizer)


# Expert episodes whose texts teach the toy tokenizer an environment's words (deterministic).
_TOY_CORPUS_TASKS, _TOY_CORPUS_STEPS = 4, 8


def _env_texts(env: str, env_kwargs: dict) -> list[str]:
  """Observations and admissible actions of a few expert episodes on `env`'s training split."""
  # pylint: disable=import-outside-toplevel
  from envs.registry import make_env, task_list
  from salt_jax import sft
  tasks = task_list(env, ENV_TRAIN_SPLIT[env], **env_kwargs)[:_TOY_CORPUS_TASKS]
  game = make_env(env, **{**env_kwargs, "expert": True, "max_steps": _TOY_CORPUS_STEPS})
  try:
    demos = sft.collect_demos(game, tasks, max_steps=_TOY_CORPUS_STEPS, only_won=False)
  finally:
    game.close()
  return sft.demo_texts(demos)


@functools.lru_cache(maxsize=4)
def _tokenizer(name: str, env: str = "toy", env_kwargs_json: str = "{}"):
  """Built once per process (the toy BPE trains for seconds); callers only read it.

  'toy' for an env other than the toy one also learns merges from that env's texts, so its
  prompts are a few times shorter than byte-level ones (what makes CPU-scale studies fit).
  """
  # pylint: disable=import-outside-toplevel  (heavy or optional: imported when chosen)
  if os.path.isdir(name):
    from salt_jax.models.tokenizer import load_tokenizer
    return load_tokenizer(name)
  if name == "qwen25":
    from salt_jax.models.tokenizer import build_qwen25_tokenizer
    return build_qwen25_tokenizer()
  if name == "toy":
    from salt_jax.agent.prompts import toy_chat_tokenizer
    if env == "toy":
      return toy_chat_tokenizer()
    return toy_chat_tokenizer(2048, extra_texts=_env_texts(env, json.loads(env_kwargs_json)))
  raise ValueError(f"tokenizer must be 'qwen25', 'toy' or a local folder, got {name!r}")


def policy_config(config: TrainConfig, tokenizer):
  """(ModelConfig, parameter dtype) of the run's policy, without building it."""
  # pylint: disable=import-outside-toplevel
  from salt_jax.models import ModelConfig
  if config.model is not None:
    with open(os.path.join(config.model, "config.json"), encoding="utf-8") as f:
      return ModelConfig.from_hf_dict(json.load(f)), jnp.dtype(config.param_dtype)
  vocab = -(-len(tokenizer) // 64) * 64  # rounded up, as real checkpoints pad their embedding
  fields = {**TINY_POLICY, **config.tiny_policy}
  eos = tokenizer.convert_tokens_to_ids(tokenizer.eos_token)
  return ModelConfig(vocab_size=vocab, eos_token_id=eos,
                     max_position_embeddings=config.max_cache_len, **fields), jnp.dtype("float32")


def build_policy(config: TrainConfig, tokenizer, mesh):
  """The policy `CausalLM`: loaded from `config.model`, else the tiny random Qwen2."""
  # pylint: disable=import-outside-toplevel
  from salt_jax.models import CausalLM, from_pretrained, shard_model
  if config.model is not None:
    # float32 by default whatever the checkpoint holds: AdamW steps of ~1e-6 on bf16 weights
    # round away (bf16 keeps 8 bits of mantissa), so a bf16 policy would not learn at the paper's lr.
    return from_pretrained(config.model, mesh=mesh, dtype=jnp.dtype(config.param_dtype))
  mcfg, _ = policy_config(config, tokenizer)
  model = CausalLM(mcfg, rngs=nnx.Rngs(config.seed))
  return shard_model(model, mesh)


def load_params(path: str, like):
  """Restores an orbax StandardCheckpointer params tree saved by `save_params` onto `like`'s
  shardings."""
  import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel
  abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
  with ocp.StandardCheckpointer() as ckpt:
    return ckpt.restore(os.path.abspath(path), abstract)


def save_params(path: str, params) -> None:
  import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel
  with ocp.StandardCheckpointer() as ckpt:
    ckpt.save(os.path.abspath(path), params, force=True)


def lr_schedule(config: TrainConfig):
  """The learning rate per optimizer step: warmup, then constant or cosine decay over the run."""
  per_iter = config.ppo_epochs * max(1, -(-config.tasks_per_iter * config.group_size
                                          * (config.max_steps if config.layout == "step" else 1)
                                          // config.minibatch_rows))
  total = max(config.iters * per_iter, config.warmup_steps + 1)
  if config.schedule == "cosine":
    return optax.warmup_cosine_decay_schedule(0.0, config.lr, max(config.warmup_steps, 1), total)
  if config.warmup_steps:
    return optax.join_schedules([optax.linear_schedule(0.0, config.lr, config.warmup_steps),
                                 optax.constant_schedule(config.lr)], [config.warmup_steps])
  return optax.constant_schedule(config.lr)


def optimizer(config: TrainConfig, schedule) -> optax.GradientTransformation:
  """AdamW at `schedule` after global-norm gradient clipping."""
  return optax.chain(optax.clip_by_global_norm(config.max_grad_norm),
                     optax.adamw(schedule, weight_decay=config.weight_decay))


def update_programs(config: TrainConfig, graphdef, tx: optax.GradientTransformation, rows: int,
                    param_shardings, opt_shardings):
  """The trainer's two jitted device programs over the policy `graphdef`'s params.

  Returns (logprobs, train_step):
    logprobs(params, input_ids, targets, attention_mask, positions) -> f32[rows, L] token
      log-probs (the old and reference log-prob phases).
    train_step(params, opt_state, mb, step_adv) -> (params, opt_state, metrics): one PPO-clip
      step with `tx` on a mini-batch of `rows` rows (dict of [rows, L] arrays incl. ref_logprobs),
      micro-batched per `config.microbatch_rows`; params and opt_state are donated and come back
      on `param_shardings` / `opt_shardings` (pytrees of shardings). A non-finite loss or
      gradient leaves both unchanged and sets metrics['skipped'].
  """
  def logprobs(params, ids, tg, am, pos):
    return token_logprobs(nnx.merge(graphdef, params), ids, tg, am, positions=pos,
                          chunk_size=config.logprob_chunk)

  def loss_fn(p, mb, step_adv):
    model = nnx.merge(graphdef, p)
    logp, ent = token_logprobs_and_entropy(model, mb["input_ids"], mb["targets"],
                                           mb["attention_mask"], positions=mb["positions"],
                                           chunk_size=config.logprob_chunk)
    adv = salt_jax.token_advantages(step_adv, mb["token_step_ids"])
    loss, m = salt_jax.policy_loss(
        logp, mb["old_logprobs"], adv, mb["loss_mask"], clip_eps=config.clip_eps,
        clip_eps_high=config.clip_eps_high, dual_clip=config.dual_clip,
        ref_logp=mb["ref_logprobs"], kl_coef=config.kl_coef, kl_estimator=config.kl_estimator,
        loss_agg=config.loss_agg)
    return loss, (m, aggregate(ent, mb["loss_mask"], "token-mean"))

  def loss_weight(mb):
    return salt_jax.aggregate_weight(mb["loss_mask"], config.loss_agg)

  def metric_weights(mb):
    """pg_loss aggregates as the loss does; the other metrics are token means."""
    tokens = salt_jax.aggregate_weight(mb["loss_mask"], "token-mean")
    m = salt_jax.PolicyLossMetrics(*([tokens] * len(salt_jax.PolicyLossMetrics._fields)))
    return m._replace(pg_loss=loss_weight(mb)), tokens

  micro = rows // config.microbatch_rows if config.microbatch_rows else 1
  grad_fn = salt_jax.microbatched_value_and_grad(
      loss_fn, micro, has_aux=True, weight_fn=loss_weight, aux_weight_fn=metric_weights)

  def train_step(params, opt_state, mb, step_adv):
    """One PPO-clip step on mini-batch `mb` (dict of [rows, L] arrays, incl. ref_logprobs)."""
    (loss, (m, ent)), grads = grad_fn(params, mb, step_adv)
    gnorm = optax.tree.norm(grads)
    ok = jnp.isfinite(loss) & jnp.isfinite(gnorm)
    updates, new_opt = tx.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    # Never apply a non-finite update: keep params and optimizer state (its step count too).
    keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(ok, a, b), new, old)  # noqa: E731
    out = dict(loss=loss, grad_norm=gnorm, kl=m.kl, clip_fraction=m.clip_fraction,
               pg_loss=m.pg_loss, ratio_mean=m.ratio_mean, approx_kl_old=m.approx_kl_old,
               entropy=ent, skipped=~ok)
    return keep(new_params, params), keep(new_opt, opt_state), out
  # Outputs pinned to the inputs' shardings: otherwise the second call sees params laid out
  # as XLA chose and compiles again.
  return jax.jit(logprobs), jax.jit(train_step, donate_argnums=(0, 1),
                                    out_shardings=(param_shardings, opt_shardings, None))


# ----------------------------------------------------------------------------- the trainer


class Trainer:
  """Owns the policy, reference, optimizer, env pool, sampler, logger and checkpoints of one run.

  Usage: `Trainer(config).run()`, or `setup()` then `iteration()` repeatedly (tests).
  """

  def __init__(self, config: TrainConfig):
    config.validate()
    self.config = config
    if config.progress:  # a notebook or a script that set up no logging still shows the phases
      log_lib.configure(only_if_unset=True)
    if config.distributed:  # before any other jax use
      multihost.initialize(config.coordinator, config.num_processes, config.process_id)
    self.num_processes, self.process_index = jax.process_count(), jax.process_index()
    devices = None if self.num_processes == 1 else multihost.mesh_devices(
        *parse_mesh_shape(config.mesh))
    self.mesh = make_mesh(config.mesh, devices)  # an unformable mesh fails here, before any work
    data = int(self.mesh.shape[DATA_AXIS])
    if config.microbatch_rows % data:
      raise ValueError(f"microbatch_rows ({config.microbatch_rows}) must be a multiple of the "
                       f"mesh's data axis ({data}): each micro-batch is split over it")
    if not config.resume and checkpoint.complete_steps(self._ckpt_dir()):
      raise ValueError(f"{config.out} already holds checkpoints: pass --resume to continue that "
                       "run, or choose another --out")
    if config.resume:
      self._check_resume_config()
    self._pool = None
    self._logger = None
    self._ckpt = None
    self.iteration_index = 0
    self.skipped_updates_total = 0
    self.applied_updates = 0  # optimizer steps taken (the schedule's position)
    self._last_save_s = None  # the last checkpoint's save time, logged with the next row
    self.last_rollout = self.last_minibatches = self.last_step_adv = self.last_advantages = None
    self.last_local_rollout = None

  # ---------------------------------------------------------------- setup

  def setup(self) -> "Trainer":
    """Builds everything; restores the last complete checkpoint when `config.resume`."""
    # pylint: disable=import-outside-toplevel
    import orbax.checkpoint as ocp
    from envs.pool import EnvPool
    from envs.registry import task_list
    from salt_jax.sampling import Sampler

    cfg = self.config
    t_setup = time.perf_counter()
    logger.info("setup: tokenizer %r", cfg.tokenizer if cfg.model is None else cfg.model)
    self.tokenizer = _build_tokenizer(cfg)
    self.pad_id = int(self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None
                      else self.tokenizer.eos_token_id)
    logger.info("setup: policy %s (%s) on a %s mesh", cfg.model or "tiny random Qwen2",
                cfg.param_dtype, "x".join(str(v) for v in self.mesh.shape.values()))
    self.model = build_policy(cfg, self.tokenizer, self.mesh)
    # Processes play different tasks, so each samples on its own devices alone: with several, the
    # sampler has its own copy of the policy there (`_sync_sampler`).
    sampler_mesh = self.mesh if self.num_processes == 1 else multihost.local_mesh(self.mesh)
    self.sampler_model = self.model if self.num_processes == 1 else build_policy(
        cfg, self.tokenizer, sampler_mesh)
    self.graphdef, params = nnx.split(self.model)
    if cfg.init_params is not None:
      params = load_params(cfg.init_params, params)
      nnx.update(self.model, params)
    self.params = params
    self.ref_params = jax.tree.map(jnp.copy, params)  # frozen copy of the initial policy
    self.schedule = lr_schedule(cfg)
    self.tx = optimizer(cfg, self.schedule)
    # optax makes its step counters on one device: replicate them over the mesh, so the jitted
    # update sees every input on the mesh's devices.
    def on_mesh(x):
      named = isinstance(getattr(x, "sharding", None), NamedSharding)
      return x if named else jax.device_put(x, replicated(self.mesh))
    self.opt_state = jax.tree.map(on_mesh, self.tx.init(params))
    # On the mesh like every other piece of state, so a checkpoint restores it there (a key on
    # one device meets the params on all of them in the sampler); orbax saves only arrays on the
    # global mesh in a multi-process run.
    self.key = jax.random.wrap_key_data(
        jax.device_put(jax.random.key_data(jax.random.key(cfg.seed)), replicated(self.mesh)))
    env_kw = {"max_steps": cfg.max_steps, **cfg.env_kwargs}
    split = cfg.train_split or ENV_TRAIN_SPLIT[cfg.env]
    task_kw = dict(cfg.env_kwargs)
    if cfg.num_train_tasks is not None:
      task_kw["num_tasks"] = cfg.num_train_tasks
    logger.info("setup: %s tasks of %s's %r split, %d env worker(s)", "all" if
                cfg.num_train_tasks is None else cfg.num_train_tasks, cfg.env, split,
                cfg.env_workers)
    self.task_sampler = TaskSampler(task_list(cfg.env, split, **task_kw), cfg.seed)
    self.eval_splits = cfg.eval_splits if cfg.eval_splits is not None else ENV_EVAL_SPLITS[cfg.env]
    self._pool = EnvPool(cfg.env, env_kw, cfg.env_workers)
    eos = {self.tokenizer.eos_token_id}
    im_end = self.tokenizer.convert_tokens_to_ids("<|im_end|>")
    if isinstance(im_end, int) and im_end >= 0 and im_end != self.tokenizer.unk_token_id:
      eos.add(im_end)
    self.sampler = Sampler(self.sampler_model, eos_token_ids=sorted(eos), pad_token_id=self.pad_id,
                           max_cache_len=cfg.max_cache_len, mesh=sampler_mesh,
                           prompt_buckets=self._prompt_buckets())
    self.embedder = None
    if cfg.salt and cfg.embedder not in (None, "none"):
      from salt_jax.embedders import SentenceEmbedder
      self.embedder = SentenceEmbedder(None if cfg.embedder == "minilm" else cfg.embedder)
    self.prompt_config = env_prompt_config(cfg.env, history_window=cfg.history_window)
    self.sampling = SamplingParams(temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
                                   stop_strings=("</action>",))
    self.data_size = int(self.mesh.shape[DATA_AXIS])
    self.rows = -(-cfg.minibatch_rows // self.data_size) * self.data_size
    self._jit()

    os.makedirs(cfg.out, exist_ok=True)
    if self.process_index == 0:  # the other processes' files would be the same
      with open(os.path.join(cfg.out, "config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg.to_json(), f, indent=1, sort_keys=True)
    self._ckpt = ocp.CheckpointManager(
        os.path.abspath(self._ckpt_dir()),
        options=ocp.CheckpointManagerOptions(max_to_keep=cfg.max_to_keep, create=True,
                                             enable_async_checkpointing=False))
    resumed = False
    if cfg.resume and self._ckpt.latest_step() is not None:
      self._restore_latest_intact()
      resumed = True
      logger.info("setup: resumed from checkpoint %d of %s", self.iteration_index, cfg.out)
    self._sync_sampler()
    self._logger = metrics_lib.MetricsLogger(
        cfg.out, tensorboard=cfg.tensorboard,
        truncate_from=self.iteration_index if resumed else None, write=self.process_index == 0)
    n_params = sum(x.size for x in jax.tree.leaves(self.params))
    logger.info("setup done in %.1fs: %.1fM parameters, writing to %s",
                time.perf_counter() - t_setup, n_params / 1e6, cfg.out)
    return self

  def _sync_sampler(self) -> None:
    """Gives the sampler's policy the current params (all processes call it together)."""
    nnx.update(self.model, self.params)
    if self.sampler_model is not self.model:
      nnx.update(self.sampler_model, multihost.copy_params(
          self.params, nnx.state(self.sampler_model), self.mesh))

  def _prompt_buckets(self) -> list[int]:
    """Powers of two from `prompt_bucket_min` up to the cache: fewer sampler compiles."""
    b = [self.config.prompt_bucket_min]
    while b[-1] * 2 <= self.config.max_cache_len:
      b.append(b[-1] * 2)
    return b

  def _jit(self):
    cfg = self.config
    self._advantages = jax.jit(functools.partial(group_advantages, cfg.algo), static_argnums=(4,))
    self._refine = jax.jit(salt_jax.refine, static_argnums=(2,))
    shard_of = lambda tree: jax.tree.map(lambda x: x.sharding, tree)  # noqa: E731
    self._logprobs, self._train_step = update_programs(
        cfg, self.graphdef, self.tx, self.rows, shard_of(self.params), shard_of(self.opt_state))

  # ---------------------------------------------------------------- checkpoints

  def _state_tree(self) -> dict:
    return {"params": self.params, "opt_state": self.opt_state, "ref_params": self.ref_params,
            "key": jax.random.key_data(self.key)}

  def _abstract_state(self) -> dict:
    """The state's shapes and dtypes on this run's shardings: a restore puts every leaf there,
    whatever mesh the checkpoint was written on (a leaf not on the mesh goes replicated)."""
    def on_mesh(x):
      sharding = x.sharding
      if not (isinstance(sharding, NamedSharding) and sharding.mesh == self.mesh):
        sharding = replicated(self.mesh)
      return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
    return jax.tree.map(on_mesh, self._state_tree())

  def _meta(self, state: dict) -> dict:
    return {"iteration": self.iteration_index, "task_sampler": self.task_sampler.state(),
            "skipped_updates_total": self.skipped_updates_total,
            "applied_updates": self.applied_updates,
            "config": self._compared_config(), "config_digest": self._config_digest(),
            "fingerprints": checkpoint.fingerprints(state)}

  def _compared_config(self) -> dict:
    """The configuration fields a resume must keep."""
    return {k: v for k, v in self.config.to_json().items()
            if k not in checkpoint.RESUME_MAY_CHANGE}

  def _config_digest(self) -> str:
    """What checkpoints written before `_compared_config` was saved are checked against (its
    fields and the mesh, which such a resume could not change)."""
    keep = {**self._compared_config(), "mesh": self.config.mesh}
    return hashlib.sha256(json.dumps(keep, sort_keys=True).encode()).hexdigest()[:16]

  def _ckpt_dir(self) -> str:
    return os.path.join(self.config.out, "checkpoints")

  def _check_resume_config(self) -> None:
    """Raises ValueError naming each field that differs from the saved run's (before any work)."""
    meta = checkpoint.newest_meta(self._ckpt_dir())
    if meta is None:
      return
    if "config" not in meta:  # written before the fields were saved: only the digest is there
      if meta.get("config_digest") != self._config_digest():
        raise ValueError(f"the checkpoint in {self.config.out} was written with a different "
                         "configuration (only iters, out, eval_every, progress may change on "
                         "--resume)")
      return
    diffs = checkpoint.config_differences(meta["config"], self._compared_config())
    if diffs:
      raise ValueError(
          f"--resume: settings differ from the run saved in {self.config.out}: "
          f"{'; '.join(diffs)}. Only {', '.join(checkpoint.RESUME_MAY_CHANGE)} may change on "
          "--resume: pass the saved values, or choose another --out")

  def save(self) -> None:
    import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel
    state = self._state_tree()
    self._ckpt.save(self.iteration_index, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(self._meta(state))))
    self._ckpt.wait_until_finished()

  def _read_checkpoint(self, step: int) -> tuple[dict, dict]:
    """Checkpoint `step`'s state (on this run's shardings) and JSON; raises DamagedCheckpoint when
    it does not read back, or reads back other values than were saved."""
    import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel
    try:
      got = self._ckpt.restore(step, args=ocp.args.Composite(
          state=ocp.args.StandardRestore(self._abstract_state()), meta=ocp.args.JsonRestore()))
    except Exception as e:  # pylint: disable=broad-except  (orbax raises bare Exception too)
      raise checkpoint.DamagedCheckpoint(f"unreadable: {checkpoint.root_cause(e)}") from e
    bad = checkpoint.damaged_leaves(got["state"], got["meta"].get("fingerprints"))
    if bad:
      raise checkpoint.DamagedCheckpoint(
          f"arrays differ from the fingerprints saved with them: {len(bad)}, e.g. {bad[0]}")
    return got["state"], got["meta"]

  def _restore(self, step: int) -> None:
    """Restores checkpoint `step` (raises DamagedCheckpoint if it is damaged)."""
    self._load(*self._read_checkpoint(step))

  def _load(self, st: dict, meta: dict) -> None:
    self.params, self.opt_state, self.ref_params = st["params"], st["opt_state"], st["ref_params"]
    self.key = jax.random.wrap_key_data(st["key"])
    self.task_sampler.restore(meta["task_sampler"])
    self.iteration_index = int(meta["iteration"])
    self.skipped_updates_total = int(meta["skipped_updates_total"])
    self.applied_updates = int(meta["applied_updates"])
    nnx.update(self.model, self.params)

  def _restore_latest_intact(self) -> None:
    """Restores the newest checkpoint that reads back intact. Newer, damaged ones are named in a
    warning and moved to <out>/damaged_checkpoints; raises ValueError when none is intact."""
    damaged = {}
    for step in sorted(self._ckpt.all_steps(), reverse=True):
      try:
        restored, problem = self._read_checkpoint(step), None
      except checkpoint.DamagedCheckpoint as e:
        problem = str(e)
      problem = next((p for p in multihost.allgather_objects(problem) if p), None)  # all agree
      if problem is None:
        break
      damaged[step] = problem
    else:
      raise ValueError(f"--resume found no intact checkpoint in {self._ckpt_dir()}: " + "; ".join(
          f"checkpoint {s}: {p}" for s, p in damaged.items()))
    if damaged:
      moved = checkpoint.set_aside(self._ckpt_dir(), list(damaged),
                                   os.path.join(self.config.out, "damaged_checkpoints"))
      self._ckpt.reload()
      warnings.warn(f"resuming from checkpoint {step} of {self.config.out}: " + "; ".join(
          f"checkpoint {s} is damaged ({p}), moved to {m}"
          for (s, p), m in zip(damaged.items(), moved)), stacklevel=2)
    self._load(*restored)

  # ---------------------------------------------------------------- one iteration

  def _round(self, n: int) -> int:
    """n rounded up to a multiple of the 'data' axis (arrays split over it must divide)."""
    return -(-n // self.data_size) * self.data_size

  def _put(self, x):
    return jax.device_put(x, batch_sharding(self.mesh, np.ndim(x)))

  def _rollout(self, tasks, key, *, seed, group_size, greedy=False):
    sampling = dataclasses.replace(self.sampling, greedy=greedy)
    return collect(self._pool, tasks, group_size, self.sampler, self.tokenizer, key,
                   prompt_config=self.prompt_config, max_steps=self.config.max_steps,
                   max_new_tokens=self.config.max_new_tokens, sampling=sampling,
                   invalid_action_penalty=self.config.invalid_action_penalty, seed=seed,
                   max_prompt_tokens=self.config.max_cache_len - self.config.max_new_tokens,
                   invalid_step=self.config.invalid_step)

  def collect_rollout(self, tasks, key, *, seed, group_size, greedy=False):
    """Plays G = `group_size` trajectories of each task; returns the `RolloutBatch` of them all.

    With several processes, each plays its contiguous share of `tasks` (whole groups) on its
    own environments and sampler (key folded with its index), and the shares are gathered: every
    process returns the same global batch. `last_local_rollout` keeps this process's share.
    """
    if self.num_processes == 1:
      self.last_local_rollout = self._rollout(tasks, key, seed=seed, group_size=group_size,
                                              greedy=greedy)
      return self.last_local_rollout
    mine = multihost.share(tasks, self.process_index, self.num_processes)
    # The key onto this process's devices (the sampler's), as a value: it may live on the mesh.
    key = jax.random.wrap_key_data(multihost.to_host(jax.random.key_data(key)))
    self.last_local_rollout = self._rollout(
        mine, jax.random.fold_in(key, self.process_index), seed=seed, group_size=group_size,
        greedy=greedy) if mine else None
    return multihost.concat_rollouts(multihost.allgather_objects(self.last_local_rollout))

  def _minibatches(self, tb: batching.TokenBatch) -> list[dict]:
    """Mini-batches of `self.rows` rows (padding rows have an all-False mask), each cut to the
    bucketed length of its own longest row: attention costs the square of the length, and one
    long trajectory (an ALFWorld heat task beside 4-step ones) would otherwise set it for all."""
    n = tb.input_ids.shape[0]
    fields = ("input_ids", "targets", "loss_mask", "token_step_ids", "old_logprobs",
              "attention_mask", "positions")
    out = []
    for s in range(0, n, self.rows):
      length = batching.trimmed_length(tb.attention_mask[s:s + self.rows], self.config.min_seq_len)
      out.append({f: getattr(tb, f)[s:s + self.rows, :length] for f in fields})
    return out

  def _logprobs_all(self, params, mbs: list[dict]) -> list[np.ndarray]:
    res = [self._logprobs(params, self._put(mb["input_ids"]), self._put(mb["targets"]),
                          self._put(mb["attention_mask"]), self._put(mb["positions"]))
           for mb in mbs]
    return [multihost.to_host(r) for r in res]

  def iteration(self) -> dict:
    """Runs one training iteration; returns (and logs) its metrics."""
    cfg = self.config
    it = self.iteration_index
    times = {}
    histograms = {}  # TensorBoard only: the step advantages before and after SALT
    t_iter = time.perf_counter()
    self.key, k_rollout, k_shuffle = jax.random.split(self.key, 3)
    tasks = self.task_sampler.next(cfg.tasks_per_iter)

    # rollout
    logger.info("iteration %d/%d: rollout of %d tasks x %d trajectories", it + 1, cfg.iters,
                len(tasks), cfg.group_size)
    t0 = time.perf_counter()
    full = self.collect_rollout(tasks, k_rollout, seed=cfg.seed * 100_003 + it,
                                group_size=cfg.group_size)
    times["rollout"] = time.perf_counter() - t0
    logger.info("iteration %d: rollout done in %.1fs: %d trajectories, %d steps, success %.2f",
                it + 1, times["rollout"], full.num_trajectories, full.num_total_steps,
                full.metrics["success_rate"])
    rm = full.metrics
    self.last_rollout = full
    batch = full.trainable()  # failed trajectories out (counted below)
    m: dict[str, Any] = {
        "success_rate": rm["success_rate"], "episode_length": rm["mean_steps"],
        "valid_action_ratio": rm["valid_action_ratio"],
        "num_trajectories": full.num_trajectories,
        "failed_trajectories": int(full.failed.sum()), "env_restarts": rm["env_restarts"],
        "response_tokens": rm["response_tokens"], "num_steps": batch.num_total_steps,
        "time/rollout_generate": rm["gen_time_s"], "time/rollout_env": rm["env_time_s"],
        "reward/mean": float(np.mean(full.outcome_rewards[~full.failed]))
        if (~full.failed).any() else float("nan"),
    }
    for tt, v in rm["success_rate_by_type"].items():
      m[f"success_rate/{tt}"] = v
    m["invalid_rewards"] = int(salt_jax.count_invalid_rewards(batch.outcome_rewards))

    nsteps = batch.num_total_steps
    upd = {}
    if nsteps == 0:  # every trajectory failed: nothing to learn from
      times.update(old_logprob=0.0, ref_logprob=0.0, advantage=0.0, salt=0.0, update=0.0)
      m.update(NO_MERGE_METRICS, skipped_groups=cfg.tasks_per_iter)
    else:
      tb = batching.from_rollout(batch, cfg.layout, pad_id=self.pad_id,
                                 min_length=cfg.min_seq_len, row_multiple=self.rows)
      mbs = self._minibatches(tb)

      # group advantages of the step rows (padded to a power of two): each row's reward, scored
      # against its group's statistics over the rows in stat_rows
      t0 = time.perf_counter()
      n_pad = self._round(batching.bucket_length(nsteps, 64))
      inputs = advantage_inputs(batch, cfg, n_pad)
      step_mask = inputs[2]
      step_adv = jax.block_until_ready(self._advantages(*map(self._put, inputs),
                                                        cfg.tasks_per_iter))
      times["advantage"] = time.perf_counter() - t0
      before = multihost.to_host(step_adv)[:nsteps]
      m["skipped_groups"] = skipped_groups(before, batch.step_group_ids)

      # SALT: merge ids on the host, refine on the device
      t0 = time.perf_counter()
      if cfg.salt:
        trajs, groups = batch.trajectories_for_salt()
        merge = salt_jax.build_merge_ids(trajs, groups, history=cfg.history,
                                         embedder=self.embedder, threshold=cfg.embed_threshold)
        ids = np.zeros(n_pad, np.int32)
        ids[:nsteps] = merge.ids
        segs = batching.bucket_length(merge.num_segments, 64)
        step_adv = jax.block_until_ready(
            self._refine(step_adv, self._put(ids), segs, self._put(step_mask)))
        m["merge_rate"] = merge.merge_rate
        m["cross_prompt_merges"] = salt_jax.cross_prompt_merges(
            merge.ids, _token_ids(batch.prompt_ids))
        # Where SALT changes the policy gradient: edges of different (prompt, response) samples
        # with different advantages (the same tokens share one gradient term).
        m["merged_steps"] = int(np.sum(np.bincount(merge.ids)[merge.ids] > 1))
        m["gradient_changing_merges"] = salt_jax.gradient_changing_merges(
            merge.ids, _token_ids(batch.prompt_ids, batch.response_ids), before)
        m["gradient_changing_share"] = (m["gradient_changing_merges"] / m["merged_steps"]
                                        if m["merged_steps"] else float("nan"))
      else:
        m.update(NO_MERGE_METRICS)
      times["salt"] = time.perf_counter() - t0
      after = multihost.to_host(step_adv)[:nsteps]
      m.update(_stats(before, "adv_before"))
      m.update(_stats(after, "adv_after"))
      m["adv_frac_changed"] = float(np.mean(np.abs(after - before) > 1e-6))

      # old log-probs (the sampler's, or recomputed under the current params) and the reference's,
      # only for an update: with every advantage 0 the loss would be KL alone, and an update would
      # move the policy (Adam makes a full step of any gradient, weight decay too) on no evidence
      # at all, so none is taken.
      learn = bool(np.any(after != 0))
      t0 = time.perf_counter()
      if learn and cfg.recompute_old_logprobs:
        for mb, lp in zip(mbs, self._logprobs_all(self.params, mbs)):
          mb["old_logprobs"] = np.where(mb["loss_mask"], lp, 0.0).astype(np.float32)
      times["old_logprob"] = time.perf_counter() - t0

      t0 = time.perf_counter()
      for mb, lp in zip(mbs, self._logprobs_all(self.ref_params, mbs) if learn else ()):
        mb["ref_logprobs"] = np.where(mb["loss_mask"], lp, 0.0).astype(np.float32)
      times["ref_logprob"] = time.perf_counter() - t0

      # PPO-clip updates over shuffled mini-batches
      t0 = time.perf_counter()
      # Kept for inspection (tests, debugging): what this iteration trained on.
      self.last_minibatches, self.last_step_adv = mbs, step_adv
      self.last_advantages = (before, after)
      histograms = {"adv_before": before, "adv_after": after}
      logger.info("iteration %d: advantages and SALT done (merge rate %.2f); %s", it + 1,
                  m.get("merge_rate", float("nan")),
                  f"update over {len(mbs)} mini-batch(es) x {cfg.ppo_epochs} epoch(s)" if learn
                  else "no update: every advantage is 0")
      upd = self._update(mbs, step_adv, k_shuffle) if learn else self._no_update()
      times["update"] = time.perf_counter() - t0
    m.update(upd)
    m["skipped_updates_total"] = self.skipped_updates_total
    m["lr"] = float(self.schedule(self.applied_updates))
    for k, v in times.items():
      m[f"time/{k}"] = v

    self.iteration_index = it + 1
    if cfg.eval_every and self.iteration_index % cfg.eval_every == 0:
      t0 = time.perf_counter()
      m.update(self.evaluate())
      m["time/eval"] = time.perf_counter() - t0
    if self._last_save_s is not None:
      m["time/checkpoint"] = self._last_save_s
    m["time/iteration"] = time.perf_counter() - t_iter
    # Logged before the checkpoint that covers it: a kill in between leaves a row that the resume
    # drops and writes again; logged after, a kill in between would lose the row.
    row = self._logger.log(it, m, histograms)
    self._last_save_s = None
    if self.iteration_index % cfg.checkpoint_every == 0 or self.iteration_index == cfg.iters:
      t0 = time.perf_counter()
      self.save()
      self._last_save_s = time.perf_counter() - t0
      logger.info("iteration %d: checkpoint saved in %.1fs", it + 1, self._last_save_s)
    return row

  def _update(self, mbs: list[dict], step_adv, key) -> dict:
    cfg = self.config
    live = [i for i, mb in enumerate(mbs) if mb["loss_mask"].any()]
    seed = int(jax.random.randint(key, (), 0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    sums: dict[str, float] = {}
    n, skipped = 0, 0
    for _ in range(cfg.ppo_epochs):
      for i in rng.permutation(live):
        mb = {k: self._put(v) for k, v in mbs[i].items()}
        self.params, self.opt_state, out = self._train_step(self.params, self.opt_state, mb,
                                                            step_adv)
        out = jax.device_get(out)
        logger.debug("update: mini-batch %d, loss %.4f%s", i, float(out.get("loss", np.nan)),
                     " (skipped: not finite)" if bool(out["skipped"]) else "")
        if bool(out["skipped"]):
          skipped += 1
          continue  # a NaN/inf mini-batch: its numbers are not averaged into the metrics
        n += 1
        self.applied_updates += 1
        for k, v in out.items():
          if k != "skipped":
            sums[k] = sums.get(k, 0.0) + float(v)
    self.skipped_updates_total += skipped
    self._sync_sampler()
    if not n:
      return {**self._no_update(), "skipped_updates": skipped}
    return {**{k: v / n for k, v in sums.items()}, "skipped_updates": skipped, "num_updates": n}

  @staticmethod
  def _no_update() -> dict:
    """The update metrics of an iteration that took no optimizer step."""
    return {**{k: float("nan") for k in ("loss", "grad_norm", "kl", "clip_fraction", "pg_loss",
                                         "ratio_mean", "approx_kl_old", "entropy")},
            "skipped_updates": 0, "num_updates": 0}

  def evaluate(self) -> dict:
    """Greedy success on `num_eval_tasks` tasks of each eval split (overall and per task type)."""
    from envs.registry import task_list  # pylint: disable=import-outside-toplevel
    cfg = self.config
    out = {}
    key = jax.random.fold_in(jax.random.key(cfg.seed + 1), self.iteration_index)
    for split in self.eval_splits:
      tasks = task_list(cfg.env, split, **cfg.env_kwargs)[:cfg.num_eval_tasks]
      if not tasks:
        continue
      b = self.collect_rollout(tasks, key, seed=0, group_size=1, greedy=True)
      out[f"eval/{split}/success_rate"] = b.metrics["success_rate"]
      out[f"eval/{split}/valid_action_ratio"] = b.metrics["valid_action_ratio"]
      for tt, v in b.metrics["success_rate_by_type"].items():
        out[f"eval/{split}/success_rate/{tt}"] = v
    return out

  # ---------------------------------------------------------------- run

  def run(self) -> list[dict]:
    """Trains from the current iteration up to `config.iters`; returns the logged rows."""
    cfg = self.config
    if self._ckpt is None:
      self.setup()
    if self.iteration_index >= cfg.iters:
      print(f"nothing to do: the checkpoint is at iteration {self.iteration_index} "
            f"(--iters={cfg.iters})", flush=True)
    progress = (metrics_lib.Progress(cfg.iters, self.iteration_index)
                if cfg.progress and self.process_index == 0 else None)
    rows = []
    try:
      while self.iteration_index < cfg.iters:
        rows.append(self.iteration())
        if progress is not None:
          progress.update(rows[-1]["iteration"], rows[-1])
    finally:
      if progress is not None:
        progress.close()
    return rows

  def close(self) -> None:
    if self._pool is not None:
      self._pool.close()
      self._pool = None
    if self._logger is not None:
      self._logger.close()
    if self._ckpt is not None:
      self._ckpt.close()

  def __enter__(self) -> "Trainer":
    return self

  def __exit__(self, *exc) -> None:
    self.close()


def train(config: TrainConfig) -> list[dict]:
  """Builds a `Trainer`, runs it to `config.iters`, closes it; returns the logged metric rows."""
  with Trainer(config) as t:
    t.setup()
    return t.run()
