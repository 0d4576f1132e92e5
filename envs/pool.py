"""Environment instances spread over worker processes, stepped in batches, robust to bad workers.

`EnvPool` owns many environment instances, each addressed by an integer *slot* (one slot plays one
trajectory). Slot s lives in worker s % num_workers. `reset_batch` / `step_batch` send every
worker its share at once and gather the answers, so environments step in parallel across cores
while the caller (the agent loop) sees one call per turn.

Failure handling, per worker:
  - An exception inside one environment call fails only that slot (its result has `failed=True`
    and the traceback in `error`).
  - A worker that dies (os._exit, segfault, OOM kill) or stays silent longer than the timeout is
    killed and restarted. The slot whose call was running is failed; slots that already answered
    in this batch keep their answer; slots still queued behind it are run again on the new worker.
  - The restarted worker has lost every environment instance. Environments are deterministic
    given (task, seed, actions), so the pool replays each surviving slot's history into the new
    worker (`replay_on_restart`) and checks that the replay ends on the observation recorded
    before; a slot whose replay fails or diverges is failed (so is every live slot of the worker
    when replay is off). A failed slot stays failed: stepping it again fails at once.
Nothing blocks longer than the timeouts, and (with replay) a failed slot never takes another along.

Workers start with 'spawn' (or 'forkserver'): forking a parent that has initialized jax is unsafe.
Spawned workers re-import the main module, so a script that makes a pool with workers needs the
usual `if __name__ == "__main__":` guard. Each answer is one pipe message, negligible next to an
ALFWorld step, so workers cost nothing noticeable where the environment is the slow part.
`num_workers=0` runs every instance in the calling process (tests, debugging): exceptions are
still caught per slot, but a crash or hang there takes the caller with it.
"""

from __future__ import annotations

import collections
import dataclasses
import multiprocessing as mp
import time
import traceback
from multiprocessing.connection import wait
from typing import Any, Optional, Sequence

from envs import registry
from envs.base import EnvStep, Task, TextEnv

@dataclasses.dataclass(frozen=True)
class PoolStep(EnvStep):
  """An `EnvStep` plus the pool's verdict. A failed result has done=True and valid=False.

  failed: the slot's environment or worker failed (crash, hang, exception); the trajectory must
    be kept out of training. `error` says why.
  """

  failed: bool = False
  error: str = ""

  @classmethod
  def from_env_step(cls, s: EnvStep) -> "PoolStep":
    return cls(observation=str(s.observation), reward=float(s.reward), done=bool(s.done),
               won=bool(s.won), valid=bool(s.valid),
               score=None if s.score is None else float(s.score),
               admissible_actions=None if s.admissible_actions is None else
               tuple(str(a) for a in s.admissible_actions))

  @classmethod
  def failure(cls, error: str) -> "PoolStep":
    return cls(observation="", done=True, valid=False, failed=True, error=error)


def _call_env(envs: dict, env_name: str, env_kwargs: dict, kind: str, item: tuple) -> tuple:
  """One reset/step/replay on the instance of `item`'s slot: ("ok", EnvStep) or ("err", str)."""
  try:
    slot = item[0]
    if kind == "step":
      env = envs.get(slot)
      if env is None:
        return ("err", f"slot {slot} has no environment in this worker (not reset)")
      return ("ok", env.step(item[1]))
    env = envs.get(slot)
    if env is None:
      env = envs[slot] = registry.make_env(env_name, **env_kwargs)
    out = env.reset(item[1], item[2])
    if kind == "replay":
      for action in item[3]:
        out = env.step(action)
    return ("ok", out)
  except Exception:  # pylint: disable=broad-except  (SystemExit/KeyboardInterrupt go through)
    return ("err", traceback.format_exc(limit=8))


def _worker_main(conn, env_name: str, env_kwargs: dict) -> None:
  """Worker loop: (kind, items) in; one (index, status, payload) message per item out.

  Answering per item (not per batch) lets the parent tell which call a crash or hang hit.
  """
  envs: dict[int, TextEnv] = {}
  while True:
    try:
      kind, items = conn.recv()
    except (EOFError, OSError, KeyboardInterrupt):
      break
    if kind == "close":
      break
    for i, item in enumerate(items):
      status, payload = _call_env(envs, env_name, env_kwargs, kind, item)
      conn.send((i, status, payload))
  for env in envs.values():
    try:
      env.close()
    except Exception:  # pylint: disable=broad-except
      pass


@dataclasses.dataclass
class _Slot:
  task: Task
  seed: int
  actions: list  # every action stepped since reset: the replay log
  failed: bool = False
  error: str = ""
  done: bool = False  # a finished episode needs no rebuilding after a restart
  last_observation: str = ""  # what a replay must end on


