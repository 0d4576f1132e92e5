"""The training iteration: rollout -> batch -> step advantages -> update -> log -> save.

`Trainer.iteration()` reads top to bottom (each phase timed, as in the paper's cost breakdown):

  rollout      `rollout.collect`: G trajectories for each of `tasks_per_iter` tasks, one row per
               step. Failed (crashed) trajectories are counted and dropped.
  salt         (SALT on) `build_merge_ids` on the host: each step's merged-edge id.
  values       (algo ppo) the critic's value of every token (`salt_jax.critic`).
  advantage    `update.step_advantages`, one jitted program: the group estimator
               (`advantages.ESTIMATORS[algo]`) over the step rows' rewards against their group's
               statistics (or GAE over the critic's values, per token), then SALT's `refine`
               over the merged edges.
  old_logprob  from the sampler (`policy_logprobs`), or recomputed with the current params.
  ref_logprob  log-probs under the frozen initial policy (the KL reference).
  update       PPO-clip (+ KL to the reference) over shuffled mini-batches
               (`update.update_programs`),
               AdamW with global-norm clipping; with a critic, its clipped value loss on each
               mini-batch first (`critic.critic_programs`), both through `state.update_step`. A
               mini-batch whose loss or gradient is not finite is skipped and counted. When every
               step advantage is 0 there is nothing to learn: the log-prob and update phases are
               skipped (`num_updates` 0).

The mini-batches go to the device once, before the log-prob phases, which fill them there; the
update's metrics come back once, after its last step. The trained state is one
`state.TrainState` (params, optimizer state, PRNG key, critic): what the update consumes and
returns, and what a checkpoint saves (`checkpoint.RunCheckpoints`), beside the task sampler's
position and the counters.

Each iteration then logs metrics (`metrics.jsonl`, TensorBoard) and saves a checkpoint. The log
is cut back to the restored iteration on resume, so a run killed at any moment resumes as if it
had never stopped.
SALT on or off changes only the advantages: the PRNG stream, task order, env seeds and every
other computation are the same.

With several processes (`TrainConfig.distributed`, `salt_jax.multihost`) each plays its share of
the tasks and every later phase runs on the gathered global batch, on a mesh over all processes.

Shapes are bucketed so each jitted function compiles once per bucket: trajectories are padded to
tasks_per_iter * G, steps and merged-edge counts to powers of two, token rows to `minibatch_rows`
and their length to a power of two or 1.5 times one (`batching.bucket_length`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import platform
import time
from typing import Any, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental.compilation_cache import compilation_cache

from envs import registry
from salt_jax import batching
from salt_jax import checkpoint
from salt_jax import metrics as metrics_lib
from salt_jax import log as log_lib
from salt_jax.log import progress_bar
from salt_jax import multihost
from salt_jax import runlock
from salt_jax.advantages import ESTIMATORS, count_invalid_rewards
from salt_jax.agent.prompts import STOP_STRING, env_prompt_config, stop_token_ids
from salt_jax.config import TrainConfig
from salt_jax.critic import critic_optimizer, critic_programs, init_critic
from salt_jax.graph import (build_merge_ids, cross_prompt_merges, gradient_changing_merges,
                            sample_ids)
from salt_jax.loss import rollout_is_weights
from salt_jax.models import lora
from salt_jax.models.build import build_policy, build_tokenizer
from salt_jax.rollout import SamplingParams, collect
from salt_jax.sampling import length_buckets
from salt_jax.state import TrainState, UpdatePrograms, update_step
from salt_jax.sharding import (DATA_AXIS, batch_sharding, make_mesh, on_mesh, parse_mesh_shape,
                               replicated)
from salt_jax.update import (estimator_options, lr_schedule, microbatch_programs, optimizer,
                             step_advantages_program, update_programs)

logger = logging.getLogger(__name__)

# The critic's update metrics (algo ppo), NaN in an iteration that took no critic step.
CRITIC_METRICS = ("value_loss", "value_clip_fraction", "value_mean", "critic_grad_norm")

# What the log-prob program reads of a mini-batch.
_LOGPROB_FIELDS = ("input_ids", "targets", "attention_mask", "positions", "logit_positions")

# SALT's metrics in an iteration without merges (SALT off, or no step to merge).
NO_MERGE_METRICS = dict(merge_rate=float("nan"), cross_prompt_merges=0, gradient_changing_merges=0,
                        merged_steps=0, gradient_changing_share=float("nan"),
                        response_differing_merges=0)


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


class IterationData(NamedTuple):
  """What the last iteration trained on (`Trainer.last`), for inspection: notebooks, debugging.

  rollout: the global `RolloutBatch`; local_rollout: this process's share (None if it played
  none); minibatches: the host mini-batches the update used; advantages: (before, after) SALT,
  f32[steps] on the host; step_adv: the padded device array the update read.
  """

  rollout: Any
  local_rollout: Any
  minibatches: Optional[list]
  advantages: Optional[tuple]
  step_adv: Any


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


def rollout_metrics(full, batch) -> dict:
  """The rollout's metrics: `full` as played, `batch` its trainable part (failed ones out)."""
  rm = full.metrics
  m = {"success_rate": rm["success_rate"], "score": rm["score"],
       "episode_length": rm["mean_steps"],
       "valid_action_ratio": rm["valid_action_ratio"], "num_trajectories": full.num_trajectories,
       "failed_trajectories": int(full.failed.sum()), "env_restarts": rm["env_restarts"],
       "response_tokens": rm["response_tokens"], "num_steps": batch.num_total_steps,
       "prompt_tokens": rm["prompt_tokens"],
       "prefilled_prompt_tokens": rm["prefilled_prompt_tokens"],
       "time/rollout_generate": rm["gen_time_s"], "time/rollout_env": rm["env_time_s"],
       "reward/mean": float(np.mean(full.outcome_rewards[~full.failed]))
       if (~full.failed).any() else float("nan")}
  for tt, v in rm["success_rate_by_type"].items():
    m[f"success_rate/{tt}"] = v
  m["invalid_rewards"] = int(count_invalid_rewards(batch.outcome_rewards))
  return m


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


