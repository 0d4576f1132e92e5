"""Metrics logs after a kill: torn last writes, and the cut back on resume, read back by
TensorBoard's own reader."""

import json
import os
import sys
import types

import numpy as np
import pytest

from salt_jax import metrics as metrics_lib
from tests.tensorboard_reader import read_tensorboard


def test_read_jsonl_leaves_out_a_torn_last_line(tmp_path):
  path = tmp_path / "metrics.jsonl"
  path.write_text('{"iteration": 0}\n\n{"iteration": 1}\n{"iterat', encoding="utf-8")
  assert metrics_lib.read_jsonl(str(path)) == [{"iteration": 0}, {"iteration": 1}]
  path.write_text('{"iteration": 0}\n{"iterat\n', encoding="utf-8")
  with pytest.raises(ValueError):  # a torn line in the middle is damage, not a kill
    metrics_lib.read_jsonl(str(path))


def test_resume_cuts_both_logs_back_to_the_checkpoint(tmp_path):
  out = str(tmp_path)
  tb = os.path.join(out, "tb")
  first = metrics_lib.MetricsLogger(out)
  for it in range(4):
    first.log(it, {"loss": float(it), "time/update": 0.5})
  first.close()
  # Killed while writing iteration 4: half a line, half a record.
  with open(os.path.join(out, "metrics.jsonl"), "a", encoding="utf-8") as f:
    f.write('{"iteration": 4, "lo')
  with open(first._tb.path, "ab") as f:  # pylint: disable=protected-access
    f.write(b"\x20\x00\x00\x00\x00\x00\x00\x00\x01")
  assert sorted({s for s, _ in read_tensorboard(tb)[0]}) == [0, 1, 2, 3]

  second = metrics_lib.MetricsLogger(out, truncate_from=2)  # the checkpoint was at iteration 2
  assert [r["iteration"] for r in metrics_lib.read_jsonl(second.jsonl_path)] == [0, 1]
  assert sorted({s for s, _ in read_tensorboard(tb)[0]}) == [0, 1]  # purged by the START event
  for it in range(2, 4):
    second.log(it, {"loss": 10.0 + it, "time/update": 0.5})
  second.close()
  rows = metrics_lib.read_jsonl(second.jsonl_path)
  assert [r["iteration"] for r in rows] == [0, 1, 2, 3]
  want = {(it, tag): [v] for it in range(4)
          for tag, v in (("loss", float(it) if it < 2 else 10.0 + it), ("time/update", 0.5))}
  assert read_tensorboard(tb)[0] == want

  fresh = metrics_lib.MetricsLogger(out)  # a new run in the same folder starts both logs over
  fresh.close()
  assert not metrics_lib.read_jsonl(fresh.jsonl_path) and read_tensorboard(tb) == ({}, {})
  assert os.listdir(tb) == [os.path.basename(fresh._tb.path)]  # pylint: disable=protected-access


def test_histograms_go_to_tensorboard_only(tmp_path):
  log = metrics_lib.MetricsLogger(str(tmp_path))
  adv = np.array([-1.0, 0.0, 0.0, 0.5, 2.0, np.nan])
  row = log.log(3, {"loss": 1.0}, {"adv_before": adv, "adv_after": adv * 2, "empty": []})
  log.close()
  assert row == {"iteration": 3, "loss": 1.0}
  scalars, hists = read_tensorboard(str(tmp_path / "tb"))
  assert scalars == {(3, "loss"): [1.0]} and set(hists) == {(3, "adv_before"), (3, "adv_after")}
  h = hists[(3, "adv_after")]
  assert (h.num, h.min, h.max, h.sum) == (5, -2.0, 4.0, 3.0)  # the NaN left out


def test_no_tensorboard_and_other_processes_write_no_events(tmp_path):
  metrics_lib.MetricsLogger(str(tmp_path / "a"), tensorboard=False).log(0, {"x": 1.0})
  assert not os.path.exists(tmp_path / "a" / "tb")
  assert metrics_lib.MetricsLogger(str(tmp_path / "b"), write=False).log(0, {"x": 1.0}) == {
      "iteration": 0, "x": 1.0}
  assert not os.path.exists(tmp_path / "b")


class _FakeWandb:
  def __init__(self):
    self.calls = []
    self.id = None

  def init(self, **kw):
    self.calls.append(("init", kw))
    self.id = kw.get("id", f"w{len(self.calls)}")  # a new id for each new run
    return self

  def log(self, row, step):
    self.calls.append(("log", step, row))

  def finish(self):
    self.calls.append(("finish",))


