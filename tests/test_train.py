"""End-to-end trainer on the toy env with a tiny policy: metrics, SALT on/off, kill and resume,
meshes, damaged checkpoints, the NaN guard, bad flags (settings checked one iteration at a time
from the same warm start: tests/test_train_settings.py).

One warm-started policy (a few behaviour-cloning steps, so trajectories differ in outcome and
advantages are not all zero) is trained for 3 iterations with SALT on (run A). Run C is the same
with SALT off for one iteration. The kill test trains A's configuration again in a subprocess that
is SIGKILLed three times (at a seeded random moment, inside a checkpoint's commit, right after a
save) and resumed each time; its log must equal run A's.
"""

import dataclasses
import gc
import glob
import json
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.compilation_cache import compilation_cache
from flax import nnx

from envs import registry
from envs.toy import ToyEnv
from salt_jax import batching
from salt_jax import metrics as metrics_lib
from envs import demos as demos_lib
from salt_jax import sft
from salt_jax.sharding import make_mesh
from salt_jax.config import TrainConfig
from salt_jax.models import cost
from salt_jax.models.build import build_policy, build_tokenizer, save_params
from salt_jax.train import Trainer, use_compilation_cache
from tests import across_workers
from tests.tensorboard_reader import read_tensorboard

# Trains or samples a policy: .ci/run runs it again under another XLA instruction set.
pytestmark = pytest.mark.samples

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

ENV_KW = {"num_rooms": 3}
# Every training task is won in 2 to 4 steps (max_steps 4), none in 1, so every trajectory has at
# least two step rows; with statistics over step rows and discounted step returns (gamma < 1) the
# rows of a won trajectory score differently, so a group with any win has non-zero advantages even
# when the sampler draws G identical trajectories. The updates the tests check therefore do not
# hang on which tokens one CPU's rounding samples. Task order (seed 3): one walk and one key-door
# task in each of the first three iterations (both success_rate/<type> keys are logged).
TASK_IDS = ("toy-train-0", "toy-train-5", "toy-train-6", "toy-train-7")
BASE = TrainConfig(env="toy", env_kwargs=ENV_KW, tokenizer="toy", group_size=4, tasks_per_iter=2,
                   train_task_ids=TASK_IDS, max_steps=4, max_new_tokens=24, max_cache_len=512,
                   prompt_bucket_min=128, env_workers=0, lr=3e-4, kl_coef=0.05,
                   group_stats="steps", gamma=0.9,
                   minibatch_rows=4, min_seq_len=64, iters=3, seed=3, temperature=1.0,
                   progress=False)

REQUIRED = [
    "iteration", "success_rate", "episode_length", "valid_action_ratio", "merge_rate",
    "cross_prompt_merges", "merged_steps", "gradient_changing_merges", "gradient_changing_share",
    "response_differing_merges", "prompt_tokens", "prefilled_prompt_tokens",
    "adv_before/mean", "adv_before/std", "adv_before/abs_mean",
    "adv_after/mean", "adv_after/std", "adv_after/abs_mean", "adv_frac_changed", "kl",
    "clip_fraction", "entropy", "loss", "grad_norm", "lr", "skipped_groups", "invalid_rewards",
    "failed_trajectories", "skipped_updates", "time/rollout", "time/old_logprob",
    "time/ref_logprob", "time/advantage", "time/salt", "time/update",
    "time/rollout_prefill", "time/rollout_decode", "flops/prefill", "bytes/decode",
    "time/xla_compile", "time/xla_compile_rollout", "time/xla_compile_update",
    "time/xla_compile_prefill", "time/xla_compile_decode",
    "rate/prefill_gflops", "rate/decode_gbs", "flops/update", "rate/update_gflops",
    "success_rate/walk", "success_rate/key-door"]
# What SALT may change: the advantages after it, and what the update makes of them.
FOLLOWS_FROM_ADVANTAGES = {
    "adv_after/mean", "adv_after/std", "adv_after/abs_mean", "adv_frac_changed", "merge_rate",
    "cross_prompt_merges", "merged_steps", "gradient_changing_merges", "gradient_changing_share",
    "response_differing_merges",
    "loss", "pg_loss", "grad_norm", "kl", "clip_fraction", "ratio_mean",
    "approx_kl_old", "entropy"}


def _untimed(row):
  """The row without what depends on the wall clock or the process: its times, the rates made
  of them, and the process's host memory."""
  return {k: v for k, v in row.items() if not k.startswith(("time/", "rate/", "mem/"))}


@pytest.fixture(scope="module")
def warm():
  """Params of the tiny policy cloned (150 steps) from a noisy expert on the training tasks (an
  admissible action drawn at random in place of the expert's at a quarter of the steps, episodes
  kept won or lost), so the policy it leaves is stochastic: a group's G trajectories differ in
  their actions, outcomes and invalid steps, and SALT's merges join steps of different futures.
  (Cloned from the clean expert to a near-zero loss, the policy drew G identical trajectories in
  most groups, and whether an iteration had anything to merge hung on the CPU's rounding.)
  Cloned once per test run: the files that train from it share it across xdist's workers."""
  return warm_params()


