"""What one training run is: `TrainConfig`, built from six small sections.

  EnvConfig        which environment, its tasks and splits
  PolicyConfig     the model, tokenizer and parameter dtype
  RolloutConfig    sampling, prompts and what counts as an invalid step
  AlgorithmConfig  the advantage estimator, rewards and SALT
  UpdateConfig     the PPO-clip update and its optimizer
  RunConfig        iterations, mesh, output, checkpoints, processes

`TrainConfig` inherits every section, so its fields are flat (`config.lr`, `TrainConfig(lr=3e-4)`)
and each section stays a readable unit (the command line groups its flags by section,
`salt_jax.cli`). Each section's `validate()` checks its own fields; `TrainConfig.validate()`
runs them all, then checks what sections ask of each other. Every field carries its help text in
`metadata["help"]`. A run writes `TrainConfig.to_json()` to `<out>/config.json`;
`TrainConfig.from_json` reads it back, so a saved config re-runs its run (`--config
<out>/config.json`).

This module imports no jax: the command line builds a config before it fixes the device count.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import math
import os
from typing import Any, Iterable, Optional, Sequence

from salt_jax import configs

PARAM_DTYPES = ("float32", "bfloat16")
SCHEDULES = ("constant", "cosine")
LAYOUTS = ("trajectory", "step")
MICROBATCH_LENGTHS = ("shared", "own")
# Tunix's regex for Qwen2's seven projections (Llama's have the same names).
DEFAULT_LORA_TARGETS = ".*q_proj|.*k_proj|.*v_proj|.*o_proj|.*gate_proj|.*up_proj|.*down_proj"


def _field(default, help_: str):
  """A dataclass field with its command-line help (mutable defaults through a factory)."""
  if isinstance(default, (dict, list)):
    return dataclasses.field(default_factory=lambda: type(default)(default),
                             metadata={"help": help_})
  return dataclasses.field(default=default, metadata={"help": help_})


def _need(ok: bool, msg: str) -> None:
  if not ok:
    raise ValueError(msg)


def _pos_int(config, name: str, lo: int = 1) -> None:
  v = getattr(config, name)
  _need(isinstance(v, int) and not isinstance(v, bool) and v >= lo,
        f"{name} must be an int >= {lo}, got {v!r}")


def _one_of(config, name: str, choices) -> None:
  _need(getattr(config, name) in choices,
        f"unknown {name} {getattr(config, name)!r}; expected one of {tuple(choices)}")


def _positive(config, name: str) -> None:
  v = getattr(config, name)
  _need(math.isfinite(v) and v > 0, f"{name} must be > 0, got {v}")


@dataclasses.dataclass(frozen=True)
class EnvConfig:
  """The environment and its tasks."""

  env: str = _field("alfworld", "environment: alfworld, textworld, toy or webshop")
  env_kwargs: dict = _field({}, "the environment's keyword arguments (JSON; its constructor's, "
                           "envs.registry.env_arguments)")
  train_split: Optional[str] = _field(None, "training split (default: the env's own)")
  eval_splits: Optional[tuple] = _field(None, "evaluation splits, comma-separated (default: the "
                                        "env's own)")
  num_train_tasks: Optional[int] = _field(None, "training tasks used (default: all)")
  train_task_ids: Optional[tuple] = _field(None, "training tasks by id, comma-separated, taken "
                                           "from the train split in this order (default: the "
                                           "split's first num_train_tasks)")
  num_eval_tasks: int = _field(8, "tasks of each eval split played greedily")
  eval_every: int = _field(0, "evaluate every N iterations (0: never)")
  env_workers: int = _field(1, "environment worker processes (0: in this process)")
  max_steps: int = _field(50, "steps an episode at most")

  def validate(self) -> None:
    """ValueError naming the first bad field of this section; the environment's arguments,
    splits and task ids against the env's own (`envs.registry.check_env_config`)."""
    from envs import registry  # pylint: disable=import-outside-toplevel
    _one_of(self, "env", registry.names())
    for name in ("max_steps", "num_eval_tasks"):
      _pos_int(self, name)
    for name in ("env_workers", "eval_every"):
      _pos_int(self, name, 0)
    ids = self.train_task_ids
    _need(ids is None or (len(ids) > 0 and all(isinstance(i, str) and i for i in ids)),
          f"train_task_ids must be None or non-empty task id strings, got {ids!r}")
    registry.check_env_config(self)