class _FakeMlflow:
  def __init__(self):
    self.calls = []

  def start_run(self, *a, **kw):
    self.calls.append(("start_run", a, kw))
    return types.SimpleNamespace(info=types.SimpleNamespace(
        run_id=kw.get("run_id", f"m{len(self.calls)}")))

  def __getattr__(self, name):
    return lambda *a, **kw: self.calls.append((name, a, kw))


def test_tracker_sends_the_numbers_of_each_row_to_wandb_or_mlflow(tmp_path, monkeypatch):
  import sys
  wandb, mlflow = _FakeWandb(), _FakeMlflow()
  monkeypatch.setitem(sys.modules, "wandb", wandb)
  monkeypatch.setitem(sys.modules, "mlflow", mlflow)
  row = {"loss": 0.5, "eval": {"success_rate": 1.0}, "note": "text", "done": True}
  logger = metrics_lib.MetricsLogger(
      str(tmp_path / "w"), tensorboard=False,
      tracker=metrics_lib.Tracker("wandb", run_name="r", config={"lr": 1e-6}))
  logger.log(3, row)
  logger.close()
  assert wandb.calls == [("init", {"project": "salt-jax", "name": "r", "config": {"lr": 1e-6}}),
                         ("log", 3, {"loss": 0.5, "eval/success_rate": 1.0}), ("finish",)]
  logger = metrics_lib.MetricsLogger(
      str(tmp_path / "m"), tensorboard=False,
      tracker=metrics_lib.Tracker("mlflow", project="p", config={"env_kwargs": {"a": 1}}))
  logger.log(0, row)
  logger.close()
  assert mlflow.calls == [("set_experiment", ("p",), {}), ("start_run", (), {"run_name": None}),
                          ("log_params", ({"env_kwargs/a": "1"},), {}),
                          ("log_metrics", ({"loss": 0.5, "eval/success_rate": 1.0},), {"step": 0}),
                          ("end_run", (), {})]
  # Off by default and on the processes that do not write; a name it does not know is an error.
  assert metrics_lib.MetricsLogger(str(tmp_path / "x"), tensorboard=False)._tracker is None
  with pytest.raises(ValueError, match="tracker"):
    metrics_lib.Tracker("neptune")
  monkeypatch.setitem(sys.modules, "wandb", None)  # not installed
  with pytest.raises(ImportError, match="pip install wandb"):
    metrics_lib.Tracker("wandb")


def test_a_resumed_run_continues_its_tracker_run(tmp_path, monkeypatch):
  """The first run records its tracker run's id in <out>/tracker.json; --resume passes it back;
  a fresh run (a new folder, or no --resume) and another tracker start a new one."""
  wandb, mlflow = _FakeWandb(), _FakeMlflow()
  monkeypatch.setitem(sys.modules, "wandb", wandb)
  monkeypatch.setitem(sys.modules, "mlflow", mlflow)
  run, other = str(tmp_path / "run"), str(tmp_path / "other")

  def recorded(out):
    with open(os.path.join(out, metrics_lib.TRACKER_FILE), encoding="utf-8") as f:
      return json.load(f)

  first = metrics_lib.open_tracker("wandb", run, resume=False, config={"lr": 1.0})
  assert first.run_id == "w1" and recorded(run) == {"name": "wandb", "run_id": "w1"}
  assert "id" not in wandb.calls[-1][1] and wandb.calls[-1][1]["name"] == "run"
  again = metrics_lib.open_tracker("wandb", run, resume=True, config={"lr": 1.0})
  assert again.run_id == "w1" and recorded(run)["run_id"] == "w1"
  assert wandb.calls[-1] == ("init", {"project": "salt-jax", "name": "run", "config": {"lr": 1.0},
                                      "id": "w1", "resume": "allow"})
  for out, resume in ((other, True), (other, False), (run, False)):  # nothing to continue
    tracker = metrics_lib.open_tracker("wandb", out, resume=resume)
    assert "id" not in wandb.calls[-1][1] and tracker.run_id != "w1"
    assert recorded(out)["run_id"] == tracker.run_id

  # MLflow: start_run(run_id=) on resume, without logging the params again.
  mlflow_first = metrics_lib.open_tracker("mlflow", run, resume=True)  # wandb's id: a new run
  assert mlflow.calls[-1] == ("start_run", (), {"run_name": "run"})
  mlflow.calls.clear()
  assert metrics_lib.open_tracker("mlflow", run, resume=True, config={"lr": 1.0}).run_id \
      == mlflow_first.run_id
  assert mlflow.calls == [("set_experiment", ("salt-jax",), {}),
                          ("start_run", (), {"run_id": mlflow_first.run_id})]
