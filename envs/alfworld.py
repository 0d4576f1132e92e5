"""Real ALFWorld (text mode) through the `alfworld` 0.4.2 package, one game per instance.

The engine is the one `alfworld.agents.environment.alfred_tw_env.AlfredTWEnv` builds (TextWorld's
`PddlEnv` behind alfworld's `AlfredDemangler`, fast-downward underneath), but driven one game at a
time so a worker can reset to any chosen task instead of cycling through a gym batch.

Task data: a `json_2.1.1`-style folder `<root>/json_2.1.1/<split>/<task>/<trial>/` holding
`traj_data.json` and `initial_state.pddl` (plus `game.tw-pddl` where alfworld already built one).
`<root>` is, in order: the `data_dir` argument, `$ALFWORLD_DATA` when it holds a `json_2.1.1`
folder (alfworld's own convention, e.g. after `alfworld-download`), else the 474 real tasks shipped
in `envs/alfworld_data/` (splits valid_train 200, valid_seen 140, valid_unseen 134), unpacked with
their `game.tw-pddl` files into `~/.cache/salt_jax/alfworld/` on first use (`$SALT_JAX_CACHE`
moves the cache). Trials missing a game file get one built next to a copy of their
`traj_data.json` in the same cache.

Episode: `reset(task)` returns alfworld's intro (the room, then "Your task is to: ...") with the
admissible commands; `step(action)` plays one command; reward 1.0 on the winning step; the episode
ends on a win or after `max_steps` (50) steps. An action that is not admissible, whatever its
content, is an invalid step answered "Nothing happens." (what the engine itself answers) without
touching the engine. With `expert=True`, `expert_action()` gives alfworld's handcoded expert's next
command (or the planner's, with `expert_type="planner"`). The handcoded expert is exact when it is
followed (invalid steps in between do not disturb it); after other valid commands it goes on from
its own heuristic tracking and may fail, as in alfworld; the planner replans from the true state.

Speed: by default (`fast_engine=True`) TextWorld's grammar parsing is memoized and a fresh load's
PDDL translation is reused by its first reset; games play identically, loads and steps 3 to 4x
faster, since the engine no longer re-parses and re-translates what it has already seen.

CLI, a first check of an install (the handcoded expert wins about 8 of 10 valid_unseen tasks):
  python -m envs.alfworld --expert --split valid_unseen --num-tasks 10
"""

from __future__ import annotations

import argparse
import collections
import functools
import hashlib
import json
import os
import pathlib
import random
import shutil
import sys
import tarfile
import tempfile
import time
import zlib
from typing import Iterable, Optional, Sequence

from envs.base import EPISODE_OVER, AdmissibleCommandEnv, EnvStep, Task  # noqa: F401

SPLITS = ("valid_train", "valid_seen", "valid_unseen")
# alfworld's task types (traj_data "task_type") -> the short names used for per-type success.
TASK_TYPES = {
    "pick_and_place_simple": "pick_and_place",
    "pick_clean_then_place_in_recep": "pick_clean_then_place",
    "pick_heat_then_place_in_recep": "pick_heat_then_place",
    "pick_cool_then_place_in_recep": "pick_cool_then_place",
    "look_at_obj_in_light": "look_at_obj_in_light",
    "pick_two_obj_and_place": "pick_two_obj_and_place",
}
EXPERT_TYPES = ("handcoded", "planner")

SHIPPED_ARCHIVE = pathlib.Path(__file__).parent / "alfworld_data" / "json_2.1.1_subset.tar.xz"
# The main job's default policy (experiments/build_alfworld_policy.py builds it): a small Qwen2
# cloned from a noisy expert on a few short valid_train tasks, with a tokenizer fitted to them.
STARTER_POLICY = pathlib.Path(__file__).parent / "alfworld_data" / "starter_policy"
_GAME_FILE = "game.tw-pddl"


