"""Real ALFWorld through alfworld 0.4.2: the shipped tasks, game files, expert wins, robustness.

Games load in 0.5 to 15 s on a busy 2-core machine, so the default tests play a few small scenes
(bathrooms) through one module-wide env; the 10-task expert run and the comparison with
`alfworld-generate` are marked slow.
"""

import collections
import importlib.machinery
import importlib.util
import json
import pathlib
import random
import re
import shutil
import sys

import pytest

pytest.importorskip("alfworld")
pytest.importorskip("textworld")

from envs import alfworld as alf  # pylint: disable=wrong-import-position
from envs.base import NOTHING_HAPPENS, Task  # pylint: disable=wrong-import-position

# Small scenes (the shortest PDDL problems of their split): fast to load.
SMALL_UNSEEN = ("valid_unseen/pick_clean_then_place_in_recep-SoapBar-None-Cabinet-424/"
                "trial_T20190908_214926_337906")
SMALL_SEEN = ("valid_seen/pick_and_place_simple-ToiletPaper-None-ToiletPaperHanger-406/"
              "trial_T20190908_122858_883968")
SMALL_SEEN_TWO = ("valid_seen/pick_two_obj_and_place-SprayBottle-None-GarbageCan-419/"
                  "trial_T20190908_164236_518264")

# Per-split task-type counts of the shipped subset (totals as in shared/alfworld/README.md).
EXPECTED_COUNTS = {
    "valid_train": {"look_at_obj_in_light": 19, "pick_and_place": 46, "pick_clean_then_place": 37,
                    "pick_cool_then_place": 28, "pick_heat_then_place": 25,
                    "pick_two_obj_and_place": 45},
    "valid_seen": {"look_at_obj_in_light": 13, "pick_and_place": 35, "pick_clean_then_place": 27,
                   "pick_cool_then_place": 25, "pick_heat_then_place": 16,
                   "pick_two_obj_and_place": 24},
    "valid_unseen": {"look_at_obj_in_light": 18, "pick_and_place": 24,
                     "pick_clean_then_place": 31, "pick_cool_then_place": 21,
                     "pick_heat_then_place": 23, "pick_two_obj_and_place": 17},
}


@pytest.fixture(scope="module")
def root():
  """The shipped data, whatever $ALFWORLD_DATA says (tests pin the data they check)."""
  return alf.shipped_data_root()


@pytest.fixture(scope="module")
def expert_env(root):
  env = alf.AlfWorldEnv(data_dir=str(root), expert=True)
  yield env
  env.close()


def _task(root, task_id):
  split = task_id.split("/", 1)[0]
  (task,) = [t for t in alf.alfworld_tasks(split, data_dir=str(root)) if t.task_id == task_id]
  return task


def _play_expert(env, task, seed=0, junk=()):
  """Plays the expert to the end, throwing each junk action in before each expert action."""
  step = env.reset(task, seed=seed)
  assert "Your task is to:" in step.observation and env.goal
  trace = []
  while not step.done:
    for j in junk:
      bad = env.step(j)
      assert not bad.valid and bad.observation == NOTHING_HAPPENS and bad.reward == 0.0
      assert bad.admissible_actions == step.admissible_actions  # the game did not move
    action = env.expert_action()
    assert action in step.admissible_actions
    step = env.step(action)
    assert step.valid
    trace.append((action, step.observation))
  return step, trace


def test_splits_and_task_types_match_the_readme(root):
  sizes = {}
  for split, expected in EXPECTED_COUNTS.items():
    tasks = alf.alfworld_tasks(split, data_dir=str(root))
    sizes[split] = len(tasks)
    assert dict(collections.Counter(t.task_type for t in tasks)) == expected
    assert all(t.split == split and t.task_id.startswith(split + "/") for t in tasks)
    assert len({t.task_id for t in tasks}) == len(tasks)
  assert sizes == {"valid_train": 200, "valid_seen": 140, "valid_unseen": 134}
  # The types take turns (a reference: rank within the type, then type order); each type's
  # tasks in id order. So any first 6k tasks hold k of each type (while each has k).
  types = list(alf.TASK_TYPES.values())
  for split in EXPECTED_COUNTS:
    tasks = alf.alfworld_tasks(split, data_dir=str(root))
    ids = {tt: sorted(t.task_id for t in tasks if t.task_type == tt) for tt in types}
    assert tasks == sorted(tasks, key=lambda t: (ids[t.task_type].index(t.task_id),
                                                 types.index(t.task_type)))
    first = [t.task_type for t in tasks[:12]]
    assert all(first.count(tt) == 2 for tt in types), first
  picked = alf.alfworld_tasks("valid_seen", data_dir=str(root), task_types=["pick_and_place"],
                              num_tasks=5)
  assert len(picked) == 5 and {t.task_type for t in picked} == {"pick_and_place"}
  with pytest.raises(ValueError):
    alf.alfworld_tasks("valid_seen", data_dir=str(root), task_types=["slice_things"])
  with pytest.raises(ValueError):
    alf.alfworld_tasks("no_such_split", data_dir=str(root))