@dataclasses.dataclass(frozen=True)
class PolicyConfig:
  """The policy and its tokenizer."""

  model: Optional[str] = _field(None, "a local Hugging Face Qwen2/Llama folder or a .gguf file "
                                "(default: a tiny random-init Qwen2, TINY_POLICY)")
  tokenizer: str = _field("qwen25", "qwen25 (offline Qwen2.5), toy, or a local folder (a --model "
                          "folder brings its own)")
  tiny_policy: dict = _field({}, "overrides of the tiny policy's architecture (JSON)")
  init_params: Optional[str] = _field(None, "an orbax params folder to start from (e.g. a "
                                      "behaviour-cloning warm start)")
  lora_rank: int = _field(0, "train LoRA adapters of this rank (through qwix) on the projections "
                          "--lora-targets matches, the base frozen and stored once; the "
                          "reference is the base (adapters off). 0: full fine-tuning")
  lora_alpha: Optional[float] = _field(None, "LoRA's alpha: the adapters' output is scaled by "
                                       "alpha / rank (default: the rank, a scale of 1, as "
                                       "verl-agent's rank 64 / alpha 64)")
  lora_targets: str = _field(DEFAULT_LORA_TARGETS, "regex over projection paths such as "
                             "'layers/0/attn/q_proj' or 'layers/3/mlp/down_proj' (full match) "
                             "that get LoRA adapters (default: all seven, Tunix's)")
  param_dtype: str = _field("float32", "parameters (and compute, unless --compute-dtype) of a "
                            "--model checkpoint: float32 (AdamW's small steps round away on bf16 "
                            "weights) or bfloat16")
  compute_dtype: Optional[str] = _field(None, "activations and matmuls of the policy and reference "
                                        "when they differ from param_dtype: bfloat16 over float32 "
                                        "parameters is mixed precision (float32 master weights "
                                        "and AdamW state, half the activation memory); None: "
                                        "param_dtype")
  attention_impl: Optional[str] = _field(None, "which program computes attention: a name in "
                                         "salt_jax.models.ATTENTION_IMPLS (default: "
                                         "default_attention_impl() picks one for the machine)")

  def policy_shape(self):
    """The policy's architecture (`salt_jax.models.ModelConfig`, without a tokenizer): the
    --model's config.json (or the .gguf's), else the tiny policy's."""
    # pylint: disable=import-outside-toplevel  (imports jax)
    from salt_jax.models.config import read_model_config, tiny_policy_config
    return (read_model_config(self.model) if self.model is not None
            else tiny_policy_config(self.tiny_policy))

  def validate(self) -> None:
    """ValueError naming the first bad field of this section, including what it names: the
    --model's config (or the tiny policy's shape), LoRA's targets on it, the folders."""
    # pylint: disable=import-outside-toplevel  (these import jax; building a config does not)
    from salt_jax.models.config import ATTENTION_IMPLS
    _one_of(self, "param_dtype", PARAM_DTYPES)
    if self.compute_dtype is not None:
      _one_of(self, "compute_dtype", PARAM_DTYPES)
    _one_of(self, "attention_impl", (None, *ATTENTION_IMPLS))
    shape = self.policy_shape()
    _pos_int(self, "lora_rank", 0)
    if self.lora_rank:
      from salt_jax.models.lora import check_targets
      _need(self.lora_alpha is None or (isinstance(self.lora_alpha, (int, float))
                                        and math.isfinite(self.lora_alpha) and self.lora_alpha > 0),
            f"lora_alpha must be None or > 0, got {self.lora_alpha!r}")
      check_targets(self.lora_targets, shape.num_layers)
    _need(self.init_params is None or os.path.isdir(self.init_params),
          f"init_params {self.init_params!r} is not a folder")
    _need(self.model is not None or self.tokenizer in ("qwen25", "toy")
          or os.path.isdir(self.tokenizer),
          f"tokenizer must be 'qwen25', 'toy' or a local folder, got {self.tokenizer!r}")


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
  """Sampling the group's trajectories."""

  group_size: int = _field(8, "trajectories per task, G")
  tasks_per_iter: int = _field(16, "tasks per iteration")
  max_new_tokens: int = _field(256, "response tokens per step at most")
  temperature: float = _field(1.0, "sampling temperature")
  top_p: float = _field(1.0, "nucleus sampling mass")
  top_k: int = _field(0, "top-k sampling (0: off)")
  prompt_history: Optional[int] = _field(None, "the prompt holds the last k (observation, action) "
                                         "steps (needs --layout step; default: the whole "
                                         "conversation)")
  prompt_task: str = _field("observation", "a windowed prompt's task line: observation (the "
                            "whole first observation) or goal (the text after 'Your task is "
                            "to: ', none at the first step: verl-agent's)")
  max_cache_len: int = _field(8192, "prompt + response tokens at most (the KV cache)")
  prompt_bucket_min: int = _field(128, "smallest sampler prompt bucket")
  prompt_buckets_per_doubling: int = _field(8, "sampler prompt buckets per doubling of length "
                                            "(1: powers of two, a prompt padded by up to half; "
                                            "8: by up to an eighth, more compiled prefills)")
  invalid_action_penalty: float = _field(0.1, "reward lost per invalid step")
  invalid_step: str = _field("admissible", "admissible (the parser or the env rejects the "
                             "action) or format (no parsable action: verl-agent's)")
  rollout_engine: str = _field("builtin", "what samples the rollouts: builtin (salt_jax's JAX "
                               "sampler) or vllm (vLLM's engine, fed the params after every "
                               "update; installed apart, see README; old log-probs are then "
                               "recomputed by the trainer; with several processes each runs "
                               "its own engine for its share of the tasks)")
  vllm_kv_cache_gib: int = _field(4, "the vllm engine's KV cache, whole GiB "
                                  "(VLLM_CPU_KVCACHE_SPACE, which vLLM reads as an int), per "
                                  "process")

  def validate(self) -> None:
    """ValueError naming the first bad field of this section."""
    # pylint: disable=import-outside-toplevel  (these import jax; building a config does not)
    from salt_jax.agent.prompts import TASK_LINES
    from salt_jax.engines import ROLLOUT_ENGINES
    from salt_jax.rollout import INVALID_STEP_MODES
    _one_of(self, "invalid_step", INVALID_STEP_MODES)
    _one_of(self, "rollout_engine", ROLLOUT_ENGINES)
    for name in ("group_size", "tasks_per_iter", "max_new_tokens", "prompt_bucket_min",
                 "prompt_buckets_per_doubling"):
      _pos_int(self, name)
    _pos_int(self, "top_k", 0)
    _need(self.max_cache_len > self.max_new_tokens + 16,
          f"max_cache_len ({self.max_cache_len}) must exceed max_new_tokens "
          f"({self.max_new_tokens}) + 16 to leave room for a prompt")
    _need(self.temperature > 0, f"temperature must be > 0, got {self.temperature}")
    _need(0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}")
    _need(self.invalid_action_penalty >= 0, "invalid_action_penalty must be >= 0")
    _need(self.prompt_history is None or self.prompt_history >= 0,
          f"prompt_history must be None or >= 0, got {self.prompt_history}")
    _one_of(self, "prompt_task", TASK_LINES)
    if self.rollout_engine == "vllm":
      _pos_int(self, "vllm_kv_cache_gib")


