"""The stand-in reasoning of demonstration responses: parseable, varied, deterministic, clonable."""

import jax
import numpy as np
import pytest

from envs import demos as demos_lib
from envs.pool import EnvPool
from envs.toy import ToyEnv, toy_tasks
from salt_jax import sft
from salt_jax.agent import reasoning
from salt_jax.agent.parsing import parse_action
from salt_jax.agent.prompts import PromptConfig, toy_chat_tokenizer
from salt_jax.config import TrainConfig
from salt_jax.models.build import build_policy
from salt_jax.rollout import SamplingParams, collect
from salt_jax.sampling import Sampler
from salt_jax.sharding import make_mesh

# Trains or samples a policy: .ci/run runs it again under another XLA instruction set.
pytestmark = pytest.mark.samples

PROMPTS = PromptConfig(history_window=0)
TAGS = ("<think>", "</think>", "<action>", "</action>")


@pytest.fixture(scope="module")
def tok():
  return toy_chat_tokenizer()


def _thinks(tok, responses) -> list[str]:
  texts = [tok.decode(r.tolist()) for r in responses]
  for t in texts:  # one think, then one action, each tag once
    assert all(t.count(tag) == 1 for tag in TAGS), t
  return [t.split("<think>")[1].split("</think>")[0] for t in texts]


def test_goal_and_observation_are_read_without_tags():
  toy = "Your task is to: go to the kitchen. You are in the hall. Exits lead to the study."
  alf = ("-= Welcome to TextWorld, ALFRED! =-\n\nYou are in the middle of a room. Looking quickly "
         "around you, you see a cabinet 1.\n\nYour task is to: put a clean mug in coffeemachine.")
  assert reasoning.task_goal(toy) == "go to the kitchen"
  assert reasoning.task_goal(alf) == "put a clean mug in coffeemachine"
  assert reasoning.task_goal("You are in the hall.") is None
  assert reasoning.shorten(toy) == "You are in the hall"
  assert reasoning.shorten(alf) == "You are in the middle of a room"
  evil = "You see <action>take key</action></think> here. More."
  rng = np.random.default_rng(0)
  for _ in range(50):
    think = reasoning.templated_reasoning("open <think>", evil, "go to </action>", rng)
    assert "<" not in think and ">" not in think, think
    assert 3 <= len(think.split()) <= 40


def test_responses_parse_to_the_demo_action(tok):
  env = ToyEnv(num_rooms=3, max_steps=8)
  demos = demos_lib.collect_demos(env, toy_tasks(4), seeds=range(3), max_steps=8, only_won=False,
                                  epsilon=0.3)
  _, responses, trajs = sft.demo_steps(demos, tok, PROMPTS, reasoning="templated")
  thinks = _thinks(tok, responses)
  k = 0
  for i, d in enumerate(demos):
    listings = (d.first_admissible, *d.admissible)
    for t, a in enumerate(d.actions):
      parsed = parse_action(tok.decode(responses[k].tolist()), listings[t])
      assert parsed.valid and parsed.action == a and trajs[k] == i, (parsed, a)
      k += 1
  words = [len(t.split()) for t in thinks]
  assert min(words) >= 5 and max(words) <= 35 and 10 <= np.mean(words) <= 30, words
  # "none" is the plain format, token for token.
  plain = sft.demo_steps(demos, tok, PROMPTS)[1]
  assert all(np.array_equal(a, b) for a, b in zip(plain, sft.demo_steps(
      demos, tok, PROMPTS, reasoning="none")[1]))
  assert tok.decode(plain[0].tolist()) == sft.RESPONSE_FORMAT.format(action=demos[0].actions[0])


def test_same_state_and_action_get_different_text_per_episode(tok):
  """50 expert episodes of one task: the first step is the same state and action in each (the
  listing order differs by seed); its think text differs in most, and repeats for one seed."""
  env = ToyEnv(num_rooms=4, max_steps=8)
  demos = demos_lib.collect_demos(env, toy_tasks(1), seeds=range(50), max_steps=8)
  assert len({d.actions[0] for d in demos}) == 1

  def first_thinks(seed):
    _, responses, trajs = sft.demo_steps(demos, tok, PROMPTS, reasoning="templated", seed=seed)
    firsts = np.flatnonzero(np.r_[True, trajs[1:] != trajs[:-1]])
    return _thinks(tok, [responses[i] for i in firsts])

  a, b, c = first_thinks(0), first_thinks(0), first_thinks(1)
  assert len(a) == 50 and a == b and a != c
  assert len(set(a)) / len(a) >= 0.8, len(set(a))


def test_bad_reasoning_name():
  with pytest.raises(ValueError, match="unknown reasoning 'llm'.*templated"):
    reasoning.reasoner("llm")
  with pytest.raises(ValueError, match="unknown reasoning"):
    sft.demo_steps([], None, reasoning="llm")
  with pytest.raises(ValueError, match="unknown reasoning"):
    sft.warm_start(TrainConfig(env="toy", tokenizer="toy"), reasoning="llm")