def sampled_success(trainer: "Trainer", rounds: int, first_seed: int,
                    group_size: Optional[int] = None, tasks: Optional[Sequence] = None) -> dict:
  """Sampled success of the trainer's current policy on `tasks` (default: its training tasks):
  `rounds` rounds of `group_size` (default: the trainer's G) trajectories of every task
  (`Trainer.collect_rollout`), round r with key and listing-order seed `first_seed + r`; failed
  trajectories left out. A fixed `group_size` measures runs that train with different G on the
  same footing; held-out tasks measure what the training did not see.

  Returns {"all": success, <task type>: its success, "valid_steps": the rounds' mean valid-step
  share, "trajectories": how many were counted, "rounds": each round's success, "tasks": {task id:
  its success}} (rates rounded to 4 places).
  """
  if group_size is None:
    group_size = trainer.config.group_size
  elif group_size < 1:
    raise ValueError(f"group_size must be >= 1, got {group_size}")
  tasks = trainer.task_sampler.tasks if tasks is None else list(tasks)
  if not tasks:
    raise ValueError("sampled_success needs at least one task")
  won, types, ids, valid, per_round = [], [], [], [], []
  for r in range(rounds):
    seed = first_seed + r
    batch = trainer.collect_rollout(tasks, jax.random.key(seed), seed=seed, group_size=group_size)
    kept = ~batch.failed
    won.append(batch.success[kept])
    types.append(np.asarray(batch.task_types)[kept])
    ids.append(np.asarray(batch.task_ids)[kept])
    valid.append(batch.metrics["valid_action_ratio"])
    per_round.append(round(float(won[-1].mean()), 4))
  won, types, ids = np.concatenate(won), np.concatenate(types), np.concatenate(ids)
  out = {"all": float(won.mean())}
  out.update({t: float(won[types == t].mean()) for t in sorted(set(types.tolist()))})
  out["valid_steps"] = float(np.mean(valid))
  out = {k: round(v, 4) for k, v in out.items()}
  out["trajectories"] = int(won.size)
  out["rounds"] = per_round  # each round's own success: the first rounds are a shorter measurement
  out["tasks"] = {t: round(float(won[ids == t].mean()), 4) for t in sorted(set(ids.tolist()))}
  return out


def _cpu_signature() -> str:
  """The CPU's model and instruction-set flags (Linux), else what `platform` knows."""
  try:
    with open("/proc/cpuinfo", encoding="utf-8") as f:
      info = dict(line.split(":", 1) for line in f if ":" in line)
    return (info.get("model name\t", "") + info.get("flags\t", "")).strip()
  except OSError:
    return platform.machine() + platform.processor()


def use_compilation_cache(folder: str, min_compile_seconds: float = 1.0) -> str:
  """Makes this process keep XLA's compiled programs in `folder` and load them from there, so a
  later process (a resumed run, the next run of a study) skips the compiles: jax's persistent
  compilation cache, for programs that took at least `min_compile_seconds` to compile. On a
  CPU the programs go to a subfolder named by the CPU's model and instruction-set flags: code
  compiled for one CPU may not run, or round alike, on another. Returns the folder used."""
  backend = jax.default_backend()
  if backend == "cpu":
    backend += "-" + hashlib.sha256(_cpu_signature().encode()).hexdigest()[:12]
  path = os.path.join(os.path.abspath(folder), backend)
  os.makedirs(path, exist_ok=True)
  jax.config.update("jax_compilation_cache_dir", path)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", min_compile_seconds)
  compilation_cache.reset_cache()  # a process that compiled before reads the setting again
  return path


class _PhaseTimes(dict):
  """{phase: seconds}; `with times("update"): ...` records one phase."""

  @contextlib.contextmanager
  def __call__(self, phase: str):
    t0 = time.perf_counter()
    try:
      yield
    finally:
      self[phase] = self.get(phase, 0.0) + time.perf_counter() - t0


# ----------------------------------------------------------------------------- the trainer


