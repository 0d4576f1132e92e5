"""Multi-process training: two processes on this machine (gloo CPU collectives) train one model.

The end-to-end run is `experiments/multihost_demo.py`'s: a behaviour-cloned tiny policy on the toy
env, 2 processes x 2 CPU devices on a 4x1 mesh, 2 iterations of 4 tasks x G=4; then 1 process
over 4 devices replays the recorded global batches. The helpers of `salt_jax.multihost` are
checked in this (single) process.
"""

import dataclasses
import importlib.util
import json
import os
import pickle
import re
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest

from envs.pool import EnvPool
from envs.toy import ToyEnv, toy_tasks
from salt_jax import metrics as metrics_lib
from salt_jax import multihost
from salt_jax.agent.prompts import toy_chat_tokenizer
from salt_jax.rollout import TextPolicySampler, collect
from salt_jax.sharding import make_mesh
from salt_jax.config import TrainConfig
from tests.test_train import _untimed  # one definition of "a row without its timings"

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load_demo():
  spec = importlib.util.spec_from_file_location(
      "multihost_demo", os.path.join(ROOT, "experiments", "multihost_demo.py"))
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


demo = _load_demo()


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  """The demo's run; its workers, and later ones of these tests, share compiled programs."""
  out = str(tmp_path_factory.mktemp("multihost"))
  cache = dict(JAX_COMPILATION_CACHE_DIR=os.path.join(out, "jax_cache"),
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
               JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="-1")
  before = {k: os.environ.get(k) for k in cache}
  os.environ.update(cache)  # the workers inherit it
  try:
    yield out, demo.run_demo(out, num_processes=2, devices=2, iters=2, check=True)
  finally:
    for k, v in before.items():
      if v is None:
        os.environ.pop(k)
      else:
        os.environ[k] = v


def _init_params(run) -> str:
  """The run's warm start: the params its processes began from."""
  with open(os.path.join(run[0], "multi", "config.json"), encoding="utf-8") as f:
    return json.load(f)["init_params"]


def test_both_processes_end_with_identical_params(run):
  out, res = run
  p0, p1 = res["multi"]
  assert p0["sha256"] == p1["sha256"]
  a = np.load(os.path.join(out, "multi", "params_0.npz"))
  b = np.load(os.path.join(out, "multi", "params_1.npz"))
  for k in a.files:
    np.testing.assert_array_equal(a[k], b[k])
  # the run trained: every iteration updated, and the policy left its reference
  assert all(r["num_updates"] >= 1 for r in p0["rows"]) and p0["rows"][1]["kl"] > 0


def test_processes_play_disjoint_whole_groups(run):
  out, res = run
  with open(os.path.join(out, "multi", demo.RECORD), "rb") as f:
    batches = pickle.load(f)
  g = demo.TOY["group_size"]
  for it, batch in enumerate(batches):
    shares = [set(p["local_tasks"][it]) for p in res["multi"]]
    assert all(shares) and not shares[0] & shares[1]
    # the global batch is process 0's share, then process 1's, each task a whole group of G
    order = batch.task_ids[::g]  # the iteration's task list, process 0's share first
    assert set(order[:2]) == shares[0] and set(order[2:]) == shares[1]
    assert batch.num_groups == demo.TOY["tasks_per_iter"]
    for grp in range(batch.num_groups):
      assert len(set(np.array(batch.task_ids)[batch.traj_group_ids == grp])) == 1
    np.testing.assert_array_equal(np.bincount(batch.traj_group_ids), [g] * batch.num_groups)


def test_metrics_are_global_and_written_once(run):
  out, res = run
  logged = metrics_lib.read_jsonl(os.path.join(out, "multi", "metrics.jsonl"))
  assert [r["iteration"] for r in logged] == [0, 1]
  n = demo.TOY["tasks_per_iter"] * demo.TOY["group_size"]
  assert all(r["num_trajectories"] == n for r in logged)
  p0, p1 = res["multi"]
  assert [_untimed(r) for r in p0["rows"]] == [_untimed(r) for r in logged]
  assert [_untimed(r) for r in p1["rows"]] == [_untimed(r) for r in logged]  # same on both
  assert not os.path.exists(os.path.join(out, "multi", "tb"))  # tensorboard off in the demo
  steps = sorted(int(s) for s in os.listdir(os.path.join(out, "multi", "checkpoints")))
  assert steps == [1, 2]  # one per iteration, their shards written by both processes