def starter_defaults(folder: os.PathLike = STARTER_POLICY) -> dict:
  """`TrainConfig` values that play the starter policy as it was cloned: `model` (the folder),
  its training tasks, prompt layout and history, and lengths (its `build.json` "play")."""
  path = pathlib.Path(folder) / "build.json"
  if not path.exists():
    raise FileNotFoundError(f"{path} is missing: run experiments/build_alfworld_policy.py")
  play = json.loads(path.read_text(encoding="utf-8"))["play"]
  return {"model": str(folder), **{k: tuple(v) if isinstance(v, list) else v
                                   for k, v in play.items()}}


def cache_root() -> pathlib.Path:
  """The project's cache folder: `$SALT_JAX_CACHE`, else `~/.cache/salt_jax`."""
  return pathlib.Path(os.environ.get("SALT_JAX_CACHE", "~/.cache/salt_jax")).expanduser()


# ---------------------------------------------------------------------------------------------
# Game files.


@functools.lru_cache(maxsize=1)
def _game_logic() -> tuple[str, str]:
  """alfworld's PDDL domain and TextWorld grammar (with the `UNKNOWN GOAL` placeholder)."""
  from alfworld.info import ALFRED_PDDL_PATH, ALFRED_TWL2_PATH  # pylint: disable=import-outside-toplevel
  return (pathlib.Path(ALFRED_PDDL_PATH).read_text(), pathlib.Path(ALFRED_TWL2_PATH).read_text())


def _task_seed(key: str) -> int:
  return zlib.crc32(key.encode("utf-8"))


def make_game_data(traj_data: dict, pddl_problem: str, key: str) -> dict:
  """The `game.tw-pddl` content for one trial, as `alfworld-generate` writes it.

  Keys: pddl_domain, grammar (alfworld's grammar with the templated goal put in by
  `alfworld.agents.utils.misc.add_task_to_grammar`), pddl_problem, solvable (True: the shipped
  tasks are exactly those alfworld's planner solves), walkthrough (None).

  alfworld picks the goal template with the global `random` module; here that draw is seeded from
  `key` (the trial's relative path) so a trial's goal text is the same on every machine.
  """
  from alfworld.agents.utils.misc import add_task_to_grammar  # pylint: disable=import-outside-toplevel
  domain, grammar = _game_logic()
  with _seeded_global_random(random.Random(_task_seed(key))):
    grammar = add_task_to_grammar(grammar, traj_data)
  return {"pddl_domain": domain, "grammar": grammar, "pddl_problem": pddl_problem,
          "solvable": True, "walkthrough": None}


def _atomic_write_text(path: pathlib.Path, text: str) -> None:
  # Workers may build the same file at once; each writes a private temp file and renames it.
  path.parent.mkdir(parents=True, exist_ok=True)
  fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
  with os.fdopen(fd, "w") as f:
    f.write(text)
  os.chmod(tmp, 0o644)  # mkstemp makes it private; the cache is shared
  os.replace(tmp, path)


def build_game_file(trial_dir: pathlib.Path, key: str,
                    out_dir: Optional[pathlib.Path] = None) -> pathlib.Path:
  """Writes `game.tw-pddl` for the trial in `trial_dir` into `out_dir` (default: beside it).

  When `out_dir` differs, `traj_data.json` is copied there too: alfworld's handcoded expert reads
  it from the game file's folder.
  """
  out_dir = out_dir or trial_dir
  traj_text = (trial_dir / "traj_data.json").read_text()
  data = make_game_data(json.loads(traj_text), (trial_dir / "initial_state.pddl").read_text(), key)
  if out_dir != trial_dir:
    _atomic_write_text(out_dir / "traj_data.json", traj_text)
  _atomic_write_text(out_dir / _GAME_FILE, json.dumps(data))
  return out_dir / _GAME_FILE


