"""parse_action against a regex reference, bad inputs, and a 10,000-output fuzz into envs."""

import random
import re
import unicodedata

import pytest
from hypothesis import given, settings, strategies as st

from envs.toy import ToyEnv, toy_tasks
from salt_jax.agent.parsing import ParsedAction, is_admissible, normalize_action, parse_action


def _reference(text, admissible=None, max_chars=200):
  """Independent reference: the last regex match of a tag pair with no opening tag inside."""
  low = text.lower()
  matches = list(re.finditer(r"<action>((?:(?!<action>).)*?)</action>", low, re.DOTALL))
  if not matches:
    return ParsedAction("", False, "missing_tags")
  raw = matches[-1].group(1)
  raw = "".join(" " if (ord(c) < 32 or 127 <= ord(c) < 160) else c for c in raw
                if not 0xD800 <= ord(c) <= 0xDFFF)
  action = " ".join(raw.split())
  if not action:
    return ParsedAction("", False, "empty")
  if len(action) > max_chars:
    return ParsedAction(action[:max_chars].strip(), False, "too_long")
  if admissible is not None and action not in {" ".join(a.lower().split()) for a in admissible}:
    return ParsedAction(action, False, "not_admissible")
  return ParsedAction(action, True, "ok")


CASES = [
    ("<think>x</think><action>go to kitchen</action>", "go to kitchen", "ok"),
    ("<action>  Go   TO\n\tKitchen </action>", "go to kitchen", "ok"),
    ("<ACTION>look</Action>", "look", "ok"),
    ("<action>look</action> then <action>take key</action>", "take key", "ok"),
    ("<action>look</action><action>take key", "look", "ok"),  # last one unclosed
    ("<action><action>look</action></action>", "look", "ok"),  # nested
    ("</action><action>look", "", "missing_tags"),
    ("<think>I should <action> later</think>", "", "missing_tags"),
    ("no tags at all", "", "missing_tags"),
    ("", "", "missing_tags"),
    ("<action>   </action>", "", "empty"),
    ("<action>\x00\x01</action>", "", "empty"),
    ("<action>dance</action>", "dance", "not_admissible"),
    ("<action>look<|im_end|></action>", "look<|im_end|>", "not_admissible"),
    ("<action>İnventory</action>", "i\u0307nventory", "not_admissible"),
    ("<action>" + "a" * 500 + "</action>", "a" * 200, "too_long"),
]
ADMISSIBLE = ["go to kitchen", "look", "take key", "Inventory"]


@pytest.mark.parametrize("text,action,reason", CASES)
def test_cases(text, action, reason):
  got = parse_action(text, ADMISSIBLE)
  assert got == ParsedAction(action, reason == "ok", reason)
  assert got == _reference(text, ADMISSIBLE)


def test_without_admissible_any_nonempty_action_is_valid():
  assert parse_action("<action>dance</action>") == ParsedAction("dance", True, "ok")
  assert parse_action("<action>dance</action>", []).reason == "not_admissible"


def test_admissible_are_normalized():
  assert parse_action("<action>go to kitchen</action>", ["  GO to\tkitchen "]).valid


def test_templates_admit_any_filled_argument():
  adm = ["search[<your query>]", "click[buy now]"]
  assert parse_action("<action>Search[Red  Shoes]</action>", adm) == ParsedAction(
      "search[red shoes]", True, "ok")
  assert parse_action("<action>search[ ]</action>", adm).valid  # WebShop searches for any text
  for bad in ("search[]", "search", "searching[x]", "search[x", "click[sell]"):
    assert parse_action(f"<action>{bad}</action>", adm).reason == "not_admissible", bad
  assert is_admissible("click[buy now]", adm) and not is_admissible("click[buy now]", [])
  assert not is_admissible("search[x]", ["search[x]y"])  # not a template: only itself


def test_normalize_action():
  assert normalize_action(" A\u00a0b\x7f\nC\ud800 ") == "a b c"
  cc = "".join(chr(c) for c in range(0x110000) if unicodedata.category(chr(c)) == "Cc")
  assert normalize_action("x" + cc + "y") == "x y"  # every control character, no other


def test_bad_inputs():
  with pytest.raises(TypeError, match="str"):
    parse_action(None)
  with pytest.raises(TypeError, match="str"):
    parse_action(b"<action>look</action>")
  with pytest.raises(ValueError, match="max_action_chars"):
    parse_action("<action>look</action>", max_action_chars=0)


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=st.sampled_from(list("<>/actionACTIO \n\tx\u0130\x00é")), max_size=60),
       st.lists(st.sampled_from(["look", "x", "action", "a c"]), max_size=3))