def test_two_processes_resume_as_if_never_stopped(run, tmp_path):
  """The run stopped after iteration 0's checkpoint, then both processes started again with
  --resume: iteration 1 and the params after it are the uninterrupted run's, on both."""
  out, res = run
  multi, resumed = os.path.join(out, "multi"), str(tmp_path / "resumed")
  shutil.copytree(multi, resumed)
  shutil.rmtree(os.path.join(resumed, "checkpoints", "2"))
  demo.launch(resumed, num_processes=2, devices=2, iters=2, init_params=_init_params(run),
              resume=True)
  got = [json.load(open(os.path.join(resumed, f"process_{i}.json"), encoding="utf-8"))
         for i in range(2)]
  want = _untimed(res["multi"][0]["rows"][1])
  assert [_untimed(r) for r in got[0]["rows"]] == [want] == [_untimed(r) for r in got[1]["rows"]]
  assert got[0]["sha256"] == got[1]["sha256"] == res["multi"][0]["sha256"]
  logged = metrics_lib.read_jsonl(os.path.join(resumed, "metrics.jsonl"))
  assert [_untimed(r) for r in logged] == [_untimed(r) for r in res["multi"][0]["rows"]]


def test_one_process_on_the_same_batches_matches(run):
  """Exact agreement cannot be asked for: the cross-process all-reduces (gloo) sum in another
  order than the in-process ones, and Adam turns ~1e-7 gradient differences into ~1e-6 param
  differences after 8 updates at lr 3e-3."""
  _, res = run
  assert res["max_param_diff"] < 1e-4
  multi, single = res["multi"][0]["rows"], res["single"]["rows"]
  for a, b in zip(multi, single):
    a, b = _untimed(a), _untimed(b)
    assert a.keys() == b.keys()
    for k in a:
      if isinstance(a[k], float):
        assert a[k] == pytest.approx(b[k], rel=1e-4, abs=1e-6, nan_ok=True), k
      else:
        assert a[k] == b[k], k


# ----------------------------------------------------------------------------- helpers


def test_share_splits_into_contiguous_disjoint_parts():
  items = list(range(7))
  parts = [multihost.share(items, p, 3) for p in range(3)]
  assert sum(parts, []) == items and [len(p) for p in parts] == [3, 2, 2]
  assert multihost.share([1], 0, 2) == [1] and multihost.share([1], 1, 2) == []
  for bad in (-1, 3):
    with pytest.raises(ValueError, match="process"):
      multihost.share(items, bad, 3)


TOK = toy_chat_tokenizer()
TASKS = toy_tasks(4)


def _policy():
  """Plays the optimal plan on even-numbered tasks, answers without tags on the others."""
  plans = {}
  for i, t in enumerate(TASKS):
    env = ToyEnv(max_steps=6)
    plans[env.reset(t).observation] = env.optimal_actions(t) if i % 2 == 0 else None

  def policy(text, rng):
    del rng
    plan = plans[re.search(r"Observation: (.*?)\n", text).group(1)]  # the first one
    if plan is None:
      return "no tags"
    k = text.count("</action><|im_end|>")
    return f"<action>{plan[min(k, len(plan) - 1)]}</action>"
  return policy


def _collect(tasks):
  sampler = TextPolicySampler(TOK, _policy(), lambda ctx, tok: -1.0)
  with EnvPool("toy", {"max_steps": 6}, 0) as pool:
    return collect(pool, tasks, 2, sampler, TOK, jax.random.key(0), max_steps=6, seed=1)


def test_concat_rollouts_equals_one_collect_over_all_tasks():
  whole = _collect(TASKS)
  parts = [_collect(TASKS[:1]), None, _collect(TASKS[1:])]  # None: a process with no share
  got = multihost.concat_rollouts(parts)
  for f in dataclasses.fields(whole):
    if f.name == "metrics":
      continue
    a, b = getattr(got, f.name), getattr(whole, f.name)
    if isinstance(b, np.ndarray):
      np.testing.assert_array_equal(a, b, err_msg=f.name)
      assert a.dtype == b.dtype, f.name
    elif f.name in ("prompt_ids", "response_ids", "old_logprobs", "sample_logprobs"):
      for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(x, y)
    else:
      assert a == b, f.name
  for k in ("success_rate", "valid_action_ratio", "mean_steps", "success_rate_by_type",
            "num_trajectories", "num_steps", "response_tokens", "num_failed", "prompt_tokens",
            "prefilled_prompt_tokens"):
    assert got.metrics[k] == whole.metrics[k], k
  # the sampler's phase split and work (NaN from this one, which reports none) carried over
  assert {"prefill_time_s", "decode_time_s", "prefill_compile_s", "decode_compile_s",
          "prefill_flops", "decode_bytes"} <= set(got.metrics)
  assert 0 < whole.metrics["success_rate"] < 1
  assert multihost.concat_rollouts([None, whole]) is whole
  with pytest.raises(ValueError, match="no rollout"):
    multihost.concat_rollouts([None])