def shipped_data_root() -> pathlib.Path:
  """The shipped 474 tasks, unpacked with their game files into the cache (done once)."""
  digest = hashlib.sha256(SHIPPED_ARCHIVE.read_bytes()).hexdigest()[:12]
  root = cache_root() / "alfworld" / f"subset-{digest}"
  if (root / "COMPLETE").exists():
    return root
  root.parent.mkdir(parents=True, exist_ok=True)
  staging = pathlib.Path(tempfile.mkdtemp(dir=root.parent, prefix=".staging-"))
  try:
    with tarfile.open(SHIPPED_ARCHIVE, "r:xz") as tf:
      tf.extractall(staging, filter="data")
    base = staging / "bundle"
    for traj in sorted(base.glob("json_2.1.1/*/*/*/traj_data.json")):
      trial = traj.parent
      build_game_file(trial, trial.relative_to(base / "json_2.1.1").as_posix())
    (base / "COMPLETE").write_text("ok\n")
    try:
      os.rename(base, root)
    except OSError:
      if not (root / "COMPLETE").exists():  # another process won the race unless it is broken
        raise
  finally:
    shutil.rmtree(staging, ignore_errors=True)
  return root


def resolve_data_root(data_dir: Optional[str] = None) -> pathlib.Path:
  """The folder holding `json_2.1.1/`: `data_dir`, `$ALFWORLD_DATA` if it has one, else shipped."""
  if data_dir:
    root = pathlib.Path(data_dir).expanduser()
    if not (root / "json_2.1.1").is_dir():
      raise FileNotFoundError(f"{root} has no json_2.1.1 folder")
    return root
  env_root = os.environ.get("ALFWORLD_DATA")
  if env_root and (pathlib.Path(env_root).expanduser() / "json_2.1.1").is_dir():
    return pathlib.Path(env_root).expanduser()
  return shipped_data_root()


@functools.lru_cache(maxsize=32)
def _list_trials(root: str, split: str) -> tuple[tuple[str, str], ...]:
  """(task_id, full task type) of every playable trial of `split`, sorted by id."""
  base = pathlib.Path(root) / "json_2.1.1"
  if not (base / split).is_dir():
    have = sorted(p.name for p in base.iterdir() if p.is_dir())
    raise ValueError(f"no split {split!r} under {base}; available: {have}")
  out = []
  for traj in sorted((base / split).glob("*/*/traj_data.json")):
    trial = traj.parent
    rel = trial.relative_to(base).as_posix()
    if "movable" in rel or "Sliced" in rel:  # alfworld's loader skips these too
      continue
    task_type = json.loads(traj.read_text())["task_type"]
    if task_type not in TASK_TYPES:
      continue
    game = trial / _GAME_FILE
    if game.exists() and not json.loads(game.read_text()).get("solvable", False):
      continue  # alfworld-generate marked it unsolvable
    out.append((rel, task_type))
  return tuple(out)


def alfworld_tasks(split: str = "valid_train", data_dir: Optional[str] = None,
                   task_types: Optional[Iterable[str]] = None,
                   num_tasks: Optional[int] = None) -> list[Task]:
  """The playable tasks of one split, the task types taking turns.

  The order is the first task of each type (in `TASK_TYPES` order), then the second of each, and
  so on, each type's tasks sorted by id: any first N tasks (a small training set, an evaluation
  of `num_eval_tasks`) cover the types evenly. Sorted by id alone, the first 16 valid_train tasks
  were all look_at_obj_in_light.

  Args:
    split: a folder under `json_2.1.1` (shipped: valid_train, valid_seen, valid_unseen).
    data_dir: the folder holding `json_2.1.1`; default as `resolve_data_root`.
    task_types: keep only these short type names (keys of `TASK_TYPES` values); default all six.
    num_tasks: keep the first this many.
  Returns:
    `Task(task_id=<split>/<task>/<trial>, task_type=<short type>, split=split)` per trial.
  """
  root = resolve_data_root(data_dir)
  keep = set(task_types) if task_types is not None else set(TASK_TYPES.values())
  unknown = keep - set(TASK_TYPES.values())
  if unknown:
    raise ValueError(f"unknown task types {sorted(unknown)}; known: {sorted(TASK_TYPES.values())}")
  by_type: dict[str, list[Task]] = {t: [] for t in TASK_TYPES.values() if t in keep}
  for rel, tt in sorted(_list_trials(str(root), split)):
    if TASK_TYPES[tt] in keep:
      by_type[TASK_TYPES[tt]].append(Task(task_id=rel, task_type=TASK_TYPES[tt], split=split))
  tasks = [ts[i] for i in range(max(map(len, by_type.values()), default=0))
           for ts in by_type.values() if i < len(ts)]
  return tasks[:num_tasks] if num_tasks is not None else tasks


