"""The `salt_jax` logger: what setup, rollout and update are doing, at a verbosity you choose.

Modules log to `logging.getLogger(__name__)` (children of "salt_jax"); the library itself adds no
handler. `configure` sends those records to stderr: the training scripts call it with their
`--log-level`, and a `Trainer` with `progress=True` calls it when nothing else has configured the
logger (so a notebook shows progress too). Levels: INFO for each phase of setup and of an
iteration, DEBUG for each turn of a rollout and each mini-batch of an update, WARNING for only
what needs attention.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Optional, TextIO, Union

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
