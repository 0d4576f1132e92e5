"""EnvPool: results equal in-process results; a crash, hang or error fails one slot only."""

import time

import pytest

from envs.base import Task
from envs.pool import EnvPool, PoolStep
from envs.registry import make_env
from envs.toy import ToyEnv, toy_tasks

TASKS = toy_tasks(4)
FAULTS = {"enable_test_faults": True, "max_steps": 30}


def _script(slot: int, t: int) -> str:
  """A fixed, slot-dependent action schedule: the optimal plan, with noise mixed in."""
  plan = ToyEnv(max_steps=30).optimal_actions(TASKS[slot % 4])
  if (slot + t) % 3 == 0:
    return "look" if t % 2 else "fly away"
  return plan[min(t // 2, len(plan) - 1)]


def _reference(slots, num_steps, seed=7):
  """Plain sequential play, one ToyEnv per slot, no pool."""
  out = {}
  for s in slots:
    env = ToyEnv(max_steps=30)
    res = [PoolStep.from_env_step(env.reset(TASKS[s % 4], seed + s))]
    for t in range(num_steps):
      res.append(PoolStep.from_env_step(env.step(_script(s, t))))
    out[s] = res
  return out


def _play(pool, slots, num_steps, seed=7, fault=None):
  """Runs the schedule through `pool`; fault=(slot, step, action) injects one bad action."""
  out = {s: [r] for s, r in zip(slots, pool.reset_batch([(s, TASKS[s % 4], seed + s)
                                                          for s in slots]))}
  for t in range(num_steps):
    items = [(s, fault[2] if fault and (s, t) == fault[:2] else _script(s, t)) for s in slots]
    for (s, _), r in zip(items, pool.step_batch(items)):
      out[s].append(r)
  return out


@pytest.mark.parametrize("num_workers", [0, 2])
def test_pool_equals_sequential_reference(num_workers):
  slots = [0, 1, 2, 3, 5, 8]
  with EnvPool("toy", {"max_steps": 30}, num_workers) as pool:
    assert _play(pool, slots, 12) == _reference(slots, 12)
    assert pool.restarts == 0


def test_crash_fails_only_that_slot_and_the_rollout_goes_on():
  slots = [0, 1, 2, 3, 4, 5]  # worker 1 holds 1, 3, 5
  ref = _reference(slots, 10)
  with EnvPool("toy", FAULTS, 2, step_timeout_s=20) as pool:
    got = _play(pool, slots, 10, fault=(3, 4, "__crash__"))
    assert pool.restarts == 1
  bad = got[3][5]  # reset + 4 steps, then the crashing step
  assert bad.failed and bad.done and not bad.valid and "died" in bad.error and "slot 3" in bad.error
  assert got[3][:5] == ref[3][:5]
  assert all(r.failed and "failed before" in r.error for r in got[3][6:])
  for s in (0, 1, 2, 4, 5):  # 1 and 5 shared the dead worker: rebuilt by replay, unchanged
    assert got[s] == ref[s], s


def test_hang_is_killed_after_the_timeout():
  slots = [0, 1, 2, 3]
  ref = _reference(slots, 6)
  with EnvPool("toy", FAULTS, 2, step_timeout_s=1.0) as pool:
    t0 = time.monotonic()
    got = _play(pool, slots, 6, fault=(2, 1, "__hang__"))
    elapsed = time.monotonic() - t0
    assert pool.restarts == 1
  assert elapsed < 15.0
  assert got[2][2].failed and "hung" in got[2][2].error
  assert got[2][:2] == ref[2][:2]
  for s in (0, 1, 3):
    assert got[s] == ref[s], s


def test_exception_fails_one_slot_without_restart():
  slots = [0, 1, 2]
  ref = _reference(slots, 4)
  with EnvPool("toy", FAULTS, 1) as pool:
    got = _play(pool, slots, 4, fault=(1, 0, "__raise__"))
    assert pool.restarts == 0
  assert got[1][1].failed and "test fault" in got[1][1].error
  assert got[0] == ref[0] and got[2] == ref[2]


def test_in_process_mode_catches_exceptions():
  with EnvPool("toy", FAULTS, 0) as pool:
    got = _play(pool, [0, 1], 2, fault=(0, 0, "__raise__"))
  assert got[0][1].failed and not got[1][1].failed


def test_without_replay_the_dead_workers_slots_fail():
  slots = [0, 1, 2, 3]
  ref = _reference(slots, 4)
  with EnvPool("toy", FAULTS, 2, replay_on_restart=False) as pool:
    got = _play(pool, slots, 4, fault=(1, 1, "__crash__"))
  assert got[1][2].failed
  assert got[3][2].failed and "could not be rebuilt" in got[3][2].error  # same worker
  assert got[0] == ref[0] and got[2] == ref[2]  # the other worker is untouched


def test_reset_revives_a_failed_slot():
  with EnvPool("toy", FAULTS, 1) as pool:
    pool.reset_batch([(0, TASKS[0], 0)])
    assert pool.step_batch([(0, "__crash__")])[0].failed
    assert pool.step_batch([(0, "look")])[0].failed
    first = pool.reset_batch([(0, TASKS[0], 0)])[0]
    assert not first.failed and not pool.step_batch([(0, "look")])[0].failed


def test_crash_during_reset():
  slots = [0, 1, 2, 3, 4]
  crash = Task("toy-train-9__crash__", "walk")
  with EnvPool("toy", FAULTS, 2) as pool:
    out = pool.reset_batch([(s, crash if s == 2 else TASKS[s % 4], 7 + s) for s in slots])
    assert pool.restarts == 1
    assert out[2].failed and "during reset of slot 2" in out[2].error
    ref = _reference([0, 1, 3, 4], 3)
    assert [out[i] for i in (0, 1, 3, 4)] == [ref[s][0] for s in (0, 1, 3, 4)]
    for t in range(3):  # slots 0 and 4 (the crashed worker's) were rebuilt or resent
      got = pool.step_batch([(s, _script(s, t)) for s in (0, 1, 3, 4)])
      assert got == [ref[s][t + 1] for s in (0, 1, 3, 4)]


def test_a_replay_that_diverges_fails_its_slot():
  with EnvPool("toy", FAULTS, 1) as pool:
    pool.reset_batch([(0, TASKS[0], 0), (1, TASKS[1], 0), (2, TASKS[2], 0)])
    pool.step_batch([(1, "__pid__"), (2, "look")])
    out = pool.step_batch([(0, "__crash__"), (1, "look"), (2, "look")])
  assert out[0].failed and "died" in out[0].error
  assert out[1].failed and "replay diverged" in out[1].error
  assert out[2] == PoolStep.from_env_step(_toy_after(TASKS[2], ["look", "look"]))  # replayed


def _toy_after(task, actions):
  env = ToyEnv(max_steps=30)
  env.reset(task, 0)
  out = None
  for a in actions:
    out = env.step(a)
  return out


def test_make_env_names():
  assert isinstance(make_env("toy", num_rooms=3), ToyEnv)
  assert isinstance(make_env("envs.toy:ToyEnv"), ToyEnv)


def test_make_expert_env_turns_the_expert_on():
  """Each family's expert answers from `make_expert_env` (the toy env, whose constructor has no
  `expert`, as from `make_env`); textworld's, off by default, is switched on."""
  from envs.registry import make_expert_env, task_list  # pylint: disable=import-outside-toplevel
  toy = make_expert_env("toy", num_rooms=3, max_steps=5)
  toy.reset(TASKS[0], 0)
  assert toy.expert_action() == ToyEnv(num_rooms=3).optimal_actions(TASKS[0])[0]
  params = {"quest_length": 5, "world_size": 2, "nb_objects": 4}
  (task,) = task_list("textworld", "train", num_tasks=1, **params)
  plain = make_env("textworld", max_steps=5, **params)
  plain.reset(task, 0)
  with pytest.raises(RuntimeError, match="expert=True"):
    plain.expert_action()
  tw = make_expert_env("textworld", max_steps=5, **params)
  first = tw.reset(task, 0)
  assert tw.expert_action() in first.admissible_actions
  for env in (plain, tw):
    env.close()


def test_bad_inputs():
  with pytest.raises(ValueError, match="num_workers"):
    EnvPool("toy", {}, -1)
  with pytest.raises(ValueError, match="fork"):
    EnvPool("toy", {}, 0, start_method="fork")
  with pytest.raises(ValueError, match="timeout"):
    EnvPool("toy", {}, 0, step_timeout_s=0)
  with EnvPool("toy", {}, 0) as pool:
    with pytest.raises(ValueError, match="distinct"):
      pool.reset_batch([(0, TASKS[0], 0), (0, TASKS[1], 0)])
    with pytest.raises(TypeError, match="Task"):
      pool.reset_batch([(0, "toy-train-0", 0)])
    pool.reset_batch([(0, TASKS[0], 0)])
    with pytest.raises(ValueError, match="never reset"):
      pool.step_batch([(9, "look")])
    with pytest.raises(TypeError, match="str"):
      pool.step_batch([(0, None)])
    bad_task = pool.reset_batch([(1, Task("x", task_type="nope"), 0)])[0]
    assert bad_task.failed and "unknown toy task type" in bad_task.error
  with pytest.raises(RuntimeError, match="closed"):
    pool.reset_batch([(0, TASKS[0], 0)])


def test_registry_entries_and_training_tasks():
  from envs import registry  # pylint: disable=import-outside-toplevel
  from salt_jax.config import TrainConfig  # pylint: disable=import-outside-toplevel
  assert registry.names() == ("alfworld", "textworld", "toy", "webshop")
  assert (registry.entry("alfworld").train_split, registry.entry("alfworld").eval_splits) == (
      "valid_train", ("valid_seen", "valid_unseen"))
  cfg = TrainConfig(env="toy", env_kwargs={"num_rooms": 3}, num_train_tasks=3)
  assert registry.training_tasks(cfg) == registry.task_list("toy", "train", num_rooms=3,
                                                            num_tasks=3)
  assert len(registry.training_tasks(cfg)) == 3
  other = TrainConfig(env="toy", train_split="heldout", num_train_tasks=2)
  assert [t.split for t in registry.training_tasks(other)] == ["heldout"] * 2
  with pytest.raises(ValueError, match="unknown environment"):
    registry.entry("nethack")
