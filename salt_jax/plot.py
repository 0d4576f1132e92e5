"""Learning curves of one or more runs, from their metrics.jsonl (host side, matplotlib).

  python -m salt_jax.plot runs/alfworld_grpo_salt/RUN [RUN ...] [--out curves.png]

Four panels per iteration: training success, valid actions, SALT's merge rate, and the share of
merged steps whose merge changed the policy gradient (`gradient_changing_share`); evaluations
(`eval/<split>/success_rate`, from --eval-every) are drawn as markers on the success panel. A run
is a folder holding metrics.jsonl, or the file itself; runs are labelled by their folder name.
The trainer draws the same picture of its own run into `<out>/curves.png` when it finishes.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Mapping, Optional, Sequence

from salt_jax.metrics import read_jsonl

METRICS_FILE = "metrics.jsonl"
CURVES_FILE = "curves.png"
PANELS = (("success_rate", "training success"), ("valid_action_ratio", "valid actions"),
          ("merge_rate", "SALT merge rate"),
          ("gradient_changing_share", "merges that change the gradient"))


def metrics_path(run: str) -> str:
  """A run's metrics.jsonl: `run` itself, or the file inside the folder `run`."""
  path = os.path.join(run, METRICS_FILE) if os.path.isdir(run) else run
  if not os.path.isfile(path):
    raise ValueError(f"{run}: no {METRICS_FILE} there (is it a run folder?)")
  return path


def series(rows: Sequence[Mapping], key: str) -> tuple[list[int], list[float]]:
  """(iterations, values) of one metric, 1-based, over the rows that hold a finite number."""
  xs, ys = [], []
  for r in rows:
    v = r.get(key)
    if isinstance(v, (int, float)) and not isinstance(v, bool) and v == v:
      xs.append(int(r["iteration"]) + 1)
      ys.append(float(v))
  return xs, ys


def plot_runs(runs: Mapping[str, Sequence[Mapping]], path: Optional[str] = None):
  """Draws the runs' curves (label -> metrics rows) into a Figure, saved to `path` if given.

  Returns the matplotlib Figure.
  """
  import matplotlib  # pylint: disable=import-outside-toplevel
  if path is not None:
    matplotlib.use("Agg", force=False)
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  from matplotlib.ticker import MaxNLocator  # pylint: disable=import-outside-toplevel
  fig, axes = plt.subplots(2, 2, figsize=(10, 6.5), sharex=True, squeeze=False)
  for (key, title), ax in zip(PANELS, axes.flat):
    ax.set_title(title, fontsize=10)
    ax.set_ylim(-0.03, 1.03)
    ax.grid(alpha=0.3)
    for i, (label, rows) in enumerate(runs.items()):
      color = f"C{i}"
      xs, ys = series(rows, key)
      if xs:
        ax.plot(xs, ys, color=color, marker="." if len(xs) < 40 else None, label=label)
      if key != "success_rate":
        continue
      evals = sorted({k for r in rows for k in r
                      if k.startswith("eval/") and k.endswith("/success_rate")})
      for j, k in enumerate(evals):
        ex, ey = series(rows, k)
        if ex:
          ax.plot(ex, ey, linestyle="none", marker="os^v"[j % 4], color=color, alpha=0.6,
                  label=f"{label}: {k.split('/')[1]}")
  for ax in axes[1]:
    ax.set_xlabel("iteration")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
  axes[0, 0].legend(fontsize=8, loc="best")
  fig.tight_layout()
  if path is not None:
    fig.savefig(path, dpi=110)
    plt.close(fig)
  return fig


def main(argv: Optional[Sequence[str]] = None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("runs", nargs="+", help="run folders (or their metrics.jsonl)")
  ap.add_argument("--out", default=CURVES_FILE, help="the picture to write (default: %(default)s)")
  args = ap.parse_args(argv)
  runs = {}
  try:
    for run in args.runs:
      label = os.path.basename(os.path.normpath(run if os.path.isdir(run)
                                                else os.path.dirname(run) or run))
      while label in runs:
        label += "'"
      runs[label] = read_jsonl(metrics_path(run))
  except ValueError as e:
    raise SystemExit(f"error: {e}") from None
  plot_runs(runs, args.out)
  print(args.out)
  return 0


if __name__ == "__main__":
  sys.exit(main())
