"""The training iteration: rollout -> batch -> step advantages -> update -> log -> save.

`Trainer` is the host loop around one `state.TrainState`; `Trainer.iteration()` reads top to
bottom (each phase timed, as in the paper's cost breakdown), the phases after the rollout being
functions of what they read (`salt_jax.phases`, `state.update`):

  rollout      `rollout.collect`: G trajectories for each of `tasks_per_iter` tasks, one row per
               step. Failed (crashed) trajectories are counted and dropped.
  salt         (SALT on) `build_merge_ids` on the host: each step's merged-edge id.
  values       (algo ppo) the critic's value of every token (`salt_jax.critic`).
  advantage    `phases.step_advantages`, one jitted program (`update.step_advantages`): the
               group estimator (`advantages.ESTIMATORS[algo]`) over the step rows' rewards
               against their group's statistics (or GAE over the critic's values, per token),
               then SALT's `refine` over the merged edges.
  old_logprob  from the sampler (`policy_logprobs`), or recomputed with the current params.
  ref_logprob  log-probs under the frozen initial policy (the KL reference).
  update       `state.update`: PPO-clip (+ KL to the reference) over shuffled mini-batches
               (`update.update_programs`), AdamW with global-norm clipping; with a critic, its
               clipped value loss on each mini-batch first (`critic.critic_programs`). A
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
from salt_jax import memory
from salt_jax import multihost
from salt_jax import phases
from salt_jax import runlock
from salt_jax import state as state_lib
from salt_jax.advantages import count_invalid_rewards
from salt_jax.agent.prompts import STOP_STRING, run_prompt_config, stop_token_ids
from salt_jax.compiles import xla_compile_seconds
from salt_jax.config import TrainConfig
from salt_jax.models import cost, lora
from salt_jax.models.config import ModelConfig
from salt_jax.models.build import build_policy, build_tokenizer
from salt_jax.rollout import SamplingParams, collect
from salt_jax.sampling import length_buckets
from salt_jax.sharding import DATA_AXIS, make_mesh, parse_mesh_shape
from salt_jax.state import TrainState

logger = logging.getLogger(__name__)

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


def _work_and_rate(work_key: str, work: float, rate_key: str, seconds: float) -> dict:
  """{work_key: work, rate_key: work / seconds in billions a second} for a phase's model work
  (FLOPs or bytes) and its time; only what is known (a sampler or model may not report its
  work), so that no row holds a NaN."""
  if not np.isfinite(work):
    return {}
  out = {work_key: float(work)}
  if np.isfinite(seconds) and seconds > 0:
    out[rate_key] = float(work) / seconds / 1e9
  return out


def update_flops(config: ModelConfig, tb, epochs: int, critic: bool) -> float:
  """Model FLOPs of an update over token batch `tb` (`salt_jax.models.cost.train_flops`): the
  policy's step over every row, logits at the loss positions, for each of `epochs`; with a
  critic, its step over the same rows (no vocabulary projection) too."""
  lengths = np.asarray(tb.attention_mask).sum(axis=1).tolist()
  flops = cost.train_flops(config, lengths, tb.num_loss_tokens)
  if critic:
    flops += cost.train_flops(config, lengths, 0)
  return epochs * flops


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
  # A sampler's split of its time, and each phase's model work and rate, where it reports them.
  for key, seconds in (("time/rollout_prefill", rm["prefill_time_s"]),
                       ("time/rollout_decode", rm["decode_time_s"]),
                       ("time/xla_compile_prefill", rm["prefill_compile_s"]),
                       ("time/xla_compile_decode", rm["decode_compile_s"])):
    if np.isfinite(seconds):
      m[key] = seconds
  m.update(_work_and_rate("flops/prefill", rm["prefill_flops"], "rate/prefill_gflops",
                          rm["prefill_time_s"]))
  m.update(_work_and_rate("bytes/decode", rm["decode_bytes"], "rate/decode_gbs",
                          rm["decode_time_s"]))
  return m


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
  """{phase: seconds}; `with times("update"): ...` records one phase, and in `compiles`
  ({phase: seconds}) the XLA compile time inside it."""

  def __init__(self):
    super().__init__()
    self.compiles: dict[str, float] = {}

  @contextlib.contextmanager
  def __call__(self, phase: str):
    t0, c0 = time.perf_counter(), xla_compile_seconds()
    try:
      yield
    finally:
      self[phase] = self.get(phase, 0.0) + time.perf_counter() - t0
      self.compiles[phase] = self.compiles.get(phase, 0.0) + xla_compile_seconds() - c0


# ----------------------------------------------------------------------------- the trainer


def _lock_run_folder(folder: str, num_processes: int,
                     process_index: int) -> Optional[runlock.RunLock]:
  """Process 0's lock on the run folder (None on the others); with several processes all of them
  learn whether process 0 got it, so all stop together when it did not."""
  lock, refused = None, None
  if process_index == 0:
    try:
      lock = runlock.RunLock(folder).acquire()
    except (runlock.RunInUse, OSError) as e:
      if num_processes == 1:
        raise
      refused = e
  if num_processes > 1:
    said = multihost.allgather_objects(None if refused is None else str(refused))[0]
    if refused is not None:
      raise refused
    if said is not None:
      raise runlock.RunInUse(f"process 0 could not lock the run folder: {said}")
  return lock


def _rollout_engine(cfg: TrainConfig, model, tokenizer, mesh, pad_id: int):
  """The run's rollout engine over `model` (`config.rollout_engine`): the built-in `Sampler`,
  or vLLM's engine (given the params by `Trainer._sync_sampler`)."""
  # pylint: disable=import-outside-toplevel
  if cfg.rollout_engine == "vllm":
    from salt_jax.engines.vllm_engine import VLLMEngine
    logger.info("setup: starting the vllm rollout engine (about a minute)")
    return VLLMEngine.from_model(
        model, tokenizer,
        model_path=cfg.model if cfg.model is not None and os.path.isdir(cfg.model) else None,
        eos_token_ids=stop_token_ids(tokenizer), max_model_len=cfg.max_cache_len,
        dtype=cfg.compute_dtype or cfg.param_dtype, kv_cache_gib=cfg.vllm_kv_cache_gib,
        seed=cfg.seed)
  from salt_jax.sampling import Sampler
  return Sampler(model, eos_token_ids=stop_token_ids(tokenizer), pad_token_id=pad_id,
                 max_cache_len=cfg.max_cache_len, mesh=mesh, prompt_buckets=length_buckets(
                     cfg.prompt_bucket_min, cfg.max_cache_len, cfg.prompt_buckets_per_doubling))