@dataclasses.dataclass(frozen=True)
class AlgorithmConfig:
  """Step advantages: the group estimator, the rewards it scores, and SALT."""

  algo: str = _field("grpo", "the group advantage estimator: a name in "
                     "salt_jax.advantages.ESTIMATORS")
  reward_scale: float = _field(1.0, "times the env's return (verl-agent: 10 per win)")
  penalty_scope: str = _field("trajectory", "trajectory (the penalty folded into the "
                              "trajectory's reward) or step (on the invalid step's own row: "
                              "verl-agent's)")
  group_stats: str = _field("trajectories", "group statistics over trajectories (one vote each) "
                            "or over step rows (steps: verl-agent's)")
  gamma: float = _field(1.0, "each step row's return discounted by the steps after it, "
                        "gamma ** (T - 1 - t) (1: the whole return on every row, verl-agent's "
                        "GRPO); with algo gigpo the discount of its step returns instead, its "
                        "episode scores undiscounted (verl-agent: 0.95); with algo ppo GAE's "
                        "discount per response token (verl-agent: 1)")
  gae_lambda: float = _field(1.0, "algo ppo: GAE's lambda (verl-agent: 1)")
  gae_scope: str = _field("step", "algo ppo: what one GAE sequence is: step (each step row on its "
                          "own, its shaped row reward on its last token: verl-agent's per-row "
                          "Monte Carlo) or trajectory (a trajectory's steps in turn, each step's "
                          "own reward on its last token, bootstrapping from the next step's "
                          "value)")
  gigpo_mode: str = _field("mean_std_norm", "GiGPO's normalisation of both advantages: "
                           "mean_std_norm (verl-agent's ALFWorld) or mean_norm (its WebShop)")
  step_advantage_w: float = _field(1.0, "GiGPO's weight of the step advantage")
  anchor_similarity: float = _field(1.0, "GiGPO's anchor states: 1 groups rows of one task "
                                    "that saw the same observation; below 1, observations whose "
                                    "difflib ratio reaches it (verl-agent's similarity mode)")
  salt: bool = _field(True, "SALT step-level advantages")
  salt_history: int = _field(3, "SALT's h: a merged state is the last h (action, observation) "
                             "pairs")
  embedder: Optional[str] = _field(None, "merge by embeddings: minilm or a local "
                                   "sentence-transformers folder (default: exact matches)")
  embed_threshold: float = _field(0.8, "cosine above which embedded states and actions merge")

  def validate(self) -> None:
    """ValueError naming the first bad field of this section."""
    # pylint: disable=import-outside-toplevel  (these import jax; building a config does not)
    from salt_jax.advantages import ESTIMATORS, GIGPO_MODES
    from salt_jax.rewards import GAE_SCOPES, GROUP_STATS, PENALTY_SCOPES
    _one_of(self, "algo", ESTIMATORS)
    _one_of(self, "penalty_scope", PENALTY_SCOPES)
    _one_of(self, "group_stats", GROUP_STATS)
    _one_of(self, "gae_scope", GAE_SCOPES)
    _one_of(self, "gigpo_mode", GIGPO_MODES)
    _pos_int(self, "salt_history")
    _positive(self, "reward_scale")
    _need(0 < self.gamma <= 1, f"gamma must be in (0, 1], got {self.gamma}")
    _need(0 <= self.gae_lambda <= 1, f"gae_lambda must be in [0, 1], got {self.gae_lambda}")
    _need(math.isfinite(self.step_advantage_w) and self.step_advantage_w >= 0,
          f"step_advantage_w must be >= 0, got {self.step_advantage_w}")
    _need(0 < self.anchor_similarity <= 1,
          f"anchor_similarity must be in (0, 1], got {self.anchor_similarity}")
    _need(self.embedder in (None, "none", "minilm") or os.path.isdir(self.embedder),
          f"embedder must be None, 'minilm' or a local sentence-transformers folder, got "
          f"{self.embedder!r}")
    _need(0 < self.embed_threshold <= 1, f"embed_threshold must be in (0, 1], got "
          f"{self.embed_threshold}")