def warm_params() -> str:
  """The path of `warm`'s params, cloned by the first worker of the test run that asks."""
  return os.path.join(across_workers.once("test_train_warm", clone_noisy_expert), "params")


def clone_noisy_expert(folder, config=BASE):
  """Saves `config`'s tiny policy cloned from the noisy expert (see `warm`) as `folder`/params."""
  tok = build_tokenizer(config)
  model = build_policy(config, tok, make_mesh(config.mesh))
  env = ToyEnv(max_steps=config.max_steps, **config.env_kwargs)
  demos = demos_lib.collect_demos(env, registry.training_tasks(config), seeds=range(12),
                                  max_steps=config.max_steps, only_won=False, epsilon=0.25)
  batch = sft.demo_token_batch(demos, tok, pad_id=tok.pad_token_id, min_length=64)
  sft.behaviour_clone(model, batch, sft.SFTConfig(steps=150, rows=8, lr=1e-2))
  save_params(os.path.join(folder, "params"), nnx.state(model))


@pytest.fixture(scope="module")
def run_a(warm, tmp_path_factory):
  """Run A: (config, trainer, rows, seen), `seen[k]` = iteration k's (rollout, mini-batches,
  (advantages before, after SALT)); checkpoints 1 to 3 (the state before iterations 1 and 2, and
  after the last) stay in its folder."""
  cfg = dataclasses.replace(BASE, out=str(tmp_path_factory.mktemp("a")), init_params=warm,
                            max_to_keep=3)
  with Trainer(cfg) as tr:
    tr.setup()
    rows, seen = [], []
    for _ in range(cfg.iters):
      rows.append(tr.iteration())
      seen.append((tr.last.rollout, [dict(mb) for mb in tr.last.minibatches or []],
                   tr.last.advantages))
    tr.checkpoints.wait()  # the tests copy its folder: checkpoint 3 complete, not in flight
    yield cfg, tr, rows, seen


def test_dropping_compiled_programs_leaves_the_run_as_it_was(run_a, tmp_path):
  """clear_programs_above=0 drops every compiled program after each iteration (what a run past
  that share of the machine's memory does): the next iteration compiles again and trains as if
  nothing happened, the same rows as run A's; run A (far below half this machine's memory)
  dropped none."""
  cfg, _, rows, _ = run_a
  cleared = dataclasses.replace(cfg, out=str(tmp_path / "cleared"), iters=2,
                                clear_programs_above=0.0)
  with Trainer(cleared) as tr:
    tr.setup()
    got = [tr.iteration() for _ in range(cleared.iters)]
  assert [_untimed(r) for r in got] == [_untimed(r) for r in rows[:2]]
  assert all(r["mem/programs_cleared"] == 1.0 and r["mem/cleared_gb"] >= -0.05 for r in got)
  assert all(r["mem/programs_cleared"] == 0.0 and r["mem/cleared_gb"] == 0.0 for r in rows)


def test_metrics_written_with_all_keys(run_a):
  cfg, tr, rows, seen = run_a
  logged = metrics_lib.read_jsonl(os.path.join(cfg.out, "metrics.jsonl"))
  assert [r["iteration"] for r in logged] == [0, 1, 2]
  for r in logged:
    missing = [k for k in REQUIRED if k not in r]
    assert not missing, missing
    assert r["skipped_updates"] == 0 and r["num_updates"] >= 1
    assert math.isfinite(r["loss"]) and math.isfinite(r["kl"]) and r["lr"] == cfg.lr
    assert 0.0 <= r["merge_rate"] < 1.0 and 0.0 <= r["valid_action_ratio"] <= 1.0
    assert 0 <= r["response_differing_merges"] <= r["merged_steps"]
    # A group's G copies of each task's first prompt are prefilled once.
    assert 0 < r["prefilled_prompt_tokens"] < r["prompt_tokens"]
    # Each phase's rate is its model work over its time (salt_jax.models.cost).
    assert r["time/rollout_prefill"] + r["time/rollout_decode"] <= r["time/rollout_generate"]
    for work, rate, phase in (("flops/prefill", "rate/prefill_gflops", "time/rollout_prefill"),
                              ("bytes/decode", "rate/decode_gbs", "time/rollout_decode"),
                              ("flops/update", "rate/update_gflops", "time/update")):
      assert r[rate] == pytest.approx(r[work] / r[phase] / 1e9)
    # XLA compiles: inside the iteration and the phases that hold them.
    for compile_key, phase in (("rollout", "rollout"), ("update", "update"),
                               ("prefill", "rollout_prefill"), ("decode", "rollout_decode")):
      assert 0.0 <= r[f"time/xla_compile_{compile_key}"] <= r[f"time/{phase}"]
    assert (r["time/xla_compile_prefill"] + r["time/xla_compile_decode"]
            <= r["time/xla_compile_rollout"] + 1e-9)
    assert (r["time/xla_compile_rollout"] + r["time/xla_compile_update"]
            <= r["time/xla_compile"] + 1e-9 <= r["time/iteration"] + 1e-9)
    # Host memory: the process holds at least its live arrays (the params among them).
    params_gb = sum(x.nbytes for x in jax.tree.leaves(tr.state.params)) / 2**30
    assert r["mem/live_arrays"] > 0 and r["mem/live_array_gb"] >= params_gb
    assert r["mem/resident_gb"] > r["mem/live_array_gb"] or not os.path.exists("/proc/self/statm")
  # The first iteration compiles the trainer's programs (its update's, at least).
  assert logged[0]["time/xla_compile_update"] > 0.0
  minibatches = seen[0][1]  # the first update's rows
  lengths = [int(n) for mb in minibatches for n in np.asarray(mb["attention_mask"]).sum(axis=1)]
  loss_tokens = sum(int(np.asarray(mb["loss_mask"]).sum()) for mb in minibatches)
  assert rows[0]["flops/update"] == pytest.approx(cfg.ppo_epochs * cost.train_flops(
      tr.model.config, lengths, loss_tokens))
  assert logged == [json.loads(json.dumps(r)) for r in rows]
  assert rows[2]["kl"] > 0.0  # the policy has moved off its reference
  # TensorBoard, as its own reader sees it: every scalar once at its step, and the histograms of
  # the step advantages before and after SALT.
  scalars, hists = read_tensorboard(os.path.join(cfg.out, "tb"))
  assert scalars == {(r["iteration"], k): [np.float32(v)] for r in rows for k, v in r.items()
                     if isinstance(v, (int, float)) and not isinstance(v, bool)
                     and k != "iteration" and math.isfinite(v)}
  assert set(hists) == {(i, t) for i in range(3) for t in ("adv_before", "adv_after")}
  assert hists[(0, "adv_after")].num == len(seen[0][2][1])