def game_file_for(task_id: str, root: pathlib.Path) -> pathlib.Path:
  """The `game.tw-pddl` of a task: the data's own, else one built into the cache."""
  trial = root / "json_2.1.1" / task_id
  if not (trial / "traj_data.json").exists():
    raise ValueError(f"unknown ALFWorld task {task_id!r} under {root}")
  if (trial / _GAME_FILE).exists():
    return trial / _GAME_FILE
  digest = hashlib.sha256(str(root.resolve()).encode()).hexdigest()[:12]
  out_dir = cache_root() / "alfworld" / f"built-{digest}" / task_id
  if (out_dir / _GAME_FILE).exists():
    return out_dir / _GAME_FILE
  return build_game_file(trial, task_id, out_dir)


# ---------------------------------------------------------------------------------------------
# The environment.


class _seeded_global_random:  # pylint: disable=invalid-name
  """Runs a block with the global `random` module drawing from `rng`, then puts it back.

  alfworld's goal templates and handcoded expert draw from the global `random`; this makes them
  reproducible per task and seed without disturbing anyone else's use of `random`.
  """

  def __init__(self, rng: random.Random):
    self._rng = rng
    self._saved = None

  def __enter__(self):
    self._saved = random.getstate()
    random.setstate(self._rng.getstate())

  def __exit__(self, *exc):
    self._rng.setstate(random.getstate())
    random.setstate(self._saved)


_MEMO_INSTALLED = False


def install_parse_memo() -> bool:
  """Memoizes TextWorld's grammar and query parsing (3 to 4x faster ALFWorld loads and steps)
  and fast-downward's translation of a game's problem (a game reset again skips it).

  TextWorld's PDDL text engine re-parses, with tatsu, the same few hundred grammar strings and
  fact queries for every admissible command of every step. Both parses are pure functions of
  their text: `textgen._parse_and_convert` results are cached and deep-copied on each use (its
  symbols get mutated), `Rule.parse_conjunctive_query` results are cached and shared (read only).
  The translation, also a function of its text, is `_translation_memo`'s.
  Observations and admissible lists are unchanged (tests/test_alfworld.py replays both ways).
  Process-wide and idempotent; returns False (no change) where textworld's internals differ.
  """
  global _MEMO_INSTALLED  # pylint: disable=global-statement
  if _MEMO_INSTALLED:
    return True
  import copy  # pylint: disable=import-outside-toplevel
  from textworld.envs.pddl import textgen  # pylint: disable=import-outside-toplevel
  from textworld.logic import Rule  # pylint: disable=import-outside-toplevel
  parse = getattr(textgen, "_parse_and_convert", None)
  query = getattr(Rule, "parse_conjunctive_query", None)
  try:
    from textworld.envs.pddl import logic as pddl_logic  # pylint: disable=import-outside-toplevel
    translate = pddl_logic.fast_downward.pddl2sas
  except (ImportError, AttributeError):
    translate = None
  if parse is None or query is None:
    return False

  @functools.lru_cache(maxsize=1 << 16)
  def parse_cached(text, rule_name):
    return parse(text, rule_name=rule_name)

  def parse_memo(*args, **kwargs):
    if len(args) == 1 and set(kwargs) <= {"rule_name", "trace"} and not kwargs.get("trace"):
      return copy.deepcopy(parse_cached(args[0], kwargs.get("rule_name")))
    return parse(*args, **kwargs)

  query_cached = functools.lru_cache(maxsize=1 << 16)(query.__func__)
  textgen._parse_and_convert = parse_memo  # pylint: disable=protected-access
  Rule.parse_conjunctive_query = classmethod(lambda cls, expr: query_cached(cls, expr))
  if translate is not None:
    pddl_logic.fast_downward.pddl2sas = _translation_memo(translate)
  _MEMO_INSTALLED = True
  return True


