"""Several processes (hosts) training one model: joining them, and moving host data between them.

The trainer's multi-process scheme (`salt_jax.train`):

  * `initialize` joins the processes (`jax.distributed.initialize`) before any other jax use; on a
    CPU it first selects gloo collectives, so two processes on one machine can train together.
  * The ('data', 'model') mesh spans every process's devices, each process owning whole rows of
    'data' (`mesh_devices`); params, optimizer state and the jitted update live on it.
  * Each process plays its contiguous share of the iteration's tasks (`share`: whole groups, so
    SALT's graph never straddles processes) with its own environments and its own sampler on its
    rows of the mesh (`local_mesh`), whose params are a copy of the global ones (`copy_params`).
  * The shares are gathered to every process (`allgather_objects`, `concat_rollouts`): every
    process then holds the same global batch, builds the same global arrays and runs the same
    jitted update, so all of them keep identical params; metrics are over the global batch.

Gathering the host batch (token ids, not activations) to every host costs a few MB per
iteration, small next to the rollout; in exchange the update path is the single-process one.
"""

from __future__ import annotations

import dataclasses
import functools
import pickle
import re
from typing import Any, Optional, Sequence

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from salt_jax import rollout

_COORDINATOR_RE = re.compile(r"^[^\s:]+:\d+$")


def check_coordinator(coordinator: Optional[str]) -> None:
  """Raises ValueError unless `coordinator` is None or 'host:port'."""
  if coordinator is not None and not _COORDINATOR_RE.match(str(coordinator)):
    raise ValueError(f"coordinator must look like host:port, got {coordinator!r}")


def initialize(coordinator: Optional[str] = None, num_processes: Optional[int] = None,
               process_id: Optional[int] = None) -> None:
  """Joins this process to the others (`jax.distributed.initialize`); a no-op when already joined.

  Call it before any other jax use (it must precede backend creation). Arguments left None are
  auto-detected by jax from the cluster's environment (TPU pods, SLURM, Open MPI, Kubernetes);
  on a single machine pass all three.

  Args:
    coordinator: 'host:port' of process 0's coordination service.
    num_processes: how many processes take part.
    process_id: this process's index in [0, num_processes).
  Raises:
    ValueError: a malformed coordinator or an out-of-range process_id.
  """
  check_coordinator(coordinator)
  if num_processes is not None and (isinstance(num_processes, bool) or num_processes < 1):
    raise ValueError(f"num_processes must be >= 1, got {num_processes!r}")
  if process_id is not None and num_processes is not None and not 0 <= process_id < num_processes:
    raise ValueError(f"process_id must be in [0, {num_processes}), got {process_id!r}")
  if jax.distributed.is_initialized():
    return
  # Without a collectives library, CPU devices of different processes cannot talk (XLA's CPU
  # client has none by default); gloo ships with jaxlib. Other platforms ignore this option.
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes,
                             process_id=process_id)


def mesh_devices(data: int, model: int) -> list:
  """All devices, ordered so that a (data, model) grid gives each process whole 'data' rows.

  Raises ValueError when the mesh does not use every device or 'data' does not split evenly
  over the processes (each process must own whole rows: its sampler runs on them alone).
  """
  devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
  n = jax.process_count()
  if data * model != len(devices) or data % n:
    raise ValueError(
        f"with {n} processes the mesh must span all {len(devices)} devices with 'data' a "
        f"multiple of {n} (each process owning whole rows); got {data}x{model}")
  return devices


def local_mesh(mesh: Mesh) -> Mesh:
  """This process's rows of `mesh` (see `mesh_devices`), with the same axis names."""
  rows = [r for r in mesh.devices if r[0].process_index == jax.process_index()]
  if not rows or any(d.process_index != jax.process_index() for r in rows for d in r):
    raise ValueError("each process must own whole rows of the mesh (see mesh_devices)")
  return Mesh(np.stack(rows), mesh.axis_names)


def copy_params(src, like, mesh: Mesh):
  """`src` (arrays on the global `mesh`) copied onto `like`'s shardings (this process's devices).

  All processes must call it (the gather to a replicated layout is a collective).
  """
  full = _replicator(mesh)(src)
  return jax.tree.map(lambda x, l: jax.device_put(x.addressable_data(0), l.sharding), full, like)


