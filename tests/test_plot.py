"""A run's console summary and curves: the line an iteration, the Wilson interval against its
defining quadratic, the summary of first and last iterations, and the curves of several runs."""

import json
import math
import os

import numpy as np
import pytest

from salt_jax import metrics as metrics_lib
from salt_jax import plot

SUCCESS = [0.5, 0.38, 0.31, 0.53, 0.41, 0.53, 0.59, 0.59, 0.53, 0.59, 0.69, 0.78, 0.75, 0.69]


def _rows(success, with_eval=False):
  rows = []
  for i, s in enumerate(success):
    r = {"iteration": i, "success_rate": s, "num_trajectories": 32, "valid_action_ratio": 0.9,
         "merge_rate": 0.3, "gradient_changing_share": 0.1, "loss": 0.01 * i,
         "time/iteration": 20.0}
    if with_eval and i % 5 == 4:
      r["eval/valid_seen/success_rate"] = s / 2
    rows.append(r)
  return rows


def _write(folder, rows):
  os.makedirs(folder)
  with open(os.path.join(folder, "metrics.jsonl"), "w", encoding="utf-8") as f:
    f.writelines(json.dumps(r) + "\n" for r in rows)
  return str(folder)


def test_wilson_interval_solves_its_quadratic():
  """The bounds are the p where (p_hat - p)^2 = z^2 p (1 - p) / n."""
  z = 1.96
  for wins, n in ((0, 10), (3, 10), (10, 10), (71, 160), (1, 1)):
    p_hat = wins / n
    a, b, c = 1 + z * z / n, -(2 * p_hat + z * z / n), p_hat * p_hat
    roots = sorted(np.roots([a, b, c]).real)
    lo, hi = metrics_lib.wilson_interval(wins, n, z)
    assert (lo, hi) == pytest.approx((max(0.0, roots[0]), min(1.0, roots[1])), abs=1e-9)
    assert lo <= p_hat <= hi
  assert all(math.isnan(x) for x in metrics_lib.wilson_interval(0, 0))


def test_iteration_line_and_summary():
  rows = _rows(SUCCESS)
  line = metrics_lib.iteration_line(2, 14, rows[2])
  assert line == ("iter  3/14  success 0.31  valid 0.90  merges 0.30 (gradient-changing 0.10)  "
                  "loss 0.0200  20.0s")
  # No update (loss absent or NaN) and missing metrics print a dash, never 'nan'.
  blank = metrics_lib.iteration_line(0, 3, {"success_rate": 0.5, "loss": float("nan")})
  assert "loss -" in blank and "valid -" in blank and "nan" not in blank
  first, last, time_line = metrics_lib.run_summary(rows)
  wins = sum(s * 32 for s in SUCCESS[:5])
  lo, hi = metrics_lib.wilson_interval(wins, 160)
  assert first == (f"success, iterations 1-5: {wins / 160:.2f} [{lo:.2f}, {hi:.2f}] over 160 "
                   "trajectories")
  assert last.startswith("success, iterations 10-14: ")
  assert time_line == "14 iterations in 4.7 min (95% intervals)"
  # Short runs: halves (one iteration each for two), and a run with no rows.
  assert metrics_lib.run_summary(rows[:2])[0].startswith("success, iteration 1: 0.50")
  assert metrics_lib.run_summary(rows[:1])[1] == "1 iterations in 0.3 min (95% intervals)"
  assert metrics_lib.run_summary([]) == ["no iteration logged"]


def test_curves_of_several_runs(tmp_path):
  a = _write(tmp_path / "grpo", _rows(SUCCESS, with_eval=True))
  b = _write(tmp_path / "salt", _rows(SUCCESS[::-1]))
  out = str(tmp_path / "both.png")
  assert plot.main([a, os.path.join(b, "metrics.jsonl"), "--out", out]) == 0
  with open(out, "rb") as f:
    assert f.read(8) == b"\x89PNG\r\n\x1a\n"
  fig = plot.plot_runs({"grpo": _rows(SUCCESS, with_eval=True), "salt": _rows(SUCCESS[::-1])})
  axes = fig.axes
  assert [ax.get_title() for ax in axes] == [t for _, t in plot.PANELS]
  success = {line.get_label(): line for line in axes[0].get_lines()}
  assert set(success) == {"grpo", "salt", "grpo: valid_seen"}
  np.testing.assert_allclose(success["grpo"].get_ydata(), SUCCESS)
  np.testing.assert_array_equal(success["grpo"].get_xdata(), np.arange(1, len(SUCCESS) + 1))
  np.testing.assert_array_equal(success["grpo: valid_seen"].get_xdata(), [5, 10])
  for ax in axes[1:]:
    assert len(ax.get_lines()) == 2


