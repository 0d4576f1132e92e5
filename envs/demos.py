"""Expert demonstrations: an environment's expert (or its optimal plan) played to the end.

Host side, no model: the behaviour-cloning warm start (`salt_jax.sft`) clones them, and a small
tokenizer fitted to an environment's words (`salt_jax.models.build`) learns from their texts.
"""

from __future__ import annotations

import dataclasses
import zlib
from typing import Optional, Sequence

import numpy as np

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


def play_expert(env, task: Task, seed: int = 0, max_steps: int = 50, *, epsilon: float = 0.0,
                rng: Optional[np.random.Generator] = None) -> Demo:
  """Plays `task` with the environment's expert (or `optimal_actions` where the env has one).

  epsilon: the chance, at each step, of a uniformly drawn admissible action in place of the
    expert's (a noisy expert; the expert then replans from where that led, so the env needs
    `expert_action()`). Cloning such episodes gives a weaker warm start, one that knows the format
    and the admissible actions of each state but picks the right one only part of the time: room
    for RL to raise success. rng draws the deviations (default: seeded by `seed` and the task id).
  """
  if not 0.0 <= epsilon <= 1.0:
    raise ValueError(f"epsilon must be in [0, 1], got {epsilon}")
  if epsilon > 0 and not hasattr(env, "expert_action"):
    raise ValueError("epsilon > 0 needs an env with expert_action() (the expert replans)")
  if rng is None:
    rng = np.random.default_rng([int(seed), zlib.crc32(task.task_id.encode("utf-8"))])
  first = env.reset(task, seed)
  plan = (iter(env.optimal_actions(task))
          if epsilon == 0 and hasattr(env, "optimal_actions") else None)
  actions, obs, adm, won = [], [], [], False
  admissible = first.admissible_actions
  for _ in range(max_steps):
    if epsilon > 0 and admissible and rng.random() < epsilon:
      a = admissible[int(rng.integers(len(admissible)))]
    else:
      a = next(plan, None) if plan is not None else env.expert_action()
    if a is None:
      break
    r = env.step(a)
    actions.append(a)
    obs.append(r.observation)
    adm.append(r.admissible_actions)
    admissible = r.admissible_actions
    won = won or r.won
    if r.done:
      break
  return Demo(task, first.observation, first.admissible_actions, tuple(actions), tuple(obs),
              tuple(adm), won)


def collect_demos(env, tasks: Sequence[Task], seeds: Sequence[int] = (0,),
                  max_steps: int = 50, only_won: bool = True, epsilon: float = 0.0) -> list[Demo]:
  """Expert episodes for every (task, seed); the seed may change the prompt (listing order) and
  draws a noisy expert's deviations (`epsilon`, see `play_expert`; keep only_won=False there, or
  the kept episodes are biased towards the lucky ones)."""
  demos = [play_expert(env, t, s, max_steps, epsilon=epsilon) for t in tasks for s in seeds]
  return [d for d in demos if d.won or not only_won]


def demo_texts(demos: Sequence[Demo]) -> list[str]:
  """Every observation and admissible-action list of the episodes (a tokenizer's corpus; the
  expert's actions are among the admissible ones)."""
  texts = []
  for d in demos:
    texts += [d.first_observation, " ".join(d.first_admissible or ()), *d.observations]
    texts += [" ".join(a or ()) for a in d.admissible]
  return texts
