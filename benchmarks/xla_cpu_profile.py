"""Where a jitted program's time goes on XLA:CPU: its threads' busy time and its ops', from a trace.

XLA:CPU records one event per executed op (a fusion, a dot, a YNNPACK matmul fusion, a while
loop) on the thread that ran it when the process starts with `XLA_FLAGS` holding
`--xla_cpu_enable_xprof_traceme=true` (`TRACE_FLAG`); `jax.profiler.trace(dir)` around some calls
writes them to `<dir>/**/*.xplane.pb`, and `jax.profiler.ProfileData` reads them back (no
TensorBoard plug-in needed). From the op events of XLA's compute threads this reports, per call:

- each thread's busy seconds (the union of its op events) and the seconds during which 0, 1, 2,
  ... threads ran an op: a program that leaves cores idle shows it here, whatever its FLOP rate;
- seconds per op kind (the op name without its `.N` suffix), summed over threads, and how many
  of them ran while no other thread did.

  XLA_FLAGS=--xla_cpu_enable_xprof_traceme=true python my_script.py   # traces into DIR
  python benchmarks/xla_cpu_profile.py DIR --calls 2                  # the summary

`benchmarks/bench_lora.py --profile DIR` does both for the trainer's update step.
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import re
from collections.abc import Iterable
from typing import NamedTuple

TRACE_FLAG = "--xla_cpu_enable_xprof_traceme=true"
# Threads where a program's ops run: XLA:CPU's intra-op pool, and the PjRt client's thread that
# starts each program and runs some of its ops itself (all of a tiny program's).
COMPUTE_THREADS = ("XLAEigen", "XLAPjRtCpuClient")
# Events on those threads that are not ops: the executor's own spans and thread-pool markers.
_NOT_OPS = ("ThunkExecutor", "SlinkyThreadPool", "ThreadpoolListener", "end: ")


class OpEvent(NamedTuple):
  thread: str
  name: str
  start_ns: int
  duration_ns: int


def op_kind(name: str) -> str:
  """'ynn_fusion.1084' -> 'ynn_fusion': an op's kind, without the instance number."""
  return re.sub(r"\.\d+$", "", name)


def read_trace(trace_dir: str) -> list[OpEvent]:
  """The op events of XLA's compute threads in the newest `*.xplane.pb` under `trace_dir`."""
  import jax  # pylint: disable=import-outside-toplevel

  paths = sorted(glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True),
                 key=os.path.getmtime)
  if not paths:
    raise FileNotFoundError(f"no *.xplane.pb under {trace_dir}")
  events = []
  for plane in jax.profiler.ProfileData.from_file(paths[-1]).planes:
    for line in plane.lines:
      if not any(name in line.name for name in COMPUTE_THREADS):
        continue
      events.extend(OpEvent(line.name, ev.name, int(ev.start_ns), int(ev.duration_ns))
                    for ev in line.events if not ev.name.startswith(_NOT_OPS))
  return events


def summarize(events: Iterable[OpEvent], calls: int = 1, top: int = 15,
              cores: int | None = None) -> dict:
  """Per call (all figures divided by `calls`): the span from the first op's start to the last
  op's end, each thread's busy seconds, the seconds with n threads busy (n = 0 .. threads), and
  the `top` op kinds by summed seconds with the seconds each ran alone (no other thread busy).
  `busy_fraction` is the threads' busy seconds over the span times the threads, or times
  `cores` where fewer (the client's thread and the pool's share the machine's cores).

  A thread's nested events (an op inside a while loop's body) count once toward its busy time
  and under the innermost op's kind while alone; `ops` sums every event as recorded.
  """
  if calls < 1:
    raise ValueError(f"calls must be >= 1, got {calls}")
  events = [e for e in events if e.duration_ns >= 0]
  if not events:
    raise ValueError("no op events: was the process started with XLA_FLAGS="
                     f"{TRACE_FLAG} and did the trace hold a call?")
  threads = sorted({e.thread for e in events})
  # Sweep the start and end points in time order; an end sorts before a start at the same time.
  points = sorted([(e.start_ns, 1, i) for i, e in enumerate(events)]
                  + [(e.start_ns + e.duration_ns, -1, i) for i, e in enumerate(events)],
                  key=lambda p: (p[0], p[1]))
  open_on = {t: [] for t in threads}  # per thread, the indices of its open events
  with_n = collections.Counter()
  busy = collections.Counter()
  alone = collections.Counter()
  last = points[0][0]
  for t, step, i in points:
    live = [stack for stack in open_on.values() if stack]
    with_n[len(live)] += t - last
    for thread, stack in open_on.items():
      if stack:
        busy[thread] += t - last
    if len(live) == 1:
      alone[op_kind(events[live[0][-1]].name)] += t - last
    stack = open_on[events[i].thread]
    if step > 0:
      stack.append(i)
    else:
      stack.remove(i)
    last = t
  per_kind = collections.Counter()
  for e in events:
    per_kind[op_kind(e.name)] += e.duration_ns
  seconds = lambda ns: ns / 1e9 / calls  # noqa: E731
  span = points[-1][0] - points[0][0]
  return {
      "calls": calls, "span_s": seconds(span),
      "threads": {t: seconds(busy[t]) for t in threads},
      "busy_fraction": (sum(busy.values()) / (min(len(threads), cores or len(threads)) * span)
                        if span else 0.0),
      "seconds_with_threads_busy": {n: seconds(with_n[n]) for n in range(len(threads) + 1)},
      "ops": [{"kind": k, "seconds": seconds(v), "alone_s": seconds(alone[k])}
              for k, v in per_kind.most_common(top)],
  }


def enable_tracing() -> None:
  """Adds `TRACE_FLAG` to XLA_FLAGS; XLA reads its flags once, so call it before the first
  array or jitted call of the process."""
  os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {TRACE_FLAG}".strip()


def profile_calls(call, calls: int, trace_dir: str, top: int = 15) -> dict:
  """`calls` calls of `call()` under the profiler (each waited on), traced into `trace_dir`:
  their `summarize`d threads and ops, per call. Needs `enable_tracing()` at the process's start."""
  import jax  # pylint: disable=import-outside-toplevel
  with jax.profiler.trace(trace_dir):
    for _ in range(calls):
      jax.block_until_ready(call())
  return summarize(read_trace(trace_dir), calls, top, cores=os.cpu_count())


def print_summary(s: dict) -> None:
  busy = ", ".join(f"{v:.3f} s" for v in s["threads"].values())
  print(f"per call ({s['calls']} traced): span {s['span_s']:.3f} s, threads busy "
        f"{100 * s['busy_fraction']:.0f}% ({busy})")
  print("seconds with n threads busy: " + ", ".join(
      f"{n}: {v:.3f}" for n, v in s["seconds_with_threads_busy"].items()))
  print(f"{'op kind':<36} {'thread-s':>9} {'alone s':>8}")
  for op in s["ops"]:
    print(f"{op['kind'][:36]:<36} {op['seconds']:>9.3f} {op['alone_s']:>8.3f}")


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("trace_dir")
  ap.add_argument("--calls", type=int, default=1, help="calls the trace holds (figures per call)")
  ap.add_argument("--top", type=int, default=15)
  ap.add_argument("--json", action="store_true", help="print the summary as JSON")
  args = ap.parse_args(argv)
  s = summarize(read_trace(args.trace_dir), args.calls, args.top, cores=os.cpu_count())
  if args.json:
    print(json.dumps(s))
  else:
    print_summary(s)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