def test_salt_changes_the_advantages_and_nothing_else(run_a, warm, tmp_path):
  """The first iteration of run A where SALT changed an advantage, again with SALT off from the
  same state (the initial one, or A's checkpoint before it): the same rollout, tokens, old and
  reference log-probs and advantages before SALT; only what follows from the advantages differs."""
  cfg, tr_a, rows, seen = run_a
  it = next((i for i, r in enumerate(rows) if r["adv_frac_changed"] > 0), None)
  assert it is not None, [{n: r[n] for n in ("success_rate", "valid_action_ratio", "merge_rate",
                                            "skipped_groups", "adv_before/abs_mean")} for r in rows]
  roll_a, mbs_a, (before_a, after_a) = seen[it]
  off = dataclasses.replace(cfg, salt=False, out=str(tmp_path / "c"), iters=it + 1)
  with Trainer(off) as tr:
    tr.setup()
    if it:  # pylint: disable=protected-access
      tr._load(*tr_a.checkpoints.read(it, tr._state_tree()))
    row_c = tr.iteration()
    roll_c, mbs_c, (before_c, after_c) = tr.last.rollout, tr.last.minibatches, tr.last.advantages
  # the same rollout, token for token
  assert roll_a.actions == roll_c.actions and roll_a.responses == roll_c.responses
  for x, y in zip(roll_a.old_logprobs + roll_a.prompt_ids, roll_c.old_logprobs + roll_c.prompt_ids):
    np.testing.assert_array_equal(x, y)
  np.testing.assert_array_equal(roll_a.outcome_rewards, roll_c.outcome_rewards)
  # the same training tokens, old and reference log-probs
  assert len(mbs_a) == len(mbs_c)
  for a, c in zip(mbs_a, mbs_c):
    assert a.keys() == c.keys()
    for k in a:
      np.testing.assert_array_equal(a[k], c[k], err_msg=k)
  # the same advantages before SALT; SALT off leaves them, SALT on changes some
  np.testing.assert_array_equal(before_a, before_c)
  np.testing.assert_array_equal(after_c, before_c)
  assert row_c["adv_frac_changed"] == 0 and np.any(after_a != before_a)
  # group sums are kept per merged edge, so the mean advantage is unchanged
  np.testing.assert_allclose(after_a.mean(), before_a.mean(), atol=1e-6)
  ra, rc = _untimed(rows[it]), _untimed(row_c)
  same = {k for k in ra if k not in FOLLOWS_FROM_ADVANTAGES}
  assert {k: ra[k] for k in same} == {k: rc.get(k) for k in same}


