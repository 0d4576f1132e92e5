"""What the trainer's checkpoints carry besides orbax's arrays, and what a resume checks.

  * Fingerprints: one uint32 per array, computed on the device (`fingerprints`) when a checkpoint
    is saved and again after it is restored. Orbax 0.12.8 (OCDBT + zstd) raises on a truncated
    or missing data file, but a data file whose bytes changed in place (bit rot, a partial
    overwrite) restores without complaint to wrong values: the fingerprints catch that.
  * The compared configuration: the fields a resume must keep (all but `RESUME_MAY_CHANGE`), read
    back from the newest checkpoint's JSON before any heavy work (`newest_meta`), so a resume
    with other flags names each differing field (`config_differences`).
  * Damaged checkpoints are moved aside (`set_aside`), not deleted.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from salt_jax import multihost

# Fields a --resume may change: where the run writes and what it reports, how far it runs, how
# its processes join, and layout-only settings (the same update in fewer rows per pass, or on
# another mesh shape).
RESUME_MAY_CHANGE = ("iters", "out", "resume", "progress", "eval_every", "tensorboard",
                     "distributed", "coordinator", "num_processes", "process_id",
                     "microbatch_rows", "mesh")
META_ITEM = "meta"  # the checkpoint's JSON item (orbax writes it to <step>/meta/metadata)


class DamagedCheckpoint(Exception):
  """A checkpoint that does not read back, or reads back other values than were saved."""


def _leaf_fingerprint(x) -> jax.Array:
  """A wrapping uint32 sum of `x`'s bits, element i weighted by the odd number 2i + 1 (i its
  flat index): a single flipped bit always changes it, and it does not depend on the sharding."""
  bits = jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{x.dtype.itemsize * 8}"))
  bits = bits.astype(jnp.uint32)
  index, stride = jnp.zeros(x.shape, jnp.uint32), 1
  for d in reversed(range(x.ndim)):  # the flat index from iotas: no reshape of a sharded array
    index = index + jax.lax.broadcasted_iota(jnp.uint32, x.shape, d) * np.uint32(stride % 2**32)
    stride *= x.shape[d]
  return jnp.sum(bits * (index * 2 + 1), dtype=jnp.uint32)


@jax.jit
def _fingerprint_leaves(leaves: list) -> jax.Array:
  return jnp.stack([_leaf_fingerprint(x) for x in leaves])


def fingerprints(tree) -> dict[str, int]:
  """{leaf path: fingerprint} of every array in `tree` (all processes must call it)."""
  flat = jax.tree_util.tree_flatten_with_path(tree)[0]
  sums = multihost.to_host(_fingerprint_leaves([x for _, x in flat]))
  return {jax.tree_util.keystr(path): int(s) for (path, _), s in zip(flat, sums)}


def damaged_leaves(tree, saved: Optional[dict]) -> list[str]:
  """Paths of the leaves of `tree` whose fingerprints differ from `saved` (none when a checkpoint
  was written without fingerprints)."""
  if saved is None:
    return []
  got = fingerprints(tree)
  return sorted(k for k in saved.keys() | got.keys() if saved.get(k) != got.get(k))


def root_cause(e: BaseException) -> str:
  """The first line of the innermost exception `e` was raised from: for a failed orbax read,
  tensorstore's, which names the array and the file (orbax's own names only an index range)."""
  while e.__cause__ is not None:
    e = e.__cause__
  return (str(e).splitlines() or [type(e).__name__])[0][:300]


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


def set_aside(ckpt_dir: str, steps, dest: str) -> list[str]:
  """Moves checkpoints `steps` of `ckpt_dir` into `dest` (process 0 moves them, every process
  waits for it); returns where they went. A name already taken there gets a numbered suffix."""
  targets = []
  for step in steps:
    target, n = os.path.join(dest, str(step)), 1
    while os.path.exists(target) or target in targets:
      target, n = os.path.join(dest, f"{step}.{n}"), n + 1
    targets.append(target)
  multihost.barrier("salt_jax_set_aside_named")  # every process has read the names
  if jax.process_index() == 0:
    os.makedirs(dest, exist_ok=True)
    for step, target in zip(steps, targets):
      shutil.move(os.path.join(ckpt_dir, str(step)), target)
  multihost.barrier("salt_jax_set_aside_moved")
  return targets
