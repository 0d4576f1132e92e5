"""Per-iteration metrics: one JSON object per line, TensorBoard scalars and histograms (through
tensorboardX), optionally Weights & Biases or MLflow (`Tracker`), a plain-text progress line.
"""

from __future__ import annotations

import importlib
import itertools
import json
import math
import os
import sys
import time
from typing import Any, Mapping, Optional, TextIO

import numpy as np

# ----------------------------------------------------------------------------- TensorBoard

_FILE_IDS = itertools.count()  # distinct names for files one process opens within a second
EVENT_FILE_PREFIX = "events.out.tfevents."


class TensorBoardWriter:
  """Scalars and histograms in a new TensorBoard event file of `logdir`, through tensorboardX.

  Written synchronously: each call is on disk when it returns. (tensorboardX's `SummaryWriter`
  queues events for a thread that flushes every 2 minutes, so a killed run would lose rows that
  its checkpoint already covers.)

  `purge_step`: where a resumed run starts again. As `SummaryWriter(purge_step=)` does, the file
  opens with a SessionLog.START event at that step, on which TensorBoard's reader drops the events
  of that step and later from the run's earlier files (written before the kill), so each step
  shows once.
  """

  def __init__(self, logdir: str, purge_step: Optional[int] = None):
    # pylint: disable=import-outside-toplevel
    from tensorboardX.event_file_writer import EventsWriter
    from tensorboardX.proto.event_pb2 import Event, SessionLog
    os.makedirs(logdir, exist_ok=True)
    self._w = EventsWriter(os.path.join(logdir, "events"),
                           f".{os.getpid()}.{next(_FILE_IDS):04d}")
    self.path = self._w._file_name  # pylint: disable=protected-access
    if purge_step is not None:
      self._w.write_event(Event(step=purge_step, wall_time=time.time(),
                                session_log=SessionLog(status=SessionLog.START)))
    self._w.flush()

  def write(self, step: int, scalars: Mapping[str, float],
            histograms: Optional[Mapping[str, Any]] = None) -> None:
    """One event at `step` with every scalar and a histogram of each non-empty array."""
    # pylint: disable=import-outside-toplevel
    from tensorboardX import summary
    from tensorboardX.proto.event_pb2 import Event
    from tensorboardX.proto.summary_pb2 import Summary
    values = [summary.scalar(tag, float(v)).value[0] for tag, v in scalars.items()]
    for tag, arr in (histograms or {}).items():
      arr = np.asarray(arr, np.float64).ravel()
      arr = arr[np.isfinite(arr)]
      if arr.size:
        values.append(summary.histogram(tag, arr, bins="auto").value[0])
    self._w.write_event(Event(wall_time=time.time(), step=int(step),
                              summary=Summary(value=values)))
    self._w.flush()

  def close(self) -> None:
    self._w.close()


def remove_event_files(logdir: str) -> None:
  """Deletes the event files of `logdir` (a fresh run in a used folder starts its log over)."""
  if os.path.isdir(logdir):
    for name in os.listdir(logdir):
      if name.startswith(EVENT_FILE_PREFIX):
        os.remove(os.path.join(logdir, name))


# ----------------------------------------------------------------------------- jsonl + logger


def flatten(d: Mapping[str, Any], prefix: str = "") -> dict:
  """{'a': {'b': 1}} -> {'a/b': 1}."""
  out = {}
  for k, v in d.items():
    name = f"{prefix}{k}"
    if isinstance(v, Mapping):
      out.update(flatten(v, name + "/"))
    else:
      out[name] = v
  return out


def _jsonable(v):
  if isinstance(v, float) and not math.isfinite(v):
    return None  # JSON has no NaN; null reads as "not defined this iteration"
  if isinstance(v, Mapping):
    return {k: _jsonable(x) for k, x in v.items()}
  if isinstance(v, (list, tuple)):
    return [_jsonable(x) for x in v]
  if hasattr(v, "item"):
    return _jsonable(v.item())
  return v


def write_json(path: str, obj) -> None:
  """`obj` as indented JSON in `path` (non-finite floats as null), written beside it first and
  renamed."""
  tmp = path + ".tmp"
  with open(tmp, "w", encoding="utf-8") as f:
    json.dump(_jsonable(obj), f, indent=1, sort_keys=True)
  os.replace(tmp, path)


