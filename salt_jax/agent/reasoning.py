"""Stand-in reasoning for demonstration responses: templated `<think>` text (host side, no jax).

An LLM writes different `<think>` text before the same action, so where SALT merges its steps the
members are different (prompt, response) samples and the averaged advantages change the gradient
(README, "When does SALT change learning?"). Demonstrations cloned as
`<think></think><action>X</action>` give a policy that writes one response per action and hides
this. A reasoner fills the `<think>` of a demonstration step instead:

  "none"       nothing: `<think></think>` (the demonstrations as they were);
  "templated"  one to three short sentences (about 8 to 30 words) drawn per step from several
               phrasings of the task goal, of what the last observation showed (its first sentence)
               and of the plan (the action): a stand-in for reasoning, not an LLM's.
  "subgoal"    the expert's sub-goal at that step and why the action serves it, from the task
               goal and the episode's actions so far (ALFWorld's six task types: find the object,
               take it, clean / heat / cool it, carry it to the target, light it with the lamp,
               the second of two), in one of several phrasings; a noisy expert's off-plan action
               is said for what it is (another object taken, the object put down elsewhere). A
               goal that is not ALFWorld's gets the goal and the action.

A reasoner is `fn(goal, observation, action, rng, previous) -> str` (goal: `task_goal` of the
episode's first observation, None when it has none; rng: a numpy Generator, seeded per demo and
step by the caller; previous: the episode's actions before this one), registered by name in
`REASONERS`. Its text never holds '<' or '>', so no tag can leak into the think and the parser
(`parsing.parse_action`) reads the action that follows.
"""

from __future__ import annotations

import re
from typing import Callable, NamedTuple, Optional, Sequence

import numpy as np

# A demonstration response: the think text, then the action in its tags.
REASONING_FORMAT = "<think>{think}</think><action>{action}</action>"

GOAL_PHRASES = (
    "My task is to {goal}.",
    "The goal is to {goal}.",
    "I need to {goal}.",
    "I have to {goal}.",
    "The task says: {goal}.",
    "Goal: {goal}.",
    "I am asked to {goal}.",
    "What I want is to {goal}.",
)
SEEN_PHRASES = (
    "I see: {seen}.",
    "The last observation says: {seen}.",
    "Now: {seen}.",
    "So far: {seen}.",
    "The observation shows: {seen}.",
    "Here: {seen}.",
    "What I saw: {seen}.",
    "Looking around: {seen}.",
)
PLAN_PHRASES = (
    "So I will {action}.",
    "The next step is to {action}.",
    "I should {action} now.",
    "Best action: {action}.",
    "That is why I choose to {action}.",
    "Then the right move is: {action}.",
    "I think {action} gets me closer.",
    "Plan: {action}, then see what happens.",
)

_GOAL = re.compile(r"your task is to:?\s*(.*?)(?:\.(?:\s|$)|\n|$)", re.IGNORECASE | re.DOTALL)
_BANNER = re.compile(r"-=.*?=-")


def _clean(text: str) -> str:
  """No angle brackets (so no tag), whitespace collapsed, end punctuation stripped."""
  return " ".join(text.replace("<", " ").replace(">", " ").split()).strip(" .")


def task_goal(first_observation: str) -> Optional[str]:
  """The goal an episode's first observation states after "Your task is to:" (the toy env's and
  ALFWorld's intro), up to the sentence's end; None when there is none."""
  m = _GOAL.search(first_observation)
  goal = _clean(m.group(1)) if m else ""
  return goal or None


def shorten(observation: str, max_words: int = 10) -> str:
  """The observation's first sentence (at most `max_words` words), without the task sentence and
  banners: "You are in the hall", "You arrive at countertop 1"."""
  text = _BANNER.sub(" ", _GOAL.sub(" ", observation)).strip()
  first = re.split(r"(?<=[.!?])\s", text, maxsplit=1)[0]
  return _clean(" ".join(first.split()[:max_words]))