# A training process to kill (orbax's commit is reached through its private module: the version
# is pinned in pyproject.toml). argv: a TrainConfig as JSON, then where to stop and wait to be
# killed: "none", "in-save:N" (inside orbax's commit of checkpoint N: its files are written to the
# temporary folder, not yet renamed into place; with async saves the loop goes on meanwhile),
# "in-flight:N" (async saves only: N's commit is held, and the loop goes on until it has to wait
# for it: the next save, or the end of the run) or "after-save:N" (checkpoint N complete). It
# writes <out>/ready (holding the iteration it starts at) when training starts and <out>/paused
# when it stops.
DRIVER = """
import json, os, sys, threading, time
from orbax.checkpoint._src.path import atomicity
from salt_jax.checkpoint import RunCheckpoints
from salt_jax.train import TrainConfig, Trainer

cfg = TrainConfig(**json.loads(sys.argv[1]))
where, _, step = sys.argv[2].partition(":")

def mark(name, text=""):  # whole or absent, as the test may read it at any moment
  with open(os.path.join(cfg.out, name + ".tmp"), "w") as f:
    f.write(text)
  os.replace(os.path.join(cfg.out, name + ".tmp"), os.path.join(cfg.out, name))

def pause():
  mark("paused")
  time.sleep(3600)

held, issued = threading.Event(), threading.Event()  # in-flight: N's commit held; save(N) returned
commit = atomicity.AtomicRenameTemporaryPath.finalize
async def finalize(self):
  if where in ("in-save", "in-flight") and self.get_final().name == step:
    if where == "in-save":
      pause()
    held.set()
    time.sleep(3600)
  await commit(self)
atomicity.AtomicRenameTemporaryPath.finalize = finalize

def pause_if_waiting_for_held():  # the loop reached a wait for the held commit
  if where == "in-flight" and issued.is_set():
    held.wait()
    pause()

save = Trainer.save
def save_then_pause(self):
  pause_if_waiting_for_held()
  save(self)
  if where == "in-flight" and self.iteration_index == int(step):
    issued.set()
  if where == "after-save" and self.iteration_index == int(step):
    self.checkpoints.wait()
    pause()
Trainer.save = save_then_pause

wait = RunCheckpoints.wait
def pause_or_wait(self):
  pause_if_waiting_for_held()
  wait(self)
RunCheckpoints.wait = pause_or_wait

with Trainer(cfg) as tr:
  tr.setup()
  mark("ready", str(tr.iteration_index))
  tr.run()
"""


