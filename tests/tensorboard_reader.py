"""Event files read back by TensorBoard's own reader (`EventAccumulator`), as the TensorBoard UI
reads them: a SessionLog.START at step s (a resumed run's purge step) drops the run's earlier
events at s and later."""

from __future__ import annotations

from tensorboard.backend.event_processing import event_accumulator


def read_tensorboard(logdir: str) -> tuple[dict, dict]:
  """({(step, tag): [scalar values]}, {(step, tag): histogram proto}) of every event file in
  `logdir`, nothing sampled away."""
  acc = event_accumulator.EventAccumulator(
      logdir, size_guidance={event_accumulator.SCALARS: 0, event_accumulator.HISTOGRAMS: 0},
      purge_orphaned_data=True)
  acc.Reload()
  tags = acc.Tags()
  scalars, histograms = {}, {}
  for tag in tags[event_accumulator.SCALARS]:
    for e in acc.Scalars(tag):
      scalars.setdefault((e.step, tag), []).append(e.value)
  for tag in tags[event_accumulator.HISTOGRAMS]:
    for e in acc.Histograms(tag):
      histograms[(e.step, tag)] = e.histogram_value
  return scalars, histograms
