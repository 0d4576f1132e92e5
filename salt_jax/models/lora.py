"""LoRA adapters on a `CausalLM`'s projections, made by qwix (the LoRA library Tunix uses).

  apply_lora(model, rank=R, alpha=A, targets=REGEX, seed=S)  A and B on matched projections
  lora_state(model) / has_lora(model)              the adapters alone, as nnx.LoRAParam
  trained_filter(model)                            what a run trains: the adapters, or all params
  merged(model) / merged_params(model)             a plain CausalLM / its weights, W + A B alpha / R
  peft_tensors(model) / peft_config(model, ...)    the adapters in PEFT's names and layout
  projection_paths(num_layers) / check_targets(targets, num_layers)   what `targets` can match

qwix intercepts the `lax.dot_general` of one module method: applied to the whole model it would
wrap `__call__` only, and the other entry points (`hidden_states` for log-probs, `forward_cached`
for the sampler) would run without the adapters. So each matched projection (`qwen2.Einsum`,
matched by its path, e.g. 'layers/3/attn/q_proj') is wrapped on its own, and every forward pass
of the model goes through the adapters. qwix makes A [prod(contracted axes), R] (he-uniform) and
B [R, prod(kept axes)] (zeros): the output at initialisation equals the base's exactly, and the
delta is x A B alpha / R.

Training the adapters alone: `nnx.split(model, nnx.LoRAParam, ...)` gives the adapters and the
frozen rest (`nnx.LoRAParam` subclasses `nnx.Param`, so a filter for the frozen weights is
`nnx.Not(nnx.LoRAParam)` or `...` after the LoRA filter). The reference policy is the same base
with the initial adapters (B = 0): no second copy of the base.
"""

from __future__ import annotations

import re
import warnings

import jax
import numpy as np
from flax import nnx

from salt_jax.models.loading import hf_tensor_specs, hf_tensors, load_state_dict
from salt_jax.models.qwen2 import CausalLM, Einsum

_PROJECTIONS = (("attn", ("q_proj", "k_proj", "v_proj", "o_proj")),
                ("mlp", ("gate_proj", "up_proj", "down_proj")))


def projection_paths(num_layers: int) -> list[str]:
  """Every projection's path, as `targets` is matched against ('layers/0/attn/q_proj', ...)."""
  return [f"layers/{i}/{part}/{name}" for i in range(num_layers) for part, names in _PROJECTIONS
          for name in names]


def check_targets(targets: str, num_layers: int) -> list[str]:
  """The projection paths that regex `targets` fully matches.

  Raises:
    ValueError: `targets` is not a regex, or it matches no projection.
  """
  try:
    pattern = re.compile(targets)
  except (re.error, TypeError) as e:
    raise ValueError(f"lora_targets {targets!r} is not a regular expression: {e}") from e
  matched = [p for p in projection_paths(num_layers) if pattern.fullmatch(p)]
  if not matched:
    raise ValueError(f"lora_targets {targets!r} matches no projection; paths look like "
                     "'layers/0/attn/q_proj' or 'layers/0/mlp/down_proj'")
  return matched


def _module_path(path) -> str:
  return "/".join(str(k) for k in path)


def _parent(model, path):
  node = model
  for k in path[:-1]:
    node = node[k] if isinstance(k, int) else getattr(node, k)
  return node


def _axis_kind(letter: str) -> str:
  """'d' for d_model (split over data, as the base weight's d side is), else 'm' (model)."""
  return "d" if letter == "D" else "m"


def apply_lora(model: CausalLM, *, rank: int, alpha: float | None = None,
               targets: str | None = None, seed: int = 0) -> CausalLM:
  """Wraps each projection whose path `targets` fully matches (None: every projection) with a
  qwix LoRA adapter of scale alpha / rank (alpha None: the rank, a scale of 1), in place.

  Each adapter's A and B are float32 `nnx.LoRAParam`s (a bf16 base stays bf16; the projection's
  output stays in its compute dtype). A's input axis and B's output axis are split as the base
  weight's first contracted / kept axis, the rank over the other mesh axis (their
  `sharding_rule` metadata names the `ShardingRules` field: `partitioning.shard_model` puts them
  on a mesh). Returns `model`.

  Raises:
    ValueError: rank < 1, alpha <= 0, a bad or unmatched `targets`, a model with adapters already.
  """
  # pylint: disable=import-outside-toplevel  (qwix is only needed when LoRA is on)
  import qwix
  if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
    raise ValueError(f"lora rank must be an int >= 1, got {rank!r}")
  alpha = rank if alpha is None else alpha
  if not (isinstance(alpha, (int, float)) and np.isfinite(alpha) and alpha > 0):
    raise ValueError(f"lora alpha must be > 0, got {alpha!r}")
  if has_lora(model):
    raise ValueError("the model already has LoRA adapters")
  n = model.config.num_layers
  wanted = set(projection_paths(n) if targets is None else check_targets(targets, n))
  rngs = nnx.Rngs(seed)
  for path, module in list(model.iter_modules()):
    if not isinstance(module, Einsum) or _module_path(path) not in wanted:
      continue
    if module.weight_axes != tuple(range(len(module.weight_axes))):
      raise ValueError(f"{_module_path(path)}: LoRA needs the contracted axes first in the weight")
    provider = qwix.LoraProvider(module_path=".*", rank=rank, alpha=float(alpha))
    example = jax.numpy.zeros((1,) + tuple(module.w.shape[i] for i in module.weight_axes),
                              module.dtype)
    with warnings.catch_warnings():  # qwix 0.1.8 reads the deprecated Variable.value
      warnings.simplefilter("ignore", DeprecationWarning)
      wrapped = qwix.apply_lora_to_model(module, provider, example, rngs=rngs)
    lhs, rhs = module.equation.split("->")[0].split(",")
    contracted = [c for c in rhs if c in lhs]
    kept = [c for c in rhs if c not in lhs]
    for name, rule in (("w_lora_a", f"lora_a_{_axis_kind(contracted[0])}r"),
                       ("w_lora_b", f"lora_b_r{_axis_kind(kept[0])}")):
      var = getattr(wrapped, name)
      # float32 whatever the base's dtype: AdamW's small steps round away on bf16 weights
      var.set_value(var.get_value().astype(jax.numpy.float32))
      var.set_metadata(sharding_rule=rule)
    wrapped.lora_rank = rank
    wrapped.lora_alpha = float(alpha)
    parent, key = _parent(model, path), path[-1]
    if isinstance(key, int):
      parent[key] = wrapped
    else:
      setattr(parent, key, wrapped)
  return model


