"""The multi-turn agent loop (host side): G trajectories per task, one sampler call per turn.

`collect` resets G environment slots per task, then each turn renders the prompt of every active
trajectory, generates all responses in one sampler call, parses the actions and steps all
environments in one `EnvPool.step_batch`. In whole-history mode a sampler that keeps its KV cache
(`salt_jax.sampling.Sampler`) continues each trajectory from its previous turn, prefilling only
the tokens the turn adds. It returns a `RolloutBatch`: one record per step, in
trajectory-major order (all steps of trajectory 0, then 1, ...), carrying the ids every step-level
method needs (group = task, trajectory, step index), as verl-agent's one row per step with `uid` and
`traj_uid`.

Rewards. Each trajectory's outcome reward is
    R = (sum of environment rewards: 1.0 on success for outcome tasks) - penalty * (invalid steps)
with penalty 0.1 by default (`outcome_rewards`). What each step row scores under a recipe is
`salt_jax.rewards`' (reward shaping).

A step is invalid (`invalid_step`) either as this project checks it by default, "admissible": the
parser rejects the output (no `<action>` tags, empty, too long, not admissible) or the environment
does (`EnvStep.valid`); or as verl-agent does, "format": only an output without a parsable action
(missing tags, empty, too long) is invalid, whatever the environment makes of the action. The
environment is stepped either way (with "" when the tags are missing): an invalid step uses up a
step, as in ALFWorld ("Nothing happens.").

A trajectory whose worker crashed or hung is `failed`: its steps before the failure are kept in the
batch but `step_train_mask` is False for them, and `trainable()` drops them altogether.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import time
import zlib
from typing import Any, Optional, Protocol, Sequence

import numpy as np

from envs.base import Task
from salt_jax.agent import parsing
from salt_jax.agent.parsing import parse_action
from salt_jax.agent.prompts import PromptConfig, Prompter
from salt_jax.log import progress_bar

logger = logging.getLogger(__name__)

INVALID_STEP_MODES = ("admissible", "format")
# verl-agent's invalid step: its projection found no action (the env's verdict is not consulted).
_FORMAT_OK = (parsing.OK, parsing.NOT_ADMISSIBLE)
# What a sampler may report of each call's two phases (summed over a rollout's calls).
_SAMPLER_PHASE_FIELDS = ("prefill_seconds", "decode_seconds", "prefill_compile_seconds",
                         "decode_compile_seconds", "prefill_flops", "decode_bytes")


class SampleOutputLike(Protocol):
  """What a sampler returns, one entry per prompt (see `salt_jax.sampling.SampleOutput`)."""

  tokens: list  # int32[n_i] new tokens
  logprobs: list  # f32[n_i] under the sampling distribution
  policy_logprobs: list  # f32[n_i] under the raw model at temperature 1: the old log-probs
  texts: Optional[list]  # decoded text, or None (the loop decodes with the tokenizer)
  finish_reasons: list
  # Optionally reused_tokens: int, prompt tokens read from a kept KV cache (0 when absent),
  # prefilled_tokens: int, prompt tokens run through the model (default: the rest), and the
  # `_SAMPLER_PHASE_FIELDS` (`salt_jax.sampling.SampleOutput`'s; NaN in the metrics when absent).


class SamplerFn(Protocol):
  """Any callable with the sampler's signature. One that also takes `decode_fn` gets the
  tokenizer's decode (stop strings need it); one that also takes `continue_rows` and
  `keep_cache` and has `clear_cache()` (as `salt_jax.sampling.Sampler`) continues each
  whole-history conversation from its previous turn's KV cache."""

  def __call__(self, prompts: list[list[int]], key: Any, *, max_new_tokens: int,
               temperature: float, top_p: float, top_k: int, greedy: bool,
               stop_strings: Sequence[str]) -> SampleOutputLike:
    ...


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """temperature, top_p, top_k (0: off), greedy, stop_strings: passed to the sampler as is."""

  temperature: float = 1.0
  top_p: float = 1.0
  top_k: int = 0
  greedy: bool = False
  stop_strings: tuple[str, ...] = ()


