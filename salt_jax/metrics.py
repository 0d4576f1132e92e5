"""Per-iteration metrics: one JSON object per line, TensorBoard scalars, a plain-text progress line.

TensorBoard event files are written here without TensorFlow or tensorboardX. The format
(tensorflow/core/lib/io/record_writer.cc, tensorflow/core/util/event.proto) is a sequence of
records

    uint64 length (little endian) | uint32 masked_crc32c(length bytes) | data[length]
    | uint32 masked_crc32c(data)

where data is a serialized `Event` proto and masked_crc32c(x) = ((crc >> 15) | (crc << 17)) +
0xa282ead8 over CRC-32C (Castagnoli). The first event carries `file_version = "brain.Event:2"`;
each scalar is an `Event{wall_time, step, summary{value{tag, simple_value}}}`. The protobuf wire
encoding of these few fields is written by hand below, and read back by `decode_event` (tests, and
`prune_events`, which cuts a resumed run's event files back to its checkpoint).
"""

from __future__ import annotations

import json
import math
import os
import socket
import struct
import sys
import time
from typing import Any, Mapping, Optional, TextIO

# ----------------------------------------------------------------------------- CRC-32C


def _crc32c_table() -> list[int]:
  poly = 0x82F63B78  # reversed Castagnoli polynomial
  table = []
  for i in range(256):
    c = i
    for _ in range(8):
      c = (c >> 1) ^ poly if c & 1 else c >> 1
    table.append(c)
  return table


_CRC_TABLE = _crc32c_table()


def crc32c(data: bytes) -> int:
  """CRC-32C of `data` (crc32c(b"123456789") == 0xE3069283). Pure Python: records are small."""
  crc = 0xFFFFFFFF
  for b in data:
    crc = _CRC_TABLE[(crc ^ b) & 0xFF] ^ (crc >> 8)
  return crc ^ 0xFFFFFFFF


def masked_crc32c(data: bytes) -> int:
  crc = crc32c(data)
  return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


# ----------------------------------------------------------------------------- protobuf wire


def _varint(n: int) -> bytes:
  out = bytearray()
  n &= (1 << 64) - 1  # negative int64 values are encoded as 10-byte two's complement
  while True:
    b = n & 0x7F
    n >>= 7
    if n:
      out.append(b | 0x80)
    else:
      out.append(b)
      return bytes(out)


def _key(field: int, wire_type: int) -> bytes:
  return _varint((field << 3) | wire_type)


def _len_field(field: int, payload: bytes) -> bytes:
  return _key(field, 2) + _varint(len(payload)) + payload


def encode_scalar_event(tag: str, value: float, step: int, wall_time: float) -> bytes:
  """Event{wall_time=1 (double), step=2 (int64), summary=5{value=1{tag=1, simple_value=2}}}."""
  summary_value = _len_field(1, tag.encode("utf-8")) + _key(2, 5) + struct.pack("<f", value)
  summary = _len_field(1, summary_value)
  return (_key(1, 1) + struct.pack("<d", wall_time) + _key(2, 0) + _varint(int(step))
          + _len_field(5, summary))


def encode_version_event(wall_time: float) -> bytes:
  """Event{wall_time, file_version=3 "brain.Event:2"}: every event file starts with it."""
  return _key(1, 1) + struct.pack("<d", wall_time) + _len_field(3, b"brain.Event:2")


def frame_record(data: bytes) -> bytes:
  header = struct.pack("<Q", len(data))
  return (header + struct.pack("<I", masked_crc32c(header)) + data
          + struct.pack("<I", masked_crc32c(data)))