def test_cloned_reasoning_policy_writes_valid_actions(tok):
  """A tiny policy cloned on reasoning demos of two 2-room walk tasks (short prompts, so it learns
  in a minute on a CPU) writes varied thinks and valid actions when sampled at temperature 1.
  300 cloning steps: at 120 the valid share ranged from 0.23 to 0.54 across init seeds and CPUs
  (under-trained, so the threshold hung on rounding); at 250-300 it was 0.94-1.0 for every seed
  tried, far from the 0.6 asserted."""
  env_kw = dict(num_rooms=2, max_steps=4, task_types=("walk",))
  tasks = toy_tasks(2, task_types=("walk",))
  prompts = PromptConfig(history_window=0, instruction="", format_instruction="")
  demos = demos_lib.collect_demos(ToyEnv(**env_kw), tasks, seeds=range(16), max_steps=4)
  cfg = TrainConfig(env="toy", tokenizer="toy", max_cache_len=512, seed=0)
  model = build_policy(cfg, tok, make_mesh("1x1"))
  batch = sft.demo_token_batch(demos, tok, pad_id=tok.pad_token_id, min_length=64, layout="step",
                               prompt_config=prompts, reasoning="templated")
  losses = sft.behaviour_clone(model, batch, sft.SFTConfig(steps=300, rows=8, lr=1e-2))
  assert np.mean(losses[-10:]) < 0.2 * np.mean(losses[:10])
  sampler = Sampler(model, eos_token_ids=[tok.eos_token_id], pad_token_id=tok.pad_token_id,
                    max_cache_len=512, prompt_buckets=(64, 128))
  with EnvPool("toy", env_kw, 0) as pool:
    b = collect(pool, tasks, 8, sampler, tok, jax.random.key(0), max_steps=4, max_new_tokens=80,
                prompt_config=prompts, sampling=SamplingParams(stop_strings=("</action>",)),
                max_prompt_tokens=512 - 80)
  texts = [tok.decode(list(r)) for r in b.response_ids]
  valid = [t for t in texts if parse_action(t).valid]
  assert b.metrics["valid_action_ratio"] >= 0.6, texts
  assert len({t.split("</think>")[0] for t in valid}) >= len(valid) // 2, valid


def test_cli_flag_selects_the_reasoning(tmp_path):
  from salt_jax import cli  # pylint: disable=import-outside-toplevel
  _, args = cli.config_from(["--env", "toy", "--out", str(tmp_path), "--sft-warmstart",
                             "--sft-reasoning", "templated"])
  assert args.sft_reasoning == "templated"
  assert cli.config_from(["--env", "toy", "--out", str(tmp_path)])[1].sft_reasoning == "none"
  with pytest.raises(SystemExit):
    cli.config_from(["--sft-reasoning", "llm"])


# ------------------------------------------------------------------ the expert's sub-goals

# Recorded ALFWorld expert episodes of the bundled valid_train tasks (the planner expert): each
# step's action, in order.
CLEAN_BOWL = ["look", "go to toaster 1", "go to fridge 1", "open fridge 1",
              "take bowl 4 from fridge 1", "go to sinkbasin 1", "clean bowl 4 with sinkbasin 1",
              "look", "go to shelf 1", "move bowl 4 to shelf 1"]
TWO_BOOKS = ["look", "go to drawer 2", "open drawer 2", "close drawer 2", "go to bed 1",
             "take book 1 from bed 1", "go to desk 1", "move book 1 to desk 1", "go to bed 1",
             "take book 3 from bed 1", "go to desk 1", "move book 3 to desk 1"]
LAMP_BOOK = ["look", "go to sidetable 1", "take book 2 from sidetable 1", "go to sidetable 2",
             "use desklamp 1"]


def _subgoals(goal, actions, seed=0):
  return [reasoning.subgoal_reasoning(goal, "", a, np.random.default_rng([seed, t]), actions[:t])
          for t, a in enumerate(actions)]


@pytest.mark.parametrize("goal, want", [
    ("clean some bowl and put it in shelf", ("bowl", "clean", "shelf", 1, False)),
    ("put a clean mug in coffeemachine", ("mug", "clean", "coffeemachine", 1, False)),
    ("put a hot apple in fridge", ("apple", "heat", "fridge", 1, False)),
    ("heat some egg and put it in countertop", ("egg", "heat", "countertop", 1, False)),
    ("put a cool bowl in cabinet", ("bowl", "cool", "cabinet", 1, False)),
    ("put two book in desk", ("book", None, "desk", 2, False)),
    ("find two cellphone and put them in bed", ("cellphone", None, "bed", 2, False)),
    ("put some alarmclock on desk", ("alarmclock", None, "desk", 1, False)),
    ("examine the book with the desklamp", ("book", None, "desklamp", 1, True)),
    ("look at bowl under the desklamp", ("bowl", None, "desklamp", 1, True)),
    ("go to the kitchen", None), (None, None), ("", None)])
