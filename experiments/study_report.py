"""Figures and the results table of `experiments/study.py` (matplotlib PNGs and results.md).

  python experiments/study.py report            # everything that has run under docs/study

Statistics: a run's held-out success is the fraction of its held-out games (`num_eval_tasks` of
each eval split) won greedily at its last evaluation. Across seeds, a method's figure is the mean
with a 95% t-interval (mean +- t_{0.975, n-1} * sd / sqrt(n)); with one seed, a 95% Wilson
interval over its games.
"""

from __future__ import annotations

import glob
import json
import math
import os
import statistics

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PAPER_COST = {"rollout": 240.0, "update": 30.0, "advantage": 0.05, "salt": 0.15}
PAPER_ALFWORLD = {"GRPO": 81.8, "GRPO+SALT": 85.2, "RLOO": 79.2, "RLOO+SALT": 84.0}


def t_interval(values: list[float]) -> tuple[float, float, float]:
  """(mean, low, high): a 95% Student-t interval over `values` (mean +- t_{0.975, n-1} * sd /
  sqrt(n), scipy's t); NaN bounds for one value, all NaN for none."""
  from scipy import stats  # pylint: disable=import-outside-toplevel  (installed with jax)
  if not values:
    return (math.nan, math.nan, math.nan)
  m = statistics.fmean(values)
  if len(values) == 1:
    return (m, math.nan, math.nan)
  half = (stats.t.ppf(0.975, len(values) - 1) * statistics.stdev(values)
          / math.sqrt(len(values)))
  return (m, m - half, m + half)


def interval(values: list[float], n_games: int) -> tuple[float, float, float]:
  """(mean, low, high) of success rates: `t_interval` over seeds, or over one run's games a 95%
  Wilson interval (scipy's binomtest); clipped to [0, 1]."""
  from scipy import stats  # pylint: disable=import-outside-toplevel
  if len(values) == 1:
    n = max(n_games, 1)
    ci = stats.binomtest(round(values[0] * n), n).proportion_ci(0.95, method="wilson")
    return (values[0], max(0.0, ci.low), min(1.0, ci.high))
  m, lo, hi = t_interval(values)
  return (m, lo if math.isnan(lo) else max(0.0, lo),  # a rate stays in [0, 1]
          hi if math.isnan(hi) else min(1.0, hi))


def load(out: str, name: str):
  path = os.path.join(out, name, "summary.json")
  if not os.path.exists(path):
    return None
  with open(path, encoding="utf-8") as f:
    return json.load(f)


def _by(rows, key):
  """Rows grouped by the value of `key`, or by the values of a tuple of keys."""
  groups: dict = {}
  for r in rows:
    groups.setdefault(tuple(r[k] for k in key) if isinstance(key, tuple) else r[key],
                      []).append(r)
  return groups


def _nanmean_curves(curves):
  n = max(len(c) for c in curves)
  out = []
  for i in range(n):
    xs = [c[i] for c in curves if i < len(c) and c[i] is not None and not math.isnan(c[i])]
    out.append(statistics.fmean(xs) if xs else math.nan)
  return out


def _smooth(xs, k=5):
  out = []
  for i in range(len(xs)):
    w = [x for x in xs[max(0, i - k + 1):i + 1] if not math.isnan(x)]
    out.append(statistics.fmean(w) if w else math.nan)
  return out


def _pyplot():
  """matplotlib with the file-only backend (reports run headless)."""
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  return matplotlib, plt


def _save(fig, docs: str, name: str) -> str:
  fig.tight_layout()
  path = os.path.join(docs, name)
  fig.savefig(path, dpi=120)
  _pyplot()[1].close(fig)
  return path


def _errorbar(ax, xs, stats, **kw):
  """Means with their (low, high) intervals, as `interval` returns them."""
  return ax.errorbar(xs, [x[0] for x in stats], yerr=[[x[0] - x[1] for x in stats],
                                                      [x[2] - x[0] for x in stats]],
                     marker="o", capsize=4, **kw)


def headline_figures(s: dict, docs: str, tag: str) -> list[str]:
  _, plt = _pyplot()
  methods = _by(s["runs"], "method")
  fig, (a0, a1) = plt.subplots(1, 2, figsize=(12, 4.2))
  for m, rows in methods.items():
    at: dict = {}  # iteration -> held-out success of each seed evaluated there
    for r in rows:
      for it, v in r["eval_curve"]:
        at.setdefault(it, []).append(v)
    its = sorted(at)
    line, = a0.plot(its, [statistics.fmean(at[i]) for i in its], marker="o", label=m)
    a0.fill_between(its, [min(at[i]) for i in its], [max(at[i]) for i in its],
                    color=line.get_color(), alpha=0.15)
    tr = [_smooth(r["train_success"]) for r in rows]
    mean_tr = _nanmean_curves(tr)
    a1.plot(range(1, len(mean_tr) + 1), mean_tr, label=m, color=line.get_color())
    a1.fill_between(range(1, len(mean_tr) + 1),
                    [min(t[i] for t in tr) for i in range(len(mean_tr))],
                    [max(t[i] for t in tr) for i in range(len(mean_tr))],
                    color=line.get_color(), alpha=0.12)
  a0.set(xlabel="iteration", ylabel="held-out success (greedy)",
         title=f"held-out games, mean and seed range ({len(next(iter(methods.values())))} seeds)")
  a1.set(xlabel="iteration", ylabel="training success (5-iteration mean)",
         title="training rollouts (sampled)")
  a0.legend()
  path = _save(fig, docs, f"{tag}_curves.png")
  return [path]


def _success_stats(s: dict, rows: list[dict]) -> tuple[tuple, tuple]:
  """(held-out, training last third) success intervals of one setting's runs."""
  held = interval([r["heldout_success"] for r in rows], s["eval_tasks"])
  late = [_late_train_success(s, r) for r in rows]
  return held, interval([x for x, _ in late], late[0][1])


def _success_panel(ax, s: dict, xs: list, rows_at: dict, label: str, **kw):
  """Held-out (dashed) and training last-third (solid) success against a setting."""
  stats = [_success_stats(s, rows_at[x]) for x in xs]
  line = _errorbar(ax, xs, [late for _, late in stats], label=f"{label}: training, last third",
                   **kw)
  ax.plot(xs, [t[0][0] for t in stats], ls="--", marker="x", color=line[0].get_color(),
          label=f"{label}: held-out")