def _per_step():
  """A `RolloutBatch` field with one entry per step ([N], trajectory-major)."""
  return dataclasses.field(metadata={"rows": "step"})


def _per_trajectory():
  """A `RolloutBatch` field with one entry per trajectory ([T])."""
  return dataclasses.field(metadata={"rows": "trajectory"})


@dataclasses.dataclass
class RolloutBatch:
  """Steps of G trajectories per task. N steps (trajectory-major), T trajectories.

  Per step (lists of length N, arrays of shape [N]):
    prompt_ids: int32[P_i] the prompt the response was sampled from.
    response_ids: int32[R_i] the sampled tokens (up to and including EOS / stop).
    old_logprobs: f32[R_i] raw-model log-probs of those tokens (the sampler's policy_logprobs).
    sample_logprobs: f32[R_i] log-probs under the sampling distribution.
    step_group_ids: int32, the task's index in `tasks` (G trajectories share it).
    step_traj_ids: int32, the trajectory's index in [0, T).
    step_index: int32, 0-based step number within the trajectory.
    actions: the parsed, normalized action ("" when the tags were missing).
    responses: the decoded response text.
    observations: the environment's reply to the action.
    step_rewards: f32 environment reward; step_dones: bool; step_valid: bool.
    parse_reasons, finish_reasons: parser verdict ("ok", "missing_tags", ...) and sampler's.
  Per trajectory ([T]):
    traj_group_ids, task_ids, task_types, success, scores (a graded task's score in [0, 1],
    WebShop's; else 1.0 won, 0.0 not), failed, errors (why failed), truncated (ended
    by max_steps or the prompt budget, not by the environment), num_steps, num_invalid, returns
    (sum of env rewards), outcome_rewards (returns - penalty * num_invalid; 0 when failed),
    first_observations.
  whole_history: the prompts are one prefix-consistent stream per trajectory (enables the
    one-sequence-per-trajectory layout).
  metrics: valid_action_ratio, success_rate, gen_time_s, env_time_s, env_wait_fraction,
    prompt_tokens (over all turns), reused_prompt_tokens (read from a kept KV cache rather
    than prefilled) and prefilled_prompt_tokens (run through the model: a prompt repeated in
    one sampler call counts once), prefill_time_s / decode_time_s (gen_time_s split by the
    sampler; prefill_compile_s / decode_compile_s the XLA compiles inside them) and
    prefill_flops / decode_bytes (the model work each phase had to do), NaN for a sampler that
    does not report them, ...
  """

  prompt_ids: list = _per_step()
  response_ids: list = _per_step()
  old_logprobs: list = _per_step()
  sample_logprobs: list = _per_step()
  step_group_ids: np.ndarray = _per_step()
  step_traj_ids: np.ndarray = _per_step()
  step_index: np.ndarray = _per_step()
  actions: list = _per_step()
  responses: list = _per_step()
  observations: list = _per_step()
  step_rewards: np.ndarray = _per_step()
  step_dones: np.ndarray = _per_step()
  step_valid: np.ndarray = _per_step()
  parse_reasons: list = _per_step()
  finish_reasons: list = _per_step()
  traj_group_ids: np.ndarray = _per_trajectory()
  task_ids: list = _per_trajectory()
  task_types: list = _per_trajectory()
  success: np.ndarray = _per_trajectory()
  scores: np.ndarray = _per_trajectory()
  failed: np.ndarray = _per_trajectory()
  errors: list = _per_trajectory()
  truncated: np.ndarray = _per_trajectory()
  num_steps: np.ndarray = _per_trajectory()
  num_invalid: np.ndarray = _per_trajectory()
  returns: np.ndarray = _per_trajectory()
  outcome_rewards: np.ndarray = _per_trajectory()
  first_observations: list = _per_trajectory()
  num_groups: int
  invalid_action_penalty: float
  whole_history: bool
  metrics: dict

  @property
  def num_trajectories(self) -> int:
    return int(self.traj_group_ids.shape[0])

  @property
  def num_total_steps(self) -> int:
    return int(self.step_traj_ids.shape[0])

  @property
  def traj_step_offsets(self) -> np.ndarray:
    """int64[T+1]: trajectory i's steps are [offsets[i], offsets[i+1])."""
    return np.concatenate([[0], np.cumsum(self.num_steps, dtype=np.int64)])

  @property
  def step_task_types(self) -> list:
    return [self.task_types[t] for t in self.step_traj_ids]

  @property
  def step_success(self) -> np.ndarray:
    """bool[N]: the step's trajectory succeeded."""
    return self.success[self.step_traj_ids]

  @property
  def step_invalid_penalty(self) -> np.ndarray:
    """f32[N]: -penalty on invalid steps, 0 elsewhere (verl-agent's per-row form)."""
    return np.where(self.step_valid, 0.0, -self.invalid_action_penalty).astype(np.float32)

  @property
  def step_train_mask(self) -> np.ndarray:
    """bool[N]: False for the steps of failed trajectories."""
    return ~self.failed[self.step_traj_ids]

  def trajectories_for_salt(self) -> tuple[list, list]:
    """([[(action, observation), ...] per trajectory], group ids), for `build_merge_ids`.

    Steps are in this batch's trajectory-major order, so `build_merge_ids(...).ids[k]` belongs to
    step k of the per-step arrays.
    """
    off = self.traj_step_offsets
    trajs = [[(self.actions[k], self.observations[k]) for k in range(off[i], off[i + 1])]
             for i in range(self.num_trajectories)]
    return trajs, [int(g) for g in self.traj_group_ids]

  def select(self, traj_mask) -> "RolloutBatch":
    """The trajectories where traj_mask is True, renumbered 0..; group ids are kept."""
    traj_mask = np.asarray(traj_mask, bool)
    if traj_mask.shape != (self.num_trajectories,):
      raise ValueError(f"traj_mask must have shape ({self.num_trajectories},), "
                       f"got {traj_mask.shape}")
    keep_t = np.flatnonzero(traj_mask)
    keep_s = np.flatnonzero(traj_mask[self.step_traj_ids])
    new_id = np.full(self.num_trajectories, -1, np.int32)
    new_id[keep_t] = np.arange(len(keep_t), dtype=np.int32)
    rows = {"step": keep_s, "trajectory": keep_t}

    def take(field: dataclasses.Field):
      value, keep = getattr(self, field.name), rows[field.metadata["rows"]]
      return value[keep] if isinstance(value, np.ndarray) else [value[i] for i in keep]

    kept = {f.name: take(f) for f in dataclasses.fields(self) if "rows" in f.metadata}
    kept["step_traj_ids"] = new_id[kept["step_traj_ids"]]
    return dataclasses.replace(self, **kept)

  def trainable(self) -> "RolloutBatch":
    """Without the failed trajectories."""
    return self.select(~self.failed)