def test_shipped_data_is_small_and_complete():
  assert alf.SHIPPED_ARCHIVE.stat().st_size < 2_000_000  # the repo travels in 64 MiB


def test_game_file_has_alfworld_generate_semantics(root, tmp_path):
  from alfworld.info import ALFRED_PDDL_PATH, ALFRED_TWL2_PATH  # pylint: disable=import-outside-toplevel
  import alfworld.gen.goal_library as glib  # pylint: disable=import-outside-toplevel
  trial = root / "json_2.1.1" / SMALL_UNSEEN
  data = json.loads((trial / "game.tw-pddl").read_text())
  assert set(data) == {"pddl_domain", "grammar", "pddl_problem", "solvable", "walkthrough"}
  assert data["solvable"] is True and data["walkthrough"] is None
  assert data["pddl_domain"] == pathlib.Path(ALFRED_PDDL_PATH).read_text()
  assert data["pddl_problem"] == (trial / "initial_state.pddl").read_text()
  # The grammar is alfworld's with "UNKNOWN GOAL" replaced by one of the type's goal templates.
  base = pathlib.Path(ALFRED_TWL2_PATH).read_text()
  traj = json.loads((trial / "traj_data.json").read_text())
  params = traj["pddl_params"]
  goals = [t.format(obj=params["object_target"].lower(), recep=params["parent_target"].lower(),
                    toggle=params["toggle_target"].lower(), mrecep=params["mrecep_target"].lower())
           for t in glib.gdict[traj["task_type"]]["templates"]]
  assert "UNKNOWN GOAL" not in data["grammar"]
  assert data["grammar"] in [base.replace("UNKNOWN GOAL", g) for g in goals]
  # Building again elsewhere gives the same file (the goal draw is seeded by the trial's path).
  out = alf.build_game_file(trial, SMALL_UNSEEN, tmp_path / "out")
  assert json.loads(out.read_text()) == data
  assert (tmp_path / "out" / "traj_data.json").read_text() == (trial / "traj_data.json").read_text()


def test_missing_game_file_is_built_into_the_cache(root, tmp_path, monkeypatch):
  monkeypatch.setenv("SALT_JAX_CACHE", str(tmp_path / "cache"))
  data_root = tmp_path / "data"
  src = root / "json_2.1.1" / SMALL_SEEN
  dst = data_root / "json_2.1.1" / SMALL_SEEN
  dst.mkdir(parents=True)
  for name in ("traj_data.json", "initial_state.pddl"):  # as alfworld-download ships, sans game
    shutil.copy(src / name, dst / name)
  monkeypatch.setenv("ALFWORLD_DATA", str(data_root))
  assert alf.resolve_data_root() == data_root
  (task,) = alf.alfworld_tasks("valid_seen")
  game = alf.game_file_for(task.task_id, data_root)
  assert str(game).startswith(str(tmp_path / "cache")) and not (dst / "game.tw-pddl").exists()
  assert json.loads(game.read_text()) == json.loads((src / "game.tw-pddl").read_text())


@pytest.mark.parametrize("task_id", [SMALL_UNSEEN, SMALL_SEEN, SMALL_SEEN_TWO])
def test_handcoded_expert_wins(expert_env, root, task_id):
  task = _task(root, task_id)
  step, trace = _play_expert(expert_env, task)
  assert step.won and step.done and step.reward == 1.0
  assert len(trace) <= expert_env.max_steps
  assert expert_env.expert_action() is None
  over = expert_env.step("look")
  assert over.done and not over.valid and over.observation == alf.EPISODE_OVER