def history_figure(s: dict, docs: str) -> list[str]:
  _, plt = _pyplot()
  by_h = _by(s["runs"], "h")
  fig, (a0, a1, a2) = plt.subplots(1, 3, figsize=(16, 4.2))
  hs = sorted(h for h in by_h if h > 0)
  _success_panel(a0, s, hs, by_h, "GRPO+SALT")
  if 0 in by_h:
    held, late = _success_stats(s, by_h[0])
    a0.axhline(late[0], color="gray", ls="-", label="GRPO: training, last third")
    a0.axhspan(late[1], late[2], color="gray", alpha=0.12)
    a0.axhline(held[0], color="gray", ls="--", label="GRPO: held-out")
  a0.set(xlabel="SALT history h", ylabel="success", title="success against h", xticks=hs)
  a0.legend(fontsize=7)
  for h in hs:
    mr = _nanmean_curves([[x if x is not None else math.nan for x in r["merge_rate"]]
                          for r in by_h[h]])
    a1.plot(range(1, len(mr) + 1), mr, label=f"h={h}")
  a1.set(xlabel="iteration", ylabel="merge rate", title="merge rate per iteration")
  a1.legend()
  changed = [statistics.fmean(_mean_of(r, "adv_frac_changed") for r in by_h[h]) for h in hs]
  cross = [statistics.fmean(_mean_of(r, "cross_prompt_merges") for r in by_h[h]) for h in hs]
  a2.bar([h - 0.2 for h in hs], changed, width=0.4, label="advantages changed (share)")
  a2.set(xlabel="SALT history h", ylabel="share of steps", xticks=hs,
         title="what SALT changed (mean per iteration)")
  a2b = a2.twinx()
  a2b.bar([h + 0.2 for h in hs], cross, width=0.4, color="tab:orange",
          label="merges across different prompts")
  a2b.set_ylabel("cross-prompt merges per iteration")
  a2.set_ylim(0, 1.35 * max(changed + [1e-3]))  # headroom for the legends
  a2b.set_ylim(0, 1.35 * max(cross + [1e-3]))
  a2.legend(loc="upper left", fontsize=7)
  a2b.legend(loc="upper right", fontsize=7)
  path = _save(fig, docs, "history_ablation.png")
  return [path]


def group_size_figure(s: dict, docs: str) -> list[str]:
  _, plt = _pyplot()
  fig, (a0, a1) = plt.subplots(1, 2, figsize=(12, 4.2))
  for m, rows in _by(s["runs"], "method").items():
    by_g = _by(rows, "G")
    gs = sorted(by_g)
    _success_panel(a0, s, gs, by_g, m)
    if m == "GRPO+SALT":
      a1.plot(gs, [statistics.fmean(_mean_merge(r) for r in by_g[g]) for g in gs], marker="o",
              label="merge rate (of steps)")
      a1.plot(gs, [statistics.fmean(_mean_of(r, "adv_frac_changed") for r in by_g[g])
                   for g in gs], marker="s", label="advantages changed (of steps)")
    a1.plot(gs, [statistics.fmean(_mean_of(r, "flat_groups") for r in by_g[g]) for g in gs],
            marker="^", ls=":", label=f"{m}: groups with equal rewards (of groups)")
  a0.set(xlabel="group size G", ylabel="success",
         title="group size (48 trajectories an iteration)")
  a0.legend(fontsize=7)
  a1.set(xlabel="group size G", ylabel="share", title="SALT and the signal against G")
  a1.legend(fontsize=7)
  path = _save(fig, docs, "group_size_ablation.png")
  return [path]


def matching_figure(s: dict, docs: str) -> list[str]:
  _, plt = _pyplot()
  fig, ax = plt.subplots(figsize=(6, 4))
  for m, rows in _by(s["runs"], "matching").items():
    mr = _nanmean_curves([[x if x is not None else math.nan for x in r["merge_rate"]]
                          for r in rows])
    ax.plot(range(1, len(mr) + 1), mr, label=m)
  ax.set(xlabel="iteration", ylabel="merge rate", title="exact against embedding matching")
  ax.legend()
  path = _save(fig, docs, "matching_merge_rate.png")
  return [path]


def cost_figure(s: dict, docs: str) -> tuple[list[str], dict]:
  matplotlib, plt = _pyplot()
  phases = ("rollout", "old_logprob", "ref_logprob", "advantage", "salt", "update")
  salt_rows = [r for r in s["runs"] if "SALT" in r.get("method", "")]
  ours = {p: statistics.fmean(r["time"][p] or 0.0 for r in salt_rows) for p in phases}
  fig, ax = plt.subplots(figsize=(8, 3.2))
  for row, (name, t) in enumerate((("salt-jax (CPU, this study)", ours),
                                   ("paper (ALFWorld, Qwen2.5-1.5B)", PAPER_COST))):
    total, left = sum(t.get(p, 0.0) for p in phases), 0.0
    for p in phases:
      w = t.get(p, 0.0) / total
      ax.barh(row, w, left=left, label=p if row == 0 else None,
              color=matplotlib.colormaps["tab10"](phases.index(p)))
      left += w
    ax.text(1.01, row, f"SALT {100 * t.get('salt', 0) / total:.2f}% ({t.get('salt', 0):.3f} s)",
            va="center", fontsize=8)
  ax.set_yticks([0, 1], ["salt-jax (this study)", "paper"])
  ax.set_xlim(0, 1.35)
  ax.set_xlabel("share of an iteration")
  ax.legend(ncol=6, fontsize=7, loc="upper center", bbox_to_anchor=(0.4, 1.25))
  path = _save(fig, docs, "cost_breakdown.png")
  return [path], ours


def merge_rate_figure(mr: dict, docs: str) -> tuple[list[str], str]:
  """merge_rates.png and a markdown table from experiments/merge_rates.py's results."""
  matplotlib, plt = _pyplot()
  rows = mr["rows"]
  envs = sorted({r["env"] for r in rows}, reverse=True)
  ps = sorted({r["p_expert"] for r in rows})
  hs = sorted({r["h"] for r in rows})
  gs = sorted({r["G"] for r in rows})
  pick = lambda **kw: [r for r in rows if all(r[k] == v for k, v in kw.items())]  # noqa: E731
  fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
  styles = {e: ls for e, ls in zip(envs, ("-", "--", ":"))}
  cmap = matplotlib.colormaps["viridis"]
  for e in envs:
    for i, p in enumerate(ps):
      color = cmap(i / max(len(ps) - 1, 1))
      cells = sorted(pick(env=e, p_expert=p, G=8), key=lambda r: r["h"])
      axes[0].plot(hs, [r["merge_rate"] for r in cells], styles[e], marker="o", color=color,
                   label=f"{e}, p={p}")
      axes[2].plot(hs, [r["cross_prompt_merges"] / max(r["steps"], 1) for r in cells], styles[e],
                   marker="o", color=color)
      cells = sorted(pick(env=e, p_expert=p, h=3), key=lambda r: r["G"])
      axes[1].plot(gs, [r["merge_rate"] for r in cells], styles[e], marker="o", color=color)
  axes[0].set(xlabel="SALT history h", ylabel="merge rate", title="merge rate against h (G=8)",
              xticks=hs)
  axes[1].set(xlabel="group size G", ylabel="merge rate", title="merge rate against G (h=3)",
              xticks=gs)
  axes[2].set(xlabel="SALT history h", ylabel="share of steps",
              title="merges joining different whole-history prompts (G=8)", xticks=hs)
  axes[0].legend(fontsize=7)
  path = _save(fig, docs, "merge_rates.png")
  lines = ["| env | p (expert) | success | " + " | ".join(f"h={h}" for h in hs) + " |",
           "|---" * (len(hs) + 3) + "|"]
  for e in envs:
    for p in ps:
      cells = sorted(pick(env=e, p_expert=p, G=8), key=lambda r: r["h"])
      lines.append(f"| {e} | {p} | {100 * cells[0]['success']:.0f}% | " + " | ".join(
          f"{r['merge_rate']:.2f} ({r['cross_prompt_merges'] / max(r['steps'], 1):.2f})"
          for r in cells) + " |")
  return [path], "\n".join(lines)