def read_records(path: str, *, torn_tail_ok: bool = False) -> list[bytes]:
  """The data of every record in an event file.

  Args:
    path: an event file.
    torn_tail_ok: a last record cut short (a write killed midway) ends the list instead of
      raising; a CRC mismatch still raises.
  Raises:
    ValueError: a truncated record (unless `torn_tail_ok`) or a bad length or data CRC.
  """
  out = []
  with open(path, "rb") as f:
    buf = f.read()
  i = 0
  while i < len(buf):
    if len(buf) - i < 12:
      if torn_tail_ok:
        break
      raise ValueError(f"{path}: truncated record header at byte {i}")
    header = buf[i:i + 8]
    (n,) = struct.unpack("<Q", header)
    (hcrc,) = struct.unpack("<I", buf[i + 8:i + 12])
    if hcrc != masked_crc32c(header):
      raise ValueError(f"{path}: bad length CRC at byte {i}")
    if len(buf) < i + 16 + n:
      if torn_tail_ok:
        break
      raise ValueError(f"{path}: truncated record data at byte {i}")
    data = buf[i + 12:i + 12 + n]
    (dcrc,) = struct.unpack("<I", buf[i + 12 + n:i + 16 + n])
    if dcrc != masked_crc32c(data):
      raise ValueError(f"{path}: bad data CRC at byte {i}")
    out.append(data)
    i += 16 + n
  return out


def _read_varint(data: bytes, i: int) -> tuple[int, int]:
  n, shift = 0, 0
  while True:
    if i >= len(data) or shift > 63:
      raise ValueError(f"bad varint at byte {i}")
    b = data[i]
    n |= (b & 0x7F) << shift
    i, shift = i + 1, shift + 7
    if not b & 0x80:
      return n, i


def _fields(data: bytes):
  """(field number, value) of each protobuf field: int for varint, bytes otherwise."""
  i = 0
  while i < len(data):
    key, i = _read_varint(data, i)
    field, wire = key >> 3, key & 7
    if wire == 0:
      v, i = _read_varint(data, i)
    elif wire in (1, 5):
      size = 8 if wire == 1 else 4
      v, i = data[i:i + size], i + size
    elif wire == 2:
      size, i = _read_varint(data, i)
      v, i = data[i:i + size], i + size
    else:
      raise ValueError(f"unsupported protobuf wire type {wire} at byte {i}")
    if i > len(data):
      raise ValueError("truncated protobuf field")
    yield field, v


def decode_event(data: bytes) -> dict:
  """The fields this module writes, read back from one record's data (the inverse of
  `encode_scalar_event` / `encode_version_event`).

  Returns:
    {'wall_time': float, 'step': int (0 if absent, as in protobuf)} plus 'file_version': str for
    a version event, or 'tag': str and 'value': float for a scalar.
  Raises:
    ValueError: the bytes are not a well-formed protobuf message.
  """
  out = {"wall_time": 0.0, "step": 0}
  for field, v in _fields(data):
    if field == 1:
      out["wall_time"] = struct.unpack("<d", v)[0]
    elif field == 2:
      out["step"] = v - (1 << 64) if v >= 1 << 63 else v
    elif field == 3:
      out["file_version"] = v.decode("utf-8")
    elif field == 5:
      for f, value in _fields(v):
        if f == 1:
          for g, x in _fields(value):
            if g == 1:
              out["tag"] = x.decode("utf-8")
            elif g == 2:
              out["value"] = struct.unpack("<f", x)[0]
  return out


def prune_events(logdir: str, before: int) -> None:
  """Drops the scalars of steps >= `before` from every event file in `logdir` (a resumed run
  writes them again), and a torn last record; a file left with no scalar is removed."""
  if not os.path.isdir(logdir):
    return
  for name in sorted(os.listdir(logdir)):
    if not name.startswith("events.out.tfevents."):
      continue
    path = os.path.join(logdir, name)
    events = [(r, decode_event(r)) for r in read_records(path, torn_tail_ok=True)]
    kept = [r for r, e in events if "tag" not in e or e["step"] < before]
    if len(kept) == sum("tag" not in e for _, e in events):  # no scalar left
      os.remove(path)
      continue
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
      f.write(b"".join(frame_record(r) for r in kept))
    os.replace(tmp, path)