@dataclasses.dataclass(frozen=True)
class UpdateConfig:
  """The PPO-clip update and its optimizer."""

  layout: str = _field("trajectory", "trajectory (one sequence per trajectory) or step (one row "
                       "per step)")
  recompute_old_logprobs: bool = _field(False, "old log-probs under the current params instead "
                                        "of the sampler's")
  rollout_is_threshold: Optional[float] = _field(
      None, "truncated importance sampling (TIS, verl's token-level rollout IS): weight each "
      "token's surrogate by min(pi_old / pi_sampler, T), the trainer's old log-prob against the "
      "sampler's; needs the trainer's own old log-probs (recompute_old_logprobs, or a rollout "
      "engine). None: off")
  lr: float = _field(1e-6, "peak learning rate (AdamW)")
  weight_decay: float = _field(0.01, "AdamW weight decay")
  warmup_steps: int = _field(0, "linear warmup, in optimizer steps")
  schedule: str = _field("constant", "constant or cosine (decay over the run)")
  max_grad_norm: float = _field(1.0, "global-norm gradient clipping")
  clip_eps: float = _field(0.2, "PPO clip range")
  clip_eps_high: Optional[float] = _field(None, "upper clip range (default: clip_eps)")
  dual_clip: Optional[float] = _field(None, "dual-clip constant c for negative advantages")
  kl_coef: float = _field(0.01, "KL-to-reference coefficient (0: the reference is not evaluated "
                          "and the logged kl is 0)")
  kl_estimator: str = _field("k3", "k1, k2 or k3")
  loss_agg: str = _field("token-mean", "token-mean, seq-mean-token-mean or seq-mean-token-sum")
  ppo_epochs: int = _field(1, "passes over the batch per iteration")
  minibatch_rows: int = _field(8, "rows per optimizer step")
  microbatch_rows: int = _field(0, "rows per forward/backward pass, gradients accumulated over "
                                "the mini-batch (0: all at once); a multiple of the mesh's data "
                                "axis")
  microbatch_lengths: str = _field("shared", "shared: every micro-batch padded to its "
                                   "mini-batch's longest row (one update program, TPU's "
                                   "choice); own: rows of like length grouped into micro-batches, "
                                   "each cut to its own longest row (a program per length; "
                                   "rows of varied length, e.g. ALFWorld's, on CPU or GPU)")
  logprob_microbatch_rows: int = _field(0, "rows per pass of the old and reference log-prob "
                                        "programs (a forward pass keeps no activations for a "
                                        "backward one, so it can take more rows than "
                                        "microbatch_rows); 0: as microbatch_rows; a multiple of "
                                        "the mesh's data axis")
  remat_policy: str = _field("none", "what the update's backward pass recomputes: a name in "
                             "salt_jax.models.REMAT_POLICIES (full: each decoder layer's "
                             "activations, keeping only its input)")
  critic_lr: float = _field(1e-5, "algo ppo: the critic's learning rate, constant (AdamW with "
                            "the policy's weight decay and gradient clipping; verl-agent: 1e-5)")
  value_clip: Optional[float] = _field(0.5, "algo ppo: how far a value may move from the "
                                       "rollout's before its error is clipped (verl's "
                                       "cliprange_value); None: no clipping")
  critic_warmup: int = _field(0, "algo ppo: iterations that train the critic alone before the "
                              "policy's updates start (verl's trainer.critic_warmup)")
  min_seq_len: int = _field(64, "shortest padded row length")
  logprob_chunk: int = _field(256, "vocabulary projection chunk (tokens)")

  def validate(self) -> None:
    """ValueError naming the first bad field of this section."""
    # pylint: disable=import-outside-toplevel  (these import jax; building a config does not)
    from salt_jax.loss import KL_ESTIMATORS, LOSS_AGG_MODES
    from salt_jax.models.config import REMAT_POLICIES
    _one_of(self, "schedule", SCHEDULES)
    _one_of(self, "layout", LAYOUTS)
    _one_of(self, "kl_estimator", KL_ESTIMATORS)
    _one_of(self, "loss_agg", LOSS_AGG_MODES)
    _one_of(self, "remat_policy", REMAT_POLICIES)
    _one_of(self, "microbatch_lengths", MICROBATCH_LENGTHS)
    for name in ("ppo_epochs", "minibatch_rows", "min_seq_len", "logprob_chunk"):
      _pos_int(self, name)
    for name in ("warmup_steps", "microbatch_rows", "logprob_microbatch_rows", "critic_warmup"):
      _pos_int(self, name, 0)
    _need(self.microbatch_rows == 0 or self.minibatch_rows % self.microbatch_rows == 0,
          f"microbatch_rows ({self.microbatch_rows}) must divide minibatch_rows "
          f"({self.minibatch_rows})")
    _need(self.logprob_microbatch_rows == 0
          or self.minibatch_rows % self.logprob_microbatch_rows == 0,
          f"logprob_microbatch_rows ({self.logprob_microbatch_rows}) must divide minibatch_rows "
          f"({self.minibatch_rows})")
    _positive(self, "lr")
    _need(math.isfinite(self.weight_decay) and self.weight_decay >= 0,
          f"weight_decay must be >= 0, got {self.weight_decay}")
    _need(self.max_grad_norm > 0, f"max_grad_norm must be > 0, got {self.max_grad_norm}")
    _need(self.kl_coef >= 0, f"kl_coef must be >= 0, got {self.kl_coef}")
    _need(self.clip_eps > 0, f"clip_eps must be > 0, got {self.clip_eps}")
    _need(self.clip_eps_high is None or self.clip_eps_high > 0,
          f"clip_eps_high must be None or > 0, got {self.clip_eps_high}")
    _need(self.dual_clip is None or self.dual_clip > 1,
          f"dual_clip must be None or > 1 (verl uses 3.0), got {self.dual_clip}")
    _positive(self, "critic_lr")
    if self.rollout_is_threshold is not None:
      _positive(self, "rollout_is_threshold")
    _need(self.value_clip is None or (math.isfinite(self.value_clip) and self.value_clip > 0),
          f"value_clip must be None or > 0, got {self.value_clip}")


