"""Expert demonstrations: an environment's expert (or its optimal plan) played to the end.

Host side, no model: the behaviour-cloning warm start (`salt_jax.sft`) clones them, and a small
tokenizer fitted to an environment's words (`salt_jax.models.build`) learns from their texts.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

from envs.base import Task


@dataclasses.dataclass(frozen=True)
class Demo:
  """One expert episode: `steps[t] = (observation seen, admissible actions, action taken)`."""

  task: Task
  first_observation: str
  first_admissible: Optional[tuple[str, ...]]
  actions: tuple[str, ...]
  observations: tuple[str, ...]  # the env's reply to each action
  admissible: tuple[Optional[tuple[str, ...]], ...]  # admissible after each action
  won: bool


def play_expert(env, task: Task, seed: int = 0, max_steps: int = 50) -> Demo:
  """Plays `task` with the environment's expert (or `optimal_actions` where the env has one)."""
  first = env.reset(task, seed)
  plan = iter(env.optimal_actions(task)) if hasattr(env, "optimal_actions") else None
  actions, obs, adm, won = [], [], [], False
  for _ in range(max_steps):
    a = next(plan, None) if plan is not None else env.expert_action()
    if a is None:
      break
    r = env.step(a)
    actions.append(a)
    obs.append(r.observation)
    adm.append(r.admissible_actions)
    won = won or r.won
    if r.done:
      break
  return Demo(task, first.observation, first.admissible_actions, tuple(actions), tuple(obs),
              tuple(adm), won)


def collect_demos(env, tasks: Sequence[Task], seeds: Sequence[int] = (0,),
                  max_steps: int = 50, only_won: bool = True) -> list[Demo]:
  """Expert episodes for every (task, seed); the seed may change the prompt (listing order)."""
  demos = [play_expert(env, t, s, max_steps) for t in tasks for s in seeds]
  return [d for d in demos if d.won or not only_won]


def demo_texts(demos: Sequence[Demo]) -> list[str]:
  """Every observation and admissible-action list of the episodes (a tokenizer's corpus; the
  expert's actions are among the admissible ones)."""
  texts = []
  for d in demos:
    texts += [d.first_observation, " ".join(d.first_admissible or ()), *d.observations]
    texts += [" ".join(a or ()) for a in d.admissible]
  return texts