def test_malformed_actions_are_invalid_steps_and_the_expert_still_wins(expert_env, root):
  rng = random.Random(0)
  junk = ["", " ", "x" * 10_000, "\x00\x01\xff", "\udcff\ud800", "ünïcödé 日本語 🙂", "<action>",
          "go to", "go to nowhere 99", "take", "look" * 3, "\n\t", b"\xff\xfe", None, 123]
  junk += ["".join(chr(rng.randrange(1, 0x10FFFF)) for _ in range(rng.randrange(1, 40)))
           for _ in range(40)]
  env = expert_env
  env.max_steps = 10_000  # room for the junk; restored below
  try:
    task = _task(root, SMALL_SEEN)
    step, _ = _play_expert(env, task, junk=junk[:5])
    assert step.won
    env.reset(task)
    for j in junk:  # a full pass of every kind, on a fresh episode
      bad = env.step(j)
      assert not bad.valid and bad.observation == NOTHING_HAPPENS and not bad.done
  finally:
    env.max_steps = 50


def test_case_and_spacing_of_admissible_commands_are_forgiven(expert_env, root):
  step = expert_env.reset(_task(root, SMALL_SEEN))
  cmd = step.admissible_actions[0]
  loud = expert_env.step("  " + cmd.upper().replace(" ", "   ") + " \n")
  assert loud.valid


def test_seeded_replays_are_identical(root):
  task = _task(root, SMALL_SEEN)
  runs = []
  for _ in range(2):
    env = alf.AlfWorldEnv(data_dir=str(root), max_steps=8)
    rng = random.Random(3)
    step = env.reset(task)
    obs = [step.observation]
    while not step.done:
      step = env.step(rng.choice(step.admissible_actions))
      obs.append((step.observation, step.admissible_actions, step.reward))
    runs.append(obs)
    env.close()
  assert runs[0] == runs[1] and len(runs[0]) == 9


def test_a_game_reset_again_replays_identically_from_the_translation_memo(root):
  """The second reset of a loaded game builds its state from the memoized translation."""
  from textworld.envs.pddl import logic as pddl_logic  # pylint: disable=import-outside-toplevel
  env = alf.AlfWorldEnv(data_dir=str(root), max_steps=8)
  task = _task(root, SMALL_UNSEEN)
  runs = []
  for _ in range(3):
    rng = random.Random(5)
    step = env.reset(task)
    hits = pddl_logic.fast_downward.pddl2sas.cache_info().hits
    obs = [step.observation, step.admissible_actions]
    while not step.done:
      step = env.step(rng.choice(step.admissible_actions))
      obs.append((step.observation, step.admissible_actions, step.reward, step.won))
    runs.append((obs, hits))
  env.close()
  assert runs[0][0] == runs[1][0] == runs[2][0] and len(runs[0][0]) == 10
  assert runs[2][1] >= runs[1][1] + 2  # both translations of the third reset came from the memo


def test_translation_memo_translates_each_text_once_and_hands_out_copies():
  calls = []

  def translate(domain, problem, **options):
    calls.append((domain, problem, options))
    return {"objects": [problem]}, f"sas:{problem}:{sorted(options.items())}"

  memo = alf._translation_memo(translate)  # pylint: disable=protected-access
  task, sas = memo("d", "p1", verbose=False)
  task["objects"].append("changed by the state")
  again, sas_again = memo("d", "p1", verbose=False)
  assert again == {"objects": ["p1"]} and sas_again == sas
  assert memo("d", "p1", verbose=False, optimize=True)[1] != sas
  memo("d", "p2", verbose=False)
  assert calls == [("d", "p1", {"verbose": False}),
                   ("d", "p1", {"verbose": False, "optimize": True}),
                   ("d", "p2", {"verbose": False})]


def test_episode_ends_after_max_steps(root):
  env = alf.AlfWorldEnv(data_dir=str(root), max_steps=3)
  env.reset(_task(root, SMALL_UNSEEN))
  steps = [env.step("look"), env.step("bogus"), env.step("inventory")]
  assert [s.done for s in steps] == [False, False, True] and not steps[-1].won
  assert [s.valid for s in steps] == [True, False, True]
  with pytest.raises(ValueError):
    env.reset(Task("valid_seen/no-such-task/trial_0", "pick_and_place", "valid_seen"))
  env.close()