@dataclasses.dataclass(frozen=True)
class RunConfig:
  """The run: how long, where, on which devices, with which processes."""

  iters: int = _field(100, "training iterations")
  seed: int = _field(0, "PRNG seed (params, sampling, task order)")
  mesh: str = _field("1x1", "DxM device mesh ('data' x 'model'); CPU devices are simulated when "
                     "the machine has fewer")
  out: str = _field("runs/default", "output folder")
  resume: bool = _field(False, "continue from the last checkpoint in --out")
  checkpoint_every: int = _field(1, "save every N iterations (and after the last)")
  max_to_keep: int = _field(2, "checkpoints kept")
  async_checkpoint: bool = _field(True, "write checkpoints in the background (orbax's async "
                                  "save): the loop goes on once the arrays are in host memory; "
                                  "off: a save returns when its checkpoint is complete")
  compilation_cache: Optional[str] = _field(
      None, "a folder that keeps XLA's compiled programs for later processes (a resumed run, "
      "the next run of a study) to load instead of compiling; on a CPU kept per CPU model and "
      "instruction set")
  clear_programs_above: float = _field(
      0.5, "after an iteration that leaves this process's resident memory above this share of "
      "the machine's memory, drop every compiled program (jax.clear_caches; later calls compile "
      "them again or load them from --compilation-cache): XLA keeps each program's code "
      "resident, and a run that keeps meeting new shapes (prompt buckets, micro-batch lengths) "
      "grows by them until it is killed. 1: never; 0: after every iteration")
  tensorboard: bool = _field(True, "write TensorBoard event files")
  progress: bool = _field(True, "show each phase's progress (a line per iteration, bars inside a "
                          "rollout and an update)")
  tracker: Optional[str] = _field(None, "also send each row to wandb or mlflow (installed "
                                  "separately; their own settings from their environment); "
                                  "--resume continues the same tracker run (<out>/tracker.json)")
  distributed: bool = _field(False, "join several processes (jax.distributed; a TPU pod's or "
                             "SLURM's are auto-detected)")
  coordinator: Optional[str] = _field(None, "host:port of process 0 (implies --distributed)")
  num_processes: Optional[int] = _field(None, "processes in the run")
  process_id: Optional[int] = _field(None, "this process's index")

  def validate(self) -> None:
    """ValueError naming the first bad field of this section: the output folder can be made,
    the mesh string parses (whether its devices exist is checked at setup), the processes."""
    # pylint: disable=import-outside-toplevel  (these import jax; building a config does not)
    from salt_jax import multihost
    from salt_jax.metrics import TRACKERS
    from salt_jax.sharding import parse_mesh_shape
    _one_of(self, "tracker", (None, *TRACKERS))
    for name in ("iters", "checkpoint_every", "max_to_keep"):
      _pos_int(self, name)
    _pos_int(self, "seed", 0)
    check_output_folder(self.out)
    _need(isinstance(self.clear_programs_above, (int, float))
          and not isinstance(self.clear_programs_above, bool)
          and 0 <= self.clear_programs_above <= 1,
          f"clear_programs_above must be a share of memory in [0, 1], got "
          f"{self.clear_programs_above!r}")
    parse_mesh_shape(self.mesh)
    if self.coordinator is not None or self.num_processes is not None \
        or self.process_id is not None:
      _need(self.distributed, "coordinator / num_processes / process_id need distributed=True")
    multihost.check_coordinator(self.coordinator)
    if self.num_processes is not None:
      _pos_int(self, "num_processes")
      _need(self.process_id is None or (isinstance(self.process_id, int)
                                        and 0 <= self.process_id < self.num_processes),
            f"process_id must be in [0, {self.num_processes}), got {self.process_id!r}")


