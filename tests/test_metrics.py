"""Metrics logs after a kill: torn last writes, event decoding, and the cut back on resume."""

import os

import pytest

from salt_jax import metrics as metrics_lib


def _scalars(logdir):
  """[(step, tag, value)] over every event file in `logdir`, in file order."""
  out = []
  for name in sorted(os.listdir(logdir)):
    for rec in metrics_lib.read_records(os.path.join(logdir, name)):
      e = metrics_lib.decode_event(rec)
      if "tag" in e:
        out.append((e["step"], e["tag"], e["value"]))
  return out


def test_decode_event_inverts_the_encoders():
  e = metrics_lib.decode_event(metrics_lib.encode_scalar_event("loss/pg", 1.5, 7, 12.25))
  assert e == {"wall_time": 12.25, "step": 7, "tag": "loss/pg", "value": 1.5}
  assert metrics_lib.decode_event(metrics_lib.encode_scalar_event("x", -2.0, -3, 0.0))["step"] == -3
  v = metrics_lib.decode_event(metrics_lib.encode_version_event(5.0))
  assert v == {"wall_time": 5.0, "step": 0, "file_version": "brain.Event:2"}


@pytest.mark.parametrize("data", [
    metrics_lib.encode_scalar_event("a", 1.0, 1, 0.0)[:-2],  # cut short
    b"\x80" * 11,  # a varint that never ends
    bytes([(1 << 3) | 3]),  # wire type 3 (groups) is not written by this module
])
def test_decode_event_rejects_malformed_bytes(data):
  with pytest.raises(ValueError):
    metrics_lib.decode_event(data)


def _event_file(path, n):
  recs = [metrics_lib.encode_scalar_event("a", float(i), i, 0.0) for i in range(n)]
  with open(path, "wb") as f:
    f.write(b"".join(metrics_lib.frame_record(r) for r in recs))
  return recs


@pytest.mark.parametrize("keep", [3, 10])  # the data cut short; the length header cut short
def test_read_records_torn_tail(tmp_path, keep):
  path = str(tmp_path / "events.out.tfevents.1")
  recs = _event_file(path, 3)
  with open(path, "r+b") as f:
    f.truncate(os.path.getsize(path) - len(metrics_lib.frame_record(recs[2])) + keep)
  with pytest.raises(ValueError, match="truncated"):
    metrics_lib.read_records(path)
  assert metrics_lib.read_records(path, torn_tail_ok=True) == recs[:2]


def test_read_records_torn_tail_ok_still_checks_crcs(tmp_path):
  path = str(tmp_path / "events.out.tfevents.1")
  _event_file(path, 2)
  with open(path, "r+b") as f:
    f.seek(14)
    byte = f.read(1)
    f.seek(14)
    f.write(bytes([byte[0] ^ 1]))
  with pytest.raises(ValueError, match="CRC"):
    metrics_lib.read_records(path, torn_tail_ok=True)


def test_read_jsonl_leaves_out_a_torn_last_line(tmp_path):
  path = tmp_path / "metrics.jsonl"
  path.write_text('{"iteration": 0}\n\n{"iteration": 1}\n{"iterat', encoding="utf-8")
  assert metrics_lib.read_jsonl(str(path)) == [{"iteration": 0}, {"iteration": 1}]
  path.write_text('{"iteration": 0}\n{"iterat\n', encoding="utf-8")
  with pytest.raises(ValueError):  # a torn line in the middle is damage, not a kill
    metrics_lib.read_jsonl(str(path))


def test_resume_cuts_both_logs_back_to_the_checkpoint(tmp_path):
  out = str(tmp_path)
  first = metrics_lib.MetricsLogger(out)
  for it in range(4):
    first.log(it, {"loss": float(it), "time/update": 0.5})
  first.close()
  # Killed while writing iteration 4: half a line, half a record.
  with open(os.path.join(out, "metrics.jsonl"), "a", encoding="utf-8") as f:
    f.write('{"iteration": 4, "lo')
  with open(first._tb.path, "ab") as f:  # pylint: disable=protected-access
    f.write(metrics_lib.frame_record(metrics_lib.encode_scalar_event("loss", 4.0, 4, 0.0))[:9])

  second = metrics_lib.MetricsLogger(out, truncate_from=2)  # the checkpoint was at iteration 2
  assert [r["iteration"] for r in metrics_lib.read_jsonl(second.jsonl_path)] == [0, 1]
  assert sorted({s for s, _, _ in _scalars(os.path.join(out, "tb"))}) == [0, 1]
  for it in range(2, 4):
    second.log(it, {"loss": float(it), "time/update": 0.5})
  second.close()
  rows = metrics_lib.read_jsonl(second.jsonl_path)
  assert [r["iteration"] for r in rows] == [0, 1, 2, 3]
  got = _scalars(os.path.join(out, "tb"))
  assert sorted(got) == sorted((it, tag, v) for it in range(4)
                               for tag, v in (("loss", float(it)), ("time/update", 0.5)))

  fresh = metrics_lib.MetricsLogger(out)  # a new run in the same folder starts both logs over
  fresh.close()
  assert not metrics_lib.read_jsonl(fresh.jsonl_path) and not _scalars(os.path.join(out, "tb"))
  assert os.listdir(os.path.join(out, "tb")) == [os.path.basename(fresh._tb.path)]  # pylint: disable=protected-access


def test_prune_events_without_a_folder_is_a_no_op(tmp_path):
  metrics_lib.prune_events(str(tmp_path / "missing"), 0)
  assert not os.path.exists(tmp_path / "missing")
