"""A tiny deterministic text environment for unit tests: walk a room graph, maybe fetch a key.

Each task is a small connected graph of rooms laid out deterministically from its `task_id`.
Two task types:
  - "walk": reach the target room.
  - "key-door": take the key (lying in some room), unlock the locked door (in the door room),
    then go to the vault behind it.
The agent starts in room 0. Actions are plain commands ("go to kitchen", "take key",
"unlock door", "look", "inventory"); the admissible list says which apply now. An action outside
that list is an invalid step ("Nothing happens.") that still uses up one of the `max_steps`.
Outcome reward: 1.0 on the winning step, else 0.0. `optimal_actions(task)` is a shortest winning
action sequence (breadth-first search over the (room, key, door) state space).

Test-only faults: with `enable_test_faults=True` the actions "__crash__" (the process exits at
once, as a segfault would), "__hang__" (sleeps for hours), "__raise__" (a Python exception) and
"__pid__" (answers with the process id: a replay elsewhere diverges) exist, and resetting a task
whose id ends in "__crash__" exits the process, so the worker pool's crash, hang, error and replay
paths can be tested. Without the flag they are ordinary invalid actions and tasks.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import random
import time
import zlib
from typing import Optional

from envs.base import EnvStep, Task, TextEnv, normalize_action

ROOM_NAMES = ("hall", "kitchen", "study", "garden", "cellar", "attic", "library", "pantry",
              "gallery", "bathroom", "bedroom", "garage")
# What the env says besides its room names: a tokenizer for it learns its merges from these
# (`salt_jax.agent.prompts.toy_chat_tokenizer`).
WORDS = "go to take key unlock door vault look inventory Nothing happens. You carry a brass key."
TASK_TYPES = ("walk", "key-door")
_NOTHING = "Nothing happens."
_OVER = "The episode is over."


@dataclasses.dataclass(frozen=True)
class _Layout:
  """The fixed world of one task. Room 0 is the start; the vault is not in `rooms`."""

  rooms: tuple[str, ...]
  edges: tuple[frozenset, ...]  # edges[i]: indices of the rooms next to room i
  task_type: str
  target: int  # walk: the room to reach
  key_room: int  # key-door: where the key lies
  door_room: int  # key-door: the room with the locked door to the vault


@dataclasses.dataclass(frozen=True)
class _State:
  room: int  # -1: the vault
  has_key: bool
  door_open: bool


def _check_types(task_types) -> tuple[str, ...]:
  task_types = tuple(task_types)
  if not task_types or any(t not in TASK_TYPES for t in task_types):
    raise ValueError(f"task_types must be a non-empty selection of {TASK_TYPES}, got {task_types}")
  return task_types


def toy_tasks(num_tasks: int = 8, split: str = "train",
              task_types: tuple = TASK_TYPES) -> list[Task]:
  """`num_tasks` tasks, the types of `task_types` taking turns ("walk", "key-door" by default;
  ("walk",) for walk tasks only); ids are unique per split."""
  if num_tasks < 0:
    raise ValueError(f"num_tasks must be >= 0, got {num_tasks}")
  task_types = _check_types(task_types)
  return [Task(task_id=f"toy-{split}-{i}", task_type=task_types[i % len(task_types)],
               split=split) for i in range(num_tasks)]


def _layout(task: Task, num_rooms: int) -> _Layout:
  if task.task_type not in TASK_TYPES:
    raise ValueError(f"unknown toy task type {task.task_type!r}; expected one of {TASK_TYPES}")
  rng = random.Random(zlib.crc32(task.task_id.encode("utf-8")))  # stable across processes
  rooms = tuple(rng.sample(ROOM_NAMES, num_rooms))
  edges = [set() for _ in range(num_rooms)]
  for i in range(1, num_rooms):  # a random tree: connected, with dead ends to explore
    j = rng.randrange(i)
    edges[i].add(j)
    edges[j].add(i)
  dist = _distances(edges)
  target = max(range(num_rooms), key=lambda r: (dist[r], r))
  key_room = rng.randrange(1, num_rooms)
  door_room = rng.randrange(num_rooms)
  return _Layout(rooms, tuple(frozenset(e) for e in edges), task.task_type, target, key_room,
                 door_room)


def _distances(edges) -> list[int]:
  dist = [-1] * len(edges)
  dist[0] = 0
  queue = collections.deque([0])
  while queue:
    r = queue.popleft()
    for n in edges[r]:
      if dist[n] < 0:
        dist[n] = dist[r] + 1
        queue.append(n)
  return dist


def _admissible(lay: _Layout, s: _State) -> list[str]:
  """The commands that do something in state `s` (sorted; the env may reorder them by seed)."""
  if s.room < 0:
    return ["go to " + lay.rooms[lay.door_room], "inventory", "look"]
  acts = ["go to " + lay.rooms[n] for n in lay.edges[s.room]]
  if lay.task_type == "key-door":
    if s.room == lay.key_room and not s.has_key:
      acts.append("take key")
    if s.room == lay.door_room and s.has_key and not s.door_open:
      acts.append("unlock door")
    if s.room == lay.door_room and s.door_open:
      acts.append("go to vault")
  return sorted(acts + ["inventory", "look"])


def _describe(lay: _Layout, s: _State) -> str:
  if s.room < 0:
    return "You are in the vault. The treasure glitters."
  parts = [f"You are in the {lay.rooms[s.room]}."]
  exits = sorted(lay.rooms[n] for n in lay.edges[s.room])
  parts.append("Exits lead to the " + ", the ".join(exits) + ".")
  if lay.task_type == "key-door":
    if s.room == lay.key_room and not s.has_key:
      parts.append("A brass key lies on the floor.")
    if s.room == lay.door_room:
      parts.append("An open door leads to the vault." if s.door_open else
                   "A locked door leads to the vault.")
  return " ".join(parts)


def _transition(lay: _Layout, s: _State, action: str) -> tuple[_State, str, bool]:
  """(next state, observation, valid) for one command; `action` is already normalized."""
  if action not in _admissible(lay, s):
    return s, _NOTHING, False
  if action == "look":
    return s, _describe(lay, s), True
  if action == "inventory":
    return s, "You carry a brass key." if s.has_key else "You carry nothing.", True
  if action == "take key":
    return dataclasses.replace(s, has_key=True), "You take the brass key.", True
  if action == "unlock door":
    return dataclasses.replace(s, door_open=True), "You unlock the door to the vault.", True
  dest = action[len("go to "):]
  room = -1 if dest == "vault" else lay.rooms.index(dest)
  s = dataclasses.replace(s, room=room)
  return s, _describe(lay, s), True


def _won(lay: _Layout, s: _State) -> bool:
  return s.room == lay.target if lay.task_type == "walk" else s.room < 0


def _goal(lay: _Layout) -> str:
  if lay.task_type == "walk":
    return f"go to the {lay.rooms[lay.target]}"
  return "take the key, unlock the door and enter the vault"


class ToyEnv(TextEnv):
  """Deterministic room-graph walk / key-door task (see the module docstring).

  Args:
    num_rooms: rooms per task (2 to 12).
    max_steps: horizon; the episode ends (lost) after this many steps.
    enable_test_faults: make "__crash__", "__hang__" and "__raise__" real (tests only).
    task_types: the task types this env plays (`toy_tasks`' argument of the same name, so one
      `env_kwargs` configures both); resetting a task of another type raises ValueError.
  """

  def __init__(self, num_rooms: int = 5, max_steps: int = 20, enable_test_faults: bool = False,
               task_types: tuple = TASK_TYPES):
    if not 2 <= num_rooms <= len(ROOM_NAMES):
      raise ValueError(f"num_rooms must be in [2, {len(ROOM_NAMES)}], got {num_rooms}")
    if max_steps < 1:
      raise ValueError(f"max_steps must be >= 1, got {max_steps}")
    self.num_rooms = num_rooms
    self.max_steps = max_steps
    self.enable_test_faults = enable_test_faults
    self.task_types = _check_types(task_types)
    self._lay: Optional[_Layout] = None
    self._state: Optional[_State] = None
    self._seed = 0
    self._steps = 0
    self._done = False

  def _listing(self) -> tuple[str, ...]:
    acts = _admissible(self._lay, self._state)
    # The seed only permutes the listed order: same world, different prompt text.
    random.Random(self._seed * 1_000_003 + self._steps).shuffle(acts)
    return tuple(acts)

  def reset(self, task: Task, seed: int = 0) -> EnvStep:
    if self.enable_test_faults and task.task_id.endswith("__crash__"):
      os._exit(3)
    lay = _layout(task, self.num_rooms)  # raises first for an unknown task type
    if task.task_type not in self.task_types:
      raise ValueError(f"task {task.task_id!r} is a {task.task_type!r} task; this env plays "
                       f"{self.task_types}")
    self._lay = lay
    self._state = _State(room=0, has_key=False, door_open=False)
    self._seed, self._steps, self._done = int(seed), 0, False
    obs = f"Your task is to: {_goal(self._lay)}. " + _describe(self._lay, self._state)
    return EnvStep(observation=obs, admissible_actions=self._listing())

  def step(self, action: str) -> EnvStep:
    if self._lay is None:
      raise RuntimeError("step() before reset()")
    if self.enable_test_faults:
      if action == "__crash__":
        os._exit(3)  # no cleanup, no exception: what a segfault looks like to the pool
      if action == "__hang__":
        time.sleep(10_000)
      if action == "__raise__":
        raise RuntimeError("test fault: __raise__")
      if action == "__pid__":  # not reproducible in another process: a replay diverges
        return EnvStep(observation=f"process {os.getpid()}", valid=False,
                       admissible_actions=self._listing())
    if self._done:
      return EnvStep(observation=_OVER, done=True, valid=False, admissible_actions=())
    action = normalize_action(action)
    self._state, obs, valid = _transition(self._lay, self._state, action)
    self._steps += 1
    won = _won(self._lay, self._state)
    self._done = won or self._steps >= self.max_steps
    return EnvStep(observation=obs, reward=1.0 if won else 0.0, done=self._done, won=won,
                   admissible_actions=() if self._done else self._listing(), valid=valid)

  def optimal_actions(self, task: Task) -> list[str]:
    """A shortest winning action sequence for `task` (BFS; ties broken by sorted action)."""
    return _shortest(_layout(task, self.num_rooms), _State(room=0, has_key=False, door_open=False))

  def expert_action(self) -> Optional[str]:
    """The first action of a shortest winning path from the current state; None once done."""
    if self._lay is None:
      raise RuntimeError("expert_action() before reset()")
    return None if self._done else _shortest(self._lay, self._state)[0]


def _shortest(lay: _Layout, start: _State) -> list[str]:
  """Breadth-first search over (room, key, door) states for a shortest winning action list."""
  parent = {start: None}
  queue = collections.deque([start])
  while queue:
    s = queue.popleft()
    if _won(lay, s):
      path = []
      while parent[s] is not None:
        s, a = parent[s]
        path.append(a)
      return path[::-1]
    for a in _admissible(lay, s):
      n, _, _ = _transition(lay, s, a)
      if n not in parent:
        parent[n] = (s, a)
        queue.append(n)
  raise AssertionError("unsolvable toy layout")  # cannot happen: every layout is connected
