"""Test setup: 8 simulated CPU devices, so mesh tests (4x2) run on any machine; one XLA
compilation cache for the whole test run.

XLA reads the flag once, when jax is first imported, so it is set here before anything imports jax.

The tests build the same small programs many times over (a toy trainer's sampler, log-prob and
update programs in most test files, and again in every trainer that a test starts as a
subprocess), so the run keeps jax's persistent compilation cache in one temporary folder that the
xdist workers and the subprocesses they start share (an environment variable jax reads on import).
The process that loads this file first (pytest's, or xdist's controller) makes the folder and
removes it at exit. jax's cache key holds the program, the devices, jax's version and XLA_FLAGS,
so a run under another instruction set (`--xla_cpu_max_isa`) never loads these programs; a test
that sets a cache of its own (`use_compilation_cache`) puts this one back after. In the same way
the run keeps one folder for what several test files build alike (`tests/across_workers.py`).
"""

import atexit
import os
import shutil
import tempfile

_flag = "--xla_force_host_platform_device_count=8"
if _flag not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache = tempfile.mkdtemp(prefix="salt_jax_tests_xla_")
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")
  atexit.register(shutil.rmtree, _cache, ignore_errors=True)
if "SALT_JAX_TESTS_SHARED" not in os.environ:
  os.environ["SALT_JAX_TESTS_SHARED"] = _shared = tempfile.mkdtemp(prefix="salt_jax_tests_shared_")
  atexit.register(shutil.rmtree, _shared, ignore_errors=True)


import importlib.util  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture
def hide_package(monkeypatch):
  """hide_package('name'): make `importlib.util.find_spec('name')` report the package as absent,
  to test the clear error a missing optional asset package gives."""
  real = importlib.util.find_spec

  def hide(package: str) -> None:
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == package else real(name, *a))
  return hide



@pytest.fixture(scope="session")
def tf4():
  """tf4(script, *args): runs `script` in a Python with transformers 4.x and torch (without this
  one's PYTHONPATH) and returns its last stdout line: checks that our Hugging Face folders load
  there too. The Python is `$SALT_JAX_TF4_PYTHON`, default /work/venv_tf4/bin/python (make one
  with `python -m venv --system-site-packages V && V/bin/pip install transformers==4.57.1
  jinja2`); the test is skipped without it."""
  import subprocess  # pylint: disable=import-outside-toplevel
  python = os.environ.get("SALT_JAX_TF4_PYTHON", "/work/venv_tf4/bin/python")
  if not os.path.exists(python):
    pytest.skip(f"no transformers 4.x Python at {python} (set $SALT_JAX_TF4_PYTHON)")
  env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}

  def run(script: str, *args: str) -> str:
    done = subprocess.run([python, "-c", script, *args], capture_output=True, text=True,
                          env=env, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip().splitlines()[-1]
  return run


@pytest.fixture
def salt_jax_logger_restored():
  """The salt_jax logger's handlers, level and propagation as they were before the test: the
  command lines (cli.main, export.main) point it at the test's captured stderr."""
  import logging  # pylint: disable=import-outside-toplevel
  logger = logging.getLogger("salt_jax")
  saved = (list(logger.handlers), logger.level, logger.propagate)
  yield
  logger.handlers[:] = saved[0]
  logger.setLevel(saved[1])
  logger.propagate = saved[2]