def check_output_folder(out: str, name: str = "out") -> None:
  """Raises ValueError, naming `name` (the field or flag), unless `out` can be an output folder:
  an existing folder, or a path not yet there whose nearest existing parent is a folder
  (`os.makedirs` refuses a path through a file)."""
  if not isinstance(out, str) or not out:
    raise ValueError(f"{name} must be a folder path, got {out!r}")
  path = os.path.abspath(os.path.expanduser(out))
  while not os.path.exists(path) and os.path.dirname(path) != path:
    path = os.path.dirname(path)
  if os.path.isdir(path):
    return
  if path == os.path.abspath(os.path.expanduser(out)):
    raise ValueError(f"{name} {out!r} is a file, not a folder; pick a folder")
  raise ValueError(f"{name} {out!r} cannot be made: {path} is a file, not a folder")


# Fields renamed since runs were saved, old name -> new: `from_json`, `--resume` and the command
# line read the old names too.
RENAMED_FIELDS = {"history": "salt_history", "history_window": "prompt_history"}


def with_current_names(data: dict) -> dict:
  """`data` (a saved config) with renamed fields under their current names."""
  return {RENAMED_FIELDS.get(k, k): v for k, v in data.items()}


SECTIONS = (EnvConfig, PolicyConfig, RolloutConfig, AlgorithmConfig, UpdateConfig, RunConfig)