def no_reasoning(goal: Optional[str], observation: str, action: str,
                 rng: np.random.Generator, previous: Sequence[str] = ()) -> str:
  """An empty think: the demonstrations as `<think></think><action>X</action>`."""
  del goal, observation, action, rng, previous
  return ""


def templated_reasoning(goal: Optional[str], observation: str, action: str,
                        rng: np.random.Generator, previous: Sequence[str] = ()) -> str:
  """One to three short sentences: the goal and/or what was seen (each phrasing drawn), then (or
  first) the plan. Each of goal-only, seen-only and both is drawn with chance 1/3 (seen-only when
  there is no goal), the plan first with chance 1/4."""
  del previous
  seen, goal = shorten(observation), goal and _clean(goal)
  parts = []
  context = int(rng.integers(3)) if goal else 1  # 0: goal, 1: seen, 2: both
  if context in (0, 2):
    parts.append(GOAL_PHRASES[rng.integers(len(GOAL_PHRASES))].format(goal=goal))
  if context in (1, 2) and seen:
    parts.append(SEEN_PHRASES[rng.integers(len(SEEN_PHRASES))].format(seen=seen))
  plan = PLAN_PHRASES[rng.integers(len(PLAN_PHRASES))].format(action=_clean(action))
  parts.insert(0 if rng.random() < 0.25 else len(parts), plan)
  return " ".join(parts)


class AlfworldGoal(NamedTuple):
  """An ALFWorld task goal: the object to handle, what to do to it first (clean / heat / cool,
  or None), where it goes (the target receptacle, or the lamp to look at it under), how many."""

  obj: str
  treat: Optional[str]
  target: str
  count: int = 1
  lamp: bool = False


# ALFWorld's goal sentences (alfworld's task-description templates), most specific first.
_ALFWORLD_GOALS = (
    (re.compile(r"(clean|heat|cool) (?:some|a|an|the) (\w+) and put it (?:in|on|into|onto) "
                r"(?:the |a )?(\w+)"), lambda m: AlfworldGoal(m[2], m[1], m[3])),
    (re.compile(r"put (?:a|an|some|the) (clean|hot|cool) (\w+) (?:in|on|into|onto) (?:the |a )?"
                r"(\w+)"), lambda m: AlfworldGoal(m[2], _TREAT_OF[m[1]], m[3])),
    (re.compile(r"(?:put|find) two (\w+) (?:and put them )?(?:in|on|into|onto) (?:the |a )?"
                r"(\w+)"), lambda m: AlfworldGoal(m[1], None, m[2], count=2)),
    (re.compile(r"put (?:a|an|some|the) (\w+) (?:in|on|into|onto) (?:the |a )?(\w+)"),
     lambda m: AlfworldGoal(m[1], None, m[2])),
    (re.compile(r"(?:examine|look at) (?:the |a |an |some )?(\w+) (?:with|under) (?:the |a )?"
                r"(\w+)"),
     lambda m: AlfworldGoal(m[1], None, m[2], lamp=True)),
)
_TREAT_OF = {"clean": "clean", "hot": "heat", "cool": "cool"}
# Where each treatment happens, and the word for an object after it.
_TREAT_PLACE = {"clean": "sinkbasin", "heat": "microwave", "cool": "fridge"}
_TREATED = {"clean": "clean", "heat": "hot", "cool": "cool"}


def alfworld_goal(goal: Optional[str]) -> Optional[AlfworldGoal]:
  """The ALFWorld goal `goal` states ("put a clean mug in coffeemachine", "examine the book with
  the desklamp"), or None when it is none of ALFWorld's task types."""
  text = " ".join((goal or "").lower().split())
  for pattern, make in _ALFWORLD_GOALS:
    m = pattern.search(text)
    if m:
      return make(m)
  return None


