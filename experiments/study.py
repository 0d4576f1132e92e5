"""SALT's findings at CPU scale: one command per experiment; results and figures under docs/.

  python experiments/study.py headline     # GRPO, GRPO+SALT, RLOO, RLOO+SALT on TextWorld, 3 seeds
  python experiments/study.py history      # SALT's h in 1..5 (GRPO+SALT), against plain GRPO
  python experiments/study.py group-size   # G in 4, 8, 12, 16, SALT on and off
  python experiments/study.py matching     # exact merges against MiniLM embedding merges (0.8)
  python experiments/study.py alfworld     # the four headline methods on the bundled ALFWorld tasks
  python experiments/study.py report       # docs/*.png and docs/results.md from what has run

Every run of an experiment shares everything but the compared setting: the policy (a tiny Qwen2
over a BPE learned from the environment's words), its supervised warm start (cloned from the
games' walkthroughs once, shared by every run), the task order, the rollout seeds and the
hyperparameters. Runs go `--jobs` at a time, each in its own process pinned to one
core. A run whose metrics are complete is not run again, so an interrupted study resumes.

A run whose config equals a finished run of another experiment (the headline's GRPO-s0 is the
history ablation's GRPO-s0 and its h=3 run) is copied from it, marked by a `REUSED_FROM` file.

Results: `<out>/warmstart-<env>/` (the warm start and its evaluation, one per environment),
`<out>/<experiment>/runs/<run>/metrics.jsonl` (the trainer's), and
`<out>/<experiment>/summary.json`, one row per run: its setting, held-out success at the end
(greedy, `num_eval_tasks` games of each eval split), the training curve and the time per phase.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

DEFAULT_OUT = os.path.join(ROOT, "docs", "study")
EVAL_TASKS = 32  # held-out games scored at each evaluation (greedy)

# TextWorld: quest length 5 (the family's minimum), two rooms, at most 6 steps an episode (one
# spare step); about 800 to 1,300 tokens a trajectory with the whole history in the prompt.
# 16 training games (the warm start's), held-out games from another seed range.
TEXTWORLD = dict(
    env="textworld", env_kwargs=dict(quest_length=5, world_size=2, nb_objects=4),
    num_train_tasks=16, max_steps=6)
# ALFWorld: the first 16 valid_train tasks (the six types in turn), 12 tasks (2 a type) of
# valid_seen and of valid_unseen at each evaluation, at most 8 steps. The warm start clones the
# PDDL planner's plans (4 to 8 steps, all 16 won within 8): alfworld's handcoded expert explores
# and won only 3 of the 16 within 8 steps. Every turn lists the 20 to 50 admissible actions, so an
# 8-step whole-history conversation reaches about 3,200 tokens (hence the cache).
ALFWORLD = dict(env="alfworld", env_kwargs=dict(expert_type="planner"), num_train_tasks=16,
                max_steps=8, num_eval_tasks=12, max_cache_len=4096)

# What every run shares (TrainConfig fields).
# The policy is the trainer's default tiny Qwen2 (2 layers, d_model 64).
BASE = dict(
    tokenizer="toy", group_size=8, tasks_per_iter=4, max_new_tokens=24, max_cache_len=3072,
    prompt_bucket_min=256, temperature=1.0, algo="grpo", salt=True, salt_history=3, lr=2e-4,
    kl_coef=0.01, minibatch_rows=8, min_seq_len=256, env_workers=0, iters=8,
    num_eval_tasks=EVAL_TASKS, max_to_keep=1, tensorboard=False, progress=False)
# The warm start clones one walkthrough of each training game until it replays about half of
# them (greedy; 45% sampled), so groups have both outcomes and the RL has a signal. Cloned from 48
# walkthroughs in 150 steps instead, the tiny policy won no game at all, training or held-out.
SFT = dict(steps=300, demos=16, lr=6e-3)

METHODS = {  # headline: name -> overrides
    "GRPO": dict(algo="grpo", salt=False), "GRPO+SALT": dict(algo="grpo", salt=True),
    "RLOO": dict(algo="rloo", salt=False), "RLOO+SALT": dict(algo="rloo", salt=True)}


@dataclasses.dataclass(frozen=True)
class Run:
  """One training run of an experiment: its name, seed and TrainConfig overrides."""

  name: str
  seed: int
  overrides: dict
  labels: dict  # what the report groups by (method, h, G, matching)


def experiment_runs(name: str, seeds: list[int]) -> tuple[dict, list[Run]]:
  """(environment settings, runs) of experiment `name`."""
  if name in ("headline", "alfworld"):
    env = TEXTWORLD if name == "headline" else ALFWORLD
    return env, [Run(f"{m}-s{s}", s, o, {"method": m}) for s in seeds for m, o in METHODS.items()]
  if name == "history":
    runs = [Run(f"GRPO-s{s}", s, dict(algo="grpo", salt=False), {"method": "GRPO", "h": 0})
            for s in seeds]
    runs += [Run(f"SALT-h{h}-s{s}", s, dict(algo="grpo", salt=True, salt_history=h),
                 {"method": "GRPO+SALT", "h": h}) for s in seeds for h in (1, 2, 3, 4, 5)]
    return TEXTWORLD, runs
  if name == "group-size":
    # The same 48 trajectories per iteration for every G: fewer tasks with larger groups.
    runs = [Run(f"{'SALT' if salt else 'GRPO'}-G{g}-s{s}", s,
                dict(algo="grpo", salt=salt, group_size=g, tasks_per_iter=48 // g),
                {"method": "GRPO+SALT" if salt else "GRPO", "G": g})
            for s in seeds for g in (4, 8, 12, 16) for salt in (False, True)]
    return TEXTWORLD, runs
  if name == "matching":
    runs = [Run(f"{m}-s{s}", s, dict(algo="grpo", salt=True, embedder=e), {"matching": m})
            for s in seeds for m, e in (("exact", None), ("embedding", "minilm"))]
    return TEXTWORLD, runs
  raise SystemExit(f"error: unknown experiment {name!r}")


def _config(env: dict, run: Run, out: str, iters: int, sft_path: str | None):
  from salt_jax.config import TrainConfig  # pylint: disable=import-outside-toplevel
  fields = {**BASE, **env, **run.overrides, "seed": run.seed, "out": out, "iters": iters,
            "init_params": sft_path, "checkpoint_every": iters}
  fields["eval_every"] = max(1, iters // 2)
  return TrainConfig(**fields)


def _complete(out: str, iters: int) -> bool:
  path = os.path.join(out, "metrics.jsonl")
  if not os.path.exists(path):
    return False
  from salt_jax.metrics import read_jsonl  # pylint: disable=import-outside-toplevel
  rows = read_jsonl(path)  # a last line cut short by a kill is not a row
  return bool(rows) and rows[-1]["iteration"] == iters - 1


def warm_start_dir(env: dict, out_root: str) -> str:
  """Where an environment's warm start lives: one per environment, shared by its experiments."""
  return os.path.join(out_root, f"warmstart-{env['env']}")


