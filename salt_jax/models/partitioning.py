"""Explicit PartitionSpecs for every parameter and activation of `CausalLM` on a (data, model) mesh.

FSDP over `data` (each weight's d_model side is split across data-parallel devices), tensor
parallelism over `model` (heads, MLP width and vocabulary split across model-parallel devices),
activations split over `data` along the batch. Each field of `ShardingRules` names its tensor and
the letters of its axes, so the name tells the layout:

  b batch, t time (query), s key slot, d d_model, v vocab, n query heads, k kv heads,
  h head_dim, f MLP width, l layer; for LoRA adapters (`salt_jax.models.lora`) r the rank and
  m any axis the base weight splits over `model` (heads, MLP width).

A dimension that the mesh axis does not divide (e.g. 2 KV heads on a model axis of 4) is left
replicated on that axis instead of failing: `fit_spec` drops it.
"""

from __future__ import annotations

import dataclasses

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from salt_jax.sharding import DATA_AXIS as _D, MODEL_AXIS as _M


@dataclasses.dataclass(frozen=True)
class ShardingRules:
  """PartitionSpec per tensor kind; field suffixes are the tensor's axis letters."""

  # Parameters.
  emb_vd: P = P(_M, _D)
  lm_head_vd: P = P(_M, _D)
  q_weight_dnh: P = P(_D, _M, None)
  kv_weight_dkh: P = P(_D, _M, None)
  o_weight_nhd: P = P(_M, None, _D)
  q_bias_nh: P = P(_M, None)
  kv_bias_kh: P = P(_M, None)
  ffw_weight_df: P = P(_D, _M)
  ffw_weight_fd: P = P(_M, _D)
  norm_d: P = P(None)
  # LoRA adapters A [in, r] and B [r, out]: the in / out axis split as the base weight's first
  # in / out axis is, the rank over the other mesh axis, so adapters (and their AdamW state) are
  # split over every device (on a 1x8 mesh a replicated A would hold 32B's at full size).
  lora_a_dr: P = P(_D, _M)
  lora_a_mr: P = P(_M, _D)
  lora_b_rd: P = P(_M, _D)
  lora_b_rm: P = P(_D, _M)
  # Activations.
  act_btd: P = P(_D, None, None)
  act_btd_kept: P = P(_D, _M, None)  # a layer input kept for the backward pass (see remat)
  act_btnh: P = P(_D, None, _M, None)
  act_btf: P = P(_D, None, _M)
  logits_btv: P = P(_D, None, _M)
  cache_bk: P = P(_D, _M, None, None)  # keys [B, K, H, S], values [B, K, S, H]


def fit_spec(spec: P, shape: tuple[int, ...], mesh: Mesh) -> P:
  """`spec` padded to `len(shape)`, with axes that do not divide their dimension dropped.

  Raises:
    ValueError: the spec has more entries than the array has dimensions, or names an axis the
      mesh lacks.
  """
  entries = tuple(spec)
  if len(entries) > len(shape):
    raise ValueError(f"PartitionSpec {spec} has more entries than shape {shape}")
  out = []
  for dim, axes in zip(shape, entries + (None,) * (len(shape) - len(entries))):
    if axes is None:
      out.append(None)
      continue
    names = axes if isinstance(axes, tuple) else (axes,)
    size = 1
    for name in names:
      if name not in mesh.shape:
        raise ValueError(f"PartitionSpec {spec} names axis {name!r}; mesh has {tuple(mesh.shape)}")
      size *= mesh.shape[name]
    out.append(axes if dim % size == 0 else None)
  return P(*out)


@dataclasses.dataclass(frozen=True)
class ActivationSharding:
  """Applies `with_sharding_constraint` for a named activation kind; a no-op without a mesh.

  Frozen and hashable, so it can live on an nnx module as static data.
  """

  mesh: Mesh | None = None
  rules: ShardingRules = ShardingRules()

  def __call__(self, x: jax.Array, kind: str) -> jax.Array:
    if self.mesh is None:
      return x
    spec = fit_spec(getattr(self.rules, kind), x.shape, self.mesh)
    return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, spec))

  def sharding(self, shape: tuple[int, ...], kind: str) -> NamedSharding | None:
    if self.mesh is None:
      return None
    return NamedSharding(self.mesh, fit_spec(getattr(self.rules, kind), shape, self.mesh))


def specs_for_state(state: nnx.State, mesh: Mesh, rules: ShardingRules | None = None) -> dict:
  """PartitionSpec per parameter of an nnx.State of `CausalLM` parameters (real or abstract), as
  the nested pure dict that `nnx.to_pure_dict(state)` gives. Each parameter names its
  `ShardingRules` field in its metadata (`sharding_rule`).

  Raises:
    ValueError: a parameter without a rule, or one naming no field of `ShardingRules`.
  """
  rules = rules or ShardingRules()

  def one(path, var):
    rule = var.get_metadata().get("sharding_rule")
    if not isinstance(rule, str) or not hasattr(rules, rule):
      raise ValueError(f"no sharding rule for parameter {jax.tree_util.keystr(path)} "
                       f"(sharding_rule metadata: {rule!r})")
    return fit_spec(getattr(rules, rule), tuple(var.shape), mesh)

  specs = jax.tree_util.tree_map_with_path(one, state,
                                           is_leaf=lambda x: isinstance(x, nnx.Variable))
  return nnx.to_pure_dict(specs)


def shardings_for_state(state: nnx.State, mesh: Mesh, rules: ShardingRules | None = None) -> dict:
  """NamedSharding per parameter of `state`, as a nested pure dict (`specs_for_state` on
  `mesh`)."""
  return jax.tree.map(lambda s: NamedSharding(mesh, s), specs_for_state(state, mesh, rules),
                      is_leaf=lambda x: isinstance(x, P))


def shard_model(model, mesh: Mesh, rules: ShardingRules | None = None):
  """Moves `model`'s parameters to their NamedShardings on `mesh`, in place; returns the model.

  Afterwards the model's forward passes also constrain activations (batch over `data`), so a
  jitted call with inputs split over `data` runs data- and tensor-parallel.
  """
  rules = rules or ShardingRules()
  state = nnx.state(model, nnx.Param)
  shardings = shardings_for_state(state, mesh, rules)
  pure = nnx.to_pure_dict(state)
  nnx.replace_by_pure_dict(state, jax.tree.map(jax.device_put, pure, shardings))
  nnx.update(model, state)
  model.activation_sharding = ActivationSharding(mesh, rules)
  return model