class EventWriter:
  """Appends scalar summaries to one `events.out.tfevents.*` file in `logdir`."""

  def __init__(self, logdir: str):
    os.makedirs(logdir, exist_ok=True)
    now = time.time()
    name = f"events.out.tfevents.{int(now)}.{socket.gethostname()}.{os.getpid()}"
    self.path = os.path.join(logdir, name)
    self._f = open(self.path, "ab")
    self._f.write(frame_record(encode_version_event(now)))
    self._f.flush()

  def scalars(self, step: int, values: Mapping[str, float]) -> None:
    now = time.time()
    for tag, v in values.items():
      self._f.write(frame_record(encode_scalar_event(tag, float(v), step, now)))
    self._f.flush()

  def close(self) -> None:
    if not self._f.closed:
      self._f.close()


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
  if hasattr(v, "item"):
    return _jsonable(v.item())
  return v


def read_jsonl(path: str) -> list[dict]:
  """The rows of a metrics file. A last line without its newline is a write cut short by a kill,
  not a row: it is left out."""
  with open(path, encoding="utf-8") as f:
    lines = f.read().split("\n")
  return [json.loads(line) for line in lines[:-1] if line.strip()]


class MetricsLogger:
  """Writes each iteration's flat metrics dict to `<out>/metrics.jsonl` and `<out>/tb/`.

  On resume, rows (jsonl lines and TensorBoard scalars) of iterations at or after the resumed
  iteration are dropped first: a run killed after logging an iteration but before its checkpoint
  completed logs that iteration again, so each iteration is in the log once.
  With write=False (the other processes of a multi-process run) it only builds the rows.
  """

  def __init__(self, out_dir: str, *, tensorboard: bool = True,
               truncate_from: Optional[int] = None, write: bool = True):
    self.write = write
    self._tb = None
    if not write:
      return
    os.makedirs(out_dir, exist_ok=True)
    self.jsonl_path = os.path.join(out_dir, "metrics.jsonl")
    start = 0 if truncate_from is None else truncate_from  # a fresh run owns the folder's log
    if os.path.exists(self.jsonl_path):
      kept = [r for r in read_jsonl(self.jsonl_path) if r.get("iteration", -1) < start]
      tmp = self.jsonl_path + ".tmp"
      with open(tmp, "w", encoding="utf-8") as f:
        for r in kept:
          f.write(json.dumps(r, sort_keys=True) + "\n")
      os.replace(tmp, self.jsonl_path)
    prune_events(os.path.join(out_dir, "tb"), start)
    self._tb = EventWriter(os.path.join(out_dir, "tb")) if tensorboard else None

  def log(self, iteration: int, metrics: Mapping[str, Any]) -> dict:
    row = {k: _jsonable(v) for k, v in flatten(metrics).items()}
    row["iteration"] = int(iteration)
    if not self.write:
      return row
    with open(self.jsonl_path, "a", encoding="utf-8") as f:
      f.write(json.dumps(row, sort_keys=True) + "\n")
    if self._tb is not None:
      self._tb.scalars(iteration, {k: v for k, v in row.items()
                                   if isinstance(v, (int, float)) and not isinstance(v, bool)
                                   and k != "iteration"})
    return row

  def close(self) -> None:
    if self._tb is not None:
      self._tb.close()


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
    def f(k, fmt="{:.2f}"):
      v = row.get(k)
      return "-" if v is None else fmt.format(v)
    times = " ".join(f"{k.split('/')[1]}={f(k, '{:.1f}s')}" for k in sorted(row)
                     if k.startswith("time/"))
    text = (f"iter {iteration + 1}/{self.total} success={f('success_rate')} "
            f"valid={f('valid_action_ratio')} merge={f('merge_rate')} loss={f('loss', '{:.4f}')} "
            f"kl={f('kl', '{:.4f}')} | {times}")
    if self._bar is not None:
      self._bar.update(1)
      self._bar.set_postfix_str(text)
    else:
      print(text, file=self.stream, flush=True)

  def close(self) -> None:
    if self._bar is not None:
      self._bar.close()
