"""TextWorld games generated offline from seeds, played in pure Python (a few ms a step).

A family of games is fixed by `GameParams` (world size, object count, quest length, ...); game
`seed` of that family is made once by `textworld.generator.make_game` and saved as a `.json` game
under `~/.cache/salt_jax/textworld/<params-hash>/game_<seed>.json` (`$SALT_JAX_CACHE` moves the
cache); later loads read the file. Generation is deterministic in (params, seed).

Playing a `.json` game runs TextWorld's own logic engine (`textworld.envs.tw.TextWorldEnv`): the
admissible commands, the state facts, the win condition and the walkthrough are TextWorld's. The
`.json` engine does not produce narrative text (that needs the Inform7-compiled `.z8` and jericho,
5x slower), so observations are rendered here from the state facts: the room, what is on and in
things, the exits, the inventory, and a one-line answer to the command.

Tasks: `textworld_tasks(split, num_tasks, **params)` gives `Task(task_id="tw-<hash>-<seed>")`;
"train" seeds are 0, 1, 2, ... and "heldout" seeds start at `HELDOUT_SEED_BASE`, so the two sets
never overlap. An action that is not admissible is an invalid step answered "Nothing happens."
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import os
import pathlib
import tempfile
import time
from typing import Any, Optional, Sequence

from envs.base import EPISODE_OVER, AdmissibleCommandEnv, EnvStep, Task  # noqa: F401

SPLITS = ("train", "heldout")
HELDOUT_SEED_BASE = 1_000_000
_DIRECTIONS = ("north", "south", "east", "west")


@dataclasses.dataclass(frozen=True)
class GameParams:
  """One family of generated games.

  The defaults make a game a small policy can partly learn: 4 rooms, 8 objects, a 5-step quest.
  Over train seeds 0-19: walkthroughs of 5 commands, 10 admissible commands a state (median; at
  most 23), and uniformly random admissible commands win 1 game in 20 within 50 steps. The
  default objective spells out every step; `brief_goal=True` states only the end goal (harder).

  world_size: number of rooms.
  nb_objects: number of objects besides the rooms (containers, supporters, items, keys, doors).
  quest_length: number of actions in the quest's winning chain (>= 1; the family is meant for >= 5).
  quest_breadth: branching of the quest's chain of dependencies.
  brief_goal: state only the quest's final goal in the objective instead of every step.
  """

  world_size: int = 4
  nb_objects: int = 8
  quest_length: int = 5
  quest_breadth: int = 1
  brief_goal: bool = False

  def __post_init__(self):
    sizes = (self.world_size, self.nb_objects, self.quest_length, self.quest_breadth)
    if any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in sizes):
      raise ValueError(f"GameParams' world_size, nb_objects, quest_length and quest_breadth must "
                       f"be ints >= 1: {self}")

  def digest(self) -> str:
    """A short stable hash naming the family (folder name, task-id prefix)."""
    text = json.dumps(dataclasses.asdict(self), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:10]


def cache_root() -> pathlib.Path:
  """The project's cache folder: `$SALT_JAX_CACHE`, else `~/.cache/salt_jax`."""
  return pathlib.Path(os.environ.get("SALT_JAX_CACHE", "~/.cache/salt_jax")).expanduser()


def game_path(params: GameParams, seed: int) -> pathlib.Path:
  return cache_root() / "textworld" / params.digest() / f"game_{seed}.json"


def make_game(params: GameParams, seed: int):
  """Generates game `seed` of the family (about 1 to 5 s); returns a `textworld.Game`."""
  import textworld  # pylint: disable=import-outside-toplevel
  from textworld.generator import make_game as tw_make_game  # pylint: disable=import-outside-toplevel
  opts = textworld.GameOptions()
  opts.seeds = seed  # derives the map, objects, quest and grammar seeds
  opts.nb_rooms = params.world_size
  opts.nb_objects = params.nb_objects
  opts.quest_length = params.quest_length
  opts.quest_breadth = params.quest_breadth
  opts.chaining.max_depth = params.quest_length
  opts.chaining.max_breadth = params.quest_breadth
  opts.grammar.only_last_action = params.brief_goal
  return tw_make_game(opts)


def ensure_game(params: GameParams, seed: int) -> pathlib.Path:
  """The cached `.json` of game `seed`, generating and saving it the first time."""
  path = game_path(params, seed)
  if path.exists():
    return path
  game = make_game(params, seed)
  path.parent.mkdir(parents=True, exist_ok=True)
  # Workers may generate the same game at once: write a private file, then rename it in place.
  fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".json")
  os.close(fd)
  game.save(tmp)
  os.chmod(tmp, 0o644)  # mkstemp makes it private; the cache is shared
  os.replace(tmp, path)
  return path