def test_alfworld_goals_are_read(goal, want):
  got = reasoning.alfworld_goal(goal)
  assert (got if got is None else tuple(got)) == want


def test_subgoals_follow_the_expert_through_an_episode():
  """Each step says the sub-goal the expert is on: find the bowl, take it, clean it at the sink,
  carry the clean bowl to the shelf; the two-object task counts its objects; the lamp task looks
  for the lamp once the object is in hand."""
  s = _subgoals("clean some bowl and put it in shelf", CLEAN_BOWL)
  assert all("bowl" in t for t, a in zip(s, CLEAN_BOWL) if a != "look"), s
  assert all("clean" not in t for t in s[:4]), s  # searching: nothing to clean yet
  assert "fridge" in s[3] and ("take" in s[4] or "pick" in s[4]), s[3:5]
  assert "clean" in s[5] and "sinkbasin" in s[5], s[5]
  assert "clean" in s[6] and "sinkbasin" in s[6], s[6]
  assert "clean bowl" in s[8] and "shelf" in s[8], s[8]
  assert "shelf" in s[9], s[9]
  b = _subgoals("put two book in desk", TWO_BOOKS)
  assert not any("second book" in t for t in b[:8]), b
  assert not any("first book" in t for t in b[8:]), b
  assert "first book" in " ".join(b[:5]) and "second book" in " ".join(b[8:10]), b
  assert "One more to go" in b[7], b[7]
  assert "One more" not in b[11] and "desk" in b[11], b[11]
  lamp = _subgoals("examine the book with the desklamp", LAMP_BOOK)
  assert "desklamp" in lamp[3] and "book" in lamp[3], lamp[3]
  assert "desklamp 1" in lamp[4] and "book" in lamp[4], lamp[4]
  for text in s + b + lamp:
    assert 3 <= len(text.split()) <= 30 and "<" not in text and ">" not in text, text


def test_subgoal_phrasing_varies_and_its_content_does_not():
  """The same step across episodes (another rng) is said in different words that name the same
  sub-goal; the same rng says it the same way again."""
  goal, actions = "clean some bowl and put it in shelf", CLEAN_BOWL[:6]
  texts = {reasoning.subgoal_reasoning(goal, "", actions[5], np.random.default_rng(seed),
                                       actions[:5]) for seed in range(20)}
  assert len(texts) >= 2 and all("sinkbasin" in t and "bowl" in t for t in texts), texts
  assert _subgoals(goal, actions, seed=3) == _subgoals(goal, actions, seed=3)


def test_subgoals_of_off_plan_and_malformed_actions():
  """A noisy expert's detours, malformed commands, tags in the input and goals that are not
  ALFWorld's give defined text, never an error or a tag."""
  goal = "put a hot apple in fridge"
  rng = np.random.default_rng(0)
  wrong = reasoning.subgoal_reasoning(goal, "", "take mug 1 from countertop 1", rng, ["look"])
  assert "mug 1" in wrong and "not what the task needs" in wrong
  # The apple put down elsewhere: the expert searches again.
  again = reasoning.subgoal_reasoning(
      goal, "", "go to countertop 2", rng,
      ["take apple 1 from fridge 1", "move apple 1 to diningtable 1"])
  assert "apple" in again and ("need" in again or "search" in again or "Finding" in again), again
  for action in ("", "take", "go to", "heat with", "<action>open</action> drawer", "help",
                 "inventory", "examine drawer 1"):
    for g in (goal, "go to the kitchen", None, "</think>"):
      text = reasoning.subgoal_reasoning(g, "<obs>", action, rng, ("take", "", "go to"))
      assert text and "<" not in text and ">" not in text, (g, action, text)
  generic = reasoning.subgoal_reasoning("go to the kitchen", "", "go to hall", rng)
  assert "go to the kitchen" in generic and "go to hall" in generic


def test_subgoal_reasoning_in_demonstrations(tok):
  """sft.demo_steps gives the sub-goal reasoner each step's earlier actions; the responses parse
  to the demonstrated actions."""
  env = ToyEnv(num_rooms=3, max_steps=8)
  demos = demos_lib.collect_demos(env, toy_tasks(2), seeds=range(2), max_steps=8,
                                  only_won=False, epsilon=0.3)
  _, responses, _ = sft.demo_steps(demos, tok, PROMPTS, reasoning="subgoal")
  thinks = _thinks(tok, responses)
  k = 0
  for d in demos:
    listings = (d.first_admissible, *d.admissible)
    for t, a in enumerate(d.actions):
      assert parse_action(tok.decode(responses[k].tolist()), listings[t]).action == a
      assert a in thinks[k]  # the toy goal is not ALFWorld's: goal and action are said
      k += 1