def warm_start_and_eval(env: dict, out_root: str, seed: int = 0) -> str:
  """The behaviour-cloning warm start every run on `env` starts from, and its held-out success
  (greedy, the same games as the runs' evaluations) in `eval.json`: every learning curve starts
  there, at iteration 0. One warm start for all seeds and experiments keeps the CPU budget (and
  makes a run's config identical wherever it recurs, see `_reuse`); the seeds vary the RL (task
  order, sampling, mini-batch order)."""
  # pylint: disable=import-outside-toplevel
  from salt_jax.sft import SFT_SUBDIR, warm_start
  from salt_jax.train import Trainer
  out = warm_start_dir(env, out_root)
  path = os.path.join(out, SFT_SUBDIR)
  cfg = _config(env, Run("sft", seed, {}, {}), out, 1, None)
  if not os.path.isdir(path):
    path = warm_start(cfg, steps=SFT["steps"], num_demos=SFT["demos"], lr=SFT["lr"])
  evaluated = os.path.join(out, "eval.json")
  if not os.path.exists(evaluated):
    cfg = dataclasses.replace(cfg, init_params=path, out=os.path.join(out, "eval"))
    with Trainer(cfg) as t:
      t.setup()
      result = t.evaluate()
    with open(evaluated, "w", encoding="utf-8") as f:
      json.dump(result, f, indent=1)
  return path


def _config_key(fields: dict) -> str:
  """A run's config (`TrainConfig.to_json()`, as in its config.json) minus its output folder:
  equal keys train the very same run."""
  return json.dumps({k: v for k, v in fields.items() if k != "out"}, sort_keys=True)


