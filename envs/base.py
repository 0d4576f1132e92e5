"""The one interface every multi-turn text environment implements.

An environment instance plays one task at a time: `reset(task)` starts it and returns the first
observation (which states the goal), `step(action)` plays one action string. Everything is plain
Python data, so instances live in worker processes and results cross process boundaries by pickle.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any, Optional

NOTHING_HAPPENS = "Nothing happens."  # ALFWorld's (and these envs') answer to an unknown command
EPISODE_OVER = "The episode is over."  # the answer to any step after the episode ended
MAX_ACTION_CHARS = 512  # no game command is longer; longer strings skip normalization


def normalize_action(action: Any) -> str:
  """The command an action stands for: whitespace collapsed, lower-cased.

  Any object is accepted (bytes decoded with replacement, others `str()`-ed) and nothing raises,
  so junk model output can only ever become an unknown command. Over-long strings map to "".
  """
  try:
    if isinstance(action, (bytes, bytearray)):
      action = bytes(action).decode("utf-8", errors="replace")
    elif not isinstance(action, str):
      action = str(action)
  except Exception:  # pylint: disable=broad-except
    return ""  # an object whose __str__ raises is no command either
  if len(action) > MAX_ACTION_CHARS:
    return ""
  return " ".join(action.split()).lower()


class AdmissibleIndex:
  """The admissible commands of one state, matched case- and whitespace-insensitively.

  Games may list commands with capitals ("drop Advent Calendar") while agents' actions are
  lower-cased; `match` returns the game's own spelling, or None for anything else.
  """

  __slots__ = ("commands", "_by_key")

  def __init__(self, commands: tuple[str, ...] = ()):
    self.commands = tuple(commands)
    self._by_key = {}
    for c in self.commands:
      self._by_key.setdefault(normalize_action(c), c)

  def match(self, action: Any) -> Optional[str]:
    key = normalize_action(action)
    return self._by_key.get(key) if key else None


@dataclasses.dataclass(frozen=True)
class Task:
  """One playable task: `task_id` names it uniquely within its environment family."""

  task_id: str
  task_type: str = "default"
  split: str = "train"


@dataclasses.dataclass(frozen=True)
class EnvStep:
  """What the environment answers after `reset` (reward 0, done False) or after one `step`.

  observation: the text the agent sees next.
  reward: the reward of this step (outcome tasks: 1.0 on the winning step, else 0.0).
  done: the episode is over (won, lost or out of steps).
  won: the task was accomplished.
  admissible_actions: the commands the game accepts now, when the game lists them, else None.
  valid: False when the action was not understood / not admissible.
  score: a graded task's score of the episode in [0, 1], on the step that ends it (WebShop: the
    purchase's); None where the outcome is only won or not (the score is then `won`).
  """

  observation: str
  reward: float = 0.0
  done: bool = False
  won: bool = False
  admissible_actions: Optional[tuple[str, ...]] = None
  valid: bool = True
  score: Optional[float] = None


class TextEnv(abc.ABC):
  """A multi-turn text environment. Implementations never raise on a malformed action string:
  any `str` is a legal argument to `step` and an unknown command is an invalid step."""

  max_steps: int = 50

  @abc.abstractmethod
  def reset(self, task: Task, seed: int = 0) -> EnvStep:
    """Start `task`; the observation states the goal and the initial scene."""

  @abc.abstractmethod
  def step(self, action: str) -> EnvStep:
    """Play one action."""

  def expert_action(self) -> Optional[str]:
    """The next action of the environment's expert (demonstrations), or None once done.

    Environments without an expert raise NotImplementedError; ones with an optional expert raise
    RuntimeError when it was not enabled at construction.
    """
    raise NotImplementedError(f"{type(self).__name__} has no expert")

  def close(self) -> None:
    """Release resources (game engines, files)."""


class AdmissibleCommandEnv(TextEnv):
  """A game that lists its admissible commands; the step logic that such games share.

  A command that is not admissible is an invalid step that leaves the game untouched (the engine
  is never asked, which also spares its re-derivation of an unchanged state); a step after the
  episode ended is invalid and says so. Subclasses set `_state` and call `_set_admissible` and
  reset `_t`, `_done`, `_won` in `reset`, and implement `_play` for admissible commands.
  """

  def __init__(self):
    self._state = None  # the engine's last state; None before the first reset
    self._admissible = AdmissibleIndex()
    self._t = 0
    self._done = True
    self._won = False

  def _set_admissible(self, commands) -> None:
    self._admissible = AdmissibleIndex(tuple(commands))

  @abc.abstractmethod
  def _play(self, command: str) -> tuple[str, bool, bool]:
    """Plays an admissible command in the engine: (observation, won, lost)."""

  def _unknown_command_observation(self) -> str:
    """The answer to a command that is not admissible (ALFWorld's; WebShop re-shows its page)."""
    return NOTHING_HAPPENS

  def _after_play(self, command: str, observation: str) -> None:
    """Called after each valid step, once `_done` is updated (e.g. to advance an expert)."""

  def step(self, action: str) -> EnvStep:
    """Plays one action; a command that is not admissible is an invalid step."""
    if self._state is None:
      raise RuntimeError(f"{type(self).__name__}.step called before reset")
    if self._done:
      return EnvStep(observation=EPISODE_OVER, done=True, won=self._won, admissible_actions=(),
                     valid=False)
    command = self._admissible.match(action)
    self._t += 1
    if command is None:
      observation, won, lost = self._unknown_command_observation(), False, False
    else:
      observation, won, lost = self._play(command)
    self._won = won
    self._done = won or lost or self._t >= self.max_steps
    if command is not None:
      self._after_play(command, observation)
    return EnvStep(observation=observation, reward=1.0 if won else 0.0, done=self._done, won=won,
                   admissible_actions=self._admissible.commands, valid=command is not None)
