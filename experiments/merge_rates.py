"""How SALT's trajectory graph merges steps, on real games, without training a policy.

  python experiments/merge_rates.py --envs textworld --tasks 16    # about 30 s
  python experiments/merge_rates.py --envs alfworld --tasks 4      # game loads: about 15 min

Groups of G trajectories are played on real tasks by a scripted epsilon-expert: each step it
takes the environment's expert action with probability p and a uniformly random admissible action
otherwise. p stands in for a policy's competence (a trained agent's groups agree more as training
goes on). For every group the script builds SALT's merge ids with history h in 1..5 and reports:
  merge rate            merged insertions / all insertions (SALT's definition)
  cross-prompt merges   merged steps whose edge joins different whole-history prompts (the
                        merges that change the summed policy gradient)
Results: <out>/merge_rates.json (one run per environment adds or replaces that environment's
rows); `python experiments/study.py report` draws them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

DEFAULT_OUT = os.path.join(ROOT, "docs", "study", "merge-rates")
HISTORIES = (1, 2, 3, 4, 5)
GROUP_SIZES = (4, 8, 12, 16)
COMPETENCE = (0.25, 0.5, 0.75, 0.9)
ENV_SETTINGS = {
    "textworld": dict(kwargs=dict(quest_length=5, world_size=2, nb_objects=4), split="train",
                      max_steps=10),
    "alfworld": dict(kwargs={}, split="valid_train", max_steps=20),
}


def play_group(env, task, group_size: int, p_expert: float, rng: np.random.Generator,
               max_steps: int) -> tuple[list, list]:
  """G trajectories of the epsilon-expert on `task`: ([(action, observation)] each, won each)."""
  trajs, won = [], []
  for g in range(group_size):
    first = env.reset(task, seed=g)
    adm, steps, w = first.admissible_actions, [], False
    for _ in range(max_steps):
      expert = env.expert_action()
      choices = [a for a in (adm or ()) if a != "help"]
      if expert is not None and (rng.random() < p_expert or not choices):
        action = expert
      elif choices:
        action = choices[int(rng.integers(len(choices)))]
      else:
        break
      r = env.step(action)
      steps.append((action, r.observation))
      adm, w = r.admissible_actions, w or r.won
      if r.done:
        break
    trajs.append(steps)
    won.append(w)
  return trajs, won


def whole_history_prompt_ids(trajs: list) -> np.ndarray:
  """An id per step of its whole-history prompt (the task and every earlier pair)."""
  seen: dict = {}
  ids = []
  for traj in trajs:
    for t in range(len(traj)):
      ids.append(seen.setdefault(tuple(traj[:t]), len(seen)))
  return np.asarray(ids, np.int64)


def measure(env_name: str, num_tasks: int, seed: int) -> list[dict]:
  """Rows (env, p, G, h, merge_rate, cross_prompt_merges, steps, success) over `num_tasks` tasks."""
  # pylint: disable=import-outside-toplevel
  from envs.registry import make_expert_env, task_list
  from salt_jax import build_merge_ids, cross_prompt_merges
  st = ENV_SETTINGS[env_name]
  env = make_expert_env(env_name, max_steps=st["max_steps"], **st["kwargs"])
  tasks = task_list(env_name, st["split"], **st["kwargs"])[:num_tasks]
  rows = []
  try:
    for p in COMPETENCE:
      rng = np.random.default_rng(seed)
      # The largest group once per task; smaller groups are its first G trajectories.
      groups = [play_group(env, t, max(GROUP_SIZES), p, rng, st["max_steps"]) for t in tasks]
      for g in GROUP_SIZES:
        trajs = [tr for grp, _ in groups for tr in grp[:g]]
        gids = [i for i, (grp, _) in enumerate(groups) for _ in grp[:g]]
        prompts = np.concatenate([whole_history_prompt_ids(grp[:g]) * len(groups) + i
                                  for i, (grp, _) in enumerate(groups)])
        success = float(np.mean([w for _, won in groups for w in won[:g]]))
        for h in HISTORIES:
          merge = build_merge_ids(trajs, gids, history=h)
          rows.append(dict(env=env_name, p_expert=p, G=g, h=h, merge_rate=merge.merge_rate,
                           cross_prompt_merges=int(cross_prompt_merges(merge.ids, prompts)),
                           steps=merge.num_steps, success=success))
  finally:
    env.close()
  return rows


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--envs", nargs="+", default=list(ENV_SETTINGS), choices=list(ENV_SETTINGS))
  ap.add_argument("--tasks", type=int, default=16, help="tasks (groups) per setting")
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--out", default=DEFAULT_OUT)
  args = ap.parse_args(argv)
  if args.tasks < 1:
    raise SystemExit("error: --tasks must be >= 1")
  rows = []
  for e in args.envs:
    t0 = time.perf_counter()
    rows += measure(e, args.tasks, args.seed)
    print(f"[merge-rates] {e}: {args.tasks} tasks x {max(GROUP_SIZES)} trajectories x "
          f"{len(COMPETENCE)} competences in {time.perf_counter() - t0:.0f}s", flush=True)
  os.makedirs(args.out, exist_ok=True)
  path = os.path.join(args.out, "merge_rates.json")
  tasks = {e: args.tasks for e in args.envs}
  if os.path.exists(path):  # keep the other environments' rows from an earlier run
    with open(path, encoding="utf-8") as f:
      old = json.load(f)
    rows += [r for r in old["rows"] if r["env"] not in args.envs]
    tasks = {**{e: n for e, n in old["tasks"].items() if e not in args.envs}, **tasks}
  with open(path, "w", encoding="utf-8") as f:
    json.dump(dict(tasks=tasks, seed=args.seed, rows=rows), f, indent=1)
  for e in args.envs:
    print(f"\n{e}: merge rate (cross-prompt merges / steps) at G=8")
    print("p_expert " + " ".join(f"{'h=' + str(h):>14}" for h in HISTORIES))
    for p in COMPETENCE:
      cells = [r for r in rows if r["env"] == e and r["p_expert"] == p and r["G"] == 8]
      print(f"{p:8.2f} " + " ".join(
          f"{r['merge_rate']:6.3f} ({r['cross_prompt_merges'] / r['steps']:.2f})" for r in cells))
  print(f"\n-> {path}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
