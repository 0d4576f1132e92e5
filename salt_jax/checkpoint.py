"""A run's checkpoints (`RunCheckpoints`): what they carry besides orbax's arrays, what a resume
checks.

  * The state: params, optimizer state and PRNG key, on the run's mesh. The reference policy is
    not saved: it is the initial policy, rebuilt from the config (--model, --init-params, seed)
    at every start and checked against the fingerprints saved with each checkpoint
    (`reference_fingerprints`), so a changed --model folder is refused rather than trained on.

  * Fingerprints: one uint32 per array, computed on the device (`fingerprints`) when a checkpoint
    is saved and again after it is restored. Orbax 0.12.8 (OCDBT + zstd) raises on a truncated
    or missing data file, but a data file whose bytes changed in place (bit rot, a partial
    overwrite) restores without complaint to wrong values: the fingerprints catch that.
  * The compared configuration: the fields a resume must keep (all but `RESUME_MAY_CHANGE`), read
    back from the newest checkpoint's JSON before any heavy work (`newest_meta`), so a resume
    with other flags names each differing field (`config_differences`).
  * Damaged checkpoints are moved aside (`set_aside`), not deleted.
  * Saves are asynchronous unless `config.async_checkpoint` is off: orbax copies the arrays to host
    memory before `save` returns (the loop may then update or donate them) and writes the files
    in a background thread. The JSON item is part of the same orbax checkpoint, so it is renamed
    into place together with the arrays: nothing is written beside a checkpoint. Every reader
    (`latest_step`, `read`, `restore_latest_intact`) and `close` wait for the write in flight
    (`wait`); orbax waits for it before the next save. A kill during the write leaves only orbax's
    temporary folder, and a resume starts from the checkpoint before it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import warnings
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from jax.sharding import NamedSharding

from salt_jax import multihost
from salt_jax.config import with_current_names
from salt_jax.sharding import replicated

# Fields a --resume may change: where the run writes and what it reports, how far it runs, how
# its processes join, and layout-only settings (the same update in fewer rows per pass, or on
# another mesh shape).
RESUME_MAY_CHANGE = ("iters", "out", "resume", "progress", "eval_every", "tensorboard",
                     "distributed", "coordinator", "num_processes", "process_id",
                     "microbatch_rows", "microbatch_lengths", "logprob_microbatch_rows",
                     "remat_policy", "mesh", "attention_impl", "tracker", "async_checkpoint",
                     "rollout_engine", "vllm_kv_cache_gib", "compilation_cache",
                     "clear_programs_above")
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


def abstract_on_mesh(tree, mesh):
  """`tree`'s shapes and dtypes on its shardings over `mesh` (a leaf on another mesh, or on one
  device, goes replicated): a restore puts every leaf there, whatever mesh wrote it."""
  def on_mesh(x):
    sharding = x.sharding
    if not (isinstance(sharding, NamedSharding) and sharding.mesh == mesh):
      sharding = replicated(mesh)
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
  return jax.tree.map(on_mesh, tree)


class RunCheckpoints:
  """The orbax checkpoints of one run under `<config.out>/checkpoints`.

  A checkpoint is complete or absent (orbax writes a temporary folder and renames it), and is
  written in the background when `config.async_checkpoint` (see `save`). Each holds
  a state pytree and a JSON item (iteration, task-sampler position, the compared config, array
  fingerprints). Before any work, `check_start` refuses a new run over existing checkpoints and a
  resume with changed settings; `restore_latest_intact` passes over damaged checkpoints (moved to
  `<out>/damaged_checkpoints`) for the newest intact one.
  """

  def __init__(self, config, mesh):
    self.config, self.mesh = config, mesh
    self.dir = os.path.join(config.out, "checkpoints")
    self._manager = None

  def compared_config(self) -> dict:
    """The configuration fields a resume must keep."""
    return {k: v for k, v in self.config.to_json().items() if k not in RESUME_MAY_CHANGE}

  def config_digest(self) -> str:
    """What checkpoints written before `compared_config` was saved are checked against (its
    fields and the mesh, which such a resume could not change)."""
    keep = {**self.compared_config(), "mesh": self.config.mesh}
    return hashlib.sha256(json.dumps(keep, sort_keys=True).encode()).hexdigest()[:16]

  def check_start(self) -> None:
    """Raises ValueError, before any work, for a new run over existing checkpoints or a resume
    whose settings differ from the saved run's (naming each differing field)."""
    if not self.config.resume:
      if complete_steps(self.dir):
        raise ValueError(f"{self.config.out} already holds checkpoints: pass --resume to continue "
                         "that run, or choose another --out")
      return
    meta = newest_meta(self.dir)
    if meta is None:
      return
    if "config" not in meta:  # written before the fields were saved: only the digest is there
      if meta.get("config_digest") != self.config_digest():
        raise ValueError(f"the checkpoint in {self.config.out} was written with a different "
                         "configuration (only iters, out, eval_every, progress may change on "
                         "--resume)")
      return
    # A run saved before LoRA existed trained every parameter: its checkpoint holds no adapters.
    saved = {"lora_rank": 0, **with_current_names(meta["config"])}
    # A field made resume-changeable after the run was saved is no longer compared.
    saved = {k: v for k, v in saved.items() if k not in RESUME_MAY_CHANGE}
    diffs = config_differences(saved, self.compared_config())
    if diffs:
      raise ValueError(
          f"--resume: settings differ from the run saved in {self.config.out}: "
          f"{'; '.join(diffs)}. Only {', '.join(RESUME_MAY_CHANGE)} may change on "
          "--resume: pass the saved values, or choose another --out")

  def open(self) -> "RunCheckpoints":
    import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel
    self._manager = ocp.CheckpointManager(
        os.path.abspath(self.dir),
        options=ocp.CheckpointManagerOptions(
            max_to_keep=self.config.max_to_keep, create=True,
            enable_async_checkpointing=self.config.async_checkpoint))
    return self

  def wait(self) -> None:
    """Returns when the checkpoint being written (if any) is complete; raises what its write
    raised."""
    if self._manager is not None:
      self._manager.wait_until_finished()

  def latest_step(self) -> Optional[int]:
    self.wait()
    return self._manager.latest_step()

  def save(self, step: int, state: dict, meta: dict) -> None:
    """Writes checkpoint `step`: `state` (arrays) and `meta` (JSON) plus the config and the
    state's fingerprints (all processes call it).

    Asynchronous (`config.async_checkpoint`): returns once the previous write is complete and
    `state` is copied to host memory, so the caller may then update or donate its arrays; the
    files are written in the background (`wait`). Otherwise it returns when the checkpoint is
    complete."""
    import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel
    meta = {**meta, "config": self.compared_config(), "config_digest": self.config_digest(),
            "fingerprints": fingerprints(state)}
    self._manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)))

  def read(self, step: int, like: dict) -> tuple[dict, dict]:
    """Checkpoint `step`'s state (on `like`'s shardings over the run's mesh) and JSON; raises
    DamagedCheckpoint when it does not read back, or reads back other values than were saved."""
    import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel
    self.wait()
    try:
      got = self._manager.restore(step, args=ocp.args.Composite(
          state=ocp.args.StandardRestore(abstract_on_mesh(like, self.mesh)),
          meta=ocp.args.JsonRestore()))
    except Exception as e:  # pylint: disable=broad-except  (orbax raises bare Exception too)
      raise DamagedCheckpoint(f"unreadable: {root_cause(e)}") from e
    bad = damaged_leaves(got["state"], got["meta"].get("fingerprints"))
    if bad:
      raise DamagedCheckpoint(
          f"arrays differ from the fingerprints saved with them: {len(bad)}, e.g. {bad[0]}")
    return got["state"], got["meta"]

  def restore_latest_intact(self, like: dict) -> tuple[dict, dict]:
    """The newest checkpoint that reads back intact, as `read` returns it. Newer, damaged ones
    are named in a warning and moved to <out>/damaged_checkpoints; raises ValueError when none
    is intact."""
    self.wait()
    damaged = {}
    for step in sorted(self._manager.all_steps(), reverse=True):
      try:
        restored, problem = self.read(step, like), None
      except DamagedCheckpoint as e:
        problem = str(e)
      problem = next((p for p in multihost.allgather_objects(problem) if p), None)  # all agree
      if problem is None:
        break
      damaged[step] = problem
    else:
      raise ValueError(f"--resume found no intact checkpoint in {self.dir}: " + "; ".join(
          f"checkpoint {s}: {p}" for s, p in damaged.items()))
    if damaged:
      moved = set_aside(self.dir, list(damaged),
                        os.path.join(self.config.out, "damaged_checkpoints"))
      self._manager.reload()
      warnings.warn(f"resuming from checkpoint {step} of {self.config.out}: " + "; ".join(
          f"checkpoint {s} is damaged ({p}), moved to {m}"
          for (s, p), m in zip(damaged.items(), moved)), stacklevel=3)
    return restored

  def close(self) -> None:
    """Waits for the checkpoint being written, then releases orbax's threads."""
    if self._manager is not None:
      try:
        self._manager.close()
      finally:
        self._manager = None