def test_matches_reference_on_tag_soup(text, admissible):
  assert parse_action(text, admissible) == _reference(text, admissible)


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=300))
def test_properties_on_any_text(text):
  got = parse_action(text)
  assert got == _reference(text)
  assert got.action == normalize_action(got.action)
  assert got.valid == (got.reason == "ok")


def fuzz_outputs(n: int, admissible=("look", "go to kitchen"), seed: int = 0):
  """n model outputs of every kind a model writes: empty, huge, random bytes, special tokens,
  nested / repeated / unclosed tags, unicode, newlines, and well-formed ones."""
  rng = random.Random(seed)
  specials = ["<|im_end|>", "<|im_start|>", "<|endoftext|>", "</s>", "<think>", "</think>"]
  pieces = ["<action>", "</action>", "<ACTION>", "</Action>", "<action", "action>", "\n", "\t",
            "   ", "go to", "kitchen", "look", "日本語", "🙂", "\u202e", "\x00", "İ", "ß"]
  def random_bytes(k):
    return bytes(rng.randrange(256) for _ in range(k)).decode("utf-8", errors="replace")
  kinds = [
      lambda: "",
      lambda: rng.choice("ab <>/\n") * 10_000,
      lambda: "<action>" + "x" * 10_000 + "</action>",
      lambda: random_bytes(rng.randrange(1, 400)),
      lambda: random_bytes(200).encode("utf-8", "surrogateescape").decode("utf-8",
                                                                          "surrogateescape"),
      lambda: "".join(rng.choice(pieces + specials) for _ in range(rng.randrange(1, 40))),
      lambda: "<action>" * rng.randrange(1, 5) + rng.choice(admissible) + "</action>" *
      rng.randrange(0, 5),
      lambda: f"<think>{random_bytes(50)}</think><action>{rng.choice(admissible)}</action>",
      lambda: f"<action>{rng.choice(admissible)}{rng.choice(specials)}</action>",
      lambda: "".join(chr(rng.randrange(0x20, 0x2FFFF)) for _ in range(rng.randrange(0, 100))),
      lambda: f"<action>{rng.choice(admissible).upper()}\n</action>" * rng.randrange(1, 4),
  ]
  return [kinds[i % len(kinds)]() for i in range(n)]


def test_fuzz_10k_outputs_through_parser_and_toy_env():
  outputs = fuzz_outputs(10_000)
  assert len(outputs) == 10_000
  env = ToyEnv(max_steps=20)
  tasks = toy_tasks(4)
  out = env.reset(tasks[0])
  reasons = set()
  for i, text in enumerate(outputs):
    p = parse_action(text, out.admissible_actions)
    reasons.add(p.reason)
    out = env.step(p.action if i % 2 else text)  # the raw text too: any str is a legal action
    assert out.valid in (True, False) and isinstance(out.observation, str)
    if out.done:
      out = env.reset(tasks[i % 4], seed=i)
  assert reasons == {"ok", "missing_tags", "empty", "too_long", "not_admissible"}


def _alfworld_env():
  """One ALFWorld game, through the registry when it exists, else envs.alfworld; or skip."""
  pytest.importorskip("alfworld")
  try:
    from envs import registry  # pylint: disable=import-outside-toplevel
    task = registry.task_list("alfworld", "valid_unseen")[0]
    make = lambda **kw: registry.make_env("alfworld", **kw)  # noqa: E731
  except ImportError:
    alf = pytest.importorskip("envs.alfworld")
    task, make = alf.alfworld_tasks("valid_unseen")[0], alf.AlfWorldEnv
  try:  # a long horizon keeps the one game loaded for the whole fuzz
    return make(max_steps=1_000_000), task
  except Exception as e:  # pylint: disable=broad-except
    pytest.skip(f"ALFWorld env not available: {e}")


def _fuzz_alfworld(n: int):
  env, task = _alfworld_env()
  out = env.reset(task, seed=0)
  for i, text in enumerate(fuzz_outputs(n, seed=1)):
    if i % 10 == 9 and out.admissible_actions:  # some real moves, so the game state changes
      text = f"<action>{out.admissible_actions[i % len(out.admissible_actions)]}</action>"
    p = parse_action(text, out.admissible_actions)
    out = env.step(p.action if i % 2 else text)  # the raw text too: any str is a legal action
    assert isinstance(out.observation, str)
    if out.done:
      out = env.reset(task, seed=i)
  env.close()


def test_fuzz_300_outputs_into_alfworld():
  _fuzz_alfworld(300)


@pytest.mark.slow
def test_fuzz_10k_outputs_into_alfworld():
  _fuzz_alfworld(10_000)