class Trainer:
  """The host loop of one run around its `state.TrainState`: rollout, batching, the jitted
  phases and update, logging and checkpoints.

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
    # One process per run folder, from here to `close()` (after the config checks above, so that
    # a refused config leaves no folder behind).
    self.run_lock = _lock_run_folder(config.out, self.num_processes, self.process_index)
    try:
      self.checkpoints.check_start()  # a new run over old checkpoints, or a changed resume: refused
    except BaseException:
      if self.run_lock is not None:
        self.run_lock.release()
      raise
    self._pool = self._logger = self._local_rollout = None
    self._opened = False
    self.iteration_index = 0  # the counters a checkpoint saves beside the state
    self.skipped_updates_total = 0
    self.applied_updates = 0  # optimizer steps taken (the schedule's position)
    self._plans: list = []  # per mini-batch: its micro-batches with microbatch_lengths "own"
    self._last_save_s = None  # the last checkpoint's save time, logged with the next row
    self.last: Optional[IterationData] = None
    # bars inside a phase (rollout turns, update mini-batches): process 0 speaks for all
    self._show_progress = config.progress and self.process_index == 0
    self.times = _PhaseTimes()

  # ---------------------------------------------------------------- setup

  def setup(self) -> "Trainer":
    """Builds everything; restores the last complete checkpoint when `config.resume`."""
    from envs.pool import EnvPool  # pylint: disable=import-outside-toplevel
    cfg = self.config
    t_setup = time.perf_counter()
    logger.info("setup: tokenizer %r", cfg.tokenizer if cfg.model is None else cfg.model)
    self.tokenizer = build_tokenizer(cfg)
    self.pad_id = int(self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None
                      else self.tokenizer.eos_token_id)
    logger.info("setup: policy %s (%s%s) on a %s mesh", cfg.model or "tiny random Qwen2",
                cfg.param_dtype, f", {cfg.compute_dtype} compute" if cfg.compute_dtype else "",
                "x".join(str(v) for v in self.mesh.shape.values()))
    self.model = build_policy(cfg, self.tokenizer, self.mesh)
    # Processes play different tasks, so each samples on its own devices alone: with several, the
    # sampler has its own copy of the policy there (`_sync_sampler`).
    sampler_mesh = self.mesh if self.num_processes == 1 else multihost.local_mesh(self.mesh)
    self.sampler_model = self.model if self.num_processes == 1 else build_policy(
        cfg, self.tokenizer, sampler_mesh)
    # The state (trained parameters: all, or the LoRA adapters), the frozen rest (a LoRA base,
    # shared with `self.model`: held once, never donated, differentiated or given to AdamW), the
    # reference (the initial trained parameters) and the optimizers.
    # `self.state` is the one live copy; the setup keeps the parts that never change.
    setup = state_lib.create(cfg, self.model, self.mesh)
    self.state, self._setup = setup.state, setup._replace(state=None)
    self.ref_fingerprints = checkpoint.fingerprints(self._reference_tree())

    self.task_sampler = TaskSampler(registry.training_tasks(cfg), cfg.seed)
    self.eval_splits = (cfg.eval_splits if cfg.eval_splits is not None
                        else registry.entry(cfg.env).eval_splits)
    logger.info("setup: %d training tasks of %s, %d env worker(s)",
                len(self.task_sampler.tasks), cfg.env, cfg.env_workers)
    self._pool = EnvPool(cfg.env, {"max_steps": cfg.max_steps, **cfg.env_kwargs},
                         cfg.env_workers)
    self.sampler = _rollout_engine(cfg, self.sampler_model, self.tokenizer, sampler_mesh,
                                   self.pad_id)
    self.embedder = None
    if cfg.salt and cfg.embedder not in (None, "none"):
      from salt_jax.embedders import SentenceEmbedder  # pylint: disable=import-outside-toplevel
      self.embedder = SentenceEmbedder(None if cfg.embedder == "minilm" else cfg.embedder)
    self.prompt_config = run_prompt_config(cfg)
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
    self._logprobs, self._values, self.programs = state_lib.build_programs(
        self.config, self._setup._replace(state=self.state), self.rows)

  # The setup's fixed parts, read where the iteration needs them.
  graphdef = property(lambda self: self._setup.graphdef)
  frozen = property(lambda self: self._setup.frozen)  # the LoRA base; empty without LoRA
  ref_params = property(lambda self: self._setup.ref_params)
  trainable = property(lambda self: self._setup.trainable)
  schedule = property(lambda self: self._setup.schedule)

  # ---------------------------------------------------------------- state and checkpoints

  def _reference_tree(self):
    """What the reference policy is made of: its params, and with LoRA the frozen base (both are
    rebuilt at every start, and checked against the fingerprints the run started with)."""
    if not self.config.lora_rank:
      return self.ref_params
    return {"adapters": self.ref_params, "base": self.frozen}

  def _state_tree(self) -> dict:
    """What a checkpoint saves: `TrainState.checkpoint_tree` (the reference is the initial
    policy, rebuilt at every start; with LoRA the params are the adapters, the base not saved)."""
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

  def collect_rollout(self, tasks, key, *, seed, group_size, greedy=False):
    """Plays G = `group_size` trajectories of each task; returns the `RolloutBatch` of them all.

    With several processes, each plays its contiguous share of `tasks` (whole groups) on its
    own environments and sampler (key folded with its index), and the shares are gathered: every
    process returns the same global batch. `_local_rollout` keeps this process's share.
    """
    cfg = self.config

    def play(tasks, key):
      return collect(self._pool, tasks, group_size, self.sampler, self.tokenizer, key,
                     prompt_config=self.prompt_config, max_steps=cfg.max_steps,
                     max_new_tokens=cfg.max_new_tokens,
                     sampling=dataclasses.replace(self.sampling, greedy=greedy),
                     invalid_action_penalty=cfg.invalid_action_penalty, seed=seed,
                     max_prompt_tokens=cfg.max_cache_len - cfg.max_new_tokens,
                     invalid_step=cfg.invalid_step, progress=self._show_progress)

    if self.num_processes == 1:
      self._local_rollout = play(tasks, key)
      return self._local_rollout
    mine = multihost.share(tasks, self.process_index, self.num_processes)
    # The key onto this process's devices (the sampler's), as a value: it may live on the mesh.
    key = jax.random.wrap_key_data(multihost.to_host(jax.random.key_data(key)))
    self._local_rollout = play(mine, jax.random.fold_in(key, self.process_index)) if mine else None
    return multihost.concat_rollouts(multihost.allgather_objects(self._local_rollout))

  def step_advantages(self, batch, tb: Optional[batching.TokenBatch] = None,
                      mbs: Optional[list] = None) -> tuple[np.ndarray, np.ndarray, Any, dict]:
    """`phases.step_advantages` of `batch` for this run: (before, after) SALT on the host, the
    padded device array of `after` for the update, and the metrics. With a critic (PPO) it
    scores the token batch `tb` (mini-batches `mbs`, which then carry the critic's targets)."""
    values = None
    if self.state.critic is not None and tb is not None and mbs is not None:
      values = lambda: phases.critic_values(  # noqa: E731
          self._values, self.state.critic, self.frozen, mbs, tb.input_ids.shape, self.rows,
          self.mesh)
    return phases.step_advantages(batch, self.config, mesh=self.mesh, embedder=self.embedder,
                                  times=self.times, tb=tb, mbs=mbs, rows=self.rows,
                                  critic_values=values)

  def _minibatches(self, tb: batching.TokenBatch) -> list[dict]:
    """`phases.minibatches` of `self.rows` rows; their micro-batch plans go to `_plans`."""
    mbs, self._plans = phases.minibatches(tb, self.rows, self.config,
                                          microbatched=self.programs.microbatch is not None)
    return mbs

  def _logprobs_all(self, params, mbs: list[dict]) -> list[np.ndarray]:
    """The token log-probs of every mini-batch under `params`, on the host."""
    return phases.score_minibatches(self._logprobs, params, mbs, phases.LOGPROB_FIELDS,
                                    self.frozen, self.mesh)

  def _logprob_passes(self, params, mbs: list[dict]) -> list:
    """The token log-probs of every mini-batch under `params`, left on the device."""
    return phases.score_minibatches(self._logprobs, params, mbs, phases.LOGPROB_FIELDS,
                                    self.frozen, self.mesh, to_host=False)

  def _recompute_old_logprobs(self, mbs: list[dict], engine: bool) -> dict:
    """`phases.recompute_old_logprobs` under the current params."""
    return phases.recompute_old_logprobs(self._logprobs, self.state.params, self.frozen, mbs,
                                         self.mesh, engine=engine,
                                         threshold=self.config.rollout_is_threshold)

  def iteration(self) -> dict:
    """Runs one training iteration; returns (and logs) its metrics."""
    cfg, it = self.config, self.iteration_index
    self.times = times = _PhaseTimes()
    t_iter, compile_iter = time.perf_counter(), xla_compile_seconds()
    key, k_rollout, k_shuffle = jax.random.split(self.state.key, 3)
    self.state = self.state._replace(key=key)
    tasks = self.task_sampler.next(cfg.tasks_per_iter)

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

    critic = self.state.critic is not None
    upd, histograms = state_lib.no_update_metrics(critic), {}
    if batch.num_total_steps == 0:  # every trajectory failed: nothing to learn from
      m.update(phases.NO_MERGE_METRICS, skipped_groups=cfg.tasks_per_iter)
    else:
      # the batch: token rows in the run's layout, cut into mini-batches
      tb = batching.from_rollout(batch, cfg.layout, pad_id=self.pad_id,
                                 min_length=cfg.min_seq_len, row_multiple=self.rows)
      mbs = self._minibatches(tb)
      # step advantages: group estimator (or critic) and SALT
      before, after, step_adv, salt_m = self.step_advantages(batch, tb, mbs)
      m.update(salt_m, skipped_groups=skipped_groups(before, batch.step_group_ids),
               adv_frac_changed=float(np.mean(np.abs(after - before) > 1e-6)),
               **_stats(before, "adv_before"), **_stats(after, "adv_after"))
      histograms = {"adv_before": before, "adv_after": after}
      self.last = self.last._replace(minibatches=mbs, advantages=(before, after),
                                     step_adv=step_adv)

      # With every advantage 0 the loss would be KL alone, and an update would move the policy
      # (Adam makes a full step of any gradient, weight decay too) on no evidence: none is taken.
      # A critic learns from every batch; the policy waits for `critic_warmup` iterations.
      train_policy = bool(np.any(after != 0)) and it >= (cfg.critic_warmup if critic else 0)
      learn = train_policy or critic
      logger.info("iteration %d: advantages and SALT done (merge rate %.2f); %s", it + 1,
                  m["merge_rate"], f"update over {len(mbs)} mini-batch(es) x {cfg.ppo_epochs} "
                  "epoch(s)" if learn else "no update: every advantage is 0")
      if learn:
        # From here the batch lives on the device: the log-prob phases fill it there and the
        # update reads it there; only a few sums come back to the host. Old log-probs are the
        # sampler's, or recomputed under the current params: always with a separate engine,
        # whose log-probs (other kernels, maybe another dtype) are only compared with ours.
        engine = cfg.rollout_engine != "builtin"
        mbs = [phases.on_device(mb, self.mesh) for mb in mbs]
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
        if train_policy:
          m.update(_work_and_rate(
              "flops/update", update_flops(self.model.config, tb, cfg.ppo_epochs, critic),
              "rate/update_gflops", times["update"]))
    m.update(upd, skipped_updates_total=self.skipped_updates_total,
             lr=float(self.schedule(self.applied_updates)))
    timed = ("rollout", "salt", "advantage", "old_logprob", "ref_logprob", "update")
    m.update({f"time/{p}": times.get(p, 0.0) for p in timed + (("values",) if critic else ())})
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
    # XLA compiles inside the iteration (a new prompt bucket or micro-batch length, a first call)
    # and inside the phases whose rates they slow: the rates above include them.
    m["time/xla_compile"] = xla_compile_seconds() - compile_iter
    for p in ("rollout", "update"):
      m[f"time/xla_compile_{p}"] = times.compiles.get(p, 0.0)
    # Host memory at the iteration's end: resident bytes rising from row to row with live arrays
    # flat is the allocator's; with live arrays rising too, a reference held (a leak).
    memory.release_free_memory()  # the iteration's freed buffers back to the OS
    resident = memory.resident_bytes()
    m["mem/programs_cleared"] = m["mem/cleared_gb"] = 0.0
    if resident > cfg.clear_programs_above * memory.total_bytes():  # NaN (no figures): never
      memory.release_compiled_programs()
      after = memory.resident_bytes()
      m["mem/programs_cleared"], m["mem/cleared_gb"] = 1.0, (resident - after) / 2**30
      resident = after
    m["mem/resident_gb"] = resident / 2**30
    live, live_bytes = memory.live_array_bytes()
    m["mem/live_arrays"], m["mem/live_array_gb"] = live, live_bytes / 2**30
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
    """`state.update` over the mini-batches (a policy step on each unless `train_policy` is
    False: the critic's warm-up); counts the steps and gives the sampler the new params."""
    self.state, m = state_lib.update(
        self.programs, self.state, [phases.on_device(mb, self.mesh) for mb in mbs], step_adv,
        key, self.frozen, epochs=self.config.ppo_epochs, plans=self._plans,
        train_policy=train_policy, progress=self._show_progress)
    self.applied_updates += m["num_updates"]
    self.skipped_updates_total += m["skipped_updates"]
    if m["num_updates"] + m["skipped_updates"]:  # new policy arrays (the old ones donated)
      self._sync_sampler()
    return m

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