def _translation_memo(translate):
  """fast-downward's PDDL-to-SAS translation (`pddl2sas(domain, problem, **options)`), memoized.

  `PddlState` translates its game's problem twice (plain and `optimize=True`) at every reset,
  most of a reset's time, though a game's text never changes. The SAS text is a string;
  the parsed task is deep-copied on each use (its objects are the new state's own to change).
  """
  import copy  # pylint: disable=import-outside-toplevel

  @functools.lru_cache(maxsize=64)
  def cached(domain, problem, options):
    return translate(domain, problem, **dict(options))

  def pddl2sas(domain, problem, **options):
    task, sas = cached(domain, problem, tuple(sorted(options.items())))
    return copy.deepcopy(task), sas

  pddl2sas.cache_info = cached.cache_info
  return pddl2sas


def _fresh_state_pddl_env():
  """TextWorld's `PddlEnv`, except that the first reset after a load reuses the load's state.

  `PddlEnv.load` translates the PDDL problem (fast-downward, 1 to 2 s for a kitchen) to list the
  entities, and `reset` translates it again into a new state. The first state is untouched until
  then, so the first reset after a load takes it instead (each env has its own copy of the
  fast-downward library, so nothing else can have moved it). Later resets translate as before.
  """
  from textworld.envs import PddlEnv  # pylint: disable=import-outside-toplevel
  from textworld.envs.pddl import logic as pddl_logic  # pylint: disable=import-outside-toplevel

  class FreshStatePddlEnv(PddlEnv):

    _fresh = None

    def load(self, filename_or_data):
      super().load(filename_or_data)
      self._fresh = self._pddl_state

    def reset(self):
      fresh, self._fresh = self._fresh, None
      if fresh is None:
        return super().reset()
      make_state = pddl_logic.PddlState
      pddl_logic.PddlState = lambda *args, **kwargs: fresh  # PddlEnv.reset builds one inline
      try:
        return super().reset()
      finally:
        pddl_logic.PddlState = make_state

  return FreshStatePddlEnv


