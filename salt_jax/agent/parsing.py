"""Turning whatever the model wrote into one environment command.

The action is the text inside the last complete `<action>...</action>` pair: the last opening
tag that has a closing tag after it, up to the first closing tag after that opening. Tags match
case-insensitively. The text is lower-cased, control characters become spaces, whitespace is
collapsed and stripped. verl-agent's `alfworld_projection` does the same with the *first* tag pair;
the last pair is what a model that talks about tags while thinking means.

A step is invalid when the tags are missing, the action is empty or longer than
`max_action_chars`, or (given an admissible list) the action is not in it. An admissible entry
that is a template, `verb[<placeholder>]` (WebShop's `search[<your query>]`), admits every
`verb[text]` with non-empty text. Nothing here raises on any `str`: an unparseable output is an
invalid step, never an error.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Iterable, Optional

OPEN_TAG = "<action>"
CLOSE_TAG = "</action>"

# Reasons, in the order they are checked.
OK = "ok"
MISSING_TAGS = "missing_tags"
EMPTY = "empty"
TOO_LONG = "too_long"
NOT_ADMISSIBLE = "not_admissible"


@dataclasses.dataclass(frozen=True)
class ParsedAction:
  """action: the normalized command ("" when the tags are missing); valid: it may be played as a
  valid step; reason: one of "ok", "missing_tags", "empty", "too_long", "not_admissible"."""

  action: str
  valid: bool
  reason: str


# Control characters (Unicode category Cc: U+0000-001F, U+007F-009F) become spaces.
_CONTROL_TO_SPACE = {c: " " for c in [*range(0x20), *range(0x7F, 0xA0)]}
_SURROGATES = re.compile("[\ud800-\udfff]")
_TEMPLATE = re.compile(r"(.+)\[<[^\]]*>\]")  # "search[<your query>]": any search[...] is admissible


def normalize_action(text: str) -> str:
  """Lower-cases, turns control characters into spaces, drops surrogates, collapses whitespace.

  Lone surrogates (from surrogateescape decoding) are dropped: they cannot even be encoded to
  UTF-8, so an environment writing them to a log or a pipe would fail.
  """
  text = _SURROGATES.sub("", text.lower().translate(_CONTROL_TO_SPACE))
  return " ".join(text.split())


def parse_action(text: str, admissible: Optional[Iterable[str]] = None, *,
                 max_action_chars: int = 200) -> ParsedAction:
  """Extracts and checks the action of one model output.

  Args:
    text: the decoded model response (any string).
    admissible: the commands the environment accepts now, or None to skip that check. They are
      normalized like the action before comparing.
    max_action_chars: longer actions are invalid ("too_long") and cut to this length.
  Returns:
    ParsedAction(action, valid, reason).
  Raises:
    TypeError: `text` is not a str (a caller bug, not a model output).
  """
  if not isinstance(text, str):
    raise TypeError(f"text must be a str, got {type(text).__name__}")
  if max_action_chars < 1:
    raise ValueError(f"max_action_chars must be >= 1, got {max_action_chars}")
  low = text.lower()  # search the lowered text only: lower() may change lengths (e.g. "İ")
  close = low.rfind(CLOSE_TAG)
  if close < 0:
    return ParsedAction("", False, MISSING_TAGS)
  start = low.rfind(OPEN_TAG, 0, close)
  if start < 0:
    return ParsedAction("", False, MISSING_TAGS)
  start += len(OPEN_TAG)
  end = low.find(CLOSE_TAG, start)  # nested "<action><action>a</action></action>" gives "a"
  action = normalize_action(low[start:end])
  if not action:
    return ParsedAction("", False, EMPTY)
  if len(action) > max_action_chars:
    return ParsedAction(action[:max_action_chars].strip(), False, TOO_LONG)
  if admissible is not None and not is_admissible(action, admissible):
    return ParsedAction(action, False, NOT_ADMISSIBLE)
  return ParsedAction(action, True, OK)


def is_admissible(action: str, admissible: Iterable[str]) -> bool:
  """Whether the normalized `action` is one of `admissible` (normalized alike) or fills one of its
  `verb[<placeholder>]` templates with non-empty text (WebShop searches for any)."""
  for a in admissible:
    a = normalize_action(str(a))
    if action == a:
      return True
    m = _TEMPLATE.fullmatch(a)
    if (m and action.startswith(m.group(1) + "[") and action.endswith("]")
        and len(action) > len(m.group(1)) + 2):
      return True
  return False
