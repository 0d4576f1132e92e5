"""tests/across_workers.py: what the test files share is built once per test run."""

import os
import subprocess
import sys
import time

import pytest

from tests import across_workers


@pytest.fixture
def shared(tmp_path, monkeypatch):
  monkeypatch.setenv(across_workers.ENV, str(tmp_path))
  return tmp_path


def _slow_build(folder):
  with open(os.path.join(folder, "built_by"), "w", encoding="utf-8") as f:
    f.write(str(os.getpid()))
  time.sleep(0.5)  # long enough that the other caller asks while this one builds
  with open(os.path.join(os.path.dirname(folder), "builds"), "a", encoding="utf-8") as f:
    f.write("1")


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ASK = ("from tests import across_workers, test_across_workers as t; "
       "print(across_workers.once('artifact', t._slow_build))")


def test_two_processes_asking_at_once_share_one_build(shared):
  workers = [subprocess.Popen([sys.executable, "-c", ASK], cwd=ROOT, stdout=subprocess.PIPE,
                              text=True) for _ in range(2)]  # the environment names `shared`
  paths = [w.communicate(timeout=120)[0].strip() for w in workers]
  assert [w.returncode for w in workers] == [0, 0]
  assert paths[0] == paths[1] == str(shared / "artifact")
  assert (shared / "builds").read_text() == "1"  # built once; the other caller waited for it
  assert (shared / "artifact" / "built_by").exists()
  assert across_workers.once("artifact", _slow_build) == paths[0]  # later callers read it
  assert (shared / "builds").read_text() == "1"


def test_a_failed_build_leaves_nothing_and_the_next_caller_builds(shared):
  def broken(folder):
    open(os.path.join(folder, "half"), "w", encoding="utf-8").close()
    raise RuntimeError("out of disk")
  with pytest.raises(RuntimeError, match="out of disk"):
    across_workers.once("artifact", broken)
  assert sorted(p.name for p in shared.iterdir()) == ["artifact.lock"]
  path = across_workers.once("artifact", lambda f: open(os.path.join(f, "ok"), "w").close())
  assert os.listdir(path) == ["ok"]


@pytest.mark.parametrize("name", ["", "a/b", ".hidden"])
def test_names_must_be_plain_folder_names(shared, name):
  with pytest.raises(ValueError, match="plain folder name"):
    across_workers.once(name, lambda f: None)