class Trainer:
  """Owns the policy, reference, optimizer, env pool, sampler, logger and checkpoints of one run.

  Usage: `Trainer(config).run()`, or `setup()` then `iteration()` repeatedly. Checkpoints are
  written in the background (`config.async_checkpoint`): the last one is complete when `run()`
  or `close()` returns, or after `checkpoints.wait()`. From construction to `close()` the run
  holds its folder (`salt_jax.runlock`): a trainer of another process on it is refused at once.
  """

  def __init__(self, config: TrainConfig):
    config.validate()
    self.config = config
    if config.progress:  # a notebook or a script that set up no logging still shows the phases
      log_lib.configure(only_if_unset=True)
    if config.distributed:  # before any other jax use
      multihost.initialize(config.coordinator, config.num_processes, config.process_id)
    if config.compilation_cache:
      use_compilation_cache(config.compilation_cache)
    self.num_processes, self.process_index = jax.process_count(), jax.process_index()
    devices = None if self.num_processes == 1 else multihost.mesh_devices(
        *parse_mesh_shape(config.mesh))
    self.mesh = make_mesh(config.mesh, devices)  # an unformable mesh fails here, before any work
    self.data_size = int(self.mesh.shape[DATA_AXIS])
    for name in ("microbatch_rows", "logprob_microbatch_rows"):
      if getattr(config, name) % self.data_size:
        raise ValueError(f"{name} ({getattr(config, name)}) must be a multiple of the mesh's "
                         f"data axis ({self.data_size}): each micro-batch is split over it")
    self.checkpoints = checkpoint.RunCheckpoints(config, self.mesh)
    # One process per run folder, from here to `close()`: another one training there is named
    # and refused before anything is built or written (after the config checks above, so that a
    # refused config leaves no folder behind).
    self.run_lock = self._lock_folder()
    try:
      self.checkpoints.check_start()  # a new run over old checkpoints, or a changed resume: refused
    except BaseException:
      if self.run_lock is not None:
        self.run_lock.release()
      raise
    self._pool = None
    self._logger = None
    self._opened = False
    self.iteration_index = 0
    self.skipped_updates_total = 0
    self._plans: list = []  # per mini-batch: its micro-batches with microbatch_lengths "own"
    self.applied_updates = 0  # optimizer steps taken (the schedule's position)
    self._last_save_s = None  # the last checkpoint's save time, logged with the next row
    self.last: Optional[IterationData] = None
    # bars inside a phase (rollout turns, update mini-batches): process 0 speaks for all
    self._show_progress = config.progress and self.process_index == 0
    self._local_rollout = None
    self.times = _PhaseTimes()

  def _lock_folder(self) -> Optional[runlock.RunLock]:
    """Process 0's lock on `config.out` (None on the others); with several processes all of them
    learn whether process 0 got it, so all stop together when it did not."""
    lock, refused = None, None
    if self.process_index == 0:
      try:
        lock = runlock.RunLock(self.config.out).acquire()
      except (runlock.RunInUse, OSError) as e:
        if self.num_processes == 1:
          raise
        refused = e
    if self.num_processes > 1:
      said = multihost.allgather_objects(None if refused is None else str(refused))[0]
      if refused is not None:
        raise refused
      if said is not None:
        raise runlock.RunInUse(f"process 0 could not lock the run folder: {said}")
    return lock

  # ---------------------------------------------------------------- setup

  def setup(self) -> "Trainer":
    """Builds everything; restores the last complete checkpoint when `config.resume`."""
    # pylint: disable=import-outside-toplevel
    from envs.pool import EnvPool
    from salt_jax.sampling import Sampler

    cfg = self.config
    t_setup = time.perf_counter()
    logger.info("setup: tokenizer %r", cfg.tokenizer if cfg.model is None else cfg.model)
    self.tokenizer = build_tokenizer(cfg)
    self.pad_id = int(self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None
                      else self.tokenizer.eos_token_id)

    # policy, reference (the initial policy, frozen), optimizer, PRNG key
    logger.info("setup: policy %s (%s%s) on a %s mesh", cfg.model or "tiny random Qwen2",
                cfg.param_dtype, f", {cfg.compute_dtype} compute" if cfg.compute_dtype else "",
                "x".join(str(v) for v in self.mesh.shape.values()))
    self.model = build_policy(cfg, self.tokenizer, self.mesh)
    # Processes play different tasks, so each samples on its own devices alone: with several, the
    # sampler has its own copy of the policy there (`_sync_sampler`).
    sampler_mesh = self.mesh if self.num_processes == 1 else multihost.local_mesh(self.mesh)
    self.sampler_model = self.model if self.num_processes == 1 else build_policy(
        cfg, self.tokenizer, sampler_mesh)
    # Trained: every parameter, or with LoRA the adapters alone; `frozen` is the rest (the base,
    # shared with `self.model`: held once, never donated, differentiated or given to AdamW).
    self.trainable = lora.trained_filter(self.model)
    self.graphdef, params, self.frozen = nnx.split(self.model, self.trainable, ...)
    # The reference is the initial policy: with LoRA the base with its initial adapters (B = 0,
    # the adapters off), so only the adapters are copied.
    self.ref_params = jax.tree.map(jnp.copy, params)
    self.ref_fingerprints = checkpoint.fingerprints(self._reference_tree())
    self.schedule = lr_schedule(cfg)
    self.tx = optimizer(cfg, self.schedule)
    # PPO's critic (`salt_jax.critic`): the policy's trained state copied, a new value head, and
    # its own optimizer; with LoRA its own adapters on the same frozen base.
    critic = critic_opt_state = None
    if ESTIMATORS[cfg.algo].critic:
      self.critic_tx = critic_optimizer(cfg)
      critic = on_mesh(init_critic(params, self.model.config.hidden_size,
                                   jax.random.key(cfg.seed + 1)), self.mesh)
      critic_opt_state = on_mesh(self.critic_tx.init(critic), self.mesh)
    # The key on the mesh like every other piece of state, so a checkpoint restores it there (a
    # key on one device meets the params on all of them in the sampler); orbax saves only arrays
    # on the global mesh in a multi-process run.
    self.state = TrainState(
        params=params, opt_state=on_mesh(self.tx.init(params), self.mesh),
        key=jax.random.wrap_key_data(jax.device_put(
            jax.random.key_data(jax.random.key(cfg.seed)), replicated(self.mesh))),
        critic=critic, critic_opt_state=critic_opt_state)

    # tasks, environments, sampler, prompts, SALT's embedder
    self.task_sampler = TaskSampler(registry.training_tasks(cfg), cfg.seed)
    self.eval_splits = (cfg.eval_splits if cfg.eval_splits is not None
                        else registry.entry(cfg.env).eval_splits)
    logger.info("setup: %d training tasks of %s, %d env worker(s)",
                len(self.task_sampler.tasks), cfg.env, cfg.env_workers)
    self._pool = EnvPool(cfg.env, {"max_steps": cfg.max_steps, **cfg.env_kwargs},
                         cfg.env_workers)
    if cfg.rollout_engine == "vllm":  # given the current params by `_sync_sampler` below
      from salt_jax.engines.vllm_engine import VLLMEngine
      logger.info("setup: starting the vllm rollout engine (about a minute)")
      self.sampler = VLLMEngine.from_model(
          self.sampler_model, self.tokenizer,
          model_path=cfg.model if cfg.model is not None and os.path.isdir(cfg.model) else None,
          eos_token_ids=stop_token_ids(self.tokenizer), max_model_len=cfg.max_cache_len,
          dtype=cfg.compute_dtype or cfg.param_dtype, kv_cache_gib=cfg.vllm_kv_cache_gib,
          seed=cfg.seed)
    else:
      self.sampler = Sampler(self.sampler_model, eos_token_ids=stop_token_ids(self.tokenizer),
                             pad_token_id=self.pad_id, max_cache_len=cfg.max_cache_len,
                             mesh=sampler_mesh, prompt_buckets=length_buckets(
                                 cfg.prompt_bucket_min, cfg.max_cache_len,
                                 cfg.prompt_buckets_per_doubling))
    self.embedder = None
    if cfg.salt and cfg.embedder not in (None, "none"):
      from salt_jax.embedders import SentenceEmbedder
      self.embedder = SentenceEmbedder(None if cfg.embedder == "minilm" else cfg.embedder)
    self.prompt_config = env_prompt_config(cfg.env, history_window=cfg.prompt_history)
    self.sampling = SamplingParams(temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
                                   stop_strings=(STOP_STRING,))

    self._build_programs()

    # output folder, checkpoints (resumed from the newest intact one), metrics log
    os.makedirs(cfg.out, exist_ok=True)
    if self.process_index == 0:  # the other processes' files would be the same
      with open(os.path.join(cfg.out, "config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg.to_json(), f, indent=1, sort_keys=True)
    self.checkpoints.open()
    self._opened = True
    resumed = cfg.resume and self.checkpoints.latest_step() is not None
    if resumed:
      self._load(*self.checkpoints.restore_latest_intact(self._state_tree()))
      logger.info("setup: resumed from checkpoint %d of %s", self.iteration_index, cfg.out)
    self._sync_sampler()
    tracker = None
    if cfg.tracker is not None and self.process_index == 0:  # a resumed run continues its own
      tracker = metrics_lib.open_tracker(cfg.tracker, cfg.out, resume=resumed,
                                         config=cfg.to_json())
    self._logger = metrics_lib.MetricsLogger(
        cfg.out, tensorboard=cfg.tensorboard,
        truncate_from=self.iteration_index if resumed else None, write=self.process_index == 0,
        tracker=tracker)
    n_params = sum(x.size for x in jax.tree.leaves(self.state.params))
    n_frozen = sum(x.size for x in jax.tree.leaves(self.frozen))
    logger.info("setup done in %.1fs: %.2fM trained parameters%s, writing to %s",
                time.perf_counter() - t_setup, n_params / 1e6,
                f" (LoRA rank {cfg.lora_rank}; {n_frozen / 1e6:.1f}M frozen)" if n_frozen else "",
                cfg.out)
    return self

  def _sync_sampler(self) -> None:
    """Gives the sampler's policy the current params (all processes call it together); a
    separate rollout engine (`config.rollout_engine`) gets a copy, timed as phase 'weight_sync':
    with LoRA the merged weights W + A B alpha / R (one matmul per projection on the host; vLLM's
    own adapters would add that work to every sampled token). With several processes each
    process's engine is loaded from that process's own copy (`sampler_model`)."""
    params = self.state.params
    nnx.update(self.model, params)
    if self.sampler_model is not self.model:
      nnx.update(self.sampler_model, multihost.copy_params(
          params, nnx.state(self.sampler_model, self.trainable), self.mesh))
    if self.config.rollout_engine != "builtin":
      with self.times("weight_sync"):
        self.sampler.update_params(
            lora.merged_params(self.sampler_model) if self.config.lora_rank
            else nnx.state(self.sampler_model, self.trainable))

  def _build_programs(self) -> None:
    """The jitted log-prob and update programs for the current config (again after a change)."""
    self.rows = -(-self.config.minibatch_rows // self.data_size) * self.data_size
    shard_of = lambda tree: jax.tree.map(lambda x: x.sharding, tree)  # noqa: E731
    st = self.state
    self._logprobs, train_step = update_programs(
        self.config, self.graphdef, self.tx, self.rows, shard_of(st.params),
        shard_of(st.opt_state))
    critic_step = None
    if st.critic is not None:
      self._values, critic_step = critic_programs(
          self.config, self.graphdef, self.critic_tx, self.rows, shard_of(st.critic),
          shard_of(st.critic_opt_state))
    microbatch = None
    if self.config.microbatch_lengths == "own":
      microbatch = microbatch_programs(self.config, self.graphdef, self.tx,
                                       shard_of(st.params), shard_of(st.opt_state))
    self.programs = UpdatePrograms(train_step, critic_step, microbatch)

  # ---------------------------------------------------------------- state and checkpoints

  def _reference_tree(self):
    """What the reference policy is made of: its params, and with LoRA the frozen base (both are
    rebuilt at every start, and checked against the fingerprints the run started with)."""
    if not self.config.lora_rank:
      return self.ref_params
    return {"adapters": self.ref_params, "base": self.frozen}

  def _state_tree(self) -> dict:
    """What a checkpoint saves: the training state (`TrainState.checkpoint_tree`). The reference
    is the initial policy, rebuilt at every start; with LoRA the params are the adapters (the
    base is not saved)."""
    return self.state.checkpoint_tree()

  def save(self) -> None:
    """Checkpoint `iteration_index`, written in the background when `config.async_checkpoint`
    (`self.checkpoints.wait()` returns when it is complete; so do `run` and `close`)."""
    self.checkpoints.save(self.iteration_index, self._state_tree(), {
        "iteration": self.iteration_index, "task_sampler": self.task_sampler.state(),
        "skipped_updates_total": self.skipped_updates_total,
        "applied_updates": self.applied_updates,
        "reference_fingerprints": self.ref_fingerprints})

  def _restore(self, step: int) -> None:
    """Restores checkpoint `step` (raises DamagedCheckpoint if it is damaged)."""
    self._load(*self.checkpoints.read(step, self._state_tree()))

  def _load(self, st: dict, meta: dict) -> None:
    changed = checkpoint.damaged_leaves(self._reference_tree(),
                                        meta.get("reference_fingerprints"))
    if changed:
      raise ValueError(
          f"the reference policy rebuilt from --model / --init-params differs from the one the "
          f"run in {self.config.out} started from ({len(changed)} arrays, e.g. {changed[0]}): "
          "were those folders changed? Resume with the original ones")
    self.state = TrainState.from_checkpoint_tree(st)
    self.task_sampler.restore(meta["task_sampler"])
    self.iteration_index = int(meta["iteration"])
    self.skipped_updates_total = int(meta["skipped_updates_total"])
    self.applied_updates = int(meta["applied_updates"])
    nnx.update(self.model, self.state.params)

  # ---------------------------------------------------------------- the phases

  def _put(self, x):
    return jax.device_put(x, batch_sharding(self.mesh, np.ndim(x)))

  def _rollout(self, tasks, key, *, seed, group_size, greedy=False):
    sampling = dataclasses.replace(self.sampling, greedy=greedy)
    return collect(self._pool, tasks, group_size, self.sampler, self.tokenizer, key,
                   prompt_config=self.prompt_config, max_steps=self.config.max_steps,
                   max_new_tokens=self.config.max_new_tokens, sampling=sampling,
                   invalid_action_penalty=self.config.invalid_action_penalty, seed=seed,
                   max_prompt_tokens=self.config.max_cache_len - self.config.max_new_tokens,
                   invalid_step=self.config.invalid_step, progress=self._show_progress)

  def collect_rollout(self, tasks, key, *, seed, group_size, greedy=False):
    """Plays G = `group_size` trajectories of each task; returns the `RolloutBatch` of them all.

    With several processes, each plays its contiguous share of `tasks` (whole groups) on its
    own environments and sampler (key folded with its index), and the shares are gathered: every
    process returns the same global batch. `_local_rollout` keeps this process's share.
    """
    if self.num_processes == 1:
      self._local_rollout = self._rollout(tasks, key, seed=seed, group_size=group_size,
                                              greedy=greedy)
      return self._local_rollout
    mine = multihost.share(tasks, self.process_index, self.num_processes)
    # The key onto this process's devices (the sampler's), as a value: it may live on the mesh.
    key = jax.random.wrap_key_data(multihost.to_host(jax.random.key_data(key)))
    self._local_rollout = self._rollout(
        mine, jax.random.fold_in(key, self.process_index), seed=seed, group_size=group_size,
        greedy=greedy) if mine else None
    return multihost.concat_rollouts(multihost.allgather_objects(self._local_rollout))

  def step_advantages(self, batch, tb: Optional[batching.TokenBatch] = None,
                      mbs: Optional[list] = None) -> tuple[np.ndarray, np.ndarray, Any, dict]:
    """(before, after) SALT as f32[steps] on the host, the padded device array of `after` for
    the update, and SALT's (and the critic's) metrics.

    With a critic's estimator (PPO) the critic scores the token batch `tb` first (its
    mini-batches `mbs`, which then carry each token's `advantages`, `returns` and `old_values`
    for the update); `before` / `after` are each step's mean token advantage."""
    cfg = self.config
    critic = ESTIMATORS[cfg.algo].critic
    if critic and (tb is None or mbs is None):
      raise ValueError(f"algo {cfg.algo!r} scores the token batch with its critic: pass tb "
                       "and mbs")
    nsteps = batch.num_total_steps
    # padded to a power of two (a multiple of the data axis) so the program compiles rarely
    n_pad = -(-batching.bucket_length(nsteps, 64) // self.data_size) * self.data_size
    merge, segments = None, 1
    with self.times("salt"):
      if cfg.salt:
        trajs, groups = batch.trajectories_for_salt()
        merge = build_merge_ids(trajs, groups, history=cfg.salt_history, embedder=self.embedder,
                                threshold=cfg.embed_threshold)
        segments = batching.bucket_length(merge.num_segments, 64)
    with self.times("advantage"):
      program = step_advantages_program(cfg.algo, cfg.tasks_per_iter, segments, cfg.salt,
                                        estimator_options(cfg))
      inputs = batching.estimator_inputs(batch, cfg, n_pad,
                                         None if merge is None else merge.ids)
    m = {}
    if critic:
      with self.times("values"):
        values = self._critic_values(tb, mbs)
      with self.times("advantage"):
        seqs = batching.gae_sequences(batch, tb, cfg, row_multiple=self.data_size)
        inputs = inputs._replace(token_rewards=seqs.rewards, token_values=seqs.gather(values),
                                 token_mask=seqs.mask, token_step_ids=seqs.step_ids)
    with self.times("advantage"):
      out = jax.block_until_ready(program(jax.tree.map(self._put, inputs)))
      before, after = out.before, out.after
    if critic:
      m.update(self._fill_critic_batch(tb, mbs, seqs, values, out))
    host_before = multihost.to_host(before)[:nsteps]
    host_after = multihost.to_host(after)[:nsteps]
    with self.times("salt"):
      m.update(merge_metrics(batch, merge, host_before) if cfg.salt else NO_MERGE_METRICS)
    if inputs.anchor_ids is not None:  # GiGPO: steps whose state another step of the task shared
      anchors = inputs.anchor_ids[:nsteps]
      m["anchored_steps"] = int(np.sum(np.bincount(anchors)[anchors] > 1))
    return host_before, host_after, after, m

  def _critic_values(self, tb: batching.TokenBatch, mbs: list[dict]) -> np.ndarray:
    """f32[B, L] on the host: the critic's value at every position of `tb`, mini-batch by
    mini-batch (each cut to its own length, as `_minibatches` cuts them)."""
    values = np.zeros(tb.input_ids.shape, np.float32)
    scored = self._score_minibatches(self._values, self.state.critic, mbs,
                                     ("input_ids", "attention_mask", "positions"))
    for i, r in enumerate(scored):
      values[i * self.rows:(i + 1) * self.rows, :r.shape[1]] = r
    return values

  def _fill_critic_batch(self, tb, mbs, seqs, values, out) -> dict:
    """Puts each token's advantage, return and old value (PPO) into the mini-batches; returns
    the critic's batch metrics: mean value and return over the trained tokens, and the share of
    the returns' variance the values explain (verl's vf_explained_var)."""
    shape = tb.input_ids.shape
    advantages = seqs.scatter(multihost.to_host(out.token_advantages), shape)
    returns = seqs.scatter(multihost.to_host(out.returns), shape)
    for i, mb in enumerate(mbs):
      rows, length = slice(i * self.rows, (i + 1) * self.rows), mb["input_ids"].shape[1]
      mb["advantages"] = advantages[rows, :length]
      mb["returns"] = returns[rows, :length]
      mb["old_values"] = values[rows, :length]
    mask = tb.loss_mask
    v, r = values[mask].astype(np.float64), returns[mask].astype(np.float64)
    explained = 1.0 - np.var(r - v) / np.var(r) if v.size > 1 and np.var(r) > 0 else float("nan")
    return {"critic/values_mean": float(v.mean()) if v.size else float("nan"),
            "critic/returns_mean": float(r.mean()) if r.size else float("nan"),
            "critic/explained_variance": float(explained)}

  def _minibatches(self, tb: batching.TokenBatch) -> list[dict]:
    """Mini-batches of `self.rows` rows (padding rows have an all-False mask), each cut to the
    bucketed length of its own longest row: attention costs the square of the length, and one
    long trajectory (an ALFWorld heat task beside 4-step ones) would otherwise set it for all."""
    n = tb.input_ids.shape[0]
    fields = ("input_ids", "targets", "loss_mask", "token_step_ids", "old_logprobs",
              "attention_mask", "positions")
    out, self._plans = [], []
    micro = self.config.microbatch_rows or self.rows
    for s in range(0, n, self.rows):
      mask = tb.attention_mask[s:s + self.rows]
      length = batching.trimmed_length(mask, self.config.min_seq_len)
      mb = {f: getattr(tb, f)[s:s + self.rows, :length] for f in fields}
      # Only the trained tokens' log-probs are read: the rest are never projected to the vocab.
      mb["logit_positions"] = batching.logit_positions(mb["loss_mask"], self.config.min_seq_len)
      out.append(mb)
      # with microbatch_lengths "own", the update's micro-batches (`state.update_step`)
      self._plans.append(batching.microbatch_plan(mask[:, :length], micro,
                                                  self.config.min_seq_len)
                         if self.programs.microbatch is not None else None)
    return out

  def _on_device(self, mb: dict) -> dict:
    """A mini-batch's arrays on the mesh, split over its data axis (those already there stay)."""
    return {k: self._put(v) for k, v in mb.items()}

  def _logprobs_all(self, params, mbs: list[dict]) -> list[np.ndarray]:
    """The token log-probs of every mini-batch under `params`, on the host."""
    return self._score_minibatches(self._logprobs, params, mbs, _LOGPROB_FIELDS)

  def _logprob_passes(self, params, mbs: list[dict]) -> list:
    """The token log-probs of every mini-batch under `params`, left on the device."""
    return self._score_minibatches(self._logprobs, params, mbs, _LOGPROB_FIELDS, to_host=False)

  def _score_minibatches(self, program, weights, mbs: list[dict], fields,
                         to_host: bool = True) -> list:
    """`program(weights, *mb[fields], frozen)` for every mini-batch, read back to the host
    (`to_host`) after all are dispatched, so the device never waits on the host."""
    res = [program(weights, *(self._put(mb[f]) for f in fields), self.frozen) for mb in mbs]
    return [multihost.to_host(r) for r in res] if to_host else res

  def _recompute_old_logprobs(self, mbs: list[dict], engine: bool) -> dict:
    """Replaces each device mini-batch's old log-probs (the sampler's) with the policy's own,
    keeping the sampler's as `rollout_logprobs` for truncated IS (`rollout_is_threshold`).
    Returns the metrics: with a separate engine the mean |engine's - trainer's log-prob| over
    the trained tokens and KL(engine || trainer) per token, estimated on the engine's tokens
    with k3 = exp(r) - 1 - r, r = trainer's - engine's log-prob (unbiased, never negative: held
    at 0 against rounding; r clipped to +-20 as verl's); with truncated IS the mean weight and
    the share of weights cut."""
    cfg = self.config
    threshold = cfg.rollout_is_threshold
    # per mini-batch, on device: sum |delta|, tokens, sum k3, sum of IS weights, weights cut
    sums = []
    for mb, lp in zip(mbs, self._logprob_passes(self.state.params, mbs)):
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

  def iteration(self) -> dict:
    """Runs one training iteration; returns (and logs) its metrics."""
    cfg, it = self.config, self.iteration_index
    self.times = times = _PhaseTimes()
    t_iter = time.perf_counter()
    key, k_rollout, k_shuffle = jax.random.split(self.state.key, 3)
    self.state = self.state._replace(key=key)
    tasks = self.task_sampler.next(cfg.tasks_per_iter)

    # rollout
    logger.info("iteration %d/%d: rollout of %d tasks x %d trajectories", it + 1, cfg.iters,
                len(tasks), cfg.group_size)
    with times("rollout"):
      full = self.collect_rollout(tasks, k_rollout, seed=cfg.seed * 100_003 + it,
                                  group_size=cfg.group_size)
    logger.info("iteration %d: rollout done in %.1fs: %d trajectories, %d steps, success %.2f",
                it + 1, times["rollout"], full.num_trajectories, full.num_total_steps,
                full.metrics["success_rate"])
    batch = full.trainable()  # failed trajectories out (counted in the metrics)
    m: dict[str, Any] = rollout_metrics(full, batch)
    self.last = IterationData(full, self._local_rollout, None, None, None)

    upd, histograms = self._no_update(), {}
    if batch.num_total_steps == 0:  # every trajectory failed: nothing to learn from
      m.update(NO_MERGE_METRICS, skipped_groups=cfg.tasks_per_iter)
    else:
      # the batch: token rows in the run's layout, cut into mini-batches
      tb = batching.from_rollout(batch, cfg.layout, pad_id=self.pad_id,
                                 min_length=cfg.min_seq_len, row_multiple=self.rows)
      mbs = self._minibatches(tb)

      # step advantages: group estimator (or critic) and SALT
      before, after, step_adv, salt_m = self.step_advantages(batch, tb, mbs)
      m.update(salt_m, skipped_groups=skipped_groups(before, batch.step_group_ids),
               adv_frac_changed=float(np.mean(np.abs(after - before) > 1e-6)))
      m.update(_stats(before, "adv_before"))
      m.update(_stats(after, "adv_after"))
      histograms = {"adv_before": before, "adv_after": after}
      self.last = self.last._replace(minibatches=mbs, advantages=(before, after),
                                     step_adv=step_adv)

      # With every advantage 0 the loss would be KL alone, and an update would move the policy
      # (Adam makes a full step of any gradient, weight decay too) on no evidence: none is taken.
      # A critic learns from every batch; the policy waits for `critic_warmup` iterations.
      critic = self.state.critic is not None
      train_policy = bool(np.any(after != 0)) and it >= (cfg.critic_warmup if critic else 0)
      learn = train_policy or critic
      logger.info("iteration %d: advantages and SALT done (merge rate %.2f); %s", it + 1,
                  m["merge_rate"], f"update over {len(mbs)} mini-batch(es) x {cfg.ppo_epochs} "
                  "epoch(s)" if learn else "no update: every advantage is 0")
      if learn:
        # The sampler's, or recomputed under the current params: always with a separate engine,
        # whose log-probs (other kernels, maybe another dtype) are only compared with ours.
        engine = cfg.rollout_engine != "builtin"
        # From here the batch lives on the device: the log-prob phases fill it there and the
        # update reads it there; only a few sums come back to the host.
        mbs = [self._on_device(mb) for mb in mbs]
        self.last = self.last._replace(minibatches=mbs)
        with times("old_logprob"):
          if train_policy and (cfg.recompute_old_logprobs or engine):
            m.update(self._recompute_old_logprobs(mbs, engine))
        if cfg.kl_coef > 0 and train_policy:  # no KL term: the reference is not evaluated
          with times("ref_logprob"):
            for mb, lp in zip(mbs, self._logprob_passes(self.ref_params, mbs)):
              mb["ref_logprobs"] = jnp.where(mb["loss_mask"], lp, 0.0)
        with times("update"):
          upd = self._update(mbs, step_adv, k_shuffle, train_policy=train_policy)
    m.update(upd)
    m["skipped_updates_total"] = self.skipped_updates_total
    m["lr"] = float(self.schedule(self.applied_updates))
    for phase in ("rollout", "salt", "advantage", "old_logprob", "ref_logprob", "update"):
      m[f"time/{phase}"] = times.get(phase, 0.0)
    if self.state.critic is not None:  # the critic's forward pass over the batch (PPO)
      m["time/values"] = times.get("values", 0.0)
    if cfg.rollout_engine != "builtin":  # the copy into the engine (inside time/update)
      m.setdefault("engine_logprob_abs_diff", float("nan"))
      m.setdefault("engine_kl", float("nan"))
      m["time/weight_sync"] = times.get("weight_sync", 0.0)

    # evaluate, log, save
    self.iteration_index = it + 1
    if cfg.eval_every and self.iteration_index % cfg.eval_every == 0:
      with times("eval"):
        m.update(self.evaluate())
      m["time/eval"] = times["eval"]
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
      self._last_save_s = time.perf_counter() - t0  # async: the wait for the last one + the copy
      logger.info("iteration %d: checkpoint %s in %.1fs", it + 1,
                  "handed to orbax's writer" if cfg.async_checkpoint else "saved",
                  self._last_save_s)
    return row

  def _update(self, mbs: list[dict], step_adv, key, *, train_policy: bool = True) -> dict:
    """The iteration's optimizer steps over shuffled mini-batches: `state.update_step` (a critic
    step with PPO, and a policy step unless `train_policy` is False: the critic's warm-up) on
    each mini-batch with a trained token, in a fresh order each epoch."""
    cfg = self.config
    mbs = [self._on_device(mb) for mb in mbs]
    live = np.flatnonzero(multihost.to_host(jnp.stack([jnp.any(mb["loss_mask"]) for mb in mbs]))
                          if mbs else [])
    perms = multihost.to_host(jax.vmap(lambda k: jax.random.permutation(k, len(live)))(
        jax.random.split(key, cfg.ppo_epochs)))
    order = [int(live[j]) for perm in perms for j in perm]
    sums: dict[str, float] = {}
    n, skipped = 0, 0
    outs, critic_outs = [], []
    with progress_bar(order, desc="update", enabled=self._show_progress, unit="batch") as bar:
      for i in bar:
        self.state, out, critic_out = update_step(self.programs, self.state, mbs[i], step_adv,
                                                  self.frozen, train_policy=train_policy,
                                                  plan=self._plans[i])
        if critic_out:
          critic_outs.append(critic_out)
        if out:
          outs.append(out)
    # Fetched once, after the last step: no mini-batch waits for the host to read its metrics.
    outs, critic_outs = jax.device_get((outs, critic_outs))
    critic_m = self._critic_metrics(critic_outs)
    for i, out in zip(order, outs):
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
    if outs:  # the policy's params are new arrays (the old ones donated), even if all skipped
      self._sync_sampler()
    if not n:
      return {**self._no_update(), "skipped_updates": skipped, **critic_m}
    return {**{k: v / n for k, v in sums.items()}, "skipped_updates": skipped, "num_updates": n,
            **critic_m}

  def _critic_metrics(self, outs: list[dict]) -> dict:
    """The critic's update metrics, averaged over its finite steps (NaN without a critic step),
    and how many of its steps were skipped as not finite."""
    if self.state.critic is None:
      return {}
    kept = [o for o in outs if not bool(o["skipped"])]
    m = {k: float(np.mean([float(o[k]) for o in kept])) if kept else float("nan")
         for k in CRITIC_METRICS}
    return {**m, "critic_skipped_updates": len(outs) - len(kept)}

  def _no_update(self) -> dict:
    """The update metrics of an iteration that took no optimizer step."""
    return {**{k: float("nan") for k in ("loss", "grad_norm", "kl", "clip_fraction", "pg_loss",
                                         "ratio_mean", "approx_kl_old", "entropy")},
            "skipped_updates": 0, "num_updates": 0, **self._critic_metrics([])}

  def evaluate(self) -> dict:
    """Greedy success on `num_eval_tasks` tasks of each eval split (overall and per task type)."""
    cfg = self.config
    out = {}
    key = jax.random.fold_in(jax.random.key(cfg.seed + 1), self.iteration_index)
    for split in self.eval_splits:
      tasks = registry.task_list(cfg.env, split, **cfg.env_kwargs)[:cfg.num_eval_tasks]
      if not tasks:
        continue
      b = self.collect_rollout(tasks, key, seed=0, group_size=1, greedy=True)
      out[f"eval/{split}/success_rate"] = b.metrics["success_rate"]
      out[f"eval/{split}/score"] = b.metrics["score"]
      out[f"eval/{split}/num_tasks"] = len(tasks)
      out[f"eval/{split}/valid_action_ratio"] = b.metrics["valid_action_ratio"]
      for tt, v in b.metrics["success_rate_by_type"].items():
        out[f"eval/{split}/success_rate/{tt}"] = v
    return out

  # ---------------------------------------------------------------- run

  def run(self) -> list[dict]:
    """Trains from the current iteration up to `config.iters`; returns the logged rows."""
    cfg = self.config
    if not self._opened:
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
      self.checkpoints.wait()  # the last checkpoint is complete when run() returns or raises
    return rows

  def close(self) -> None:
    """Closes the rollout engine (a separate one holds its own memory and threads), the env pool,
    the log and the checkpoints (the last one complete), then gives the run folder's lock back."""
    try:
      engine_close = getattr(getattr(self, "sampler", None), "close", None)
      if engine_close is not None:  # idempotent: close() may be called again
        engine_close()
      if self._pool is not None:
        self._pool.close()
        self._pool = None
      if self._logger is not None:
        self._logger.close()
      self.checkpoints.close()
    finally:
      if self.run_lock is not None:
        self.run_lock.release()

  def __enter__(self) -> "Trainer":
    return self

  def __exit__(self, *exc) -> None:
    self.close()


def train(config: TrainConfig) -> list[dict]:
  """Builds a `Trainer`, runs it to `config.iters`, closes it; returns the logged metric rows."""
  with Trainer(config) as t:
    t.setup()
    return t.run()