@dataclasses.dataclass
class PolicyOutput:
  """`SampleOutputLike` as produced by `TextPolicySampler`."""

  tokens: list
  logprobs: list
  policy_logprobs: list
  texts: list
  finish_reasons: list


class TextPolicySampler:
  """A sampler that plays a Python policy on prompt text: tests, env debugging, demonstrations.

  `policy(prompt_text, rng) -> response_text` sees the decoded prompt; the response is encoded and
  the tokenizer's EOS appended. Its log-probs come from `logprob_fn(context_ids, token) -> float`
  (context = prompt + response so far; default 0.0 for all), used for both `logprobs` and
  `policy_logprobs`. `rng` is seeded from the key and the prompt's tokens, so a prompt's response
  does not depend on which other prompts share the call.

  Attributes:
    calls: the prompt lists of every call, in order (tests count turns with it).
  """

  def __init__(self, tokenizer, policy, logprob_fn=None):
    self.tokenizer = tokenizer
    self.policy = policy
    self.logprob_fn = logprob_fn
    self.calls: list[list[list[int]]] = []

  def __call__(self, prompts, key, *, max_new_tokens, temperature=1.0, top_p=1.0, top_k=0,
               greedy=False, stop_strings=(), decode_fn=None) -> PolicyOutput:
    del temperature, top_p, top_k, greedy, decode_fn  # a scripted policy has no sampling knobs
    self.calls.append([list(p) for p in prompts])
    try:
      import jax  # pylint: disable=import-outside-toplevel
      key_words = np.asarray(jax.random.key_data(key)).ravel()
    except Exception:  # pylint: disable=broad-except  (any other key: its integer value)
      key_words = np.asarray(key).ravel()
    eos = self.tokenizer.eos_token_id
    out = PolicyOutput([], [], [], [], [])
    for p in prompts:
      p = [int(t) for t in p]
      seed = [zlib.crc32(np.asarray(p, np.int64).tobytes())] + [int(w) for w in key_words]
      text = self.policy(self.tokenizer.decode(p), np.random.default_rng(seed))
      toks = list(self.tokenizer.encode(text, add_special_tokens=False))
      reason = "eos"
      for s in stop_strings:  # cut after the first stop string, as a real sampler stops there
        at = text.find(s)
        if at >= 0:
          toks = list(self.tokenizer.encode(text[:at + len(s)], add_special_tokens=False))
          reason = "stop"
          break
      if reason == "eos":
        toks.append(eos)
      if len(toks) > max_new_tokens:
        toks, reason = toks[:max_new_tokens], "length"
      lp = np.array([0.0 if self.logprob_fn is None else self.logprob_fn(p + toks[:j], t)
                     for j, t in enumerate(toks)], np.float32)
      out.tokens.append(np.asarray(toks, np.int32))
      out.logprobs.append(lp)
      out.policy_logprobs.append(lp.copy())
      out.texts.append(self.tokenizer.decode(toks))
      out.finish_reasons.append(reason)
    return out