def _kind(name: str) -> str:
  """An object's or receptacle's kind: "apple 1" -> "apple"."""
  return re.sub(r"\s+\d+$", "", name.strip())


# ALFWorld's commands, read as (verb, object, place).
_COMMANDS = (
    (re.compile(r"^take (.+?) from (.+)$"), "take"),
    (re.compile(r"^(?:move|put) (.+?) (?:to|in|on|into|onto|in/on) (.+)$"), "put"),
    (re.compile(r"^(clean|heat|cool) (.+?) with (.+)$"), "treat"),
    (re.compile(r"^go to (.+)$"), "go"),
    (re.compile(r"^open (.+)$"), "open"),
    (re.compile(r"^close (.+)$"), "close"),
    (re.compile(r"^use (.+)$"), "use"),
    (re.compile(r"^examine (.+)$"), "examine"),
)


def _command(action: str) -> tuple[str, tuple]:
  """(verb, its arguments) of an ALFWorld command; ("other", (action,)) for any other text."""
  text = " ".join(action.lower().split())
  for pattern, verb in _COMMANDS:
    m = pattern.match(text)
    if m:
      return verb, m.groups()
  return "other", (text,)


class _Progress(NamedTuple):
  """Where an episode stands after its actions so far: the goal object held (its name, or
  None), whether it was treated, how many were placed at the target."""

  holding: Optional[str]
  treated: bool
  placed: int


def _progress(goal: AlfworldGoal, previous: Sequence[str]) -> _Progress:
  holding, treated, placed = None, False, 0
  for a in previous:
    verb, args = _command(a)
    if verb == "take" and _kind(args[0]) == goal.obj:
      holding, treated = args[0], False
    elif verb == "put" and holding is not None and args[0] == holding:
      placed += int(_kind(args[1]) == goal.target)
      holding, treated = None, False
    elif verb == "treat" and holding is not None and args[1] == holding:
      treated = treated or args[0] == goal.treat
  return _Progress(holding, treated, placed)


def _say(rng: np.random.Generator, *phrasings: str, **fields) -> str:
  return phrasings[int(rng.integers(len(phrasings)))].format(**fields)