def _reuse(cfg, out_root: str, iters: int) -> str | None:
  """A finished run of another experiment with `cfg`'s exact config (the headline's GRPO-s0 is
  the history ablation's GRPO-s0): its folder, else None. Training is deterministic for a config
  (tests/test_train.py), so rerunning it would only spend the CPU again."""
  key = _config_key(cfg.to_json())
  for exp in sorted(os.listdir(out_root)):
    runs = os.path.join(out_root, exp, "runs")
    if not os.path.isdir(runs):
      continue
    for name in sorted(os.listdir(runs)):
      folder = os.path.join(runs, name)
      path = os.path.join(folder, "config.json")
      if os.path.abspath(folder) == os.path.abspath(cfg.out) or not os.path.exists(path) \
          or os.path.exists(os.path.join(folder, REUSED)) or not _complete(folder, iters):
        continue
      with open(path, encoding="utf-8") as f:
        if _config_key(json.load(f)) == key:
          return folder
  return None


REUSED = "REUSED_FROM"  # in a run folder whose metrics were copied from an identical run


def _launch(args_json: str, core: int | None) -> subprocess.Popen:
  cmd = [sys.executable, os.path.abspath(__file__), "_run", args_json]
  if core is not None and hasattr(os, "sched_setaffinity"):
    cmd = ["taskset", "-c", str(core)] + cmd
  return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def check_runs(env: dict, runs: list[Run], root: str, iters: int, out_root: str) -> None:
  """SystemExit with one `error:` line for a bad --out or a run config that would fail
  (`TrainConfig.validate`: e.g. a negative --seeds), before the warm start."""
  from salt_jax.config import check_output_folder  # pylint: disable=import-outside-toplevel
  try:
    check_output_folder(out_root, "--out")
    for r in runs:
      _config(env, r, os.path.join(root, "runs", r.name), iters, None).validate()
  except ValueError as e:
    raise SystemExit(f"error: {e}") from None


def run_experiment(name: str, seeds: list[int], iters: int, jobs: int, out_root: str) -> str:
  """Runs every missing run of `name` (`jobs` at a time); writes and returns its summary.json."""
  env, runs = experiment_runs(name, seeds)
  root = os.path.join(out_root, name)
  check_runs(env, runs, root, iters, out_root)
  os.makedirs(root, exist_ok=True)
  t0 = time.perf_counter()
  sft = warm_start_and_eval(env, out_root)
  print(f"[study] {name}: warm start ready ({time.perf_counter() - t0:.0f}s)", flush=True)
  todo = []
  for r in runs:
    out = os.path.join(root, "runs", r.name)
    if _complete(out, iters):
      continue
    if os.path.isdir(out):  # an interrupted run: start it again from scratch
      from salt_jax import runlock  # pylint: disable=import-outside-toplevel
      if (who := runlock.holder(out)) is not None:  # not interrupted: another command trains it
        raise SystemExit(f"error: {runlock.in_use(out, who)}")
      shutil.rmtree(out)
    same = _reuse(_config(env, r, out, iters, sft), out_root, iters)
    if same is not None:
      os.makedirs(out)
      for f in ("config.json", "metrics.jsonl"):
        shutil.copy(os.path.join(same, f), out)
      with open(os.path.join(out, REUSED), "w", encoding="utf-8") as f:
        f.write(os.path.relpath(same, out_root) + "\n")
      print(f"[study] {r.name}: the same run as {os.path.relpath(same, out_root)}", flush=True)
      continue
    todo.append(json.dumps(dict(env=env, run=dataclasses.asdict(r), out=out, iters=iters,
                                sft=sft)))
  cores = list(range(jobs)) if jobs > 1 else [None]
  running: list[tuple[subprocess.Popen, str, float, int | None]] = []
  failed = []
  while todo or running:
    while todo and len(running) < jobs:
      busy = {c for _, _, _, c in running}
      core = next(c for c in cores if c not in busy)
      spec = todo.pop(0)
      running.append((_launch(spec, core), spec, time.perf_counter(), core))
    time.sleep(1.0)
    for item in list(running):
      proc, spec, start, _ = item
      if proc.poll() is None:
        continue
      running.remove(item)
      log = proc.stdout.read()
      rn = json.loads(spec)["run"]["name"]
      if proc.returncode != 0:
        failed.append(rn)
        print(f"[study] {rn} FAILED (exit {proc.returncode}):\n{log[-3000:]}", flush=True)
      else:
        print(f"[study] {rn} done in {time.perf_counter() - start:.0f}s "
              f"({len(todo)} to start, {len(running)} running)", flush=True)
        write_summary(name, runs, root, iters)
  if failed:
    raise SystemExit(f"error: {len(failed)} runs failed: {failed}")
  path = write_summary(name, runs, root, iters)
  print(f"[study] {name}: {len(runs)} runs in {time.perf_counter() - t0:.0f}s -> {path}",
        flush=True)
  return path