def _start(cfg, stop, work):
  """The driver on `cfg` in a subprocess; its processes share compiled programs (a cache in
  `work`, where their output goes too)."""
  for name in ("ready", "paused"):
    if os.path.exists(os.path.join(cfg.out, name)):
      os.remove(os.path.join(cfg.out, name))
  env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=str(work / "jax_cache"),
             JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
             JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="-1")
  log = open(work / f"{stop}.log", "w+", encoding="utf-8")  # pylint: disable=consider-using-with
  proc = subprocess.Popen([sys.executable, "-c", DRIVER, json.dumps(cfg.to_json()), stop],
                          cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
  proc.log = log
  return proc


def _wait_for(proc, path, timeout=600.0):
  deadline = time.monotonic() + timeout
  while not os.path.exists(path):
    if proc.poll() is not None or time.monotonic() > deadline:
      log = _kill(proc)
      raise AssertionError(f"no {path} (exit code {proc.returncode}):\n{log[-3000:]}")
    time.sleep(0.05)
  with open(path, encoding="utf-8") as f:
    return f.read()


def _kill(proc) -> str:
  """SIGKILL (unless it already ended); returns its output."""
  if proc.poll() is None:
    os.kill(proc.pid, signal.SIGKILL)
  proc.wait()
  proc.log.seek(0)
  text = proc.log.read()
  proc.log.close()
  return text


def _steps(out):
  """Complete checkpoints (orbax names them by step) and temporary, uncommitted ones."""
  names = os.listdir(os.path.join(out, "checkpoints"))
  return (sorted(int(n) for n in names if n.isdigit()),
          sorted(n for n in names if ".orbax-checkpoint-tmp" in n))


def _tensorboard_scalars(out):
  """{(step, tag): [values]} of the run, as TensorBoard's reader sees them."""
  return read_tensorboard(os.path.join(out, "tb"))[0]


def test_killed_at_any_moment_resumes_as_if_never_stopped(run_a, tmp_path):
  cfg, _, rows, _ = run_a
  _kill_three_times_and_resume(cfg, rows, tmp_path)


@pytest.mark.slow  # about 80 s here; the fast suite resumes on 4x2 in test_resume_on_a_4x2_mesh_*
def test_killed_at_any_moment_on_a_4x2_mesh(run_4x2, tmp_path):
  cfg, _, rows = run_4x2
  _kill_three_times_and_resume(cfg, rows, tmp_path)


def _kill_three_times_and_resume(cfg, rows, tmp_path):
  """Trains `cfg` in subprocesses killed three times and resumed; its logs must equal `rows`, the
  uninterrupted run's."""
  out = str(tmp_path / "k")
  fresh = dataclasses.replace(cfg, out=out)
  resume = dataclasses.replace(fresh, resume=True)

  # 1. SIGKILL at a seeded random moment of all iterations but the last (were it slower than
  # that, the stop inside the last checkpoint's commit holds it, so it never finishes before the
  # kill).
  proc = _start(fresh, f"in-save:{cfg.iters}", tmp_path)
  _wait_for(proc, os.path.join(out, "ready"))
  delay = random.Random(7).uniform(0.0, sum(r["time/iteration"] for r in rows[:-1]))
  try:
    proc.wait(timeout=delay)
  except subprocess.TimeoutExpired:
    pass
  assert proc.poll() is None, "the run ended by itself before the kill"
  _kill(proc)
  done, _ = _steps(out)
  last = done[-1] if done else 0

  # 2. SIGKILL inside the next checkpoint's commit: the resumed run starts from the last complete
  # checkpoint, and the half-written one is left aside. Saved asynchronously, the loop went on
  # while it was written, up to the next save, and logged the iteration after it.
  stop = "in-flight" if cfg.async_checkpoint else "in-save"
  proc = _start(resume, f"{stop}:{last + 1}", tmp_path)
  assert _wait_for(proc, os.path.join(out, "ready")) == str(last)
  _wait_for(proc, os.path.join(out, "paused"))
  _kill(proc)
  done, partial = _steps(out)
  assert (done[-1] if done else 0) == last
  assert any(n.startswith(f"{last + 1}.") for n in partial), partial
  if cfg.async_checkpoint and last + 1 < cfg.iters:
    logged = metrics_lib.read_jsonl(os.path.join(out, "metrics.jsonl"))
    assert logged[-1]["iteration"] == last + 1, logged

  # 3. SIGKILL right after the last checkpoint is complete.
  proc = _start(resume, f"after-save:{cfg.iters}", tmp_path)
  assert _wait_for(proc, os.path.join(out, "ready")) == str(last)
  _wait_for(proc, os.path.join(out, "paused"))
  _kill(proc)
  assert _steps(out)[0][-1] == cfg.iters

  # Each iteration logged once, with the uninterrupted run's numbers, in both logs.
  logged = metrics_lib.read_jsonl(os.path.join(out, "metrics.jsonl"))
  assert [r["iteration"] for r in logged] == list(range(cfg.iters))
  assert [_untimed(r) for r in logged] == [_untimed(json.loads(json.dumps(r))) for r in rows]
  scalars = _tensorboard_scalars(out)
  want = {(r["iteration"], k): [np.float32(v)] for r in logged for k, v in r.items()
          if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "iteration"}
  assert scalars == want


def test_minibatches_are_cut_to_their_own_longest_row(run_a):
  _, tr, _, _ = run_a
  rng = np.random.default_rng(0)
  lengths = [700, 650, 690, 600, 80, 70, 90, 60, 300, 10, 20, 30]  # long, short, mixed groups
  prompts = [rng.integers(3, 50, n - 5) for n in lengths]
  responses = [rng.integers(3, 50, 5) for _ in lengths]
  logps = [rng.normal(size=5).astype(np.float32) for _ in lengths]
  tb = batching.step_rows(prompts, responses, logps, pad_id=0, min_length=64,
                          row_multiple=tr.rows)
  assert tr.rows == 4 and tr.config.min_seq_len == 64 and tb.input_ids.shape == (12, 768)
  mbs = tr._minibatches(tb)  # pylint: disable=protected-access
  assert [mb["input_ids"].shape for mb in mbs] == [(4, 768), (4, 96), (4, 384)]
  # nothing lost: each mini-batch is its rows of the batch, cut where only padding follows
  for s, mb in zip(range(0, tb.input_ids.shape[0], tr.rows), mbs):
    # only the response tokens' positions are projected to the vocabulary
    np.testing.assert_array_equal(mb.pop("logit_positions"),
                                  batching.logit_positions(mb["loss_mask"], 64))
    assert mb["loss_mask"].any(axis=1).all()
    for k, v in mb.items():
      full = getattr(tb, k)[s:s + tr.rows]
      np.testing.assert_array_equal(v, full[:, :v.shape[1]], err_msg=k)
      assert not np.any(tb.attention_mask[s:s + tr.rows, v.shape[1]:]), k


def test_nan_guard_skips_the_update(run_a):
  """A mini-batch of its own (the last rollout's first, with reference log-probs whether or not
  that iteration updated) whose old log-probs are NaN: skipped, counted, nothing changed."""
  _, tr, _, _ = run_a
  mb = {k: np.array(v) for k, v in tr.last.minibatches[0].items()}
  (ref_lp,) = tr._logprobs_all(tr.ref_params, [mb])  # pylint: disable=protected-access
  mb["ref_logprobs"] = np.where(mb["loss_mask"], ref_lp, 0.0).astype(np.float32)
  mb["old_logprobs"] = np.where(mb["loss_mask"], np.nan, 0.0).astype(np.float32)
  assert mb["loss_mask"].any()
  before = jax.tree.map(np.asarray, tr.state.params)
  opt_before = jax.tree.map(np.asarray, tr.state.opt_state)
  total = tr.skipped_updates_total
  res = tr._update([mb], tr.last.step_adv, jax.random.key(0))  # pylint: disable=protected-access
  assert res["skipped_updates"] == 1 and res["num_updates"] == 0 and math.isnan(res["loss"])
  assert tr.skipped_updates_total == total + 1
  jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, tr.state.params), before)
  jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, tr.state.opt_state),
               opt_before)


