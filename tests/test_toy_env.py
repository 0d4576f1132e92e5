"""ToyEnv: deterministic, solvable by its optimal path (checked against a black-box BFS), robust."""

import collections
import copy

import pytest
from hypothesis import given, settings, strategies as st

from envs.base import EnvStep, Task
from envs.toy import TASK_TYPES, ToyEnv, toy_tasks


def _bfs_shortest_win(env: ToyEnv, task: Task, keep_state: bool = False) -> int:
  """Reference: shortest winning length by BFS over deep copies, using only reset/step.

  Starts from a fresh reset, or (keep_state) from wherever `env` is now. States are told apart by
  the env's internal state tuple (the test's only peek inside).
  """
  first = env.step("look") if keep_state else env.reset(task)  # "look" changes nothing
  start = copy.deepcopy(env)
  queue = collections.deque([(start, first.admissible_actions, 0)])
  seen = {start._state}
  while queue:
    e, admissible, depth = queue.popleft()
    for a in admissible:
      child = copy.deepcopy(e)
      out = child.step(a)
      if out.won:
        return depth + 1
      if not out.done and child._state not in seen:
        seen.add(child._state)
        queue.append((child, out.admissible_actions, depth + 1))
  return -1


def test_toy_tasks():
  tasks = toy_tasks(6, "valid")
  assert [t.task_type for t in tasks] == ["walk", "key-door"] * 3
  assert len({t.task_id for t in tasks}) == 6
  assert all(t.split == "valid" for t in tasks)
  assert toy_tasks(0) == []
  with pytest.raises(ValueError):
    toy_tasks(-1)


@pytest.mark.parametrize("num_rooms", [2, 5, 8])
def test_optimal_path_wins_and_is_shortest(num_rooms):
  env = ToyEnv(num_rooms=num_rooms, max_steps=50)
  for task in toy_tasks(10):
    plan = env.optimal_actions(task)
    out = env.reset(task)
    assert "Your task is to:" in out.observation and not out.done and out.reward == 0.0
    for t, a in enumerate(plan):
      assert a in out.admissible_actions
      out = env.step(a)
      assert out.valid
      assert out.done == out.won == (t == len(plan) - 1)
      assert out.reward == (1.0 if t == len(plan) - 1 else 0.0)
    assert len(plan) == _bfs_shortest_win(ToyEnv(num_rooms=num_rooms, max_steps=50), task)
    if task.task_type == "key-door":
      assert {"take key", "unlock door", "go to vault"} <= set(plan)


def test_expert_follows_a_shortest_path_from_anywhere():
  env = ToyEnv(max_steps=50)
  for task in toy_tasks(6):
    out = env.reset(task)
    for a in ["look", "inventory"] + [x for x in out.admissible_actions if x.startswith("go")][:1]:
      out = env.step(a)  # a detour first
    steps = 0
    while not out.done:
      out = env.step(env.expert_action())
      steps += 1
    assert out.won and env.expert_action() is None
    probe = ToyEnv(max_steps=50)
    first = probe.reset(task)
    for a in ["look", "inventory"] + [x for x in first.admissible_actions if x.startswith("go")][:1]:
      probe.step(a)  # the same detour
    assert steps == _bfs_shortest_win(probe, task, keep_state=True)
  with pytest.raises(RuntimeError, match="before reset"):
    ToyEnv().expert_action()


def test_replay_is_deterministic_and_seed_only_reorders():
  task = toy_tasks(2)[1]
  actions = ["look", "go to nowhere", "inventory"] + ToyEnv().optimal_actions(task)
  def play(seed):
    env = ToyEnv()
    return [env.reset(task, seed=seed)] + [env.step(a) for a in actions]
  a, b, c = play(3), play(3), play(4)
  assert a == b
  assert [x.observation for x in a] == [x.observation for x in c]
  assert [set(x.admissible_actions) for x in a] == [set(x.admissible_actions) for x in c]
  assert any(x.admissible_actions != y.admissible_actions for x, y in zip(a, c))


def test_invalid_action_and_horizon():
  env = ToyEnv(max_steps=3)
  task = toy_tasks(1)[0]
  env.reset(task)
  for t in range(3):
    out = env.step("dance wildly")
    assert out == EnvStep(observation="Nothing happens.", reward=0.0, done=t == 2, won=False,
                          admissible_actions=out.admissible_actions, valid=False)
  assert out.done and out.admissible_actions == ()
  after = env.step("look")  # past the end: no error, nothing changes
  assert after.done and not after.valid and not after.won


def test_actions_are_normalized_like_the_parser():
  env = ToyEnv()
  task = toy_tasks(1)[0]
  out = env.reset(task)
  a = out.admissible_actions[0]
  assert env.step("  " + a.upper().replace(" ", "\t ") + "\n").valid


def test_faults_are_plain_invalid_actions_without_the_flag():
  env = ToyEnv()
  env.reset(toy_tasks(1)[0])
  for a in ("__crash__", "__hang__", "__raise__"):
    assert not env.step(a).valid
  faulty = ToyEnv(enable_test_faults=True)
  faulty.reset(toy_tasks(1)[0])
  with pytest.raises(RuntimeError, match="test fault"):
    faulty.step("__raise__")


@settings(max_examples=100, deadline=None)
@given(st.lists(st.text(max_size=40), max_size=25), st.integers(0, 2**31 - 1))
def test_any_string_is_a_legal_action(actions, seed):
  env = ToyEnv(max_steps=10)
  env.reset(toy_tasks(2)[seed % 2], seed=seed)
  for a in actions:
    out = env.step(a)
    assert isinstance(out, EnvStep) and isinstance(out.observation, str)


def test_bad_arguments():
  with pytest.raises(ValueError, match="num_rooms"):
    ToyEnv(num_rooms=1)
  with pytest.raises(ValueError, match="num_rooms"):
    ToyEnv(num_rooms=13)
  with pytest.raises(ValueError, match="max_steps"):
    ToyEnv(max_steps=0)
  with pytest.raises(ValueError, match="task type"):
    ToyEnv().reset(Task("x", task_type="cooking"))
  with pytest.raises(RuntimeError, match="before reset"):
    ToyEnv().step("look")
  assert set(TASK_TYPES) == {"walk", "key-door"}


def test_toy_task_types():
  """toy_tasks(task_types=("walk",)) gives walk tasks only; the env refuses other types."""
  tasks = toy_tasks(4, task_types=("walk",))
  assert [t.task_type for t in tasks] == ["walk"] * 4
  assert [t.task_type for t in toy_tasks(3)] == ["walk", "key-door", "walk"]
  env = ToyEnv(num_rooms=3, task_types=["walk"])
  env.reset(tasks[1])
  with pytest.raises(ValueError, match="key-door"):
    env.reset(toy_tasks(2)[1])
  with pytest.raises(ValueError, match="task_types"):
    toy_tasks(2, task_types=("swim",))