def _mean_of(r: dict, key: str) -> float:
  """Mean over iterations of a summary row's per-iteration `key` (NaN and None skipped)."""
  xs = [x for x in r.get(key) or [] if x is not None and not math.isnan(x)]
  return statistics.fmean(xs) if xs else math.nan


def _mean_merge(r):
  return _mean_of(r, "merge_rate")


def _pct(x):
  return "n/a" if x is None or math.isnan(x) else f"{100 * x:.1f}"


def _late_train_success(s: dict, r: dict) -> tuple[float, int]:
  """(mean training success over the last third of a run's iterations, episodes it counts)."""
  xs = r["train_success"][-max(1, len(r["train_success"]) // 3):]
  base = s.get("base", {})
  per_iter = r.get("episodes_per_iter", base.get("group_size", 1) * base.get("tasks_per_iter", 1))
  return statistics.fmean(xs), per_iter * len(xs)


def table(s: dict, key) -> str:
  """One row per value of `key` (a label, or a tuple of labels such as ("method", "G"))."""
  head = ", ".join(key) if isinstance(key, tuple) else key
  lines = [f"| {head} | held-out success % (95% CI) | training success %, last third (95% CI) "
           "| runs | mean merge rate | advantages changed % | cross-prompt merges / iter "
           "| groups with equal rewards % | valid actions % |",
           "|---|---|---|---|---|---|---|---|---|"]
  for k, rows in _by(s["runs"], key).items():  # in the order the experiment lists its runs
    k = ", ".join(map(str, k)) if isinstance(k, tuple) else k
    (m, lo, hi), (tm, tlo, thi) = _success_stats(s, rows)
    mr = [_mean_merge(r) for r in rows]
    cpm = statistics.fmean(_mean_of(r, "cross_prompt_merges") for r in rows)
    changed = statistics.fmean(_mean_of(r, "adv_frac_changed") for r in rows)
    flat = statistics.fmean(_mean_of(r, "flat_groups") for r in rows)
    va = statistics.fmean(statistics.fmean(r["valid_action_ratio"]) for r in rows)
    mmr = statistics.fmean(mr)
    lines.append(f"| {k} | {_pct(m)} ({_pct(lo)} to {_pct(hi)}) | "
                 f"{_pct(tm)} ({_pct(tlo)} to {_pct(thi)}) | {len(rows)} | "
                 f"{'n/a' if math.isnan(mmr) else f'{mmr:.3f}'} | {_pct(changed)} | {cpm:.1f} | "
                 f"{_pct(flat)} | {100 * va:.1f} |")
  return "\n".join(lines)


def by_type_table(s: dict) -> str:
  """Final held-out success per eval split and task type, mean over a method's seeds."""
  cells = sorted({k for r in s["runs"] for k in r.get("heldout_by_type", {})})
  if len(cells) < 2:  # one split of one type: the overall table says it all
    return ""
  lines = ["| method | " + " | ".join(c.replace("/", ": ") for c in cells) + " |",
           "|---|" + "---|" * len(cells)]
  for m, rows in _by(s["runs"], "method").items():
    vals = [_mean_of({"x": [r.get("heldout_by_type", {}).get(c) for r in rows]}, "x")
            for c in cells]
    lines.append(f"| {m} | " + " | ".join(_pct(v) for v in vals) + " |")
  return "\n".join(lines)


# The four methods on the toy tasks (`experiments/learning_check.py` lines, one per run, in
# docs/study/<TOY_FOUR_METHODS>/runs.jsonl).
# The four methods per environment (`learning_check.py --env`): {env: (folder of runs.jsonl under
# the study's out, what the report calls the tasks, the figure's file)}.
FOUR_METHODS = {
    "toy": ("toy-four-methods", "the toy tasks", "toy_four_methods.png"),
    "textworld": ("textworld-four-methods", "TextWorld", "textworld_four_methods.png"),
    "alfworld": ("alfworld-four-methods", "the bundled ALFWorld tasks",
                 "alfworld_four_methods.png"),
}
TOY_FOUR_METHODS = FOUR_METHODS["toy"][0]
# The baselines beside GRPO (issue #42): GRPO, GiGPO and PPO with a critic, each with and without
# SALT (docs/study/<folder>/*.jsonl, one file per command): {env: (folder, title, figure)}. The
# toy tasks in the fast learning test's setting (a clone per seed); TextWorld in its four
# methods' setting (one warm start), whose GRPO runs may come from there (`baseline_runs`).
BASELINES = {
    "toy": ("toy-baselines", "GRPO, GiGPO and PPO with a critic on the toy tasks (the fast "
            "test's setting)", "toy_baselines.png"),
    "textworld": ("textworld-baselines", "GRPO, GiGPO and PPO with a critic on TextWorld (the "
                  "four methods' setting)", "textworld_baselines.png"),
    "alfworld": ("alfworld-baselines", "GRPO, GiGPO and PPO with a critic on ALFWorld (the four "
                 "methods' setting)", "alfworld_baselines.png"),
}

# Real pretrained models through the trainer (issue #41): {folder of *.jsonl learning-check runs
# under the study's out: (title, figure)}. The folder's cloning line (--iters 0, the measurement
# before RL that every run repeats) is not a run.
REAL_MODELS = {
    "smollm2-alfworld": ("SmolLM2-135M-Instruct on the bundled ALFWorld tasks, GRPO and GRPO+SALT "
                         "from its clone", "smollm2_alfworld.png"),
}


def _by_method(runs: list[dict]) -> dict[str, list[dict]]:
  """Learning-check runs grouped by method name ("GRPO", "GRPO+SALT", ...)."""
  out: dict = {}
  for r in runs:
    out.setdefault(r["algo"].upper() + ("+SALT" if r["salt"] else ""), []).append(r)
  return out


def _measurement(r: dict, it: int, on: str = "train") -> dict:
  """A learning-check run's measurement after `it` iterations: before RL, after its last
  iteration, or a `mid` measurement (keyed by int in a run, by str once read back from JSON);
  on="heldout": its held-out tasks' measurement then."""
  if on == "heldout":
    held = r["heldout"]
    return held[str(it)] if str(it) in held else held[it]
  if it == 0:
    return r["before"]
  if it == r["iters"]:
    return r["after"]
  return r["mid"][str(it)] if str(it) in r["mid"] else r["mid"][it]


def _measured(r: dict, it: int, on: str = "train") -> float:
  """The measured success of `_measurement(r, it, on)`."""
  return _measurement(r, it, on)["all"]


def _measured_after(r: dict, it: int) -> bool:
  """Whether a learning-check run was measured on its training tasks after `it` iterations."""
  return it in (0, r["iters"]) or str(it) in r["mid"] or it in r["mid"]


def _checkpoints(runs: list[dict]) -> list[int]:
  """Iteration counts after which every run was measured: 0, the shared `mid` ones, the last."""
  iters = {r["iters"] for r in runs}
  if len(iters) != 1:
    raise ValueError(f"runs of different lengths: {sorted(iters)}")
  common = set.intersection(*({int(k) for k in r["mid"]} for r in runs))
  return [0] + sorted(common - {0}) + [iters.pop()]


LATE_ITERS = 10  # the training rollouts' success is also compared over a run's last 10 iterations


def _late_curve(r: dict) -> float:
  """Mean training-rollout success over a run's last LATE_ITERS iterations."""
  return statistics.fmean(r["curve"][-LATE_ITERS:])


def _early_curve(r: dict) -> float:
  """Mean training-rollout success over a run's first LATE_ITERS iterations: how fast it learnt
  (where every method ends near 100%, the one place left for a difference)."""
  return statistics.fmean(r["curve"][:LATE_ITERS])


def _salt_base_pairs(runs: list[dict]) -> list[tuple[str, int, dict, dict]]:
  """[(algo, seed, SALT's run, its base's run)] in (algo, seed) order: runs paired by (algo,
  seed); a seed without both runs is left out, two runs of one (algo, salt, seed) are an error."""
  by: dict = {}
  for r in runs:
    key = (r["algo"], bool(r["salt"]), r["seed"])
    if key in by:
      raise ValueError(f"two runs of {key}")
    by[key] = r
  return [(algo, seed, r, by[algo, False, seed]) for (algo, salt, seed), r in sorted(by.items())
          if salt and (algo, False, seed) in by]


def paired_effects(runs: list[dict], it, on: str = "train") -> dict[str, list[tuple[int, float]]]:
  """{base method: [(seed, SALT's success minus its base's)]} after `it` iterations (the fixed
  measurement of the training tasks, or of the held-out ones with on="heldout"), or with
  `it="late"` / `it="early"` over the training rollouts of the last / first LATE_ITERS
  iterations; runs paired by (algo, seed); a seed without both runs is left out, two runs of one
  (algo, salt, seed) are an error."""
  curves = {"late": _late_curve, "early": _early_curve}
  value = curves[it] if it in curves else (lambda r: _measured(r, it, on))
  out: dict = {}
  for algo, seed, r, base in _salt_base_pairs(runs):
    out.setdefault(algo.upper(), []).append((seed, value(r) - value(base)))
  return out


def grpo_effects(runs: list[dict], it, on: str = "train") -> dict[str, list[tuple[int, float]]]:
  """{method: [(seed, its success minus GRPO's)]} for every method but GRPO and GRPO+SALT (whose
  difference is SALT's, above), measured as `paired_effects` measures; runs paired by seed with
  GRPO's run of the same seed (same warm start and first rollout); a seed without a GRPO run is
  left out, two runs of one method and seed are an error."""
  curves = {"late": _late_curve, "early": _early_curve}
  value = curves[it] if it in curves else (lambda r: _measured(r, it, on))
  by: dict = {}
  for r in runs:
    key = (r["algo"].upper() + ("+SALT" if r["salt"] else ""), r["seed"])
    if key in by:
      raise ValueError(f"two runs of {key}")
    by[key] = r
  out: dict = {}
  for (method, seed), r in sorted(by.items()):
    if method not in ("GRPO", "GRPO+SALT") and ("GRPO", seed) in by:
      out.setdefault(method, []).append((seed, value(r) - value(by["GRPO", seed])))
  return out


def _ci(stat, scale=100.0) -> str:
  m, lo, hi = stat
  if math.isnan(lo):
    return f"{scale * m:+.1f}"
  return f"{scale * m:+.1f} ({scale * lo:+.1f} to {scale * hi:+.1f})"


def _paired_cell(pairs: list) -> str:
  """Paired differences [(seed, d)] as "mean (95% t-interval); wins/ties/losses", in points."""
  d = [x for _, x in pairs]
  if not d:
    return "-"
  wins, losses = sum(x > 0 for x in d), sum(x < 0 for x in d)
  return f"{_ci(t_interval(d))}; {wins}/{len(d) - wins - losses}/{losses}"


def _has_heldout(runs: list[dict]) -> bool:
  """Whether every run also measured held-out tasks (`learning_check.py --heldout-tasks`)."""
  return bool(runs) and all(r.get("heldout") for r in runs)


def four_methods_tables(runs: list[dict]) -> str:
  """Success per method after each measured iteration count (mean and 95% t-interval over seeds;
  on the held-out tasks too where every run measured them), SALT's merges, and SALT minus its base
  per seed (paired) with its 95% t-interval."""
  if not runs:
    raise ValueError("no runs")
  its = _checkpoints(runs)
  methods = _by_method(runs)
  measures = [(i, "train") for i in its]
  if _has_heldout(runs):
    measures += [(i, "heldout") for i in its]
  head = {"train": "success after {} % (95% CI)", "heldout": "held-out success after {} %"}
  lines = ["| method | seeds | " + " | ".join(head[on].format(i) for i, on in measures)
           + " | valid steps %, last 5 | merged steps % | of merged: responses differ % "
             "| of merged: gradient changes % |",
           "|---|---|" + "---|" * (len(measures) + 4)]
  for m in sorted(methods, key=lambda k: (k.split("+")[0], "+" in k)):
    rows = methods[m]
    cells = []
    for i, on in measures:
      m_, lo, hi = t_interval([_measured(r, i, on) for r in rows])
      cells.append(f"{_pct(m_)}" + ("" if math.isnan(lo) or lo == hi  # one seed, or one clone
                                    else f" ({_pct(lo)} to {_pct(hi)})"))
    valid = statistics.fmean(statistics.fmean(r["valid"][-5:]) for r in rows)
    tot = {k: sum(sum(r["merges"][k]) for r in rows) for k in
           ("num_steps", "merged_steps", "response_differing_merges", "gradient_changing_merges")}
    merged = tot["merged_steps"]
    share = lambda k: _pct(tot[k] / merged if merged else math.nan)  # noqa: E731
    merges = (f"{_pct(merged / tot['num_steps'] if tot['num_steps'] else math.nan)} | "
              f"{share('response_differing_merges')} | {share('gradient_changing_merges')}"
              if any(r["salt"] for r in rows) else "- | - | -")  # merges are SALT's
    lines.append(f"| {m} | {len(rows)} | " + " | ".join(cells) + f" | {100 * valid:.1f} | "
                 + merges + " |")
  paired = [(i, on) for i, on in measures if i != 0] + [("early", "train"), ("late", "train")]
  name = {"train": "after {}", "heldout": "held-out after {}"}
  header = ["| comparison | seeds | " + " | ".join(name[on].format(i) for i, on in paired[:-2])
            + f" | training rollouts, first {LATE_ITERS} iterations"
            + f" | training rollouts, last {LATE_ITERS} iterations |",
            "|---|---|" + "---|" * len(paired)]
  lines += ["", "SALT minus its base, same seed, same warm start and first rollout (points; mean "
            "and 95% t-interval over seeds; wins / ties / losses):", "", *header]
  effects = {(i, on): paired_effects(runs, i, on) for i, on in paired}
  for algo in sorted(effects["late", "train"]):
    cells = [_paired_cell(effects[k][algo]) for k in paired]
    lines.append(f"| {algo}+SALT - {algo} | {len(effects['late', 'train'][algo])} | "
                 + " | ".join(cells)
                 + " |")
  against = {(i, on): grpo_effects(runs, i, on) for i, on in paired}
  if against["late", "train"]:
    lines += ["", "Each method minus GRPO, same seed, same warm start and first rollout (points; "
              "mean and 95% t-interval over seeds; wins / ties / losses):", "", *header]
    for method in sorted(against["late", "train"], key=lambda k: (k.split("+")[0], "+" in k)):
      cells = [_paired_cell(against[k][method]) for k in paired]
      lines.append(f"| {method} - GRPO | {len(against['late', 'train'][method])} | "
                   + " | ".join(cells) + " |")
  return "\n".join(lines)


def four_methods_figure(runs: list[dict], docs: str,
                        name: str = FOUR_METHODS["toy"][2]) -> list[str]:
  """Training rollouts' success per iteration (mean over seeds, 5-iteration mean) per method, and
  each seed's paired SALT-minus-base difference at the last measurement."""
  _, plt = _pyplot()
  fig, (a0, a1) = plt.subplots(1, 2, figsize=(12, 4.2))
  methods = _by_method(runs)
  for m in sorted(methods):
    curves = [_smooth(r["curve"]) for r in methods[m]]
    mean = _nanmean_curves(curves)
    a0.plot(range(1, len(mean) + 1), mean, label=f"{m} ({len(curves)} seeds)")
  a0.set(xlabel="iteration", ylabel="training success (5-iteration mean)",
         title="training rollouts (sampled), mean over seeds")
  a0.legend()
  last = _checkpoints(runs)[-1]
  effects = sorted(paired_effects(runs, last).items())
  for x, (algo, pairs) in enumerate(effects):
    d = [100 * v for _, v in pairs]
    a1.scatter([x] * len(d), d, alpha=0.6)
    m, lo, hi = t_interval(d)
    if not math.isnan(lo):
      a1.errorbar([x + 0.15], [m], yerr=[[m - lo], [hi - m]], marker="o", capsize=5, color="k")
    a1.set_xticks(list(range(x + 1)))
  a1.set_xticklabels([f"{a}+SALT - {a}" for a, _ in effects])
  a1.set_xlim(-0.5, len(effects) - 0.5)
  a1.axhline(0, color="grey", lw=0.8)
  a1.set(ylabel=f"success after {last} iterations, points", title="SALT minus its base, per seed")
  return [_save(fig, docs, name)]


# The h and G ablations: learning-check runs that differ from an environment's four methods' runs
# only in SALT's h or in G, compared after SWEEP_ITERS iterations (the four methods' runs measured
# there too supply h=3 and G=8). {env: {param: folder of the sweep's *.jsonl under the study's out}}.
SWEEPS = {"toy": {"h": "toy-history", "G": "toy-group-size"},
          "textworld": {"h": "textworld-history"}}
SWEEP_PARAMS = ("h", "G")
SWEEP_ITERS = 20


def _sweep_setting(r: dict) -> tuple:
  """(algo, salt, h, G) of a learning-check run: h None without SALT; TrainConfig's defaults
  where the run did not override them."""
  from salt_jax.config import TrainConfig  # pylint: disable=import-outside-toplevel  (no jax)
  over, default = r.get("overrides") or {}, TrainConfig()
  return (r["algo"], bool(r["salt"]),
          over.get("salt_history", default.salt_history) if r["salt"] else None,
          over.get("group_size", default.group_size))


def sweep_runs(runs: list[dict], iters: int = SWEEP_ITERS) -> dict[tuple, dict[int, dict]]:
  """{(algo, salt, h, G): {seed: run}} of the runs measured after `iters` iterations (others are
  left out). All must be measured with the same trajectories per task (`eval_group_size`, else
  their G); one setting and seed run twice must agree up to `iters` (then it is kept once)."""
  out: dict = {}
  measured_g = set()
  for r in runs:
    if not _measured_after(r, iters):
      continue
    key = _sweep_setting(r)
    measured_g.add(r.get("eval_group_size") or key[3])
    seen = out.setdefault(key, {}).get(r["seed"])
    if seen is not None and (_measured(seen, iters) != _measured(r, iters)
                             or seen["curve"][:iters] != r["curve"][:iters]):
      raise ValueError(f"two runs of {key}, seed {r['seed']} disagree within {iters} iterations")
    out[key][r["seed"]] = seen or r
  if len(measured_g) > 1:
    raise ValueError(f"runs measured with different group sizes {sorted(measured_g)}: "
                     "give the ablation --eval-group-size")
  return out


def _late_window(iters: int) -> str:
  """The iterations `_upto`'s "late" covers, as "first-last"."""
  return f"{max(1, iters - LATE_ITERS + 1)}-{iters}"


def _upto(r: dict, iters: int) -> dict:
  """What a run shows after `iters` iterations: measured success, the training rollouts' mean
  success over its last LATE_ITERS iterations, and SALT's merge totals over those `iters`."""
  merges = {k: sum(v[:iters]) for k, v in r["merges"].items()}
  return {"success": _measured(r, iters),
          "late": statistics.fmean(r["curve"][max(0, iters - LATE_ITERS):iters]), **merges}


def _merge_shares(ats: list[dict]) -> dict[str, float]:
  """SALT's merges over `_upto` summaries: "merged" (of steps), "gradient_changing" and
  "response_differing" (of merged steps); NaN where there is nothing to divide by."""
  tot = {k: sum(a[k] for a in ats) for k in (
      "num_steps", "merged_steps", "gradient_changing_merges", "response_differing_merges")}
  merged = tot["merged_steps"]
  return {"merged": merged / tot["num_steps"] if tot["num_steps"] else math.nan,
          "gradient_changing": tot["gradient_changing_merges"] / merged if merged else math.nan,
          "response_differing": tot["response_differing_merges"] / merged if merged else math.nan}


def sweep_rows(runs: list[dict], param: str, iters: int = SWEEP_ITERS) -> list[dict]:
  """One row per setting of the `param` ("h" or "G") sweep of GRPO: {"label", "value", "salt",
  "seeds", "success": t-interval, "paired" / "paired_late": (SALT minus GRPO at the same G and
  seed, success after `iters` / training rollouts' last LATE_ITERS) t-interval and per-seed list,
  "merged", "gradient_changing", "response_differing" shares}."""
  if param not in SWEEP_PARAMS:
    raise ValueError(f"param must be one of {SWEEP_PARAMS}, got {param!r}")
  by = {k: v for k, v in sweep_runs(runs, iters).items() if k[0] == "grpo"
        and (k[3] == 8 if param == "h" else k[2] in (None, 3))}
  rows = []
  for (algo, salt, h, g), seeds in sorted(by.items(), key=lambda kv: (
      kv[0][3], kv[0][1], kv[0][2] or 0)):
    at = {seed: _upto(r, iters) for seed, r in sorted(seeds.items())}
    base = by.get((algo, False, None, g), {})
    pairs = [(seed, at[seed], _upto(base[seed], iters)) for seed in at if salt and seed in base]
    shares = _merge_shares(list(at.values()))
    rows.append({
        "label": (f"GRPO+SALT, h={h}" if salt else "GRPO") + ("" if param == "h" else f", G={g}"),
        "value": h if param == "h" else g, "salt": salt, "seeds": sorted(at),
        "success": interval([a["success"] for a in at.values()],  # a rate: clipped to [0, 1]
                            _measurement(next(iter(seeds.values())), iters).get("trajectories", 0)),
        "paired": [(seed, a["success"] - b["success"]) for seed, a, b in pairs],
        "paired_late": [(seed, a["late"] - b["late"]) for seed, a, b in pairs],
        **shares, "merged": shares["merged"] if salt else math.nan})  # merges are SALT's
  return rows


def sweep_table(runs: list[dict], param: str, iters: int = SWEEP_ITERS) -> str:
  """The `param` sweep as markdown: success after `iters` iterations per setting and SALT minus
  GRPO per seed (paired), with 95% t-intervals, and SALT's merges."""
  rows = sweep_rows(runs, param, iters)
  if not rows:
    raise ValueError(f"no runs measured after {iters} iterations")
  lines = [f"| setting | seeds | success after {iters} % (95% CI) | SALT - GRPO after {iters}, "
           "points (95% CI; wins/ties/losses) | SALT - GRPO, training rollouts of iterations "
           f"{_late_window(iters)} | merged steps % | of merged: gradient "
           "changes % | of merged: responses differ % |", "|---|---|---|---|---|---|---|---|"]
  for row in rows:
    m, lo, hi = row["success"]
    ci = "" if math.isnan(lo) else f" ({_pct(lo)} to {_pct(hi)})"
    lines.append(f"| {row['label']} | {len(row['seeds'])} | {_pct(m)}{ci} | "
                 f"{_paired_cell(row['paired'])} | {_paired_cell(row['paired_late'])} | "
                 + " | ".join("-" if math.isnan(row[k]) else _pct(row[k]) for k in (
                     "merged", "gradient_changing", "response_differing")) + " |")
  return "\n".join(lines)


def sweep_figure(runs: list[dict], param: str, docs: str, iters: int = SWEEP_ITERS,
                 env: str = "toy") -> list[str]:
  """Success after `iters` against h or G (GRPO and GRPO+SALT, 95% t-intervals), SALT minus GRPO
  per seed, and SALT's merged and gradient-changing shares; saved as `env`'s sweep folder name."""
  _, plt = _pyplot()
  rows = sweep_rows(runs, param, iters)
  fig, (a0, a1, a2) = plt.subplots(1, 3, figsize=(16, 4.2))
  salt = [r for r in rows if r["salt"]]
  base = [r for r in rows if not r["salt"]]
  name = {"h": "SALT history h", "G": "group size G"}[param]
  xs = [r["value"] for r in salt]
  _errorbar(a0, xs, [r["success"] for r in salt], label="GRPO+SALT")
  if param == "h":
    for r in base:  # one GRPO: h is SALT's
      m, lo, hi = r["success"]
      a0.axhline(m, color="gray", label=f"GRPO ({len(r['seeds'])} seeds)")
      if not math.isnan(lo):
        a0.axhspan(lo, hi, color="gray", alpha=0.12)
  else:
    _errorbar(a0, [r["value"] for r in base], [r["success"] for r in base], label="GRPO")
  a0.set(xlabel=name, ylabel=f"success after {iters} iterations", xticks=sorted(set(xs)),
         title=f"success against {param}")
  a0.legend(fontsize=8)
  step = 0.12 * ((max(xs) - min(xs)) or 4) / 4 if xs else 0.0
  for key, color, label, shift in (
      ("paired", "k", f"measured after {iters}", step),
      ("paired_late", "tab:orange", f"training rollouts, iterations "
       f"{_late_window(iters)}", 2 * step)):
    for i, (x, r) in enumerate(zip(xs, salt)):
      d = [100 * v for _, v in r[key]]
      a1.scatter([x + shift - step] * len(d), d, alpha=0.4, color=color, s=12)
      m, lo, hi = t_interval(d)
      if not math.isnan(lo):
        a1.errorbar([x + shift], [m], yerr=[[m - lo], [hi - m]], marker="o", capsize=5,
                    color=color, label=label if i == 0 else None)
  a1.axhline(0, color="grey", lw=0.8)
  a1.set(xlabel=name, ylabel="points", xticks=sorted(set(xs)),
         title="GRPO+SALT minus GRPO, per seed (dots) and mean with 95% CI")
  if a1.get_legend_handles_labels()[0]:  # one seed: dots only, no interval to label
    a1.legend(fontsize=8)
  a2.plot(xs, [r["merged"] for r in salt], marker="o", label="merged (of steps)")
  a2.plot(xs, [r["gradient_changing"] for r in salt], marker="s",
          label="gradient-changing (of merged)")
  a2.set(xlabel=name, ylabel="share", xticks=sorted(set(xs)), ylim=(0, 1),
         title=f"SALT's merges, first {iters} iterations")
  a2.legend(fontsize=8)
  return [_save(fig, docs, f"{SWEEPS[env][param].replace('-', '_')}.png")]


# SALT minus its base in every environment at once: the four methods' runs compared after
# COMPARE_ITERS iterations (every environment measured there; the toy's 30-iteration runs too).
COMPARE_ITERS = 20
PAPER_GAIN = {b: PAPER_ALFWORLD[b + "+SALT"] - PAPER_ALFWORLD[b] for b in ("GRPO", "RLOO")}
ALL_ENVS = "all"


def _across_row(base: str, env: str, pairs: list[tuple]) -> dict:
  """One row of `across_envs_rows` from [(env, seed, SALT's `_upto`, its base's)]."""
  return {"base": base, "env": env, "pairs": [(e, s) for e, s, _, _ in pairs],
          "success": [a["success"] - b["success"] for _, _, a, b in pairs],
          "late": [a["late"] - b["late"] for _, _, a, b in pairs],
          **_merge_shares([a for _, _, a, _ in pairs])}


def across_envs_rows(by_env: dict[str, list[dict]], iters: int = COMPARE_ITERS) -> list[dict]:
  """SALT minus its base, paired by (environment, seed), after `iters` iterations: per base
  estimator one row per environment (in `by_env`'s order) and one over every environment's pairs
  (env ALL_ENVS). Each row: "success" / "late" (the differences of the measurement after `iters`
  and of the training rollouts' mean over iterations `iters` - LATE_ITERS + 1 to `iters`),
  "pairs" [(env, seed)], SALT's "merged" share of steps and "gradient_changing" share of merged
  steps over those iterations. A run not measured after `iters` is an error, as are two runs of
  one (algo, salt, seed) in an environment; a seed without both runs is left out."""
  per_base: dict = {}
  for env, runs in by_env.items():
    for r in runs:
      if not _measured_after(r, iters):
        raise ValueError(f"{env}: run {(r['algo'], bool(r['salt']), r['seed'])} was not "
                         f"measured after {iters} iterations")
    try:
      pairs = _salt_base_pairs(runs)
    except ValueError as e:
      raise ValueError(f"{env}: {e}") from e
    for algo, seed, r, base in pairs:
      per_base.setdefault(algo.upper(), {}).setdefault(env, []).append(
          (env, seed, _upto(r, iters), _upto(base, iters)))
  rows = []
  for base in sorted(per_base):
    envs = per_base[base]
    rows += [_across_row(base, env, envs[env]) for env in by_env if env in envs]
    rows.append(_across_row(base, ALL_ENVS, [p for env in by_env for p in envs.get(env, [])]))
  return rows


def across_envs_table(by_env: dict[str, list[dict]], iters: int = COMPARE_ITERS) -> str:
  """`across_envs_rows` as markdown: paired differences with 95% t-intervals, wins/ties/losses."""
  rows = across_envs_rows(by_env, iters)
  if not rows:
    raise ValueError("no paired runs")
  window = _late_window(iters)
  lines = [f"| comparison | tasks | pairs | after {iters} iterations, points (95% CI; "
           f"wins/ties/losses) | training rollouts of iterations {window}, points | merged "
           f"steps %, iterations 1-{iters} | of merged: gradient changes % | the paper (ALFWorld, "
           "Qwen2.5-1.5B) |", "|---|---|---|---|---|---|---|---|"]
  for row in rows:
    tasks = (f"all {len(by_env)}, pooled" if row["env"] == ALL_ENVS
             else FOUR_METHODS[row["env"]][1] if row["env"] in FOUR_METHODS else row["env"])
    lines.append(f"| {row['base']}+SALT - {row['base']} | {tasks} | {len(row['pairs'])} | "
                 f"{_paired_cell(list(zip(row['pairs'], row['success'])))} | "
                 f"{_paired_cell(list(zip(row['pairs'], row['late'])))} | "
                 f"{_pct(row['merged'])} | {_pct(row['gradient_changing'])} | "
                 f"{PAPER_GAIN[row['base']]:+.1f} |")
  return "\n".join(lines)


def across_envs_figure(by_env: dict[str, list[dict]], docs: str,
                       iters: int = COMPARE_ITERS) -> list[str]:
  """SALT minus its base per environment and pooled (mean and 95% t-interval, points), the two
  measures side by side, with the paper's ALFWorld gain marked."""
  _, plt = _pyplot()
  rows = across_envs_rows(by_env, iters)
  fig, axes = plt.subplots(1, 2, figsize=(13, 0.5 * len(rows) + 1.8), sharey=True)
  labels = [f"{r['base']}+SALT - {r['base']}, "
            + ("pooled" if r["env"] == ALL_ENVS else r["env"]) for r in rows]
  window = _late_window(iters)
  for ax, key, title in ((axes[0], "success", f"measured after {iters} iterations"),
                         (axes[1], "late", f"training rollouts, iterations {window}")):
    for y, r in enumerate(rows):
      d = [100 * v for v in r[key]]
      ax.scatter(d, [y] * len(d), alpha=0.35, s=12, color="tab:blue")
      m, lo, hi = t_interval(d)
      color = "k" if r["env"] == ALL_ENVS else "tab:blue"
      ax.errorbar([m], [y], xerr=None if math.isnan(lo) else [[m - lo], [hi - m]], marker="o",
                  capsize=4, color=color)
      ax.plot([PAPER_GAIN[r["base"]]] * 2, [y - 0.4, y + 0.4], color="tab:red", lw=2,
              label="the paper's gain" if y == 0 else None)
    ax.axvline(0, color="grey", lw=0.8)
    ax.set(xlabel="points", title=title)
  axes[0].set_yticks(range(len(rows)))
  axes[0].set_yticklabels(labels)
  axes[0].invert_yaxis()
  axes[0].legend(fontsize=8, loc="lower right")
  fig.suptitle("SALT minus its base, paired by seed (dots), mean and 95% t-interval")
  return [_save(fig, docs, "salt_minus_base.png")]


def four_methods_runs(out: str, env: str) -> list[dict]:
  """The four methods' learning-check runs of `env` under `out` (FOUR_METHODS' folder); []."""
  from salt_jax.metrics import read_jsonl  # pylint: disable=import-outside-toplevel  (jax)
  path = os.path.join(out, FOUR_METHODS[env][0], "runs.jsonl")
  return read_jsonl(path) if os.path.exists(path) else []


def baseline_runs(out: str, env: str = "toy") -> list[dict]:
  """The runs of every JSON-lines file in `out`/BASELINES[env]'s folder; []. Where the folder
  holds no GRPO run, `env`'s four methods' GRPO runs (GRPO+SALT too) join them when they
  started from the same warm start: the same measurement before RL (a clone cloned again on
  another CPU's rounding differs, and then GRPO must be run beside)."""
  from salt_jax.metrics import read_jsonl  # pylint: disable=import-outside-toplevel  (jax)
  runs = [r for f in sorted(glob.glob(os.path.join(out, BASELINES[env][0], "*.jsonl")))
          for r in read_jsonl(f)]
  if runs and not any(r["algo"] == "grpo" for r in runs) and env in FOUR_METHODS:
    starts = {json.dumps(r["before"], sort_keys=True) for r in runs}
    runs += [r for r in four_methods_runs(out, env) if r["algo"] == "grpo"
             and json.dumps(r["before"], sort_keys=True) in starts]
  return runs


def real_model_runs(out: str, folder: str) -> list[dict]:
  """The RL runs (at least one iteration) of every JSON-lines file in `out`/`folder`; []."""
  from salt_jax.metrics import read_jsonl  # pylint: disable=import-outside-toplevel  (jax)
  return [r for f in sorted(glob.glob(os.path.join(out, folder, "*.jsonl")))
          for r in read_jsonl(f) if r["iters"] > 0]


def per_run_table(runs: list[dict]) -> str:
  """One row per run: its training tasks' success before RL and after it, the rise, and the
  held-out tasks' before and after where the run measured them."""
  lines = ["| method | seed | iterations | success before % | after % | rise (points) "
           "| held-out before % | held-out after % |", "|---|---|---|---|---|---|---|---|"]
  for m, rows in sorted(_by_method(runs).items()):
    for r in sorted(rows, key=lambda r: r["seed"]):
      before, after = _measured(r, 0), _measured(r, r["iters"])
      held = ([_pct(_measured(r, i, "heldout")) for i in (0, r["iters"])]
              if _has_heldout([r]) else ["-", "-"])
      lines.append(f"| {m} | {r['seed']} | {r['iters']} | {_pct(before)} | {_pct(after)} | "
                   f"{100 * (after - before):+.1f} | {held[0]} | {held[1]} |")
  return "\n".join(lines)


def sweep_sets(out: str, env: str) -> dict[str, list[dict]]:
  """`env`'s learning-check runs under `out`: {"four-methods": its runs.jsonl, "h" / "G": the
  sweep's own files (SWEEPS' folder, e.g. `out`/toy-history/*.jsonl) with the four methods' runs
  of the same seeds}; only those present."""
  from salt_jax.metrics import read_jsonl  # pylint: disable=import-outside-toplevel  (jax)
  found = {}
  base = four_methods_runs(out, env)
  if base:
    found["four-methods"] = base
  for param, folder in SWEEPS.get(env, {}).items():
    files = sorted(glob.glob(os.path.join(out, folder, "*.jsonl")))
    if files:
      own = [r for f in files for r in read_jsonl(f)]
      seeds = {r["seed"] for r in own}
      if own:
        found[param] = own + [r for r in base if r["seed"] in seeds]
  return found


def docs_dir(out: str) -> str:
  """Where figures go: docs/ for the default docs/study, else `out` itself."""
  docs = os.path.dirname(os.path.abspath(out)) if os.path.basename(out) == "study" else out
  os.makedirs(docs, exist_ok=True)
  return docs


def report(out: str) -> str:
  """Writes the PNGs beside `out` (docs/) and `out`/results.md; returns the markdown."""
  docs = docs_dir(out)
  md = ["# Study results (generated by `python experiments/study.py report`)", ""]
  if os.path.exists(os.path.join(docs, "trajectory_graph.png")):
    md += ["![one group's trajectory graph](trajectory_graph.png)", ""]
  mr_path = os.path.join(out, "merge-rates", "merge_rates.json")
  if os.path.exists(mr_path):
    with open(mr_path, encoding="utf-8") as f:
      mr = json.load(f)
    figs, tab = merge_rate_figure(mr, docs)
    n_tasks = ", ".join(f"{e} {n}" for e, n in sorted(mr["tasks"].items()))
    md += [f"## Merge rates of scripted groups (tasks: {n_tasks}; `experiments/merge_rates.py`)",
           "", "Merge rate at G=8 (in brackets: share of steps merged across different "
           "whole-history prompts).", "", tab, ""]
    md += [f"![merge rates]({os.path.relpath(f, docs)})" for f in figs] + [""]
  for name, key in (("headline", "method"), ("alfworld", "method"), ("history", "h"),
                    ("group-size", ("method", "G")), ("matching", "matching")):
    s = load(out, name)
    if s is None:
      continue
    md += [f"## {name} ({s['iters']} iterations, {s['eval_tasks']} held-out games per eval)", "",
           table(s, key), ""]
    if s.get("missing"):
      md += [f"Not run (the study was stopped): {', '.join(s['missing'])}.", ""]
    if name in ("headline", "alfworld"):
      per_type = by_type_table(s)
      if per_type:
        md += ["Held-out success % at the end, per split and task type (mean over seeds):", "",
               per_type, ""]
      figs = headline_figures(s, docs, name)
      paths, ours = cost_figure(s, docs) if name == "headline" else ([], None)
      figs += paths
      if ours:
        md += ["Time per phase per iteration (s), SALT runs: " + ", ".join(
            f"{p} {v:.3f}" for p, v in ours.items()), ""]
    elif name == "history":
      figs = history_figure(s, docs)
    elif name == "group-size":
      figs = group_size_figure(s, docs)
    else:
      figs = matching_figure(s, docs)
    md += [f"![{name}]({os.path.relpath(f, docs)})" for f in figs] + [""]
  for env, (folder, tasks, figure) in FOUR_METHODS.items():
    runs = four_methods_runs(out, env)
    if not runs:
      continue
    held = (f"; held-out: {runs[0]['heldout_tasks']} tasks of the env's eval split, measured "
            "the same way" if _has_heldout(runs) else "")
    md += [f"## The four methods on {tasks} ({folder}; `experiments/learning_check.py`)", "",
           f"Sampled success on the training tasks (fixed keys neither training nor cloning "
           f"uses{held}).", "", four_methods_tables(runs), ""]
    md += [f"![{env} four methods]({os.path.relpath(f, docs)})"
           for f in four_methods_figure(runs, docs, figure)] + [""]
  for env, (folder, title, figure) in BASELINES.items():
    runs = baseline_runs(out, env)
    if not runs:
      continue
    md += [f"## {title} ({folder}; `experiments/learning_check.py`)", "",
           "Sampled success on the training tasks (fixed keys neither training nor cloning "
           "uses).", "", four_methods_tables(runs), ""]
    md += [f"![{env} baselines]({os.path.relpath(f, docs)})"
           for f in four_methods_figure(runs, docs, figure)] + [""]
  for folder, (title, figure) in REAL_MODELS.items():
    runs = real_model_runs(out, folder)
    if not runs:
      continue
    md += [f"## {title} ({folder}; `experiments/learning_check.py`)", "",
           "Sampled success on the training tasks (fixed keys neither training nor cloning uses)"
           + ("; held-out tasks measured the same way." if _has_heldout(runs) else "."), "",
           per_run_table(runs), "", four_methods_tables(runs), ""]
    md += [f"![{folder}]({os.path.relpath(f, docs)})"
           for f in four_methods_figure(runs, docs, figure)] + [""]
  by_env = {env: measured for env in FOUR_METHODS if (measured := [
      r for r in four_methods_runs(out, env) if _measured_after(r, COMPARE_ITERS)])}
  if by_env:
    md += [f"## SALT minus its base in every environment ({COMPARE_ITERS} iterations; the four "
           "methods' runs above)", "", across_envs_table(by_env, COMPARE_ITERS), ""]
    md += [f"![SALT minus its base]({os.path.relpath(f, docs)})"
           for f in across_envs_figure(by_env, docs, COMPARE_ITERS)] + [""]
  for env, folders in SWEEPS.items():
    found = sweep_sets(out, env)
    for param in SWEEP_PARAMS:
      if param in found:
        md += [f"## {param} on {FOUR_METHODS[env][1]} ({folders[param]} with "
               f"{FOUR_METHODS[env][0]}'s runs of the same seeds)", "",
               sweep_table(found[param], param, SWEEP_ITERS), ""]
        md += [f"![{env} {param}]({os.path.relpath(f, docs)})"
               for f in sweep_figure(found[param], param, docs, SWEEP_ITERS, env)] + [""]
  text = "\n".join(md)
  with open(os.path.join(docs, "results.md"), "w", encoding="utf-8") as f:
    f.write(text)
  return text