def read_jsonl(path: str) -> list[dict]:
  """The rows of a metrics file. A last line without its newline is a write cut short by a kill,
  not a row: it is left out."""
  with open(path, encoding="utf-8") as f:
    lines = f.read().split("\n")
  return [json.loads(line) for line in lines[:-1] if line.strip()]


def write_jsonl(path: str, rows) -> None:
  """Replaces the file `path` with `rows`, one JSON object a line, written beside it first and
  renamed (so it holds the old rows or the new ones, whole)."""
  tmp = path + ".tmp"
  with open(tmp, "w", encoding="utf-8") as f:
    for r in rows:
      f.write(json.dumps(r, sort_keys=True) + "\n")
  os.replace(tmp, path)


# ----------------------------------------------------------------------------- W&B / MLflow

TRACKERS = ("wandb", "mlflow")
TRACKER_FILE = "tracker.json"  # in a run's folder: {"name": ..., "run_id": ...}, for --resume


class Tracker:
  """Each row's numbers to Weights & Biases or MLflow; neither is a dependency of salt-jax.

  wandb: `wandb.init(project=, name=, config=)`, then `run.log(row, step=iteration)`.
  mlflow: `mlflow.set_experiment(project)`, `mlflow.start_run(run_name=)`, the config as params,
  then `mlflow.log_metrics(row, step=iteration)`. Their own settings (API keys, tracking URI) come
  from their environment variables as usual.

  `run_id`: a tracker run to continue (a resumed training run's, `open_tracker`):
  `wandb.init(..., id=run_id, resume="allow")` or `mlflow.start_run(run_id=run_id)`, whose params
  are not logged again (MLflow refuses a changed one, and the resume changed `resume`). The rows
  a killed run logged after its last checkpoint come again: W&B keeps the first ones (it ignores a
  step below its last), MLflow records both. `self.run_id` is the tracker's id of the run.
  """

  def __init__(self, name: str, *, project: str = "salt-jax", run_name: Optional[str] = None,
               config: Optional[Mapping[str, Any]] = None, run_id: Optional[str] = None):
    if name not in TRACKERS:
      raise ValueError(f"tracker must be one of {TRACKERS}, got {name!r}")
    try:
      self._mod = importlib.import_module(name)
    except ImportError as e:
      raise ImportError(f"the {name} tracker needs `pip install {name}`") from e
    self.name = name
    config = dict(config or {})
    if name == "wandb":
      again = {} if run_id is None else {"id": run_id, "resume": "allow"}
      self._run = self._mod.init(project=project, name=run_name, config=config, **again)
      self.run_id = self._run.id
    else:
      self._mod.set_experiment(project)
      if run_id is None:
        self._run = self._mod.start_run(run_name=run_name)
        if config:
          self._mod.log_params({k: str(v)[:500] for k, v in flatten(config).items()})
      else:
        self._run = self._mod.start_run(run_id=run_id)
      self.run_id = self._run.info.run_id

  def log(self, step: int, scalars: Mapping[str, float]) -> None:
    if self.name == "wandb":
      self._run.log(dict(scalars), step=step)
    else:
      self._mod.log_metrics(dict(scalars), step=step)

  def close(self) -> None:
    if self.name == "wandb":
      self._run.finish()
    else:
      self._mod.end_run()


def open_tracker(name: str, out_dir: str, *, resume: bool,
                 config: Optional[Mapping[str, Any]] = None) -> Tracker:
  """The `name` tracker of the training run in `out_dir`, named after the folder. With `resume`,
  the tracker run recorded in `<out_dir>/tracker.json` continues (when it was `name`'s); otherwise
  a new one starts. Either way its id is recorded there for the next resume."""
  path = os.path.join(out_dir, TRACKER_FILE)
  run_id = None
  if resume and os.path.exists(path):
    with open(path, encoding="utf-8") as f:
      saved = json.load(f)
    run_id = saved.get("run_id") if saved.get("name") == name else None
  tracker = Tracker(name, run_name=os.path.basename(os.path.abspath(out_dir)), config=config,
                    run_id=run_id)
  os.makedirs(out_dir, exist_ok=True)
  with open(path + ".tmp", "w", encoding="utf-8") as f:
    json.dump({"name": name, "run_id": tracker.run_id}, f)
  os.replace(path + ".tmp", path)  # whole or absent, whenever the run is killed
  return tracker