def _one_run(spec_json: str) -> int:
  """Child process: one training run."""
  spec = json.loads(spec_json)
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  from salt_jax.train import train  # pylint: disable=import-outside-toplevel
  cfg = _config(spec["env"], Run(**spec["run"]), spec["out"], spec["iters"], spec["sft"])
  cfg.validate()
  train(cfg)
  return 0


def trajectory_graph_figure(out_root: str, docs: str, seed: int = 0, group_size: int = 8,
                            task_index: int = 0) -> str:
  """docs/trajectory_graph.png: one group of the seed's warm-started policy on a training game.

  G trajectories sampled at temperature 1, GRPO advantages, SALT (h=3) merges and refinement,
  drawn with `salt_jax.viz.plot_trajectory_graph`.
  """
  # pylint: disable=import-outside-toplevel
  import jax
  import matplotlib
  matplotlib.use("Agg")
  import numpy as np

  import salt_jax
  from salt_jax.train import Trainer
  from salt_jax.viz import plot_trajectory_graph
  env, _ = experiment_runs("headline", [seed])
  sft = os.path.join(warm_start_dir(env, out_root), "sft_params")
  cfg = _config(env, Run("graph", seed, {}, {}), os.path.join(out_root, "graph-tmp"), 1,
                sft if os.path.isdir(sft) else None)
  with Trainer(cfg) as t:
    t.setup()
    task = t.task_sampler.tasks[task_index]
    batch = t.collect_rollout([task], jax.random.key(seed), seed=seed, group_size=group_size)
  trajs, groups = batch.trajectories_for_salt()
  adv = np.asarray(salt_jax.grpo_advantages(batch.outcome_rewards, np.asarray(groups), 1))
  before = adv[batch.step_traj_ids]
  merge = salt_jax.build_merge_ids(trajs, groups, history=3)
  after = np.asarray(salt_jax.refine(before, merge.ids, merge.num_segments))
  won = int(batch.success.sum())
  fig = plot_trajectory_graph(trajs, before, after, history=3, merge=merge,
                              valid=batch.step_valid, title=(
      f"one group on TextWorld game {task.task_id}: {group_size} trajectories of the warm-started "
      f"policy, {won} won; GRPO advantages before and after SALT (h=3)"))
  path = os.path.join(docs, "trajectory_graph.png")
  fig.savefig(path, dpi=120, bbox_inches="tight")
  return path


PHASES = ("rollout", "old_logprob", "ref_logprob", "advantage", "salt", "update")


def _episodes_per_iter(r: Run) -> int:
  fields = {**BASE, **r.overrides}
  return fields["group_size"] * fields["tasks_per_iter"]


def write_summary(name: str, runs: list[Run], root: str, iters: int) -> str:
  """summary.json: per finished run its labels, final held-out success, curves and phase times;
  the runs not finished yet are listed under "missing" (the study writes it after every run, so
  an interrupted study still reports what it has)."""
  from salt_jax.metrics import read_jsonl  # pylint: disable=import-outside-toplevel
  rows, missing = [], []
  env, _ = experiment_runs(name, [0])
  for r in runs:
    if not _complete(os.path.join(root, "runs", r.name), iters):
      missing.append(r.name)
      continue
    ms = read_jsonl(os.path.join(root, "runs", r.name, "metrics.jsonl"))
    evals = [(m["iteration"] + 1, _eval_success(m)) for m in ms if _eval_success(m) is not None]
    start = os.path.join(warm_start_dir(env, os.path.dirname(root)), "eval.json")
    if os.path.exists(start):
      with open(start, encoding="utf-8") as f:
        evals.insert(0, (0, _eval_success(json.load(f))))
    reused = os.path.join(root, "runs", r.name, REUSED)
    if os.path.exists(reused):
      with open(reused, encoding="utf-8") as f:
        same_as = f.read().strip()
    else:
      same_as = None
    last_eval = next((m for m in reversed(ms) if _eval_success(m) is not None), {})
    by_type = {k[len("eval/"):].replace("/success_rate", ""): v for k, v in last_eval.items()
               if k.startswith("eval/") and "/success_rate/" in k}
    rows.append(dict(
        run=r.name, seed=r.seed, **r.labels, same_as=same_as,
        eval_games=_eval_games(env, last_eval), heldout_by_type=by_type,
        episodes_per_iter=_episodes_per_iter(r),
        heldout_success=evals[-1][1] if evals else None, eval_curve=evals,
        train_success=[m["success_rate"] for m in ms],
        merge_rate=[m.get("merge_rate") for m in ms],
        cross_prompt_merges=[m.get("cross_prompt_merges", 0) for m in ms],
        adv_frac_changed=[m.get("adv_frac_changed") for m in ms],
        # groups whose G rewards were all equal: zero advantages, nothing to learn or refine
        flat_groups=[m.get("skipped_groups", 0) / {**BASE, **r.overrides}["tasks_per_iter"]
                     for m in ms],
        valid_action_ratio=[m["valid_action_ratio"] for m in ms],
        time={p: _mean([m.get(f"time/{p}") for m in ms]) for p in PHASES + ("iteration",)}))
  path = os.path.join(root, "summary.json")
  games = max([r["eval_games"] for r in rows], default=_eval_games(env, {}))
  with open(path, "w", encoding="utf-8") as f:
    json.dump(dict(experiment=name, iters=iters, eval_tasks=games, base=BASE, sft=SFT,
                   runs=rows, missing=missing), f, indent=1)
  return path