class _Worker:
  """One worker process and the parent's end of its pipe."""

  def __init__(self, ctx, env_name: str, env_kwargs: dict):
    self.conn, child = ctx.Pipe(duplex=True)
    self.proc = ctx.Process(target=_worker_main, args=(child, env_name, env_kwargs), daemon=True)
    self.proc.start()
    child.close()  # so that the worker's death reads as EOF here

  def kill(self) -> None:
    if self.proc.is_alive():
      self.proc.kill()
    self.proc.join(timeout=5.0)
    self.conn.close()


class EnvPool:
  """Many environment instances in `num_workers` processes (0: in-process).

  Args:
    env_name: "toy", "module:Class" or a name `envs.registry.make_env` knows.
    env_kwargs: keyword arguments for each environment instance.
    num_workers: worker processes; 0 runs everything in this process.
    step_timeout_s: a worker that answers no step within this many seconds is declared hung.
    reset_timeout_s: the same for reset (game loading is slower) and for replays after a restart.
    start_method: 'spawn' or 'forkserver'.
    replay_on_restart: rebuild surviving slots on a restarted worker by replaying their actions.
  """

  def __init__(self, env_name: str, env_kwargs: Optional[dict] = None, num_workers: int = 1, *,
               step_timeout_s: float = 60.0, reset_timeout_s: float = 300.0,
               start_method: str = "spawn", replay_on_restart: bool = True):
    if num_workers < 0:
      raise ValueError(f"num_workers must be >= 0, got {num_workers}")
    if step_timeout_s <= 0 or reset_timeout_s <= 0:
      raise ValueError("step_timeout_s and reset_timeout_s must be > 0")
    if start_method not in ("spawn", "forkserver"):
      raise ValueError(f"start_method must be 'spawn' or 'forkserver' (fork is unsafe with jax), "
                       f"got {start_method!r}")
    self.env_name = env_name
    self.env_kwargs = dict(env_kwargs or {})
    self.num_workers = num_workers
    self.step_timeout_s = float(step_timeout_s)
    self.reset_timeout_s = float(reset_timeout_s)
    self.replay_on_restart = replay_on_restart
    self.restarts = 0  # worker restarts so far (crashes + hangs)
    self._slots: dict[int, _Slot] = {}
    self._local: dict[int, TextEnv] = {}
    self._ctx = mp.get_context(start_method)
    self._workers = [_Worker(self._ctx, env_name, self.env_kwargs) for _ in range(num_workers)]
    self._closed = False

  # ---- public API ----

  def reset_batch(self, items: Sequence[tuple[int, Task, int]]) -> list[PoolStep]:
    """Resets slots. items: [(slot, task, seed)], slots distinct. Returns one result per item."""
    self._check_open()
    items = [(int(s), t, int(seed)) for s, t, seed in items]
    self._check_distinct([s for s, _, _ in items])
    for s, t, _ in items:
      if not isinstance(t, Task):
        raise TypeError(f"slot {s}: task must be an envs.base.Task, got {type(t).__name__}")
    for s, t, seed in items:  # a reset revives a failed slot
      self._slots[s] = _Slot(task=t, seed=seed, actions=[])
    return self._run("reset", items, self.reset_timeout_s)

  def step_batch(self, items: Sequence[tuple[int, str]]) -> list[PoolStep]:
    """Steps slots. items: [(slot, action)], slots distinct and reset. One result per item."""
    self._check_open()
    items = [(int(s), a) for s, a in items]
    self._check_distinct([s for s, _ in items])
    for s, a in items:
      if s not in self._slots:
        raise ValueError(f"slot {s} was never reset")
      if not isinstance(a, str):
        raise TypeError(f"slot {s}: action must be a str, got {type(a).__name__}")
    live = [(s, a) for s, a in items if not self._slots[s].failed]
    answers = dict(zip([s for s, _ in live], self._run("step", live, self.step_timeout_s)))
    return [answers[s] if s in answers else
            PoolStep.failure(f"slot {s} had failed before: {self._slots[s].error}")
            for s, _ in items]

  def close(self) -> None:
    if self._closed:
      return
    self._closed = True
    for w in self._workers:
      try:
        w.conn.send(("close", []))
      except (OSError, ValueError):
        pass
    for w in self._workers:
      w.proc.join(timeout=2.0)
      w.kill()
    for env in self._local.values():
      try:
        env.close()
      except Exception:  # pylint: disable=broad-except
        pass

  def __enter__(self) -> "EnvPool":
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  # ---- internals ----

  def _check_open(self) -> None:
    if self._closed:
      raise RuntimeError("EnvPool is closed")

  @staticmethod
  def _check_distinct(slots: list[int]) -> None:
    dup = [s for s, c in collections.Counter(slots).items() if c > 1]
    if dup:
      raise ValueError(f"slots must be distinct within one batch, repeated: {dup}")

  def _record(self, kind: str, item: tuple, r: PoolStep) -> PoolStep:
    """Keeps the slot's replay log and failed flag current as each answer arrives."""
    s = self._slots[item[0]]
    if r.failed:
      s.failed, s.error = True, r.error
    else:
      s.done = r.done
      if kind != "replay":
        s.last_observation = r.observation
      if kind == "step":
        s.actions.append(item[1])
    return r

  def _run(self, kind: str, items: list[tuple], timeout_s: float) -> list[PoolStep]:
    if self.num_workers == 0:
      return [self._record(kind, it, self._to_result(
          *_call_env(self._local, self.env_name, self.env_kwargs, kind, it))) for it in items]
    by_worker: dict[int, list[int]] = collections.defaultdict(list)  # worker -> item indices
    for i, it in enumerate(items):
      by_worker[it[0] % self.num_workers].append(i)
    results: list[Optional[PoolStep]] = [None] * len(items)
    pending: dict[int, collections.deque] = {}
    deadline: dict[int, float] = {}
    for w, idx in by_worker.items():
      self._send(w, kind, [items[i] for i in idx])
      pending[w] = collections.deque(idx)
      deadline[w] = time.monotonic() + timeout_s
    while pending:
      conns = {self._workers[w].conn: w for w in pending}
      wait_s = max(0.0, min(deadline.values()) - time.monotonic())
      for conn in wait(list(conns), timeout=wait_s):
        w = conns[conn]
        while w in pending:  # drain what is there: one wait() per burst, not per answer
          try:
            if not conn.poll(0):
              break
            _, status, payload = conn.recv()
          except (EOFError, OSError):
            self._fail_worker(w, kind, items, pending, deadline, results, timeout_s, "died")
            break
          i = pending[w].popleft()
          results[i] = self._record(kind, items[i], self._to_result(status, payload))
          deadline[w] = time.monotonic() + timeout_s  # each answer restarts the clock
          if not pending[w]:
            del pending[w], deadline[w]
      now = time.monotonic()
      # Data already waiting is an answer, not a hang (the clock ran while we restarted another).
      for w in [w for w, d in deadline.items() if d <= now and not self._workers[w].conn.poll(0)]:
        self._fail_worker(w, kind, items, pending, deadline, results, timeout_s,
                          f"hung (no answer in {timeout_s:.1f} s)")
    return results

  def _send(self, w: int, kind: str, items: list[tuple]) -> None:
    try:
      self._workers[w].conn.send((kind, items))
    except (OSError, ValueError):
      pass  # a dead worker: the wait loop sees EOF and handles it

  def _fail_worker(self, w, kind, items, pending, deadline, results, timeout_s, why) -> None:
    """Kills worker w, fails its running item, restarts it, replays survivors, resends the rest."""
    queue = pending.pop(w)
    deadline.pop(w)
    code = self._workers[w].proc.exitcode
    self._workers[w].kill()
    culprit = queue.popleft()
    results[culprit] = self._record(kind, items[culprit], PoolStep.failure(
        f"worker {w} {why}{'' if code is None else f' (exit code {code})'} during {kind} of "
        f"slot {items[culprit][0]}"))
    self.restarts += 1
    self._workers[w] = _Worker(self._ctx, self.env_name, self.env_kwargs)
    # Survivors: every other live slot of this worker, rebuilt from its replay log (which already
    # holds the steps answered in this batch). Slots queued for reset/replay are simply resent.
    queued = {items[i][0] for i in queue}
    survivors = [(s, info.task, info.seed, list(info.actions))
                 for s, info in self._slots.items()
                 if s % self.num_workers == w and not info.failed and not info.done
                 and not (kind != "step" and s in queued)]
    lost = []
    if survivors and self.replay_on_restart:
      replayed = self._run("replay", survivors, self.reset_timeout_s + timeout_s * max(
          len(a) for *_, a in survivors))
      lost = [(item[0], r.error or "replay diverged: a different final observation")
              for item, r in zip(survivors, replayed)
              if r.failed or r.observation != self._slots[item[0]].last_observation]
    elif survivors:
      lost = [(item[0], "replay_on_restart is off") for item in survivors]
    for s, err in lost:
      msg = f"worker {w} restarted and slot {s} could not be rebuilt: {err}"
      self._slots[s].failed, self._slots[s].error = True, msg  # (a replay failure marked it too)
      for i in list(queue):
        if items[i][0] == s:
          results[i] = PoolStep.failure(msg)
          queue.remove(i)
      for i in range(len(items)):
        if items[i][0] == s and results[i] is not None and not results[i].failed:
          results[i] = PoolStep.failure(msg)  # answered, but its instance is gone
    if queue:
      self._send(w, kind, [items[i] for i in queue])
      pending[w] = queue
      deadline[w] = time.monotonic() + timeout_s

  @staticmethod
  def _to_result(status: str, payload: Any) -> PoolStep:
    if status == "ok" and isinstance(payload, EnvStep):
      return PoolStep.from_env_step(payload)
    if status == "ok":
      return PoolStep.failure(f"environment returned {type(payload).__name__}, not EnvStep")
    return PoolStep.failure(str(payload))