def test_single_process_helpers():
  assert multihost.allgather_objects({"a": 1}) == [{"a": 1}]
  x = jax.device_put(np.arange(8.0), jax.sharding.NamedSharding(
      make_mesh("8x1"), jax.sharding.PartitionSpec("data")))
  np.testing.assert_array_equal(multihost.to_host(x), np.arange(8.0))
  mesh = make_mesh("4x2", multihost.mesh_devices(4, 2))
  assert multihost.local_mesh(mesh).devices.shape == (4, 2)
  with pytest.raises(ValueError, match="span all 8 devices"):
    multihost.mesh_devices(2, 1)


@pytest.mark.parametrize("coordinator", ["localhost", "a:b", "host:1 ", ":12"])
def test_bad_coordinator(coordinator):
  with pytest.raises(ValueError, match="host:port"):
    multihost.initialize(coordinator, 2, 0)


def test_initialize_rejects_bad_process_numbers():
  with pytest.raises(ValueError, match="num_processes"):
    multihost.initialize("localhost:1234", 0, 0)
  with pytest.raises(ValueError, match="process_id"):
    multihost.initialize("localhost:1234", 2, 2)


@pytest.mark.parametrize("change, match", [
    (dict(coordinator="h:1"), "distributed=True"),
    (dict(distributed=True, coordinator="h"), "host:port"),
    (dict(distributed=True, num_processes=0), "num_processes"),
    (dict(distributed=True, num_processes=2, process_id=2), "process_id"),
])
def test_config_rejects_bad_process_flags(change, match):
  with pytest.raises(ValueError, match=match):
    TrainConfig(env="toy", tokenizer="toy", **change).validate()


def test_logger_of_other_processes_writes_nothing(tmp_path):
  log = metrics_lib.MetricsLogger(str(tmp_path / "x"), write=False)
  assert log.log(3, {"a": 1.5}) == {"a": 1.5, "iteration": 3}
  log.close()
  assert not os.path.exists(tmp_path / "x")


def test_config_json_round_trips_the_process_fields(tmp_path):
  cfg = TrainConfig(env="toy", tokenizer="toy", distributed=True, coordinator="h:1",
                    num_processes=2, process_id=1, out=str(tmp_path))
  cfg.validate()
  assert json.loads(json.dumps(cfg.to_json()))["coordinator"] == "h:1"


@pytest.mark.parametrize("flags, match", [
    (["--coordinator=127.0.0.1:1", "--sft-warmstart", "--out=x"], "--init-params"),
    (["--num-processes=2", "--process-id=0"], "same --out"),
])
def test_script_rejects_bad_process_flags_before_importing_jax(flags, match):
  script = os.path.join(ROOT, "experiments", "alfworld_grpo_salt.py")
  p = subprocess.run([sys.executable, script, *flags], capture_output=True, text=True,
                     timeout=60, check=False)
  assert p.returncode != 0 and match in p.stderr


def test_ppo_trains_its_critic_across_two_processes(run, tmp_path):
  """--algo ppo over two processes from the GRPO run's warm start: the critic's values, GAE and
  both updates run on the global batch, and each process ends with the same policy and critic."""
  res = demo.run_demo(str(tmp_path), num_processes=2, devices=2, iters=2, algo="ppo",
                      init_params=_init_params(run))
  p0, p1 = res["multi"]
  assert p0["sha256"] == p1["sha256"]
  for row in p0["rows"]:
    assert row["num_updates"] >= 1 and row["critic_skipped_updates"] == 0
    assert np.isfinite(row["value_loss"]) and np.isfinite(row["critic_grad_norm"])