@dataclasses.dataclass(frozen=True)
class TrainConfig(RunConfig, UpdateConfig, AlgorithmConfig, RolloutConfig, PolicyConfig,
                  EnvConfig):
  """Everything one run needs (the fields of all six sections); `validate()` checks it."""

  def validate(self) -> None:
    """Raises ValueError naming the first bad field (called before any work): each section's own
    fields (`EnvConfig.validate`, ... `RunConfig.validate`, in that order), then what sections
    ask of each other."""
    # pylint: disable=import-outside-toplevel  (these import jax; building a config does not)
    from salt_jax.advantages import ESTIMATORS
    from salt_jax.engines import check_vllm_engine
    for section in SECTIONS:
      section.validate(self)
    _need(self.group_size >= 2 or ESTIMATORS[self.algo].critic,
          f"group_size {self.group_size} gives {self.algo} no baseline: each trajectory is its "
          "own group, so every advantage is 0 and nothing is learned; use group_size >= 2 (or "
          "algo ppo, whose baseline is a critic)")
    _need(not (self.layout == "trajectory" and self.prompt_history is not None),
          "layout 'trajectory' (one sequence per trajectory) needs whole-history prompts; "
          "use layout='step' with a prompt_history")
    _need(self.rollout_is_threshold is None or self.recompute_old_logprobs
          or self.rollout_engine != "builtin",
          "rollout_is_threshold weighs the trainer's old log-probs against the sampler's: set "
          "recompute_old_logprobs (or a rollout engine), or the weights are all 1")
    if self.rollout_engine == "vllm":
      check_vllm_engine(self.policy_shape())  # installed, and a head size its CPU attention runs


  def to_json(self) -> dict:
    return json.loads(json.dumps(dataclasses.asdict(self), default=str))

  @classmethod
  def from_json(cls, data: dict, *, ignore_unknown: bool = False) -> "TrainConfig":
    """The config `to_json` wrote (JSON lists back to tuples). A field this version does not
    have raises ValueError naming it, or is dropped with `ignore_unknown` (an older run's)."""
    names = {f.name for f in dataclasses.fields(cls)}
    data = with_current_names(data)
    unknown = sorted(set(data) - names)
    if unknown and not ignore_unknown:
      raise ValueError(f"unknown config fields: {', '.join(unknown)}")
    return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in data.items()
                  if k in names})

  @classmethod
  def load(cls, path: str, *, ignore_unknown: bool = False) -> "TrainConfig":
    """The config in JSON file `path` (a run's config.json), as `from_json` reads it."""
    with open(path, encoding="utf-8") as f:
      return cls.from_json(json.load(f), ignore_unknown=ignore_unknown)

  @classmethod
  def from_recipe(cls, name: str, **overrides) -> "TrainConfig":
    """The config of `salt_jax.recipes.RECIPES[name]`, with `overrides` on top."""
    if name not in configs.RECIPE_NAMES:
      raise ValueError(f"unknown recipe {name!r}; known: {sorted(configs.RECIPE_NAMES)}")
    return cls(**{**read_config_files([name])[0], **overrides})


