"""Device meshes from `--mesh=DxM` strings, with the axes ('data', 'model').

`data` carries the batch (and FSDP parameter shards); `model` carries tensor parallelism. Meshes
are built with Auto axes so that XLA propagates shardings through ops such as `segment_sum`
without each call naming its output sharding.
"""

from __future__ import annotations

import re

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

DATA_AXIS = "data"
MODEL_AXIS = "model"
MESH_AXES = (DATA_AXIS, MODEL_AXIS)

_MESH_RE = re.compile(r"^\s*(\d+)\s*[xX]\s*(\d+)\s*$")


def parse_mesh_shape(spec: str) -> tuple[int, int]:
  """'4x2' -> (4, 2): data-parallel size by model-parallel size. Raises ValueError otherwise."""
  m = _MESH_RE.match(str(spec))
  if not m:
    raise ValueError(f"mesh must look like DxM (e.g. 4x2 or 1x1), got {spec!r}")
  data, model = int(m.group(1)), int(m.group(2))
  if data < 1 or model < 1:
    raise ValueError(f"mesh sizes must be >= 1, got {spec!r}")
  return data, model


def make_mesh(spec: str | tuple[int, int], devices=None) -> Mesh:
  """A ('data', 'model') mesh over the first D*M devices, Auto axes.

  Raises ValueError naming the shortfall when fewer devices exist than the mesh asks for (a CPU
  host can simulate more with XLA_FLAGS=--xla_force_host_platform_device_count=N, set before
  jax is imported).
  """
  data, model = parse_mesh_shape(spec) if isinstance(spec, str) else tuple(spec)
  devices = list(jax.devices() if devices is None else devices)
  need = data * model
  if need > len(devices):
    raise ValueError(
        f"mesh {data}x{model} needs {need} devices but only {len(devices)} "
        f"{devices[0].platform if devices else ''} device(s) are visible; on a CPU host set "
        f"XLA_FLAGS=--xla_force_host_platform_device_count={need} before importing jax")
  grid = np.asarray(devices[:need], dtype=object).reshape(data, model)
  return Mesh(grid, MESH_AXES)


def batch_sharding(mesh: Mesh, ndim: int = 1) -> NamedSharding:
  """Leading (batch) axis split over `data`, the rest replicated."""
  return NamedSharding(mesh, P(DATA_AXIS, *([None] * (ndim - 1))))


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def on_mesh(tree, mesh: Mesh):
  """`tree` with every array not already on a NamedSharding replicated over `mesh` (optax makes
  its step counters on one device): a jitted program then sees every input on the mesh, and its
  second call does not compile again for the first call's output shardings."""
  def one(x):
    return x if isinstance(getattr(x, "sharding", None), NamedSharding) else jax.device_put(
        x, replicated(mesh))
  return jax.tree.map(one, tree)