def _adapted(model):
  """(path, projection) of every projection that carries an adapter."""
  return [(path, m) for path, m in model.iter_modules()
          if isinstance(m, Einsum) and hasattr(m, "w_lora_a")]


def has_lora(model) -> bool:
  return bool(_adapted(model))


def trained_filter(model):
  """The nnx filter of what a run trains: the adapters when the model has them, else every
  parameter (`nnx.split(model, trained_filter(model), ...)` gives trained, then frozen)."""
  return nnx.LoRAParam if has_lora(model) else nnx.Param


def lora_state(model) -> nnx.State:
  """The adapters' parameters (what a LoRA run trains and checkpoints)."""
  return nnx.state(model, nnx.LoRAParam)


def _delta(module) -> np.ndarray:
  """alpha / R * A B in the base weight's shape (host float32)."""
  a = np.asarray(jax.device_get(module.w_lora_a[...]), np.float32)
  b = np.asarray(jax.device_get(module.w_lora_b[...]), np.float32)
  return (a @ b).reshape(module.w.shape) * (module.lora_alpha / module.lora_rank)


def merged_params(model, *, adapters: bool = True) -> dict:
  """The base's parameters as a pure dict (`nnx.to_pure_dict` layout, host float arrays in the
  base's dtype) with each adapted projection's weight replaced by W + A B alpha / R (the base's
  own weights alone with `adapters=False`)."""
  pure = jax.device_get(nnx.to_pure_dict(nnx.state(model, nnx.Not(nnx.LoRAParam))))
  for path, module in _adapted(model) if adapters else ():
    node = pure
    for k in path:
      node = node[k]
    w = np.asarray(node["w"])
    node["w"] = (w.astype(np.float32) + _delta(module)).astype(w.dtype)
  return pure


def merged(model: CausalLM, *, adapters: bool = True) -> CausalLM:
  """A plain `CausalLM` (no adapters, on the first device) whose projections are
  W + A B alpha / R: the same outputs as `model` up to rounding (the base alone with
  `adapters=False`)."""
  tensors = dict(hf_tensors(merged_params(model, adapters=adapters), model.config))
  return load_state_dict(model.config, tensors, dtype=model.param_dtype,
                         compute_dtype=model.dtype)


def _hf_module_names(config) -> dict:
  """{projection path: its Hugging Face module name ('model.layers.0.self_attn.q_proj')}, from
  the one mapping of our parameters to HF tensors (`loading.hf_tensor_specs`)."""
  return {spec.path[:-1]: name[:-len(".weight")] for name, spec in hf_tensor_specs(config).items()
          if spec.path[-1] == "w"}


def peft_tensors(model) -> dict[str, np.ndarray]:
  """The adapters under PEFT's names and layout: lora_A [R, in], lora_B [out, R] (in / out as the
  Hugging Face weight's [out, in] flattens our axes; every projection keeps HF's order)."""
  out, names = {}, _hf_module_names(model.config)
  for path, m in _adapted(model):
    pre = f"base_model.model.{names[tuple(path)]}"
    out[pre + ".lora_A.weight"] = np.ascontiguousarray(
        np.asarray(jax.device_get(m.w_lora_a[...]), np.float32).T)
    out[pre + ".lora_B.weight"] = np.ascontiguousarray(
        np.asarray(jax.device_get(m.w_lora_b[...]), np.float32).T)
  return out


def peft_config(model, *, base_model: str | None = None) -> dict:
  """adapter_config.json for `peft_tensors`: PEFT's LoRA fields (dropout 0, no bias, no rsLoRA).
  Target modules by their short names when every layer has the same ones, else by full name."""
  adapted = _adapted(model)
  if not adapted:
    raise ValueError("the model has no LoRA adapters")
  ranks = {m.lora_rank for _, m in adapted}
  alphas = {m.lora_alpha for _, m in adapted}
  if len(ranks) != 1 or len(alphas) != 1:
    raise ValueError("PEFT's config holds one rank and alpha; the adapters have several")
  short = {p[-1] for p, _ in adapted}
  per_layer = {(p[1], p[-1]) for p, _ in adapted}
  every_layer = per_layer == {(i, s) for i in range(model.config.num_layers) for s in short}
  names = _hf_module_names(model.config)
  targets = sorted(short) if every_layer else sorted(names[tuple(p)] for p, _ in adapted)
  return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
          "r": ranks.pop(), "lora_alpha": alphas.pop(), "target_modules": targets,
          "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False, "use_rslora": False,
          "use_dora": False, "init_lora_weights": True, "inference_mode": True,
          "modules_to_save": None, "layers_to_transform": None, "layers_pattern": None,
          "rank_pattern": {}, "alpha_pattern": {}, "revision": None}