def _takes(sampler, name: str) -> bool:
  """The sampler accepts keyword `name` (or any keyword)."""
  try:
    params = inspect.signature(sampler).parameters
  except (TypeError, ValueError):
    return False
  return name in params or any(p.kind == p.VAR_KEYWORD for p in params.values())


def _check_output(out, n: int) -> None:
  for name in ("tokens", "logprobs", "policy_logprobs", "finish_reasons"):
    if len(getattr(out, name)) != n:
      raise ValueError(f"sampler returned {len(getattr(out, name))} {name} for {n} prompts")
  if out.texts is not None and len(out.texts) != n:
    raise ValueError(f"sampler returned {len(out.texts)} texts for {n} prompts")
  for i in range(n):
    m = len(out.tokens[i])
    if len(out.logprobs[i]) != m or len(out.policy_logprobs[i]) != m:
      raise ValueError(f"sampler output {i}: {m} tokens but {len(out.logprobs[i])} logprobs and "
                       f"{len(out.policy_logprobs[i])} policy_logprobs")


def collect(env_pool, tasks: Sequence[Task], group_size: int, sampler: SamplerFn, tokenizer, key,
            *, prompt_config: PromptConfig = PromptConfig(), max_steps: int = 50,
            max_new_tokens: int = 256, sampling: SamplingParams = SamplingParams(),
            invalid_action_penalty: float = 0.1, seed: int = 0,
            max_prompt_tokens: Optional[int] = None, slot_offset: int = 0,
            reuse_cache: bool = True, invalid_step: str = "admissible",
            progress: bool = False) -> RolloutBatch:
  """Plays `group_size` trajectories of every task; returns their steps (see `RolloutBatch`).

  Args:
    env_pool: an `envs.pool.EnvPool` (or anything with its reset_batch / step_batch).
    tasks: the tasks of this batch; task k is group k (a task listed twice is two groups).
    group_size: G >= 1 trajectories per task. Trajectory i plays task i // G in pool slot
      slot_offset + i; all G start from the same `seed`, so a group shares its initial state.
    sampler: see `SamplerFn`; called once per turn with the prompts of all active trajectories.
    tokenizer: a transformers tokenizer with a chat template (decode and the prompt rendering).
    key: a jax PRNG key, split once per turn.
    prompt_config: whole-history (default) or windowed prompts.
    max_steps: at most this many steps per trajectory (the env may end earlier).
    max_new_tokens: per response.
    sampling: temperature, top_p, top_k, greedy, stop_strings.
    invalid_action_penalty: subtracted from the outcome reward per invalid step (>= 0).
    seed: the environment seed of every trajectory.
    max_prompt_tokens: a trajectory whose next prompt would be longer ends there (truncated);
      set it to what the sampler's cache holds minus max_new_tokens.
    slot_offset: first pool slot used (slots slot_offset .. slot_offset + T - 1).
    reuse_cache: in whole-history mode, with a sampler that can (see `SamplerFn`), each turn
      after the first continues every trajectory from its previous turn's KV cache, so only the
      new tokens are prefilled. The rollout is the same either way (up to float rounding).
    invalid_step: "admissible" or verl-agent's "format" (see the module docstring).
    progress: a bar over the turns on stderr (`salt_jax.log.progress_bar`), with the active
      trajectories and the steps so far; off (silent) when False.
  Returns:
    RolloutBatch.
  """
  import jax  # pylint: disable=import-outside-toplevel  (key splitting only)

  tasks = list(tasks)
  if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
    raise ValueError(f"group_size must be an int >= 1, got {group_size!r}")
  if not tasks:
    raise ValueError("tasks is empty")
  if any(not isinstance(t, Task) for t in tasks):
    raise TypeError("tasks must be envs.base.Task instances")
  if max_steps < 1 or max_new_tokens < 1:
    raise ValueError(f"max_steps and max_new_tokens must be >= 1, got {max_steps}, "
                     f"{max_new_tokens}")
  if not invalid_action_penalty >= 0:
    raise ValueError(f"invalid_action_penalty must be >= 0, got {invalid_action_penalty}")
  if max_prompt_tokens is not None and max_prompt_tokens < 1:
    raise ValueError(f"max_prompt_tokens must be None or >= 1, got {max_prompt_tokens}")
  if not isinstance(reuse_cache, bool):
    raise ValueError(f"reuse_cache must be a bool, got {reuse_cache!r}")
  if invalid_step not in INVALID_STEP_MODES:
    raise ValueError(f"invalid_step must be one of {INVALID_STEP_MODES}, got {invalid_step!r}")

  prompter = Prompter(tokenizer, prompt_config)
  kwargs = dict(max_new_tokens=max_new_tokens, temperature=sampling.temperature,
                top_p=sampling.top_p, top_k=sampling.top_k, greedy=sampling.greedy,
                stop_strings=tuple(sampling.stop_strings))
  if _takes(sampler, "decode_fn"):
    kwargs["decode_fn"] = tokenizer.decode
  # Whole-history prompts extend the previous prompt + response, so the cache carries over.
  reuse = (reuse_cache and prompt_config.history_window is None
           and _takes(sampler, "continue_rows") and hasattr(sampler, "clear_cache"))
  n_traj = len(tasks) * group_size
  traj_task = [tasks[i // group_size] for i in range(n_traj)]
  steps: list[list[dict]] = [[] for _ in range(n_traj)]
  failed = np.zeros(n_traj, bool)
  done = np.zeros(n_traj, bool)
  truncated = np.zeros(n_traj, bool)
  errors = [""] * n_traj
  first_obs = [""] * n_traj
  convs: list = [None] * n_traj
  admissible: list = [None] * n_traj
  row_of = np.full(n_traj, -1)  # each trajectory's row in the last sampler call
  gen_s = env_s = 0.0
  prompt_tokens = reused_tokens = prefilled_tokens = 0
  # the sampler's own split of its time and the work it had to do (NaN when it reports none)
  phase_sums = dict.fromkeys(_SAMPLER_PHASE_FIELDS, 0.0)
  t_start = time.perf_counter()
  restarts_before = int(getattr(env_pool, "restarts", 0))

  t0 = time.perf_counter()
  resets = env_pool.reset_batch([(slot_offset + i, traj_task[i], seed) for i in range(n_traj)])
  env_s += time.perf_counter() - t0
  for i, r in enumerate(resets):
    if r.failed:
      failed[i], errors[i], done[i] = True, r.error, True
      continue
    first_obs[i], admissible[i] = r.observation, r.admissible_actions
    convs[i] = prompter.start(r.observation, r.admissible_actions)
    done[i] = r.done

  turns = 0
  bar = progress_bar(total=max_steps, desc="rollout", enabled=progress, unit="turn")
  for _ in range(max_steps):
    if max_prompt_tokens is not None:
      for i in np.flatnonzero(~done):
        if len(convs[i].prompt_ids) > max_prompt_tokens:
          done[i] = truncated[i] = True
    active = [int(i) for i in np.flatnonzero(~done)]
    if not active:
      break
    turns += 1
    key, sub = jax.random.split(key)
    prompts = [list(convs[i].prompt_ids) for i in active]
    logger.debug("rollout turn %d: %d of %d trajectories active, longest prompt %d tokens",
                 turns, len(active), len(done), max(len(q) for q in prompts))
    if reuse:
      kwargs["keep_cache"] = True
      kwargs["continue_rows"] = None if turns == 1 else [int(row_of[i]) for i in active]
      row_of[active] = np.arange(len(active))
    t0 = time.perf_counter()
    out = sampler(prompts, sub, **kwargs)
    gen_s += time.perf_counter() - t0
    _check_output(out, len(active))
    turn_tokens = sum(len(p) for p in prompts)
    reused = int(getattr(out, "reused_tokens", 0))
    prompt_tokens += turn_tokens
    reused_tokens += reused
    prefilled_tokens += int(getattr(out, "prefilled_tokens", turn_tokens - reused))
    for name in _SAMPLER_PHASE_FIELDS:
      phase_sums[name] += float(getattr(out, name, float("nan")))
    texts = out.texts if out.texts is not None else [
        tokenizer.decode([int(t) for t in toks]) for toks in out.tokens]
    parsed = [parse_action(texts[j], admissible[i]) for j, i in enumerate(active)]
    t0 = time.perf_counter()
    results = env_pool.step_batch([(slot_offset + i, p.action) for i, p in zip(active, parsed)])
    env_s += time.perf_counter() - t0
    for j, (i, p, r) in enumerate(zip(active, parsed, results)):
      if r.failed:
        failed[i], errors[i], done[i] = True, r.error, True
        continue
      resp = np.asarray(out.tokens[j], np.int32)
      steps[i].append(dict(
          prompt_ids=np.asarray(prompts[j], np.int32), response_ids=resp,
          old_logprobs=np.asarray(out.policy_logprobs[j], np.float32),
          sample_logprobs=np.asarray(out.logprobs[j], np.float32), action=p.action,
          response=texts[j], observation=r.observation, reward=float(r.reward), done=r.done,
          won=r.won, score=r.score, parse_reason=p.reason,
          valid=(p.reason in _FORMAT_OK) if invalid_step == "format" else (p.valid and r.valid),
          finish_reason=str(out.finish_reasons[j])))
      done[i] = r.done
      admissible[i] = r.admissible_actions
      if not r.done:
        convs[i].advance(resp, p.action, r.observation, r.admissible_actions)
    bar.update(1)
    # drawn every turn (a turn is a batched generation: the redraw costs nothing beside it)
    bar.set_postfix_str(f"{len(active)}/{n_traj} active, {sum(map(len, steps))} steps")
  bar.close()
  if reuse:
    sampler.clear_cache()  # the kept cache is as large as the rollout's: free it for training
  truncated |= ~done  # out of max_steps while the env was still going

  flat = [s for traj in steps for s in traj]
  num_steps = np.array([len(s) for s in steps], np.int32)
  traj_ids = np.repeat(np.arange(n_traj, dtype=np.int32), num_steps)
  valid = np.array([s["valid"] for s in flat], bool)
  num_invalid = np.array([sum(not s["valid"] for s in traj) for traj in steps], np.int32)
  returns = np.array([sum(s["reward"] for s in traj) for traj in steps], np.float32)
  success = np.array([any(s["won"] for s in traj) for traj in steps], bool) & ~failed
  # A graded task's score is its last graded step's; a pass/fail task scores whether it was won.
  scores = np.array([next((s["score"] for s in reversed(traj) if s["score"] is not None), won)
                     for traj, won in zip(steps, success)], np.float32)
  outcome = np.where(failed, 0.0, returns - invalid_action_penalty * num_invalid).astype(np.float32)
  group_of = np.arange(n_traj, dtype=np.int32) // group_size
  total_s = time.perf_counter() - t_start
  metrics = dict(
      num_trajectories=n_traj, num_failed=int(failed.sum()), num_steps=len(flat), turns=turns,
      response_tokens=int(sum(len(s["response_ids"]) for s in flat)),
      prompt_tokens=prompt_tokens, reused_prompt_tokens=reused_tokens,
      prefilled_prompt_tokens=prefilled_tokens,
      prefill_time_s=phase_sums["prefill_seconds"], decode_time_s=phase_sums["decode_seconds"],
      prefill_compile_s=phase_sums["prefill_compile_seconds"],
      decode_compile_s=phase_sums["decode_compile_seconds"],
      prefill_flops=phase_sums["prefill_flops"], decode_bytes=phase_sums["decode_bytes"],
      gen_time_s=gen_s, env_time_s=env_s, other_time_s=total_s - gen_s - env_s,
      total_time_s=total_s, env_wait_fraction=env_wait_fraction(env_s, gen_s),
      env_restarts=int(getattr(env_pool, "restarts", 0)) - restarts_before)
  col = lambda k: [s[k] for s in flat]  # pylint: disable=unnecessary-lambda-assignment
  batch = RolloutBatch(
      prompt_ids=col("prompt_ids"), response_ids=col("response_ids"),
      old_logprobs=col("old_logprobs"), sample_logprobs=col("sample_logprobs"),
      step_group_ids=group_of[traj_ids], step_traj_ids=traj_ids,
      step_index=np.concatenate([np.arange(n, dtype=np.int32) for n in num_steps]),
      actions=col("action"), responses=col("response"), observations=col("observation"),
      step_rewards=np.array(col("reward"), np.float32), step_dones=np.array(col("done"), bool),
      step_valid=valid, parse_reasons=col("parse_reason"), finish_reasons=col("finish_reason"),
      traj_group_ids=group_of, task_ids=[t.task_id for t in traj_task],
      task_types=[t.task_type for t in traj_task], success=success, scores=scores, failed=failed,
      errors=errors, truncated=truncated & ~failed, num_steps=num_steps, num_invalid=num_invalid,
      returns=returns, outcome_rewards=outcome, first_observations=first_obs,
      num_groups=len(tasks), invalid_action_penalty=float(invalid_action_penalty),
      whole_history=prompt_config.history_window is None, metrics=metrics)
  metrics.update(outcome_rates(batch))
  return batch


def outcome_rates(batch: RolloutBatch) -> dict:
  """Success rate (overall and per task type), mean score, valid-action ratio and mean episode
  length over the batch's trajectories that did not fail (NaN where none is left)."""
  ok = ~batch.failed
  ok_steps = ok[batch.step_traj_ids]
  nan = float("nan")
  types = np.array(batch.task_types)
  return dict(
      success_rate=float(batch.success[ok].mean()) if ok.any() else nan,
      score=float(batch.scores[ok].mean()) if ok.any() else nan,
      valid_action_ratio=float(batch.step_valid[ok_steps].mean()) if ok_steps.any() else nan,
      mean_steps=float(batch.num_steps[ok].mean()) if ok.any() else nan,
      success_rate_by_type={
          t: float(batch.success[ok & (types == t)].mean()) if (ok & (types == t)).any() else nan
          for t in sorted(set(batch.task_types))})


def env_wait_fraction(env_s: float, gen_s: float) -> float:
  """The share of the rollout's busy time spent waiting on environments (vs generating)."""
  return env_s / (env_s + gen_s) if env_s + gen_s > 0 else float("nan")