@functools.lru_cache(maxsize=4)
def _replicator(mesh: Mesh):
  """A jitted identity whose output is replicated over `mesh` (one compile per tree shape)."""
  return jax.jit(lambda t: t, out_shardings=NamedSharding(mesh, PartitionSpec()))


def barrier(name: str) -> None:
  """Waits until every process reaches the barrier `name` (a no-op with one process)."""
  if jax.process_count() > 1:
    multihost_utils.sync_global_devices(name)


def to_host(x) -> np.ndarray:
  """The whole value of a (possibly multi-process) jax array as numpy, on every process.

  All processes must call it when `x` spans several (it is then a collective).
  """
  if getattr(x, "is_fully_addressable", True) or x.is_fully_replicated:
    return np.asarray(x)
  return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def allgather_objects(obj: Any) -> list:
  """[obj of process 0, obj of process 1, ...] on every process (pickled; all must call it)."""
  if jax.process_count() == 1:
    return [obj]
  data = np.frombuffer(pickle.dumps(obj), np.uint8)
  sizes = multihost_utils.process_allgather(np.array([data.size], np.int64)).reshape(-1)
  padded = np.zeros(int(sizes.max()), np.uint8)
  padded[:data.size] = data
  got = multihost_utils.process_allgather(padded)
  return [pickle.loads(got[i, :int(sizes[i])].tobytes()) for i in range(len(sizes))]


def share(items: Sequence, process: int, num_processes: int) -> list:
  """Process `process`'s contiguous share of `items`: sizes differ by at most one, the first
  processes take the extra ones (as `np.array_split`); a share may be empty."""
  if not 0 <= process < num_processes:
    raise ValueError(f"process must be in [0, {num_processes}), got {process}")
  q, r = divmod(len(items), num_processes)
  start = process * q + min(process, r)
  return list(items[start:start + q + (process < r)])


# Per-step and per-trajectory ids renumbered when batches are concatenated.
_GROUP_IDS = ("step_group_ids", "traj_group_ids")
_TRAJ_IDS = ("step_traj_ids",)
_SUMMED = ("num_trajectories", "num_failed", "num_steps", "response_tokens", "env_restarts",
           "prompt_tokens", "reused_prompt_tokens", "prefilled_prompt_tokens", "prefill_flops",
           "decode_bytes")
_SLOWEST = ("gen_time_s", "env_time_s", "other_time_s", "total_time_s", "turns",
            "prefill_time_s", "decode_time_s", "prefill_compile_s", "decode_compile_s")


def concat_rollouts(batches: Sequence):
  """One `RolloutBatch` of several processes' batches, in order (None entries: empty shares).

  Group and trajectory ids are renumbered to stay unique; counts add up; rates (success,
  valid actions, mean steps, per task type) are over the whole batch; times are the slowest
  process's (the iteration waits for it), so a phase's work over its time is the processes'
  rate together.
  """
  batches = [b for b in batches if b is not None]
  if not batches:
    raise ValueError("no rollout batches to concatenate")
  if len(batches) == 1:
    return batches[0]
  out = {}
  group_off = np.cumsum([0] + [b.num_groups for b in batches])
  traj_off = np.cumsum([0] + [b.num_trajectories for b in batches])
  for f in dataclasses.fields(batches[0]):
    vals = [getattr(b, f.name) for b in batches]
    if f.name in _GROUP_IDS + _TRAJ_IDS:
      off = group_off if f.name in _GROUP_IDS else traj_off
      out[f.name] = np.concatenate([v + off[i] for i, v in enumerate(vals)]).astype(vals[0].dtype)
    elif isinstance(vals[0], np.ndarray):
      out[f.name] = np.concatenate(vals)
    elif isinstance(vals[0], list):
      out[f.name] = [x for v in vals for x in v]
    elif f.name == "num_groups":
      out[f.name] = int(group_off[-1])
    elif f.name != "metrics":
      out[f.name] = vals[0]  # run-wide settings (penalty, prompt layout): equal everywhere
  merged = dataclasses.replace(batches[0], **out)
  merged.metrics = _merged_metrics(merged, [b.metrics for b in batches])
  return merged


def _merged_metrics(b, parts: list[dict]) -> dict:
  m = {k: sum(p[k] for p in parts) for k in _SUMMED}
  m.update({k: max(p[k] for p in parts) for k in _SLOWEST})
  m.update(rollout.outcome_rates(b))
  m["env_wait_fraction"] = rollout.env_wait_fraction(m["env_time_s"], m["gen_time_s"])
  return m
