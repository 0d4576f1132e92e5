"""TextWorld games from seeds (envs/textworld_games.py) and the env registry (envs/registry.py).

Games are generated once into the user cache (1 to 5 s each) and reused, so repeated runs are fast;
the determinism test generates into a temporary cache on purpose.
"""

import random

import pytest

pytest.importorskip("textworld")

from envs import registry  # pylint: disable=wrong-import-position
from envs import textworld_games as twg  # pylint: disable=wrong-import-position
from envs.base import NOTHING_HAPPENS, Task  # pylint: disable=wrong-import-position

from hypothesis import HealthCheck, given, settings  # pylint: disable=wrong-import-position
from tests.env_fuzz import check_junk_step, junk_actions  # pylint: disable=wrong-import-position

SEEDS = (0, 1, 2)


@pytest.fixture(scope="module")
def env():
  e = twg.TextWorldEnv(expert=True)
  yield e
  e.close()


@pytest.fixture(scope="module")
def tasks():
  return twg.textworld_tasks("train", num_tasks=len(SEEDS))


@pytest.mark.parametrize("i", range(len(SEEDS)))
def test_walkthrough_wins(env, tasks, i):
  step = env.reset(tasks[i])
  assert env.goal and env.goal in step.observation and "-= " in step.observation
  assert 5 <= len(env.walkthrough) <= env.max_steps
  for n, action in enumerate(env.walkthrough):
    assert step.admissible_actions is not None and action in step.admissible_actions
    step = env.step(action)
    assert step.valid and step.done == (n == len(env.walkthrough) - 1)
  assert step.won and step.reward == 1.0 and "You won!" in step.observation
  over = env.step(env.walkthrough[0])
  assert over.done and not over.valid


def test_expert_recovers_from_detours(env, tasks):
  step = env.reset(tasks[0])
  rng = random.Random(0)
  for _ in range(4):  # wander first
    step = env.step(rng.choice([a for a in step.admissible_actions if not a.startswith("examine")]))
  played = 0
  while not step.done:
    step = env.step(env.expert_action())
    played += 1
  assert step.won and played <= 30 and env.expert_action() is None


@pytest.mark.slow  # ~30 s to generate the first time (cached after)
def test_longer_quests_and_bigger_worlds():
  params = dict(world_size=5, nb_objects=10, quest_length=7)
  (task,) = twg.textworld_tasks("heldout", num_tasks=1, **params)
  e = twg.TextWorldEnv(**params)
  step = e.reset(task)
  assert task.task_type == "quest7" and len(e.walkthrough) >= 7
  for action in e.walkthrough:
    step = e.step(action)
  assert step.won
  brief = twg.TextWorldEnv(brief_goal=True)
  (task,) = twg.textworld_tasks("heldout", num_tasks=1, brief_goal=True)
  brief.reset(task)
  detailed = twg.TextWorldEnv()
  detailed.reset(twg.textworld_tasks("heldout", num_tasks=1)[0])
  assert len(brief.goal) < len(detailed.goal)


def test_seeded_replays_are_identical(tasks):
  runs = []
  for _ in range(2):
    e = twg.TextWorldEnv(max_steps=15)
    rng = random.Random(7)
    step = e.reset(tasks[1])
    trace = [step.observation]
    while not step.done:
      step = e.step(rng.choice(step.admissible_actions))
      trace.append((step.observation, step.admissible_actions, step.reward, step.done))
    runs.append(trace)
  assert runs[0] == runs[1] and len(runs[0]) >= 2


def test_generation_is_deterministic(tmp_path, monkeypatch):
  import textworld  # pylint: disable=import-outside-toplevel
  params = twg.GameParams(world_size=2, nb_objects=4, quest_length=3)  # small: quick to make
  files = []
  for sub in ("a", "b"):
    monkeypatch.setenv("SALT_JAX_CACHE", str(tmp_path / sub))
    files.append(twg.ensure_game(params, 3))
  assert files[0].read_bytes() == files[1].read_bytes()
  assert files[0].relative_to(tmp_path / "a") == files[1].relative_to(tmp_path / "b")
  other = textworld.Game.load(str(twg.ensure_game(params, 4)))
  same = textworld.Game.load(str(files[1]))
  assert (other.walkthrough, other.objective) != (same.walkthrough, same.objective)


def test_splits_are_disjoint_and_ids_checked():
  train = twg.textworld_tasks("train", num_tasks=50)
  held = twg.textworld_tasks("heldout", num_tasks=50)
  assert not {t.task_id for t in train} & {t.task_id for t in held}
  assert {t.split for t in held} == {"heldout"} and train[0].task_id.endswith("-0")
  e = twg.TextWorldEnv(quest_length=6)
  with pytest.raises(ValueError):
    e.reset(train[0])  # another family's task
  with pytest.raises(ValueError):
    twg.textworld_tasks("test")
  with pytest.raises(ValueError):
    twg.GameParams(quest_length=0)


@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
@given(junk=junk_actions("go", "take", "go nowhere", "<action>look</action>"))
def test_malformed_actions_are_invalid_steps(env, tasks, junk):
  # A valid step must be a real command, case aside.
  real = lambda j, adm: " ".join(str(j).split()).lower() in [a.lower() for a in adm]  # noqa: E731
  check_junk_step(env, tasks[2], junk, real, lambda: NOTHING_HAPPENS)


def test_capitalized_admissible_commands_match_lowercased_actions(env):
  # Find a state listing a command with capitals (TextWorld names some things "Advent Calendar").
  for task in twg.textworld_tasks("train", num_tasks=len(SEEDS)):
    step = env.reset(task)
    caps = [a for a in step.admissible_actions if a != a.lower()]
    if caps:
      assert env.step(caps[0].lower()).valid
      return
  pytest.skip("no capitalized command in these games")


# -- registry ----------------------------------------------------------------------------------


def test_registry_makes_envs_and_task_lists():
  assert set(registry.names()) >= {"alfworld", "textworld", "toy", "webshop"}
  tw = registry.make_env("textworld", max_steps=30, quest_length=5)
  assert isinstance(tw, twg.TextWorldEnv) and tw.max_steps == 30
  tasks = registry.task_list("textworld", "train", num_tasks=2, max_steps=30, expert=True)
  assert [t.task_id for t in tasks] == [t.task_id for t in twg.textworld_tasks("train", 2)]
  toy = registry.make_env("toy")
  toy_tasks = registry.task_list("toy", "train", num_tasks=3, max_steps=7)
  assert len(toy_tasks) == 3 and "task" in toy.reset(toy_tasks[0]).observation.lower()
  with pytest.raises(ValueError):
    registry.make_env("no-such-env")


def test_registry_builds_textworld_from_one_kwargs_dict():
  kwargs = {"max_steps": 12, "quest_length": 5}  # the env's and the task list's, in one dict
  e = registry.make_env("textworld", **kwargs)
  assert isinstance(e, twg.TextWorldEnv) and e.max_steps == 12
  assert registry.task_list("textworld", "heldout", num_tasks=1, **kwargs)[0].split == "heldout"


def test_task_list_alfworld_drops_env_only_kwargs():
  pytest.importorskip("alfworld")
  from envs import alfworld as alf  # pylint: disable=import-outside-toplevel
  root = str(alf.shipped_data_root())
  tasks = registry.task_list("alfworld", "valid_unseen", data_dir=root, max_steps=50, expert=True)
  assert len(tasks) == 134 and isinstance(tasks[0], Task)