def task_id(params: GameParams, seed: int) -> str:
  return f"tw-{params.digest()}-{seed}"


def parse_task_id(tid: str, params: GameParams) -> int:
  """The seed in a task id of this family; ValueError for another family's or a malformed id."""
  prefix = f"tw-{params.digest()}-"
  if not tid.startswith(prefix) or not tid[len(prefix):].isdigit():
    raise ValueError(f"task {tid!r} is not a TextWorld task of family {params} ({prefix}<seed>)")
  return int(tid[len(prefix):])


def textworld_tasks(split: str = "train", num_tasks: int = 64, start: int = 0,
                    **params: Any) -> list[Task]:
  """`num_tasks` tasks of one split; `params` are `GameParams` fields.

  "train" uses seeds start, start + 1, ...; "heldout" uses HELDOUT_SEED_BASE + start, ....
  Nothing is generated here: games are made on first reset (or by `ensure_game`).
  """
  if split not in SPLITS:
    raise ValueError(f"unknown TextWorld split {split!r}; expected one of {SPLITS}")
  gp = GameParams(**params)
  base = HELDOUT_SEED_BASE if split == "heldout" else 0
  return [Task(task_id=task_id(gp, base + start + i), task_type=f"quest{gp.quest_length}",
               split=split) for i in range(num_tasks)]


# ---------------------------------------------------------------------------------------------
# Rendering observations from facts.


def _a(name: str) -> str:
  return f"an {name}" if name[:1] in "aeiou" else f"a {name}"


def _listing(names: Sequence[str]) -> str:
  names = [_a(n) for n in names]
  if len(names) <= 1:
    return "".join(names)
  return ", ".join(names[:-1]) + " and " + names[-1]


class _View:
  """An index of one state's facts for rendering text."""

  def __init__(self, facts, infos):
    self.infos = infos
    self.by_name = collections.defaultdict(list)
    for f in facts:
      self.by_name[f.name].append(tuple(v.name for v in f.arguments))
    self.holds = collections.defaultdict(set)
    for name in ("open", "closed", "locked"):
      for (x,) in self.by_name[name]:
        self.holds[x].add(name)

  def name(self, eid: str) -> str:
    info = self.infos.get(eid)
    return (info.name if info is not None and info.name else eid)

  def player_room(self) -> Optional[str]:
    for x, r in self.by_name["at"]:
      if x == "P":
        return r
    return None

  def contents(self, relation: str, holder: str) -> list[str]:
    return sorted(self.name(x) for x, h in self.by_name[relation] if h == holder)

  def state_of(self, eid: str) -> str:
    for s in ("locked", "closed", "open"):
      if s in self.holds[eid]:
        return s
    return ""

  def describe_thing(self, eid: str) -> str:
    name = self.name(eid)
    kind = self.infos[eid].type if eid in self.infos else ""
    if kind == "c":
      state = self.state_of(eid)
      if state == "open":
        inside = self.contents("in", eid)
        return (f"The {name} is open. In it you see {_listing(inside)}." if inside
                else f"The {name} is open and empty.")
      return f"The {name} is {state or 'closed'}."
    if kind in ("s", "t"):
      on = self.contents("on", eid)
      return (f"On the {name} you see {_listing(on)}." if on else f"There is nothing on the {name}.")
    if kind == "d":
      return f"The {name} is {self.state_of(eid) or 'closed'}."
    desc = self.infos[eid].desc if eid in self.infos else ""
    if desc and "[" not in desc:  # the game's own text, unless it holds Inform7 conditionals
      return desc.strip()
    return f"You see nothing special about the {name}."

  def describe_room(self) -> str:
    room = self.player_room()
    if room is None:
      return ""
    lines = [f"-= {self.name(room).title()} =-"]
    here = [x for x, r in self.by_name["at"] if r == room and x != "P"]
    kinds = {x: (self.infos[x].type if x in self.infos else "") for x in here}
    furniture = sorted((x for x in here if kinds[x] in ("c", "s", "t")), key=self.name)
    loose = sorted(self.name(x) for x in here if kinds[x] not in ("c", "s", "t", "d"))
    if furniture:
      lines.append(f"You see {_listing([self.name(x) for x in furniture])}.")
      lines.extend(self.describe_thing(x) for x in furniture)
    if loose:
      lines.append(f"On the floor you see {_listing(loose)}.")
    exits = []
    for d in _DIRECTIONS:
      for other, r in self.by_name[f"{d}_of"]:
        if r == room:
          door = [dd for rr, dd, oo in self.by_name["link"] if rr == room and oo == other]
          exits.append(f"{d} (through {_a(self.state_of(door[0]) or 'closed')} {self.name(door[0])})"
                       if door else d)
    lines.append(f"Exits: {', '.join(exits)}." if exits else "There is no exit.")
    return "\n".join(lines)

  def describe_inventory(self) -> str:
    carried = self.contents("in", "I")
    return f"You are carrying {_listing(carried)}." if carried else "You are carrying nothing."


