"""salt_jax.log: the level from a flag or $SALT_JAX_LOG_LEVEL, one handler however often it is set
up, and an application's own logging setup left alone; progress bars, and no tqdm warning in a
notebook without ipywidgets."""

import importlib
import io
import logging
import sys
import types
import warnings

import pytest
import tqdm
import tqdm.std

from salt_jax import log


@pytest.fixture
def clean_logger():
  logger = logging.getLogger(log.LOGGER_NAME)
  saved = (list(logger.handlers), logger.level, logger.propagate)
  logger.handlers.clear()
  yield logger
  logger.handlers[:] = saved[0]
  logger.setLevel(saved[1])
  logger.propagate = saved[2]


def test_level_from_flag_or_environment(monkeypatch):
  monkeypatch.delenv(log.ENV_VAR, raising=False)
  assert log.level_of(None) == logging.INFO
  assert log.level_of("debug") == logging.DEBUG and log.level_of(logging.ERROR) == logging.ERROR
  monkeypatch.setenv(log.ENV_VAR, "warning")
  assert log.level_of(None) == logging.WARNING
  with pytest.raises(ValueError, match="SALT_JAX_LOG_LEVEL"):
    log.level_of("loud")


def test_configure_writes_once_at_its_level(clean_logger):
  first, second = io.StringIO(), io.StringIO()
  log.configure("info", first)
  log.configure("warning", second)  # replaces the first handler: no duplicate lines
  child = logging.getLogger("salt_jax.train")
  child.info("not shown")
  child.warning("shown once")
  assert first.getvalue() == "" and second.getvalue().count("shown once") == 1
  assert "salt_jax.train WARNING shown once" in second.getvalue()


def test_only_if_unset_keeps_the_applications_handler(clean_logger):
  mine = logging.StreamHandler(io.StringIO())
  clean_logger.addHandler(mine)
  log.configure("debug", io.StringIO(), only_if_unset=True)
  assert clean_logger.handlers == [mine]


def test_progress_bar_goes_to_stderr_and_is_silent_when_off(capsys):
  assert list(log.progress_bar(range(3), desc="update", enabled=False)) == [0, 1, 2]
  bar = log.progress_bar(total=2, desc="update", enabled=False)
  bar.update(2)
  bar.set_postfix_str("x")
  bar.close()
  assert capsys.readouterr() == ("", "")
  assert list(log.progress_bar(range(3), desc="update", unit="batch")) == [0, 1, 2]
  out, err = capsys.readouterr()
  assert out == "" and "update" in err and "batch" in err
  stream = io.StringIO()
  with log.progress_bar(total=4, desc="rollout", stream=stream) as bar:
    bar.update(4)
  assert "rollout" in stream.getvalue() and capsys.readouterr() == ("", "")


@pytest.fixture
def kernel_without_ipywidgets(monkeypatch):
  """What tqdm sees in a Jupyter kernel without ipywidgets, with tqdm.auto not imported yet."""
  shell = type("ZMQInteractiveShell", (), {})()
  monkeypatch.setitem(sys.modules, "ipykernel.zmqshell", types.ModuleType("ipykernel.zmqshell"))
  monkeypatch.setitem(sys.modules, "IPython", types.SimpleNamespace(get_ipython=lambda: shell))
  monkeypatch.setitem(sys.modules, "ipywidgets", None)  # import ipywidgets: ImportError
  for name in ("auto", "autonotebook", "notebook"):
    monkeypatch.delitem(sys.modules, f"tqdm.{name}", raising=False)
    monkeypatch.delattr(tqdm, name, raising=False)


def _import_warnings(import_it) -> list[str]:
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import_it()
  return [str(w.message) for w in caught]


def test_plain_tqdm_import_in_such_a_kernel_warns(kernel_without_ipywidgets):
  # The warning the notebooks showed (transformers imports tqdm.auto): the fixture reproduces it.
  assert any("IProgress not found" in m
             for m in _import_warnings(lambda: importlib.import_module("tqdm.auto")))


def test_no_iprogress_warning_in_a_kernel_without_ipywidgets(kernel_without_ipywidgets):
  assert _import_warnings(log.import_tqdm_auto_quietly) == []
  assert "tqdm.auto" in sys.modules  # what transformers imports next, silently
  assert _import_warnings(lambda: importlib.import_module("tqdm.auto")) == []
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    bar = log.progress_bar(range(2), desc="update", stream=io.StringIO())
  assert type(bar) is tqdm.std.tqdm and not caught  # the text bar, no widget
  bar.close()


def test_progress_bar_is_tqdm_auto_when_ipywidgets_imports(monkeypatch):
  monkeypatch.setitem(sys.modules, "ipywidgets", types.ModuleType("ipywidgets"))
  import tqdm.auto  # pylint: disable=import-outside-toplevel
  with log.progress_bar(total=1, stream=io.StringIO()) as bar:
    assert type(bar) is tqdm.auto.tqdm
