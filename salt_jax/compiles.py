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
_total = [0.0]
_lock = threading.Lock()
_listening = [False]


def _on_duration_event(event: str, duration_secs: float, **_) -> None:
  if event == _XLA_COMPILE_EVENT:
    with _lock:
      _total[0] += duration_secs


def xla_compile_seconds() -> float:
  """Seconds of XLA compiles (and compilation-cache loads) in this process since the first call
  of this function: differences of two calls time the compiles between them."""
  with _lock:
    if not _listening[0]:
      jax.monitoring.register_event_duration_secs_listener(_on_duration_event)
      _listening[0] = True
    return _total[0]