@pytest.mark.parametrize("change, match", [
    (dict(group_size=0), "group_size"),
    (dict(group_size=1), "no baseline: .* every advantage is 0"),
    (dict(algo="a2c"), "unknown algo"),
    (dict(mesh="4by2"), "DxM"),
    (dict(layout="trajectory", prompt_history=2), "whole-history"),
    (dict(model="/no/such/folder"), "not a local folder"),
    (dict(tokenizer="nope"), "tokenizer"),
    (dict(mesh="3x3"), "needs 9 devices"),  # 8 simulated CPU devices in tests
    (dict(layout="rows"), "unknown layout"),
    (dict(embedder="/no/such/model"), "embedder must be"),
    (dict(param_dtype="float16"), "param_dtype"),
    (dict(microbatch_rows=3), "must divide minibatch_rows"),
    (dict(microbatch_rows=-1), "microbatch_rows"),
    (dict(mesh="4x2", microbatch_rows=2), "multiple of the mesh's data axis"),
    (dict(logprob_microbatch_rows=3), r"logprob_microbatch_rows \(3\) must divide"),
    (dict(mesh="4x2", logprob_microbatch_rows=2), "logprob_microbatch_rows .* multiple of the "
                                                   "mesh's data axis"),
    (dict(remat_policy="layers"), "unknown remat_policy"),
    (dict(compute_dtype="float8"), "unknown compute_dtype"),
])
def test_bad_flags_fail_before_any_work(change, match, tmp_path):
  cfg = dataclasses.replace(BASE, out=str(tmp_path / "x"), **change)
  with pytest.raises(ValueError, match=match):
    Trainer(cfg)
  assert not os.path.exists(cfg.out)  # nothing was written