class AlfWorldEnv(AdmissibleCommandEnv):
  """One ALFWorld text game at a time; `reset` may pick any task of the data root.

  Args:
    data_dir: folder holding `json_2.1.1/`; default as `resolve_data_root`.
    max_steps: the episode ends after this many steps (valid or not).
    expert: track alfworld's expert along the episode so `expert_action()` works (costs the
      engine's fact list every step).
    expert_type: "handcoded" (alfworld's `HandCodedTWAgent`) or "planner" (fast-downward's plan,
      `policy_commands`; slower).
    fast_engine: memoize TextWorld's parsing (`install_parse_memo`) and skip the second PDDL
      translation of a fresh load (`_fresh_state_pddl_env`): the same games, 3 to 4x faster.
  """

  def __init__(self, data_dir: Optional[str] = None, max_steps: int = 50, expert: bool = False,
               expert_type: str = "handcoded", fast_engine: bool = True):
    if expert_type not in EXPERT_TYPES:
      raise ValueError(f"expert_type must be one of {EXPERT_TYPES}, got {expert_type!r}")
    super().__init__()
    self.data_dir = data_dir
    self.max_steps = max_steps
    self.expert = expert
    self.expert_type = expert_type
    self.fast_engine = fast_engine
    self._root: Optional[pathlib.Path] = None
    self._engine = None
    self._loaded: Optional[str] = None  # game file path the engine holds
    self._expert_agent = None
    self._expert_rng = random.Random(0)
    self._expert_next: Optional[str] = None
    self.task: Optional[Task] = None
    self.goal: str = ""
    self.load_seconds = 0.0  # time the last reset spent loading / resetting the game

  def _make_engine(self):
    # Imported here: alfworld and textworld are heavy, and only this env needs them.
    if self.fast_engine:
      install_parse_memo()
    import textworld  # pylint: disable=import-outside-toplevel
    from textworld.envs import PddlEnv  # pylint: disable=import-outside-toplevel
    engine_class = _fresh_state_pddl_env() if self.fast_engine else PddlEnv
    from alfworld.agents.environment.alfred_tw_env import AlfredDemangler  # pylint: disable=import-outside-toplevel
    infos = textworld.EnvInfos(won=True, admissible_commands=True,
                               facts=self.expert and self.expert_type == "handcoded",
                               policy_commands=self.expert and self.expert_type == "planner")
    return AlfredDemangler(engine_class(infos), shuffle=False)  # no shuffled ids: as alfworld's eval

  def reset(self, task: Task, seed: int = 0) -> EnvStep:
    """Loads `task`'s game (reusing it when it is the one already loaded) and starts it.

    The engine is deterministic; `seed` only seeds the handcoded expert's random fallbacks.
    """
    start = time.perf_counter()
    if self._root is None:
      self._root = resolve_data_root(self.data_dir)
    game_file = str(game_file_for(task.task_id, self._root))
    if self._engine is None:
      self._engine = self._make_engine()
    # fast-downward's translator overwrites sys.argv ("translate.py domain task"): put it back.
    argv = list(sys.argv)
    try:
      if self._loaded != game_file:
        self._loaded = None
        self._engine.load(game_file)
        self._loaded = game_file
      self._state = self._engine.reset()
    finally:
      sys.argv[:] = argv
    self.task = task
    self._t, self._done, self._won = 0, False, bool(self._state["won"])
    self._set_admissible(self._state["admissible_commands"])
    feedback = self._state.feedback
    self.goal = feedback.split("Your task is to:", 1)[-1].strip() if "Your task is to:" in feedback else ""
    if self.expert:
      self._expert_reset(game_file, seed)
    self.load_seconds = time.perf_counter() - start
    return EnvStep(observation=feedback, admissible_actions=self._admissible.commands)

  def _play(self, command: str) -> tuple[str, bool, bool]:
    self._state, _, _ = self._engine.step(command)
    self._set_admissible(self._state["admissible_commands"])
    return self._state.feedback, bool(self._state["won"]), False

  def _after_play(self, command: str, observation: str) -> None:
    # Only valid steps reach here: an invalid one leaves the game as it was, so the expert's next
    # command stands (feeding it junk would make the handcoded expert drop its planned command).
    if self.expert and not self._done:
      self._expert_observe(command, observation)

  def expert_action(self) -> Optional[str]:
    """The expert's next command (admissible, or "look" where it has none); None once done."""
    if not self.expert:
      raise RuntimeError("construct AlfWorldEnv(expert=True) to use expert_action()")
    if self._state is None or self._done:
      return None
    return self._expert_next

  def close(self) -> None:
    if self._engine is not None:
      self._engine.close()
    self._engine, self._loaded, self._state = None, None, None

  # -- internals ------------------------------------------------------------------------------

  def _expert_reset(self, game_file: str, seed: int) -> None:
    self._expert_rng = random.Random(seed)
    if self.expert_type == "planner":
      self._expert_next = self._planner_next()
      return
    from alfworld.agents.expert import HandCodedTWAgent  # pylint: disable=import-outside-toplevel
    self._expert_agent = HandCodedTWAgent(max_steps=200)  # as alfworld's AlfredExpert
    self._expert_agent.reset(game_file)
    self._expert_agent.observe(self._state.feedback)
    self._expert_next = "look"  # alfworld's AlfredExpert also opens with "look"

  def _expert_observe(self, command: str, feedback: str) -> None:
    if self.expert_type == "planner":
      self._expert_next = self._planner_next()
      return
    # The handcoded expert tracks the episode from each (command, feedback), invalid ones too.
    state = dict(self._state)
    state["feedback"] = feedback
    nxt = "look"
    try:
      with _seeded_global_random(self._expert_rng):
        proposal = self._expert_agent.act(state, 0, state["won"], command)
      if proposal in self._admissible.commands:
        nxt = proposal
    except Exception:  # pylint: disable=broad-except
      # alfworld's expert gives up (HandCodedAgentTimeout / Failed) on some states: fall back to
      # "look" as AlfredExpert's default plan does, instead of ending the rollout.
      pass
    self._expert_next = nxt

  def _planner_next(self) -> str:
    plan = self._state.get("policy_commands") or []
    return plan[0] if plan and plan[0] in self._admissible.commands else "look"


