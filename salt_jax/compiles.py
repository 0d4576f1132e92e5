"""Seconds this process spends in XLA compiles: what tells a compile-bound phase from a slow one.

A phase's wall time holds the compiles of every program it runs for the first time (a new prompt
bucket, a new micro-batch length); `xla_compile_seconds()` read before and after the phase gives
the share. It counts JAX's own backend-compile duration event, which covers an XLA compile or a
load from the persistent compilation cache; tracing and lowering are left out (a nested jit's
tracing would be counted twice).
"""

from __future__ import annotations

import threading

import jax

_XLA_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


class _CompileClock:
  """The process's running sum of compile events; listens from its first read on, since JAX's
  listeners cannot be removed and most processes never ask."""

  def __init__(self):
    self.seconds = 0.0
    self.listening = False
    self.lock = threading.Lock()

  def on_duration_event(self, event: str, duration_secs: float, **_) -> None:
    if event == _XLA_COMPILE_EVENT:
      with self.lock:
        self.seconds += duration_secs

  def read(self) -> float:
    with self.lock:
      if not self.listening:
        jax.monitoring.register_event_duration_secs_listener(self.on_duration_event)
        self.listening = True
      return self.seconds


_CLOCK = _CompileClock()


def xla_compile_seconds() -> float:
  """Seconds of XLA compiles (and compilation-cache loads) in this process since the first call
  of this function: differences of two calls time the compiles between them."""
  return _CLOCK.read()