def refresh_summaries(out_root: str) -> list[str]:
  """Rewrites every experiment's summary.json from its run folders (same seeds and iterations),
  so a report always reads what this version of `write_summary` records."""
  paths = []
  for name in ("headline", "history", "group-size", "matching", "alfworld"):
    path = os.path.join(out_root, name, "summary.json")
    if not os.path.exists(path):
      continue
    with open(path, encoding="utf-8") as f:
      s = json.load(f)
    seeds = sorted({row["seed"] for row in s["runs"]}
                   | {int(m.rsplit("-s", 1)[1]) for m in s.get("missing", [])})
    _, runs = experiment_runs(name, seeds or [0])
    paths.append(write_summary(name, runs, os.path.join(out_root, name), s["iters"]))
  return paths


def _eval_split_keys(m: dict) -> list[str]:
  """The metrics row's overall success keys, one per eval split (`eval/<split>/success_rate`)."""
  return [k for k in m if k.startswith("eval/") and k.endswith("/success_rate")
          and k.count("/") == 2]


def _eval_games(env: dict, m: dict) -> int:
  """Games behind one held-out success figure: the eval tasks of each split that `m` scored
  (the figure is the mean over splits; one split when `m` has none)."""
  return {**BASE, **env}["num_eval_tasks"] * max(1, len(_eval_split_keys(m)))


def _eval_success(m: dict):
  keys = _eval_split_keys(m)
  return _mean([m[k] for k in keys]) if keys else None


def _mean(xs):
  xs = [x for x in xs if x is not None and not (isinstance(x, float) and math.isnan(x))]
  return sum(xs) / len(xs) if xs else None


def main(argv=None) -> int:
  argv = sys.argv[1:] if argv is None else argv
  if argv[:1] == ["_run"]:
    return _one_run(argv[1])
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("experiment", choices=("headline", "history", "group-size", "matching",
                                        "alfworld", "report"))
  p.add_argument("--seeds", type=int, nargs="+", default=None,
                 help="default: 0 1 2 (headline, alfworld), 0 (ablations)")
  p.add_argument("--iters", type=int, default=BASE["iters"])
  p.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1),
                 help="runs at once, each pinned to one core")
  p.add_argument("--out", default=DEFAULT_OUT)
  args = p.parse_args(argv)
  if args.experiment == "report":
    from study_report import docs_dir, report  # pylint: disable=import-outside-toplevel
    refresh_summaries(args.out)
    if os.path.isdir(warm_start_dir(TEXTWORLD, args.out)):
      trajectory_graph_figure(args.out, docs_dir(args.out))
    print(report(args.out))
    return 0
  if args.iters < 1 or args.jobs < 1:
    raise SystemExit("error: --iters and --jobs must be >= 1")
  seeds = args.seeds if args.seeds is not None else (
      [0, 1, 2] if args.experiment in ("headline", "alfworld") else [0])
  run_experiment(args.experiment, seeds, args.iters, args.jobs, args.out)
  return 0


if __name__ == "__main__":
  sys.exit(main())