# ---------------------------------------------------------------------------------------------
# CLI.


def play(env: AlfWorldEnv, task: Task, policy: str = "expert", seed: int = 0) -> dict:
  """Plays one episode with the expert or uniformly random admissible commands."""
  rng = random.Random(seed)
  t0 = time.perf_counter()
  step = env.reset(task, seed=seed)
  load_s = time.perf_counter() - t0
  actions = []
  t1 = time.perf_counter()
  while not step.done:
    action = env.expert_action() if policy == "expert" else rng.choice(step.admissible_actions)
    actions.append(action)
    step = env.step(action)
  step_s = (time.perf_counter() - t1) / max(len(actions), 1)
  return {"task_id": task.task_id, "task_type": task.task_type, "won": step.won,
          "steps": len(actions), "load_s": load_s, "step_s": step_s, "actions": actions}


def main(argv: Optional[Sequence[str]] = None) -> float:
  parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
  parser.add_argument("--split", default="valid_unseen")
  parser.add_argument("--num-tasks", type=int, default=10)
  parser.add_argument("--expert", action="store_true", help="play the expert (else random)")
  parser.add_argument("--expert-type", default="handcoded", choices=EXPERT_TYPES)
  parser.add_argument("--task-type", action="append", help="keep only these types (repeatable)")
  parser.add_argument("--shuffle-seed", type=int, default=0,
                      help="pick tasks from a seeded shuffle (types mixed); -1 for sorted order")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--max-steps", type=int, default=50)
  parser.add_argument("--data-dir", default=None)
  args = parser.parse_args(argv)
  if args.num_tasks < 1 or args.max_steps < 1:
    parser.error(f"--num-tasks and --max-steps must be >= 1, got {args.num_tasks}, "
                 f"{args.max_steps}")
  try:
    resolve_data_root(args.data_dir)
  except FileNotFoundError as e:
    parser.error(f"--data-dir: {e}")
  unknown = sorted(set(args.task_type or ()) - set(TASK_TYPES.values()))
  if unknown:
    parser.error(f"unknown --task-type {unknown}; known: {sorted(TASK_TYPES.values())}")
  try:
    tasks = alfworld_tasks(args.split, data_dir=args.data_dir, task_types=args.task_type)
  except ValueError as e:
    parser.error(f"--split: {e}")
  if args.shuffle_seed >= 0:
    random.Random(args.shuffle_seed).shuffle(tasks)
  tasks = tasks[:args.num_tasks]
  env = AlfWorldEnv(data_dir=args.data_dir, max_steps=args.max_steps, expert=args.expert,
                    expert_type=args.expert_type)
  policy = "expert" if args.expert else "random"
  wins = 0
  per_type = collections.defaultdict(lambda: [0, 0])
  for i, task in enumerate(tasks):
    r = play(env, task, policy=policy, seed=args.seed)
    wins += r["won"]
    per_type[task.task_type][0] += r["won"]
    per_type[task.task_type][1] += 1
    print(f"[{i + 1}/{len(tasks)}] {'WON ' if r['won'] else 'LOST'} steps={r['steps']:2d} "
          f"load={r['load_s']:.1f}s step={1000 * r['step_s']:.0f}ms {task.task_type:22s} "
          f"{task.task_id}", flush=True)
  env.close()
  rate = wins / max(len(tasks), 1)
  for tt, (w, n) in sorted(per_type.items()):
    print(f"  {tt:22s} {w}/{n}")
  print(f"{policy} success on {args.split}: {wins}/{len(tasks)} = {rate:.2f}")
  return rate


if __name__ == "__main__":
  main()
