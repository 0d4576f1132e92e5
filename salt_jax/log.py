"""The `salt_jax` logger: what setup, rollout and update are doing, at a verbosity you choose.

Modules log to `logging.getLogger(__name__)` (children of "salt_jax"); the library itself adds no
handler. `configure` sends those records to stderr: the training scripts call it with their
`--log-level`, and a `Trainer` with `progress=True` calls it when nothing else has configured the
logger (so a notebook shows progress too). Levels: INFO for each phase of setup and of an
iteration, DEBUG for each turn of a rollout and each mini-batch of an update, WARNING for only
what needs attention.

`progress_bar` is the bar inside a phase (the turns of a rollout, the mini-batches of an update):
tqdm on stderr, a widget in a notebook that has ipywidgets, and a silent pass-through when off.
`import_tqdm_auto_quietly` (run by `import salt_jax`) keeps a notebook without ipywidgets free of
tqdm's "IProgress not found" warning, which importing transformers would print.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
import warnings
from typing import Iterable, Optional, TextIO, Union

LOGGER_NAME = "salt_jax"
ENV_VAR = "SALT_JAX_LOG_LEVEL"
LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


def level_of(level: Union[str, int, None]) -> int:
  """A level from a name ('debug', 'INFO', ...), a number, or None: `$SALT_JAX_LOG_LEVEL`, else
  INFO. ValueError for an unknown name."""
  if level is None:
    level = os.environ.get(ENV_VAR) or "INFO"
  if isinstance(level, int):
    return level
  name = str(level).strip().upper()
  if name not in LEVELS:
    raise ValueError(f"log level must be one of {LEVELS} (or ${ENV_VAR}), got {level!r}")
  return getattr(logging, name)


def configure(level: Union[str, int, None] = None, stream: Optional[TextIO] = None,
              *, only_if_unset: bool = False) -> logging.Logger:
  """Sends the `salt_jax` logger's records to `stream` (stderr) at `level` (see `level_of`).

  Calling it again replaces the handler it added (no duplicate lines). With `only_if_unset`, a
  logger that already has a handler (the application set one up) is left as it is.
  """
  logger = logging.getLogger(LOGGER_NAME)
  ours = [h for h in logger.handlers if getattr(h, "_salt_jax", False)]
  if only_if_unset and logger.handlers:
    return logger
  for h in ours:
    logger.removeHandler(h)
  handler = logging.StreamHandler(stream or sys.stderr)
  handler._salt_jax = True  # pylint: disable=protected-access
  handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s",
                                         datefmt="%H:%M:%S"))
  logger.addHandler(handler)
  logger.setLevel(level_of(level))
  logger.propagate = False  # one line per record, whatever the root logger does
  return logger


def progress_bar(iterable: Optional[Iterable] = None, total: Optional[int] = None, desc: str = "",
                 enabled: bool = True, *, unit: str = "it", stream: Optional[TextIO] = None):
  """A tqdm bar over `iterable` (or one to `update()` by hand) that says how far a phase is.

  Args:
    iterable: what to iterate over (None: call `.update(n)` yourself).
    total: the expected count (len(iterable) when None and it has one).
    desc: the bar's prefix, e.g. "rollout" or "update".
    enabled: False gives tqdm's disabled bar: it iterates and accepts `update`, `set_postfix` and
      `close`, and writes nothing.
    unit: what one step is ("turn", "batch").
    stream: where the bar goes; stderr (the one current at the call) when None, never stdout.
  Returns:
    A `tqdm.auto` bar (a notebook widget when ipywidgets is installed, text otherwise) that
    disappears when closed (leave=False), so phase bars do not pile up under the iteration lines.
  """
  # pylint: disable=import-outside-toplevel
  try:
    importlib.import_module("ipywidgets")  # tqdm.auto's notebook bar needs it, warns without it
    from tqdm.auto import tqdm
  except ImportError:
    from tqdm.std import tqdm
  return tqdm(iterable, total=total, desc=desc, unit=unit, leave=False, dynamic_ncols=True,
              file=stream if stream is not None else sys.stderr, disable=not enabled)


def import_tqdm_auto_quietly() -> None:
  """Imports `tqdm.auto` without its "IProgress not found" warning, in a Jupyter kernel.

  transformers imports `tqdm.auto` as it loads; in a kernel without ipywidgets that prints a
  TqdmWarning ("IProgress not found. Please update jupyter and ipywidgets") into the notebook,
  and tqdm falls back to its text bar, the bar `progress_bar` picks there. Imported here first,
  with that one warning ignored, `tqdm.auto` is loaded when transformers asks for it, and says
  nothing. Outside a kernel (where tqdm.auto does not warn) it does nothing.
  """
  if "ipykernel.zmqshell" not in sys.modules or "tqdm.auto" in sys.modules:
    return
  with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message="IProgress not found")
    try:
      importlib.import_module("tqdm.auto")
    except ImportError:
      pass
