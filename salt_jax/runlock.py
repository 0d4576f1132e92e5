"""One process per run folder: an OS file lock on `<folder>/.salt_jax.lock` for a run's life.

Two trainers writing one `--out` would interleave their metrics rows and overwrite each other's
checkpoints, so a run holds this lock from its `Trainer` until `close()` and a second trainer,
resume or warm start into the folder is refused at once with `RunInUse`, naming the holder:

  runs/x is in use by another salt-jax process (pid 1234 on host h, since 2026-12-04 14:00:00);
  wait for it or pick another --out

The lock is `flock(LOCK_EX | LOCK_NB)`, which the kernel releases when its process ends, however
it ends: after `kill -9`, `--resume` starts at once, and a lock file left by a dead process does
not block. The file records the holder (pid, host, start time, command) only to name it in the
refusal. A clean release deletes the file, so a finished run's folder holds only its own files.

Within one process the lock is re-entrant (a count per folder, keyed by its real path): the
command line holds it across the warm start and the trainer that follows (`cli.main`), and a test
or notebook may open a second `Trainer` on a folder it already trains in.
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import json
import os
import socket
import sys
import threading
import time
from typing import Optional

LOCK_FILE = ".salt_jax.lock"


class RunInUse(ValueError):
  """The folder is locked by another process (a ValueError: the command line prints it as one
  `error:` line)."""


@dataclasses.dataclass
class _Held:
  fd: int
  path: str
  count: int
  holder: str  # as `_holder_text` words it


_HELD: dict[str, _Held] = {}  # real path of a folder -> this process's hold on it
_REGISTRY = threading.Lock()


def _forget_in_child() -> None:
  """A forked child shares its parent's lock (flock belongs to the open file, not the process):
  it closes its copies without unlocking, so the lock still ends with the parent."""
  global _REGISTRY  # pylint: disable=global-statement
  for held in _HELD.values():
    try:
      os.close(held.fd)
    except OSError:
      pass
  _HELD.clear()
  _REGISTRY = threading.Lock()  # another thread may have held it at the fork


if hasattr(os, "register_at_fork"):
  os.register_at_fork(after_in_child=_forget_in_child)


def _describe(info: dict) -> str:
  return f"pid {info['pid']} on host {info['host']}, since {info['since']}"


def _holder_text(fd: int) -> str:
  """The holder as it wrote itself ("pid P on host H, since T"); it writes just after locking, so
  an empty or half-read file is read again for up to a second."""
  for _ in range(20):
    try:
      return _describe(json.loads(os.pread(fd, 65536, 0).decode("utf-8")))
    except (ValueError, KeyError, TypeError, OSError):
      time.sleep(0.05)
  return "holder unknown"


def in_use(folder: str, holder: str) -> RunInUse:
  """The refusal of a folder that `holder` ("pid P on host H, since T") holds."""
  return RunInUse(f"{folder} is in use by another salt-jax process ({holder}); wait for it or "
                  "pick another --out")


def holder(folder: str) -> Optional[str]:
  """Who holds `folder`'s lock now ("pid P on host H, since T"; this process too), None if nobody.

  It looks without locking when it can: only a lock file that is there is tried, with a shared
  lock given back at once (an acquisition at that very moment would be refused).
  """
  key = os.path.realpath(folder)
  with _REGISTRY:
    if key in _HELD:
      return _HELD[key].holder
  try:
    fd = os.open(os.path.join(key, LOCK_FILE), os.O_RDONLY)
  except (FileNotFoundError, NotADirectoryError):
    return None
  try:
    fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
  except OSError as e:
    if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
      raise
    return _holder_text(fd)
  finally:
    os.close(fd)  # gives the shared lock back too
  return None


def _lock_file(folder: str, path: str) -> int:
  """An open descriptor of `path` holding its exclusive flock; RunInUse if another holds it."""
  while True:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
      if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
        os.close(fd)
        raise
      who = _holder_text(fd)
      os.close(fd)
      raise in_use(folder, who) from None
    # A releasing holder deletes the file before unlocking it: a lock on a file no longer at
    # `path` guards nothing, so open the new one.
    try:
      if os.path.samestat(os.fstat(fd), os.stat(path)):
        return fd
    except FileNotFoundError:
      pass
    os.close(fd)


class RunLock:
  """This process's hold on a run folder: `with RunLock(out): ...`, or `acquire()` / `release()`.

  `acquire` creates the folder if needed and raises `RunInUse` if another process holds it;
  `release` (idempotent) gives the hold back, and the lock goes when this process's last hold on
  the folder does.
  """

  def __init__(self, folder: str):
    self.folder = folder
    self.held = False
    self._key: Optional[str] = None

  def acquire(self) -> "RunLock":
    if self.held:
      return self
    os.makedirs(self.folder, exist_ok=True)
    key = os.path.realpath(self.folder)
    with _REGISTRY:
      if key in _HELD:
        _HELD[key].count += 1
      else:
        path = os.path.join(key, LOCK_FILE)
        fd = _lock_file(self.folder, path)
        info = {"pid": os.getpid(), "host": socket.gethostname(),
                "since": time.strftime("%Y-%m-%d %H:%M:%S"), "command": getattr(sys, "argv", [])}
        try:
          os.ftruncate(fd, 0)
          os.pwrite(fd, json.dumps(info).encode("utf-8"), 0)
        except OSError:
          os.close(fd)
          raise
        _HELD[key] = _Held(fd, path, 1, _describe(info))
    self._key, self.held = key, True
    return self

  def release(self) -> None:
    if not self.held:
      return
    self.held = False
    with _REGISTRY:
      held = _HELD.get(self._key)
      if held is None:  # forgotten in a forked child: the parent holds it
        return
      held.count -= 1
      if held.count:
        return
      del _HELD[self._key]
      try:  # deleted while still locked (see `_lock_file`)
        os.unlink(held.path)
      except FileNotFoundError:
        pass
      os.close(held.fd)

  def __enter__(self) -> "RunLock":
    return self.acquire()

  def __exit__(self, *exc) -> None:
    self.release()