@pytest.mark.slow
def test_cli_expert_wins_most_valid_unseen_tasks(capsys):
  rate = alf.main(["--expert", "--split", "valid_unseen", "--num-tasks", "10"])
  out = capsys.readouterr().out
  assert out.count("WON") + out.count("LOST") == 10
  assert rate >= 0.7  # alfworld's own AlfredTWEnv run: 8 of 10


@pytest.mark.slow
def test_same_game_as_alfworld_generate(root, tmp_path):
  """Runs alfworld's `alfworld-generate` script (with its solvability check) on one trial."""
  script = shutil.which("alfworld-generate")
  if script is None:
    pytest.skip("alfworld-generate script not on PATH")
  src = root / "json_2.1.1" / SMALL_SEEN
  data = tmp_path / "in" / "json_2.1.1" / SMALL_SEEN
  data.mkdir(parents=True)
  for name in ("traj_data.json", "initial_state.pddl"):
    shutil.copy(src / name, data / name)
  loader = importlib.machinery.SourceFileLoader("alfworld_generate", script)
  spec = importlib.util.spec_from_loader("alfworld_generate", loader)
  gen = importlib.util.module_from_spec(spec)
  loader.exec_module(gen)
  args = type("Args", (), dict(
      data_path=str(tmp_path / "in"), save_path=str(tmp_path / "out"), start=0, end=None,
      domain=gen.pjoin(sys.modules["alfworld.info"].BUILTIN_DATA_PATH, "alfred.pddl"),
      grammar=gen.pjoin(sys.modules["alfworld.info"].BUILTIN_DATA_PATH, "alfred.twl2"),
      expert_type="handcoded", verbose=False, goal_desc_human_anns_prob=0.0, seed=1))
  gen.gen_game_files(args)
  theirs = json.loads((tmp_path / "out" / "json_2.1.1" / SMALL_SEEN / "game.tw-pddl").read_text())
  ours = json.loads((src / "game.tw-pddl").read_text())
  assert set(theirs) == set(ours)
  assert theirs["solvable"] is True and ours["solvable"] is True
  assert theirs["pddl_domain"] == ours["pddl_domain"]
  assert theirs["pddl_problem"] == ours["pddl_problem"]
  # Grammars differ at most in which goal template alfworld's unseeded draw picked.
  goal_line = re.compile(r'"Your task is to: [^"]*"')
  assert goal_line.sub("GOAL", theirs["grammar"]) == goal_line.sub("GOAL", ours["grammar"])
  assert len(goal_line.findall(theirs["grammar"])) == 1


_PLAIN_TRACE = """
import json, sys
from envs import alfworld as alf
env = alf.AlfWorldEnv(data_dir=sys.argv[1], expert=True, fast_engine=False)
(task,) = [t for t in alf.alfworld_tasks("valid_seen", data_dir=sys.argv[1]) if t.task_id == sys.argv[2]]
step = env.reset(task)
trace = [[None, step.observation, list(step.admissible_actions)]]
while not step.done:
  action = env.expert_action()
  step = env.step(action)
  trace.append([action, step.observation, list(step.admissible_actions)])
assert not alf._MEMO_INSTALLED
print(json.dumps(trace))
"""


@pytest.mark.slow
def test_fast_engine_leaves_games_unchanged(expert_env, root):
  """The fast engine (this process) and textworld's own (a fresh process) play the same games."""
  import subprocess  # pylint: disable=import-outside-toplevel
  out = subprocess.run([sys.executable, "-c", _PLAIN_TRACE, str(root), SMALL_SEEN], check=True,
                       capture_output=True, text=True, cwd=pathlib.Path(__file__).parents[1])
  plain = json.loads(out.stdout.strip().splitlines()[-1])
  step = expert_env.reset(_task(root, SMALL_SEEN))
  assert alf._MEMO_INSTALLED  # pylint: disable=protected-access  (the first reset installs it)
  memo = [[None, step.observation, list(step.admissible_actions)]]
  while not step.done:
    action = expert_env.expert_action()
    step = expert_env.step(action)
    memo.append([action, step.observation, list(step.admissible_actions)])
  assert memo == plain and step.won


@pytest.mark.slow
def test_planner_expert_wins(root):
  env = alf.AlfWorldEnv(data_dir=str(root), expert=True, expert_type="planner")
  step, _ = _play_expert(env, _task(root, SMALL_SEEN))
  assert step.won
  env.close()
