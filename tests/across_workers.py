"""What several test files build the same way (a behaviour-cloned policy), made once per test run
and shared by pytest-xdist's workers: the first to ask builds it under a file lock while the
others wait, then all read it.

The folder is the test run's (tests/conftest.py makes it and removes it at exit), so a run under
another XLA instruction set, whose clones round differently, builds its own.
"""

import fcntl
import os
import shutil
from typing import Callable

ENV = "SALT_JAX_TESTS_SHARED"  # the run's folder, set by tests/conftest.py for every worker


def once(name: str, build: Callable[[str], None]) -> str:
  """The folder `name` in this test run's shared folder, filled by `build(folder)` the first time
  any worker asks for it. A build that raised leaves nothing behind: the next caller builds
  again (and raises the same error)."""
  if not name or os.sep in name or name.startswith("."):
    raise ValueError(f"a plain folder name, not {name!r}")
  path = os.path.join(os.environ[ENV], name)
  with open(path + ".lock", "w", encoding="utf-8") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
    if not os.path.isdir(path):
      partial = path + ".partial"
      shutil.rmtree(partial, ignore_errors=True)
      os.makedirs(partial)
      try:
        build(partial)
      except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
      os.rename(partial, path)  # whole or absent
  return path
