"""What the trainer's checkpoints carry besides orbax's arrays, and what a resume checks.

The compared configuration: the fields a resume must keep (all but `RESUME_MAY_CHANGE`), read back
from the newest checkpoint's JSON before any heavy work (`newest_meta`), so a resume with other
flags names each differing field (`config_differences`).
"""

from __future__ import annotations

import json
import os
from typing import Optional


# Fields a --resume may change: where the run writes and what it reports, how far it runs, how
# its processes join, and layout-only settings (the same update in fewer rows per pass, or on
# another mesh shape).
RESUME_MAY_CHANGE = ("iters", "out", "resume", "progress", "eval_every", "tensorboard",
                     "distributed", "coordinator", "num_processes", "process_id",
                     "microbatch_rows", "mesh")
META_ITEM = "meta"  # the checkpoint's JSON item (orbax writes it to <step>/meta/metadata)


def complete_steps(ckpt_dir: str) -> list[int]:
  """Steps of the complete checkpoints in `ckpt_dir`, newest first (orbax names a finished one
  by its step, an unfinished one by its step and a temporary suffix)."""
  if not os.path.isdir(ckpt_dir):
    return []
  return sorted((int(n) for n in os.listdir(ckpt_dir) if n.isdigit()), reverse=True)


def newest_meta(ckpt_dir: str) -> Optional[dict]:
  """The JSON item of the newest checkpoint whose JSON reads back, or None (no checkpoint)."""
  for step in complete_steps(ckpt_dir):
    try:
      with open(os.path.join(ckpt_dir, str(step), META_ITEM, "metadata"), encoding="utf-8") as f:
        return json.load(f)
    except (OSError, ValueError):
      continue  # damaged: the restore names it; any older checkpoint holds the same config
  return None


def config_differences(saved: dict, now: dict) -> list[str]:
  """'field: saved X, now Y' for each saved field whose value `now` does not keep. Fields absent
  from `saved` are not compared: a later version added them, with defaults that keep the old
  behaviour."""
  out = []
  for k in sorted(saved):
    if k not in now:
      out.append(f"{k}: saved {saved[k]!r}, now no such field")
    elif now[k] != saved[k]:
      out.append(f"{k}: saved {saved[k]!r}, now {now[k]!r}")
  return out