# ---------------------------------------------------------------------------------------------
# The environment.


class TextWorldEnv(AdmissibleCommandEnv):
  """Plays the generated games of one `GameParams` family; `reset` may pick any seed.

  Args:
    max_steps: the episode ends after this many steps (valid or not).
    expert: compute TextWorld's winning policy from the current state every step, so
      `expert_action()` works from any state (a little slower).
    max_loaded: number of loaded games kept in memory (loading one takes ~0.3 s).
    **params: `GameParams` fields.
  """

  def __init__(self, max_steps: int = 50, expert: bool = False, max_loaded: int = 32,
               **params: Any):
    super().__init__()
    self.params = GameParams(**params)
    self.max_steps = max_steps
    self.expert = expert
    self.max_loaded = max_loaded
    self._engines: collections.OrderedDict = collections.OrderedDict()  # seed -> engine (LRU)
    self._engine = None
    self.task: Optional[Task] = None
    self.walkthrough: tuple[str, ...] = ()
    self.goal: str = ""
    self.load_seconds = 0.0

  def _engine_for(self, seed: int):
    if seed in self._engines:
      self._engines.move_to_end(seed)
      return self._engines[seed]
    import textworld  # pylint: disable=import-outside-toplevel
    from textworld.envs.tw import TextWorldEnv as TWEngine  # pylint: disable=import-outside-toplevel
    infos = textworld.EnvInfos(admissible_commands=True, won=True, lost=True,
                               policy_commands=self.expert)
    engine = TWEngine(infos)
    engine.load(str(ensure_game(self.params, seed)))
    self._engines[seed] = engine
    while len(self._engines) > self.max_loaded:
      self._engines.popitem(last=False)
    return engine

  def reset(self, task: Task, seed: int = 0) -> EnvStep:
    """Starts `task` (generating its game on first use). Games are deterministic; `seed` unused."""
    del seed  # the game is fully determined by the task's own seed
    start = time.perf_counter()
    self._engine = self._engine_for(parse_task_id(task.task_id, self.params))
    self._state = self._engine.reset()
    self.task = task
    self._t, self._done, self._won = 0, False, False
    self._set_admissible(self._state["admissible_commands"])
    game = self._engine._game  # pylint: disable=protected-access
    self.walkthrough = tuple(game.metadata.get("walkthrough") or game.walkthrough or ())
    self.goal = game.objective
    self.load_seconds = time.perf_counter() - start
    view = self._view()
    obs = f"{self.goal}\n\n{view.describe_room()}\n{view.describe_inventory()}"
    return EnvStep(observation=obs, admissible_actions=self._admissible.commands)

  def _play(self, command: str) -> tuple[str, bool, bool]:
    self._state, _, _ = self._engine.step(command)
    self._set_admissible(self._state["admissible_commands"])
    won, lost = bool(self._state["won"]), bool(self._state["lost"])
    observation = self._feedback(command)
    if won:
      observation += "\n\nYou have completed the quest. You won!"
    elif lost:
      observation += "\n\nYou lost!"
    return observation, won, lost

  def expert_action(self) -> Optional[str]:
    """TextWorld's next winning command from the current state; None once done or lost."""
    if not self.expert:
      raise RuntimeError("construct TextWorldEnv(expert=True) to use expert_action()")
    if self._state is None or self._done:
      return None
    plan = self._state.get("policy_commands") or []
    return plan[0] if plan else None

  def close(self) -> None:
    self._engines.clear()
    self._engine, self._state = None, None

  # -- internals ------------------------------------------------------------------------------

  def _view(self) -> _View:
    return _View(self._state["_facts"], self._engine._game.infos)  # pylint: disable=protected-access

  def _feedback(self, command: str) -> str:
    view = self._view()
    verb = command.split(" ", 1)[0]
    if verb in ("go", "look"):
      return view.describe_room()
    if verb == "inventory":
      return view.describe_inventory()
    target = self._target_entity(command)
    if verb == "examine":
      return view.describe_thing(target) if target else f"You {command}."
    if verb == "open" and target:
      return f"You open the {view.name(target)}. " + view.describe_thing(target)
    return f"You {command}."

  def _target_entity(self, command: str) -> Optional[str]:
    # The entity named right after the verb ("open <x>", "examine <x>"), by the game's names.
    name = command.split(" ", 1)[1] if " " in command else ""
    for eid, info in self._engine._game.infos.items():  # pylint: disable=protected-access
      if info.name == name and info.type not in ("P", "I"):
        return eid
    return None