def read_config_files(names: Iterable[str]) -> tuple[dict[str, Any], dict[str, Any]]:
  """(config fields, script settings) of the config files `names` (`salt_jax.configs`), later
  values winning: a TOML file's keys (renamed fields under their new names, lists as tuples), a
  JSON file's whole config (`TrainConfig.from_json`). ValueError naming the file for an unknown
  key, or for what `configs.read` refuses."""
  fields = {f.name for f in dataclasses.fields(TrainConfig)}
  values, script = {}, {}
  for path, data in configs.read(names):
    if path.endswith(".json"):
      try:
        values.update(dataclasses.asdict(TrainConfig.from_json(data)))
      except (TypeError, ValueError) as e:
        raise ValueError(f"{path}: {e}") from None
      continue
    data = with_current_names(data)
    unknown = sorted(set(data) - fields - set(configs.SCRIPT_KEYS))
    if unknown:
      raise ValueError(f"{path}: unknown config fields: {', '.join(unknown)}")
    for k, v in data.items():
      (script if k in configs.SCRIPT_KEYS else values)[k] = tuple(v) if isinstance(v, list) else v
  return values, script


def script_defaults(*names: str) -> dict[str, Any]:
  """The fields and script settings of the config files `names` in one dict: an experiment
  script's `defaults` (`salt_jax.cli.main`)."""
  fields, script = read_config_files(names)
  return {**fields, **script}


def section_of(name: str) -> type:
  """The section dataclass that declares field `name`."""
  for section in SECTIONS:
    if name in {f.name for f in dataclasses.fields(section)}:
      return section
  raise KeyError(name)


def parse_overrides(items: Sequence[str]) -> dict:
  """`TrainConfig` overrides from "FIELD=VALUE" strings (the scripts' `--set`): each value a Python
  literal (`lr=3e-4`, `env_kwargs={"num_rooms": 2}`), else the bare string (`tokenizer=toy`).
  A missing "=" or a name that is not a `TrainConfig` field is a ValueError."""
  fields = {f.name for f in dataclasses.fields(TrainConfig)}
  out = {}
  for item in items:
    name, sep, value = item.partition("=")
    if not sep:
      raise ValueError(f"an override is FIELD=VALUE, got {item!r}")
    if name not in fields:
      raise ValueError(f"{name!r} is not a TrainConfig field (in {item!r})")
    try:
      out[name] = ast.literal_eval(value)
    except (ValueError, SyntaxError):
      out[name] = value
  return out
