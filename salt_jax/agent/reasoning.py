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

A reasoner is `fn(goal, observation, action, rng) -> str` (goal: `task_goal` of the episode's
first observation, None when it has none; rng: a numpy Generator, seeded per demo and step by the
caller), registered by name in `REASONERS`. Its text never holds '<' or '>', so no tag can leak
into the think and the parser (`parsing.parse_action`) reads the action that follows.
"""

from __future__ import annotations

import re
from typing import Callable, Optional

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
                 rng: np.random.Generator) -> str:
  """An empty think: the demonstrations as `<think></think><action>X</action>`."""
  del goal, observation, action, rng
  return ""


def templated_reasoning(goal: Optional[str], observation: str, action: str,
                        rng: np.random.Generator) -> str:
  """One to three short sentences: the goal and/or what was seen (each phrasing drawn), then (or
  first) the plan. Each of goal-only, seen-only and both is drawn with chance 1/3 (seen-only when
  there is no goal), the plan first with chance 1/4."""
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


Reasoner = Callable[[Optional[str], str, str, np.random.Generator], str]
REASONERS: dict[str, Reasoner] = {"none": no_reasoning, "templated": templated_reasoning}


def reasoner(name: Optional[str]) -> Reasoner:
  """The reasoner registered as `name` (None: "none"); ValueError naming the known ones."""
  name = "none" if name is None else name
  if name not in REASONERS:
    raise ValueError(f"unknown reasoning {name!r}; known: {sorted(REASONERS)}")
  return REASONERS[name]