def subgoal_reasoning(goal: Optional[str], observation: str, action: str,
                      rng: np.random.Generator, previous: Sequence[str] = ()) -> str:
  """The expert's sub-goal at this step and what the action does for it (module docstring)."""
  del observation  # the sub-goal follows from the goal and the actions so far
  parsed = alfworld_goal(goal)
  act = _clean(action) or "wait"
  if parsed is None:
    return _say(rng, "My goal: {goal}. Next I {act}.", "To {goal}, I {act} now.",
                "I {act}, one step towards: {goal}.", goal=_clean(goal or "") or "finish the task",
                act=act)
  g = parsed
  done = _progress(g, previous)
  obj, target = g.obj, g.target
  needs_treat = g.treat is not None and not done.treated
  treated = f"{_TREATED[g.treat]} " if g.treat is not None else ""
  article = " an" if obj[:1] in "aeiou" else " a"
  which = (article if g.count == 1 else " the second" if done.placed >= 1 else " the first")
  verb, args = _command(action)
  f = dict(obj=obj, target=target, which=which, treated=treated, act=act)
  if verb == "go":
    place = _kind(args[0])
    f.update(place=args[0])
    if done.holding is None:
      return _say(rng, "I still need{which} {obj}. It may be at the {place}, so I go there.",
                  "No {obj} in hand yet; I search the {place} next.",
                  "Finding{which} {obj} comes first: I try the {place}.", **f)
    if g.lamp:
      return _say(rng, "I hold the {obj}; now I need the {target} to look at it. I try the "
                  "{place}.", "With the {obj} in hand I look for the {target}, maybe at the "
                  "{place}.", **f)
    if needs_treat and place == _TREAT_PLACE[g.treat]:
      f.update(how=g.treat)
      return _say(rng, "I have the {obj}, but it must be {treated}first: I take it to the {place}.",
                  "The {obj} is not {treated}yet, so I go to the {place} to {how} it.", **f)
    if needs_treat:
      f.update(tool=_TREAT_PLACE[g.treat])
      return _say(rng, "I carry the {obj} and still have to make it {treated}at a {tool}.",
                  "The {obj} must get to a {tool} first; I pass the {place}.", **f)
    if place == target:
      return _say(rng, "The {treated}{obj} is ready: I bring it to the {target}.",
                  "Now the {obj} goes to the {target}, so I walk there.",
                  "Next sub-goal: carry the {treated}{obj} to the {target}.", **f)
    return _say(rng, "I hold the {obj} and am on my way to the {target}.", **f)
  if verb == "open":
    f.update(place=args[0])
    if done.holding is None:
      return _say(rng, "{which_cap} {obj} may be inside the {place}; I open it to check.",
                  "I open the {place} to look for{which} {obj}.",
                  which_cap=which.strip().capitalize(), **f)
    return _say(rng, "I open the {place} so the {obj} can go in.", **f)
  if verb == "close":
    f.update(place=args[0])
    return _say(rng, "Nothing I need in the {place}; I close it and move on.",
                "I close the {place} again.", **f)
  if verb == "take":
    f.update(thing=args[0], place=args[1])
    if _kind(args[0]) == obj:
      return _say(rng, "Here is{which} {obj}: I pick up the {thing}.",
                  "Found{which} {obj} on the {place}, so I take it.",
                  "Sub-goal reached, the {obj} is here; I take the {thing}.", **f)
    return _say(rng, "The {thing} is not what the task needs, but I take it.", **f)
  if verb == "treat":
    f.update(how=args[0], thing=args[1], place=args[2])
    if g.treat == args[0] and _kind(args[1]) == obj:
      return _say(rng, "The task wants a {treated}{obj}: I {how} it with the {place}.",
                  "Now I make the {obj} {treated}using the {place}.", **f)
    return _say(rng, "I {how} the {thing} with the {place}.", **f)
  if verb == "put":
    f.update(thing=args[0], place=args[1])
    if _kind(args[0]) == obj and _kind(args[1]) == target:
      more = " One more to go." if g.count == 2 and done.placed == 0 else ""
      return _say(rng, "The {treated}{obj} belongs in the {target}: I put it there.{more}",
                  "Last step for this {obj}: it goes to the {target}.{more}", more=more, **f)
    return _say(rng, "I put the {thing} down at the {place}.", **f)
  if verb == "use":
    f.update(place=args[0])
    if g.lamp and done.holding is not None:
      return _say(rng, "With the {obj} in hand I switch on the {place} to examine it.",
                  "The {obj} is with me, so I use the {place} to look at it.", **f)
    return _say(rng, "I use the {place}.", **f)
  if verb == "examine":
    f.update(place=args[0])
    return _say(rng, "I examine the {place} to see what is there.",
                "A closer look at the {place} before going on.", **f)
  if act == "inventory":
    return _say(rng, "I check what I am carrying.", "First I see what I hold.", **f)
  if act == "look":
    return _say(rng, "I look around to see where I am and what is here.",
                "A look around first, to see where things stand.", **f)
  return _say(rng, "I {act} before going on.", "Next: {act}.", **f)


Reasoner = Callable[..., str]  # fn(goal, observation, action, rng, previous) -> str
REASONERS: dict[str, Reasoner] = {"none": no_reasoning, "templated": templated_reasoning,
                                  "subgoal": subgoal_reasoning}


def reasoner(name: Optional[str]) -> Reasoner:
  """The reasoner registered as `name` (None: "none"); ValueError naming the known ones."""
  name = "none" if name is None else name
  if name not in REASONERS:
    raise ValueError(f"unknown reasoning {name!r}; known: {sorted(REASONERS)}")
  return REASONERS[name]