def test_bad_runs_are_one_line_errors(tmp_path):
  with pytest.raises(SystemExit, match="error: .*no metrics.jsonl"):
    plot.main([str(tmp_path / "missing")])
  bad = tmp_path / "bad"
  bad.mkdir()
  (bad / "metrics.jsonl").write_text("{not json\n")
  with pytest.raises(SystemExit, match="error: "):
    plot.main([str(bad), "--out", str(tmp_path / "x.png")])


def _eval_rows(rng, n_iters=23, every=2):
  """Training rows with evaluations every `every` iterations on two splits; some per-type rates
  undefined (NaN in memory, null once read back from metrics.jsonl)."""
  rows = []
  for i in range(n_iters):
    r = {"iteration": i, "success_rate": float(rng.uniform())}
    if (i + 1) % every == 0:
      for split in ("valid_seen", "valid_unseen"):
        pre = f"eval/{split}/"
        r.update({pre + "success_rate": float(rng.uniform()), pre + "score": float(rng.uniform()),
                  pre + "valid_action_ratio": float(rng.uniform()), pre + "num_tasks": 12,
                  pre + "success_rate/pick": float(rng.uniform()),
                  pre + "success_rate/heat": float("nan") if i % 3 else None})
    rows.append(r)
  return rows


def test_eval_summary_averages_each_splits_last_five_evaluations():
  rows = _eval_rows(np.random.default_rng(0))
  summary = metrics_lib.eval_summary(rows)
  assert sorted(summary) == ["valid_seen", "valid_unseen"]
  evals = [r for r in rows if "eval/valid_seen/success_rate" in r]
  last = evals[-5:]
  for split, got in summary.items():
    pre = f"eval/{split}/"
    assert got["after_iterations"] == [r["iteration"] + 1 for r in last] == [14, 16, 18, 20, 22]
    assert got["num_tasks"] == 12
    for key in ("success_rate", "score", "valid_action_ratio"):
      np.testing.assert_allclose(got[key], np.mean([r[pre + key] for r in last]), rtol=1e-12)
    np.testing.assert_allclose(got["success_rate_by_type"]["pick"],
                               np.mean([r[pre + "success_rate/pick"] for r in last]), rtol=1e-12)
    assert math.isnan(got["success_rate_by_type"]["heat"])  # no evaluation played it
  # Fewer evaluations than the window: all of them; last=1: the newest alone.
  two = metrics_lib.eval_summary(rows[:4])["valid_seen"]
  assert two["after_iterations"] == [2, 4]
  np.testing.assert_allclose(two["success_rate"], np.mean(
      [rows[1]["eval/valid_seen/success_rate"], rows[3]["eval/valid_seen/success_rate"]]))
  one = metrics_lib.eval_summary(rows, last=1)["valid_unseen"]
  assert one["success_rate"] == rows[21]["eval/valid_unseen/success_rate"]
  # As read back from metrics.jsonl (NaN written as null): the same summary.
  logged = [json.loads(json.dumps({k: metrics_lib._jsonable(v) for k, v in r.items()}))
            for r in rows]  # pylint: disable=protected-access
  again = metrics_lib.eval_summary(logged)
  assert json.dumps(metrics_lib._jsonable(again)) == json.dumps(  # pylint: disable=protected-access
      metrics_lib._jsonable(summary))  # pylint: disable=protected-access


def test_eval_summary_lines_and_bad_inputs(tmp_path):
  assert metrics_lib.eval_summary(_rows(SUCCESS)) == {}  # a run that never evaluated
  assert metrics_lib.eval_summary([]) == {}
  for bad in (0, -1, 2.5, True, None):
    with pytest.raises(ValueError, match="last must be a positive int"):
      metrics_lib.eval_summary([], last=bad)
  rows = _eval_rows(np.random.default_rng(1))
  summary = metrics_lib.eval_summary(rows)
  lines = metrics_lib.eval_summary_lines(summary)
  assert len(lines) == 2 and lines[0].startswith(
      "eval valid_seen (mean of the last 5 evaluations, after iterations 14, 16, 18, 20, 22, "
      "12 tasks, greedy): success ")
  assert "(heat nan, pick " in lines[0] and ", score " in lines[0] and ", valid " in lines[0]
  single = metrics_lib.eval_summary_lines(metrics_lib.eval_summary(rows[:2]))
  assert single[0].startswith("eval valid_seen (after 2 iterations, 12 tasks, greedy)")
  path = str(tmp_path / "eval.json")
  metrics_lib.write_json(path, summary)
  with open(path, encoding="utf-8") as f:
    back = json.load(f)
  assert back["valid_seen"]["success_rate_by_type"]["heat"] is None  # JSON has no NaN
  assert back["valid_unseen"]["after_iterations"] == [14, 16, 18, 20, 22]