@pytest.mark.parametrize("param_dtype", ["float32", "bfloat16"])
def test_checkpoint_policy_is_loaded_in_param_dtype(param_dtype, tmp_path):
  # A bf16 checkpoint trains in float32 by default: AdamW's ~1e-6 steps would round away in bf16.
  from salt_jax.models import CausalLM, ModelConfig, save_pretrained  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  tok = build_tokenizer(BASE)
  mcfg = ModelConfig(vocab_size=-(-len(tok) // 64) * 64, hidden_size=32, intermediate_size=64,
                     num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16)
  folder = tmp_path / "policy"
  save_pretrained(CausalLM(mcfg, rngs=nnx.Rngs(0), dtype=jnp.bfloat16,
                           param_dtype=jnp.bfloat16), str(folder))
  cfg = dataclasses.replace(BASE, model=str(folder), param_dtype=param_dtype)
  cfg.validate()
  model = build_policy(cfg, tok, make_mesh("1x1"))
  dtypes = {x.dtype for x in jax.tree.leaves(nnx.state(model, nnx.Param))}
  assert dtypes == {jnp.dtype(param_dtype)}
  assert model.dtype == jnp.dtype(param_dtype)  # computes in it too, unless compute_dtype says
  # Mixed precision: float32 parameters computing in bfloat16, for a checkpoint and the tiny policy.
  for c in (cfg, dataclasses.replace(BASE, model=None)):
    c = dataclasses.replace(c, param_dtype="float32", compute_dtype="bfloat16")
    c.validate()
    model = build_policy(c, tok, make_mesh("1x1"))
    assert {x.dtype for x in jax.tree.leaves(nnx.state(model, nnx.Param))} == {jnp.dtype("float32")}
    assert model.dtype == jnp.bfloat16


def test_fresh_run_refuses_a_folder_with_checkpoints(run_a):
  cfg, _, _, _ = run_a
  with pytest.raises(ValueError, match="--resume"):
    Trainer(cfg)


@pytest.mark.parametrize("flag, match", [
    ("--mesh=4x", "--mesh must look like DxM"),  # before jax is imported
    ("--algo=a2c", "unknown algo"),
    ("--embedder=/no/such/model", "embedder must be"),
    ("--recipe=paper", "unknown --recipe"),
])
def test_script_rejects_bad_flags_before_any_work(flag, match, tmp_path):
  script = os.path.join(ROOT, "experiments", "textworld_grpo_salt.py")
  out = str(tmp_path / "run")
  p = subprocess.run([sys.executable, script, flag, f"--out={out}"], capture_output=True,
                     text=True, timeout=120, check=False)
  assert p.returncode != 0 and match in p.stderr, p.stderr[-2000:]
  assert not os.path.exists(out)


@pytest.fixture(scope="module")
def run_4x2(warm, tmp_path_factory):
  """Run A's configuration for 2 iterations on the 4x2 mesh, uninterrupted: (config, trainer,
  rows); its checkpoints 1 and 2 stay in its folder."""
  cfg = dataclasses.replace(BASE, mesh="4x2", out=str(tmp_path_factory.mktemp("m")), iters=2,
                            init_params=warm)
  with Trainer(cfg) as tr:
    tr.setup()
    yield cfg, tr, tr.run()


def _on_the_whole_mesh(tr):
  """Every piece of the trainer's state lives on all 8 devices of its mesh."""
  # pylint: disable=protected-access
  return {len(x.sharding.device_set) for x in jax.tree.leaves(tr._state_tree())} == {8}


def test_iterations_on_a_4x2_mesh(run_4x2):
  _, tr, rows = run_4x2
  assert _on_the_whole_mesh(tr)  # params, optimizer state, reference and key
  for row in rows:
    assert row["num_updates"] >= 1 and row["skipped_updates"] == 0
    assert math.isfinite(row["loss"]) and math.isfinite(row["grad_norm"])


def _copy_run(src, dst, drop_steps=()):
  """A copy of run folder `src` (checkpoints, logs) without checkpoints `drop_steps`: the folder a
  run stopped earlier would have left."""
  shutil.copytree(src, dst)
  for step in drop_steps:
    shutil.rmtree(os.path.join(dst, "checkpoints", str(step)))
  return str(dst)


def _params(tr):
  return [np.asarray(x) for x in jax.tree.leaves(tr.state.params)]


def test_resume_on_a_4x2_mesh_continues_as_if_never_stopped(run_4x2, tmp_path):
  """The issue's `--mesh=4x2 --resume`: stopped after iteration 0's checkpoint, resumed in a new
  Trainer, iteration 1 and the params after it are the uninterrupted run's."""
  cfg, tr_a, rows = run_4x2
  out = _copy_run(cfg.out, tmp_path / "r", drop_steps=[2])
  with Trainer(dataclasses.replace(cfg, out=out, resume=True)) as tr:
    tr.setup()
    assert tr.iteration_index == 1 and _on_the_whole_mesh(tr)
    # pylint: disable=protected-access
    assert (jax.tree.map(lambda x: x.sharding, tr._state_tree())
            == jax.tree.map(lambda x: x.sharding, tr_a._state_tree()))
    (row,) = tr.run()
    assert _untimed(row) == _untimed(rows[1])
    for a, b in zip(_params(tr), _params(tr_a)):
      np.testing.assert_array_equal(a, b)


def test_resume_onto_another_mesh_shape(run_a, tmp_path):
  """Saved on 1x1, resumed on 4x2: every array restored exactly, onto the whole mesh, and the run
  trains on."""
  cfg, tr_a, _, _ = run_a
  out = _copy_run(cfg.out, tmp_path / "m")
  with Trainer(dataclasses.replace(cfg, out=out, resume=True, mesh="4x2", iters=4)) as tr:
    tr.setup()
    assert tr.iteration_index == 3 and _on_the_whole_mesh(tr)
    for a, b in zip(_params(tr), _params(tr_a)):
      np.testing.assert_array_equal(a, b)
    (row,) = tr.run()
  assert row["iteration"] == 3 and row["skipped_updates"] == 0
  # It trained on, unless no group of this rollout had a signal (then no update is taken).
  if row["skipped_groups"] < cfg.tasks_per_iter:
    assert row["num_updates"] >= 1 and math.isfinite(row["loss"]) and row["kl"] > 0
  else:
    assert row["num_updates"] == 0 and row["adv_after/abs_mean"] == 0


# After a failed read orbax 0.12.8 leaves coroutines that raise once its event loop is closed
# (printed as "Exception ignored in ..."): noise from orbax, not a failure of the test. The tests
# collect them (`_collect_orbax_leftovers`) while the noise is filtered.
ORBAX_LEFTOVERS = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


def _collect_orbax_leftovers():
  gc.collect()


def _largest_data_file(step_dir):
  """The biggest file of orbax's array data (OCDBT) in a checkpoint."""
  files = glob.glob(os.path.join(step_dir, "state", "ocdbt.process_*", "d", "*"))
  return max(files, key=os.path.getsize)


def _truncate(path):
  with open(path, "r+b") as f:
    f.truncate(os.path.getsize(path) // 2)


def _flip_a_byte(path):
  """A changed byte in place: orbax reads it back without complaint (the values are wrong)."""
  with open(path, "r+b") as f:
    f.seek(os.path.getsize(path) // 2)
    b = f.read(1)
    f.seek(-1, os.SEEK_CUR)
    f.write(bytes([b[0] ^ 0xFF]))


@ORBAX_LEFTOVERS
@pytest.mark.parametrize("damage, reason", [
    (_truncate, "unreadable"), (os.remove, "unreadable"), (_flip_a_byte, "arrays differ")])
def test_resume_falls_back_from_a_damaged_checkpoint(run_a, tmp_path, damage, reason):
  """The newest checkpoint (3) damaged: the resume warns, moves it aside and restores checkpoint
  2. After the damage orbax reads back silently (a changed byte), the run also trains iteration 2
  again: as the uninterrupted run did."""
  cfg, _, rows, _ = run_a
  out = _copy_run(cfg.out, tmp_path / "d")
  damage(_largest_data_file(os.path.join(out, "checkpoints", "3")))
  with Trainer(dataclasses.replace(cfg, out=out, resume=True)) as tr:
    with pytest.warns(UserWarning, match=f"checkpoint 3 is damaged \\({reason}"):
      tr.setup()
    assert tr.iteration_index == 2
    assert os.listdir(os.path.join(out, "damaged_checkpoints")) == ["3"]
    if damage is _flip_a_byte:
      (row,) = tr.run()
      assert _untimed(row) == _untimed(rows[2])
      assert _steps(out) == _steps(cfg.out)  # a new checkpoint 3 where the damaged one was
  _collect_orbax_leftovers()


@ORBAX_LEFTOVERS
def test_resume_with_no_intact_checkpoint_stops(run_a, tmp_path):
  cfg, _, _, _ = run_a
  out = _copy_run(cfg.out, tmp_path / "d")
  for step in _steps(out)[0]:  # every one run A kept (1 to 3)
    os.remove(_largest_data_file(os.path.join(out, "checkpoints", str(step))))
  with Trainer(dataclasses.replace(cfg, out=out, resume=True)) as tr:
    with pytest.raises(ValueError, match="no intact checkpoint.*checkpoint 3: unreadable.*"
                                         "checkpoint 2: unreadable"):
      tr.setup()
  assert _steps(out) == _steps(cfg.out)  # left as they were
  assert not os.path.exists(os.path.join(out, "damaged_checkpoints"))
  _collect_orbax_leftovers()


def test_resume_with_other_settings_names_them(run_a):
  cfg, _, _, _ = run_a
  with open(os.path.join(cfg.out, "config.json"), encoding="utf-8") as f:
    saved = f.read()
  with pytest.raises(ValueError, match=r"group_size: saved 4, now 8; lr: saved 0\.0003, now 1\.0"):
    Trainer(dataclasses.replace(cfg, resume=True, group_size=8, lr=1.0))
  with open(os.path.join(cfg.out, "config.json"), encoding="utf-8") as f:
    assert f.read() == saved  # nothing rewritten
  # what a resume may change
  Trainer(dataclasses.replace(cfg, resume=True, iters=9, mesh="4x2", microbatch_rows=4,
                              eval_every=2, progress=True, tensorboard=False))


def test_resume_of_a_checkpoint_with_only_a_config_digest(tmp_path):
  """Checkpoints written before the configuration was saved field by field: the digest decides."""
  cfg = dataclasses.replace(BASE, out=str(tmp_path / "old"), resume=True)
  meta = os.path.join(cfg.out, "checkpoints", "1", "meta")
  os.makedirs(meta)
  digest = Trainer(cfg).checkpoints.config_digest()
  for written, ok in ((digest, True), ("0123456789abcdef", False)):
    with open(os.path.join(meta, "metadata"), "w", encoding="utf-8") as f:
      json.dump({"iteration": 1, "config_digest": written}, f)
    if ok:
      Trainer(cfg)
    else:
      with pytest.raises(ValueError, match="written with a different configuration"):
        Trainer(cfg)


def test_resume_of_a_run_saved_before_a_field_became_changeable(tmp_path):
  """A saved run records every field; one that a later version lets a resume change
  (`checkpoint.RESUME_MAY_CHANGE`) is not compared, whatever the saved value."""
  cfg = dataclasses.replace(BASE, out=str(tmp_path / "old"), resume=True)
  meta = os.path.join(cfg.out, "checkpoints", "1", "meta")
  os.makedirs(meta)
  saved = {**cfg.to_json(), "microbatch_lengths": "own", "compilation_cache": "/elsewhere"}
  with open(os.path.join(meta, "metadata"), "w", encoding="utf-8") as f:
    json.dump({"iteration": 1, "config": saved}, f)
  Trainer(cfg)
  saved["lr"] = 1.0
  with open(os.path.join(meta, "metadata"), "w", encoding="utf-8") as f:
    json.dump({"iteration": 1, "config": saved}, f)
  with pytest.raises(ValueError, match="lr: saved 1.0"):
    Trainer(cfg)


def test_script_names_the_settings_a_resume_changes(tmp_path):
  """The experiment scripts stop, before any work, on a --resume whose flags differ from the
  saved run's (here a checkpoint's saved fields, as orbax lays them out)."""
  out = tmp_path / "run"
  meta = out / "checkpoints" / "1" / "meta"
  meta.mkdir(parents=True)
  (meta / "metadata").write_text(json.dumps({"iteration": 1, "config": {"group_size": 3}}))
  script = os.path.join(ROOT, "experiments", "textworld_grpo_salt.py")
  p = subprocess.run([sys.executable, script, "--resume", f"--out={out}"], capture_output=True,
                     text=True, timeout=120, check=False)
  assert p.returncode != 0 and "error: --resume: settings differ" in p.stderr, p.stderr[-2000:]
  assert "group_size: saved 3, now 4" in p.stderr
  assert sorted(os.listdir(out)) == ["checkpoints"]  # nothing written


def test_compilation_cache_keeps_programs_per_cpu(tmp_path):
  """`use_compilation_cache`: compiled programs land in a per-CPU subfolder of the folder given
  (the same one on every call on this machine), and a fresh compile of the same program is
  served from it."""
  before = (jax.config.jax_compilation_cache_dir,
            jax.config.jax_persistent_cache_min_compile_time_secs)
  events = []
  jax.monitoring.register_event_listener(lambda name, **kw: events.append(name))
  try:
    path = use_compilation_cache(str(tmp_path), min_compile_seconds=0)
    assert os.path.dirname(path) == str(tmp_path) and os.path.basename(path).startswith("cpu-")
    assert use_compilation_cache(str(tmp_path), min_compile_seconds=0) == path

    def program(x):
      return jnp.tanh(x @ x.T) * 3.0 + 0.123  # a program no other test compiles
    jax.jit(program).lower(jnp.ones((5, 7))).compile()
    assert any("program" in f for f in os.listdir(path)), os.listdir(path)
    jax.clear_caches()
    events.clear()
    jax.jit(program).lower(jnp.ones((5, 7))).compile()
    assert "/jax/compilation_cache/cache_hits" in events, events
  finally:
    jax.config.update("jax_compilation_cache_dir", before[0])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", before[1])
    compilation_cache.reset_cache()
