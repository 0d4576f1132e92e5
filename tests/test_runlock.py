"""One process per run folder (`salt_jax.runlock`): the lock between processes, a second trainer
on a folder in training refused at once, `--resume` right after a `kill -9`, the warm start's
folder locked from one trainer to the next, and exports refused where they would overwrite.

The processes are real subprocesses (flock is per open file, so one process cannot stand for
two); a toy trainer is the tiny random policy of two iterations of one task, G = 2.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from salt_jax import cli
from salt_jax import export
from salt_jax import runlock
from salt_jax import sft
from salt_jax.train import Trainer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HOST = socket.gethostname()

# Holds a RunLock on argv[1], says so on stdout, and waits to be killed.
HOLD = """
import sys, time
from salt_jax.runlock import RunLock
RunLock(sys.argv[1]).acquire()
print("held", flush=True)
time.sleep(3600)
"""

# Whether another process could lock the folder argv[1] now (the OS lock alone; it creates nothing).
PROBE = """
import fcntl, os, sys
try:
  fd = os.open(os.path.join(sys.argv[1], ".salt_jax.lock"), os.O_RDONLY)
except FileNotFoundError:
  print("free")
  sys.exit()
try:
  fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
  print("free")
except BlockingIOError:
  print("locked")
"""


def _hold(folder):
  """A subprocess holding `folder`'s lock (it has said so when this returns)."""
  proc = subprocess.Popen([sys.executable, "-c", HOLD, str(folder)], cwd=ROOT,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  line = proc.stdout.readline()
  assert line == "held\n", (line, proc.stderr.read() if proc.poll() is not None else "")
  return proc


def _kill9(proc):
  if proc.poll() is None:
    os.kill(proc.pid, signal.SIGKILL)
  proc.wait(timeout=60)
  for f in (proc.stdout, proc.stderr):
    if f is not None:
      f.close()


def _free_elsewhere(folder) -> bool:
  """Could another process lock `folder` now?"""
  p = subprocess.run([sys.executable, "-c", PROBE, str(folder)], capture_output=True, text=True,
                     timeout=60, check=True)
  return {"free": True, "locked": False}[p.stdout.strip()]


pytestmark = pytest.mark.usefixtures("salt_jax_logger_restored")  # main() re-points it


# ----------------------------------------------------------------------------- the lock itself


def test_another_process_is_refused_with_the_holder_until_it_is_killed(tmp_path):
  folder = tmp_path / "run"
  proc = _hold(folder)
  try:
    with pytest.raises(runlock.RunInUse) as e:
      runlock.RunLock(str(folder)).acquire()
    assert str(e.value).startswith(f"{folder} is in use by another salt-jax process "
                                   f"(pid {proc.pid} on host {HOST}, since ")
    assert "\n" not in str(e.value)
    assert isinstance(e.value, ValueError)  # the command line's one-line errors
    assert runlock.holder(str(folder)).startswith(f"pid {proc.pid} on host {HOST}")
  finally:
    _kill9(proc)
  # The kernel let go with the process: no wait, although its lock file is still there.
  assert os.path.exists(folder / runlock.LOCK_FILE)
  assert runlock.holder(str(folder)) is None
  with runlock.RunLock(str(folder)) as lock:
    assert lock.held and not _free_elsewhere(folder)
    with open(folder / runlock.LOCK_FILE, encoding="utf-8") as f:
      assert json.load(f)["pid"] == os.getpid()  # the holder now, not the dead one
  assert _free_elsewhere(folder)
  assert not os.path.exists(folder / runlock.LOCK_FILE)  # a clean release leaves no file


def test_release_frees_the_folder_after_the_last_hold_of_this_process(tmp_path):
  folder = tmp_path / "run"
  first = runlock.RunLock(str(folder)).acquire()
  second = runlock.RunLock(str(tmp_path / "." / "run")).acquire()  # the same folder: re-entrant
  assert os.path.isdir(folder) and not _free_elsewhere(folder)
  first.release()
  first.release()  # twice is once
  assert not _free_elsewhere(folder)
  second.release()
  assert _free_elsewhere(folder) and os.listdir(folder) == []
  proc = _hold(folder)  # and another process takes it at once
  _kill9(proc)


def test_a_stale_lock_file_does_not_block(tmp_path):
  folder = tmp_path / "run"
  folder.mkdir()
  (folder / runlock.LOCK_FILE).write_text(json.dumps(
      {"pid": 999999, "host": HOST, "since": "2020-01-01 00:00:00"}))
  assert runlock.holder(str(folder)) is None
  with runlock.RunLock(str(folder)):
    with open(folder / runlock.LOCK_FILE, encoding="utf-8") as f:
      assert json.load(f)["pid"] == os.getpid()
  proc = _hold(folder)
  _kill9(proc)


# ----------------------------------------------------------------------------- trainers

TOY_FLAGS = ["--env=toy", '--env-kwargs={"num_rooms": 3}', "--tokenizer=toy", "--group-size=2",
             "--tasks-per-iter=1", "--num-train-tasks=2", "--max-steps=2", "--max-new-tokens=8",
             "--max-cache-len=128", "--prompt-bucket-min=64", "--env-workers=0", "--iters=2",
             "--checkpoint-every=1", "--no-progress", "--no-tensorboard"]

# The command line, paused for good (argv[1] written) once checkpoint 1 is complete.
PAUSED_CLI = """
import os, sys, time
from salt_jax import cli
from salt_jax.train import Trainer
marker = sys.argv[1]
save = Trainer.save
def save_then_pause(self):
  save(self)
  self.checkpoints.wait()
  with open(marker + ".tmp", "w") as f:
    f.write(str(self.iteration_index))
  os.replace(marker + ".tmp", marker)
  time.sleep(3600)
Trainer.save = save_then_pause
sys.exit(cli.main(sys.argv[2:]))
"""

CLI = "import sys; from salt_jax import cli; sys.exit(cli.main(sys.argv[1:]))"


def _env(work):
  """The trainer processes share compiled programs (a cache in `work`)."""
  return dict(os.environ, JAX_COMPILATION_CACHE_DIR=str(work / "jax_cache"),
              JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
              JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="-1")


def _cli(work, *flags):
  return subprocess.run([sys.executable, "-c", CLI, *TOY_FLAGS, *flags], cwd=ROOT,
                        env=_env(work), capture_output=True, text=True, timeout=600, check=False)


def test_second_trainer_is_refused_and_resume_follows_a_kill(tmp_path, capsys):
  out = tmp_path / "run"
  marker = tmp_path / "paused"
  log = open(tmp_path / "holder.log", "w+", encoding="utf-8")  # pylint: disable=consider-using-with
  holder = subprocess.Popen([sys.executable, "-c", PAUSED_CLI, str(marker), *TOY_FLAGS,
                             f"--out={out}"], cwd=ROOT, env=_env(tmp_path), stdout=log,
                            stderr=subprocess.STDOUT)
  try:
    deadline = time.monotonic() + 600
    while not marker.exists():
      if holder.poll() is not None or time.monotonic() > deadline:
        _kill9(holder)
        log.seek(0)
        raise AssertionError(f"the holder never paused:\n{log.read()[-3000:]}")
      time.sleep(0.1)
    assert marker.read_text() == "1"
    before = {n: (out / n).read_bytes() for n in ("config.json", "metrics.jsonl")}

    # The same command again, and a resume: refused before any work, in one line.
    for extra in ([], ["--resume"]):
      p = _cli(tmp_path, f"--out={out}", *extra)
      assert p.returncode != 0, (extra, p.stdout[-2000:], p.stderr[-2000:])
      assert "Traceback" not in p.stderr, p.stderr[-3000:]
      errors = [line for line in p.stderr.splitlines() if line.startswith("error:")]
      assert errors == [p.stderr.strip().splitlines()[-1]], p.stderr[-3000:]
      assert errors[0].startswith(f"error: {out} is in use by another salt-jax process (pid "
                                  f"{holder.pid} on host {HOST}, since "), errors
      assert errors[0].endswith("wait for it or pick another --out")
    assert {n: (out / n).read_bytes() for n in before} == before  # nothing written

    # An export into it: refused, naming the holder.
    assert export.main(["--run", str(out), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"error: {out} is in use by another salt-jax process (pid "
                              f"{holder.pid} on "), err
  finally:
    _kill9(holder)
    log.close()

  # kill -9 freed it: the resume starts at once and finishes the run.
  p = _cli(tmp_path, f"--out={out}", "--resume")
  assert p.returncode == 0, p.stderr[-3000:]
  with open(out / "metrics.jsonl", encoding="utf-8") as f:
    assert [json.loads(line)["iteration"] for line in f] == [0, 1]
  assert not os.path.exists(out / runlock.LOCK_FILE)


def test_warm_start_keeps_the_folder_locked_between_its_trainers(tmp_path, monkeypatch):
  """`--sft-warmstart` closes the trainer it checked the flags with and builds one on the cloned
  params: no other process could take the folder in between."""
  out = tmp_path / "run"
  seen = []

  def warm_start(cfg, **_):
    seen.append(("warm start", _free_elsewhere(out)))
    path = out / sft.SFT_SUBDIR
    path.mkdir()
    return str(path)

  close = Trainer.close

  def close_and_look(self):
    close(self)
    seen.append(("closed", _free_elsewhere(out)))

  class Stop(Exception):
    pass

  def setup(self):
    raise Stop()

  monkeypatch.setattr(sft, "warm_start", warm_start)
  monkeypatch.setattr(Trainer, "close", close_and_look)
  monkeypatch.setattr(Trainer, "setup", setup)
  with pytest.raises(Stop):
    cli.main([*TOY_FLAGS, "--sft-warmstart", f"--out={out}"])
  # the first trainer closed with the folder still locked; the second one freed it
  assert seen == [("warm start", False), ("closed", False), ("closed", True)]


# ----------------------------------------------------------------------------- export


def test_export_refuses_a_run_folder_and_a_folder_with_files(tmp_path, capsys):
  run = tmp_path / "run"
  (run / "checkpoints").mkdir(parents=True)
  (run / "config.json").write_text('{"env": "toy"}')
  other = tmp_path / "other"
  other.mkdir()
  (other / "notes.txt").write_text("mine")
  for out, what in ((run, "is a training run's folder"), (other, "is not empty")):
    # refused before the run is read: --run needs no checkpoint here
    assert export.main(["--run", str(run), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: --out {out} {what}"), err
  assert (run / "config.json").read_text() == '{"env": "toy"}'
  assert sorted(os.listdir(run)) == ["checkpoints", "config.json"]
  assert os.listdir(other) == ["notes.txt"]