class MetricsLogger:
  """Writes each iteration's flat metrics dict to `<out>/metrics.jsonl` and `<out>/tb/`.

  On resume, rows (jsonl lines and TensorBoard scalars) of iterations at or after the resumed
  iteration are dropped first: a run killed after logging an iteration but before its checkpoint
  completed logs that iteration again, so each iteration is in the log once.
  With write=False (the other processes of a multi-process run) it only builds the rows.
  `tracker`: None (the default), or a `Tracker` (W&B or MLflow) that gets every row's numbers too
  and is closed with the logger.
  """

  def __init__(self, out_dir: str, *, tensorboard: bool = True,
               truncate_from: Optional[int] = None, write: bool = True,
               tracker: Optional[Tracker] = None):
    self.write = write
    self._tb = None
    self._tracker = tracker if write else None
    if not write:
      return
    os.makedirs(out_dir, exist_ok=True)
    self.jsonl_path = os.path.join(out_dir, "metrics.jsonl")
    start = 0 if truncate_from is None else truncate_from  # a fresh run owns the folder's log
    if os.path.exists(self.jsonl_path):
      write_jsonl(self.jsonl_path,
                  [r for r in read_jsonl(self.jsonl_path) if r.get("iteration", -1) < start])
    tb = os.path.join(out_dir, "tb")
    if truncate_from is None:
      remove_event_files(tb)
    if tensorboard:
      self._tb = TensorBoardWriter(tb, purge_step=truncate_from)

  def log(self, iteration: int, metrics: Mapping[str, Any],
          histograms: Optional[Mapping[str, Any]] = None) -> dict:
    """Appends the row of `metrics` (flattened) to the jsonl file and TensorBoard, with
    `histograms` ({tag: array}) in TensorBoard only; returns the row."""
    row = {k: _jsonable(v) for k, v in flatten(metrics).items()}
    row["iteration"] = int(iteration)
    if not self.write:
      return row
    with open(self.jsonl_path, "a", encoding="utf-8") as f:
      f.write(json.dumps(row, sort_keys=True) + "\n")
    scalars = {k: v for k, v in row.items()
               if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "iteration"}
    if self._tb is not None:
      self._tb.write(iteration, scalars, histograms)
    if self._tracker is not None:
      self._tracker.log(iteration, scalars)
    return row

  def close(self) -> None:
    if self._tb is not None:
      self._tb.close()
    if self._tracker is not None:
      self._tracker.close()


def iteration_line(iteration: int, total: int, row: Mapping[str, Any]) -> str:
  """One iteration as one line: success, valid actions, SALT's merges (and the share that
  changes the gradient), loss (- when no update ran) and the iteration's seconds."""
  def f(k, fmt="{:.2f}"):
    v = row.get(k)
    return "-" if v is None or (isinstance(v, float) and not math.isfinite(v)) else fmt.format(v)
  width = len(str(total))
  return (f"iter {iteration + 1:>{width}}/{total}  success {f('success_rate')}  "
          f"valid {f('valid_action_ratio')}  merges {f('merge_rate')} "
          f"(gradient-changing {f('gradient_changing_share')})  loss {f('loss', '{:.4f}')}  "
          f"{f('time/iteration', '{:.1f}s')}")


def wilson_interval(successes: float, n: float, z: float = 1.96) -> tuple[float, float]:
  """The Wilson score interval of a success rate (95% at z = 1.96); (nan, nan) when n = 0."""
  if n <= 0:
    return float("nan"), float("nan")
  p = successes / n
  centre = (p + z * z / (2 * n)) / (1 + z * z / n)
  half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
  return max(0.0, centre - half), min(1.0, centre + half)


def run_summary(rows, *, window: int = 5) -> list[str]:
  """What a finished run did, for the console: training success over its first and its last
  `window` iterations (pooled over their trajectories, with a 95% Wilson interval) and the time
  it took. `rows` are a run's metrics rows, in order."""
  rows = [r for r in rows if isinstance(r.get("success_rate"), (int, float))]
  if not rows:
    return ["no iteration logged"]

  def pooled(part):
    n = sum(r.get("num_trajectories", 1) for r in part)
    wins = sum(r["success_rate"] * r.get("num_trajectories", 1) for r in part)
    lo, hi = wilson_interval(wins, n)
    first, last = part[0]["iteration"] + 1, part[-1]["iteration"] + 1
    span = f"iteration {first}" if first == last else f"iterations {first}-{last}"
    return f"{span}: {wins / n:.2f} [{lo:.2f}, {hi:.2f}] over {int(n)} trajectories"

  k = min(window, max(1, len(rows) // 2))
  lines = [f"success, {pooled(rows[:k])}"]
  if len(rows) > k:
    lines.append(f"success, {pooled(rows[-k:])}")
  seconds = sum(r.get("time/iteration", 0.0) for r in rows)
  lines.append(f"{len(rows)} iterations in {seconds / 60:.1f} min (95% intervals)")
  return lines


def eval_summary(rows, *, last: int = 5) -> dict:
  """The paper's evaluation of a run: each split's greedy evaluation (`--eval-every`) averaged
  over its last `last` evaluations (success overall and per task type, score, valid actions).

  Returns {split: {"after_iterations": [...], "num_tasks", "success_rate", "score",
  "valid_action_ratio", "success_rate_by_type": {type: rate}}}; a split never evaluated is
  absent. A per-type rate averages the evaluations that played that type (NaN if none did).
  """
  if isinstance(last, bool) or not isinstance(last, int) or last < 1:
    raise ValueError(f"last must be a positive int, got {last!r}")
  splits = sorted({k[len("eval/"):-len("/success_rate")] for r in rows for k in r
                   if k.startswith("eval/") and k.endswith("/success_rate")
                   and k.count("/") == 2})
  out = {}
  for split in splits:
    pre = f"eval/{split}/"
    evals = [r for r in rows if isinstance(r.get(pre + "success_rate"), (int, float))][-last:]
    types = sorted({k[len(pre + "success_rate/"):] for r in evals for k in r
                    if k.startswith(pre + "success_rate/")})

    def mean(key, part=evals):
      vals = [float(r[key]) for r in part if isinstance(r.get(key), (int, float))]
      vals = [v for v in vals if math.isfinite(v)]
      return sum(vals) / len(vals) if vals else float("nan")

    out[split] = {
        "after_iterations": [int(r["iteration"]) + 1 for r in evals],
        "num_tasks": int(evals[-1].get(pre + "num_tasks", 0)),
        "success_rate": mean(pre + "success_rate"), "score": mean(pre + "score"),
        "valid_action_ratio": mean(pre + "valid_action_ratio"),
        "success_rate_by_type": {t: mean(pre + "success_rate/" + t) for t in types}}
  return out


def eval_summary_lines(summary: Mapping[str, Any]) -> list[str]:
  """`eval_summary`'s result as console lines, one per split."""
  lines = []
  for split, e in summary.items():
    n, after = len(e["after_iterations"]), e["after_iterations"]
    when = (f"after {after[0]} iterations" if n == 1 else f"mean of the last {n} evaluations, "
            f"after iterations {', '.join(map(str, after))}")
    types = ", ".join(f"{t} {v:.2f}" for t, v in e["success_rate_by_type"].items())
    lines.append(f"eval {split} ({when}, {e['num_tasks']} tasks, greedy): success "
                 f"{e['success_rate']:.2f}" + (f" ({types})" if types else "")
                 + f", score {e['score']:.2f}, valid {e['valid_action_ratio']:.2f}")
  return lines


class Progress:
  """One plain-text line per iteration (tqdm's bar when tqdm is installed and stderr is a tty)."""

  def __init__(self, total: int, initial: int = 0, stream: TextIO = sys.stderr):
    self.stream = stream
    self._bar = None
    if stream.isatty():
      try:
        import tqdm  # pylint: disable=import-outside-toplevel
        self._bar = tqdm.tqdm(total=total, initial=initial, file=stream, dynamic_ncols=True)
      except ImportError:
        pass
    self.total = total

  def update(self, iteration: int, row: Mapping[str, Any]) -> None:
    text = iteration_line(iteration, self.total, row)
    if self._bar is not None:
      self._bar.update(1)
      self._bar.set_postfix_str(text)
    else:
      print(text, file=self.stream, flush=True)

  def close(self) -> None:
    if self._bar is not None:
      self._bar.close()
