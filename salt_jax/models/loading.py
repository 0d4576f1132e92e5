"""Hugging Face checkpoints <-> `CausalLM`: safetensors only, straight into sharded parameters.

Loading never builds the model concretely: `nnx.eval_shape` gives the abstract parameters, each
checkpoint tensor is read alone (safetensors, no pickle), reshaped to its einsum layout, cast, and
`jax.device_put` to its NamedSharding (only each device's shard is transferred), then `nnx.merge`
assembles the model. Peak host memory is about one tensor; no device holds a full copy of an
FSDP/TP-sharded model.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, SingleDeviceSharding
from safetensors import safe_open
import safetensors.numpy

from salt_jax.models.config import ModelConfig, read_hf_config
from salt_jax.models.gguf import is_gguf_file, load_gguf_state_dict
from salt_jax.models.partitioning import ActivationSharding, ShardingRules, shardings_for_state
from salt_jax.models.qwen2 import CausalLM

_INDEX_FILE = "model.safetensors.index.json"
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


@dataclasses.dataclass(frozen=True)
class _TensorSpec:
  """Where one HF tensor lives in the model and how its layout maps onto ours."""

  path: tuple  # key path in the nnx state's pure dict
  hf_shape: tuple[int, ...]
  to_model: Callable[[np.ndarray], np.ndarray]
  to_hf: Callable[[np.ndarray], np.ndarray]


def _identity(x):
  return x


def _transpose(x):
  return np.ascontiguousarray(x.T)


def hf_tensor_specs(config: ModelConfig) -> dict[str, _TensorSpec]:
  """HF tensor name -> its place, HF shape and layout maps, for every parameter of the model."""
  c = config
  d, n, k, h, f = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size

  def in_proj(heads):  # HF [heads*H, D] <-> ours [D, heads, H]
    return (lambda w: np.ascontiguousarray(w.T).reshape(d, heads, h),
            lambda w: np.ascontiguousarray(w.reshape(d, heads * h).T))

  def bias(heads):  # HF [heads*H] <-> ours [heads, H]
    return (lambda b: b.reshape(heads, h), lambda b: b.reshape(heads * h))

  out_proj = (lambda w: np.ascontiguousarray(w.T).reshape(n, h, d),  # HF [D, N*H] <-> [N, H, D]
              lambda w: np.ascontiguousarray(w.reshape(n * h, d).T))

  specs = {
      "model.embed_tokens.weight": _TensorSpec(("embed_tokens",), (c.vocab_size, d),
                                               _identity, _identity),
      "model.norm.weight": _TensorSpec(("final_norm", "scale"), (d,), _identity, _identity),
  }
  if not c.tie_word_embeddings:
    specs["lm_head.weight"] = _TensorSpec(("lm_head",), (c.vocab_size, d), _identity, _identity)
  for i in range(c.num_layers):
    pre = f"model.layers.{i}."
    attn = ("layers", i, "attn")
    mlp = ("layers", i, "mlp")
    specs[pre + "self_attn.q_proj.weight"] = _TensorSpec(attn + ("q_proj", "w"), (n * h, d),
                                                         *in_proj(n))
    specs[pre + "self_attn.k_proj.weight"] = _TensorSpec(attn + ("k_proj", "w"), (k * h, d),
                                                         *in_proj(k))
    specs[pre + "self_attn.v_proj.weight"] = _TensorSpec(attn + ("v_proj", "w"), (k * h, d),
                                                         *in_proj(k))
    specs[pre + "self_attn.o_proj.weight"] = _TensorSpec(attn + ("o_proj", "w"), (d, n * h),
                                                         *out_proj)
    if c.attention_bias:
      specs[pre + "self_attn.q_proj.bias"] = _TensorSpec(attn + ("q_bias",), (n * h,), *bias(n))
      specs[pre + "self_attn.k_proj.bias"] = _TensorSpec(attn + ("k_bias",), (k * h,), *bias(k))
      specs[pre + "self_attn.v_proj.bias"] = _TensorSpec(attn + ("v_bias",), (k * h,), *bias(k))
    specs[pre + "mlp.gate_proj.weight"] = _TensorSpec(mlp + ("gate_proj", "w"), (f, d),
                                                      _transpose, _transpose)
    specs[pre + "mlp.up_proj.weight"] = _TensorSpec(mlp + ("up_proj", "w"), (f, d),
                                                    _transpose, _transpose)
    specs[pre + "mlp.down_proj.weight"] = _TensorSpec(mlp + ("down_proj", "w"), (d, f),
                                                      _transpose, _transpose)
    specs[pre + "input_layernorm.weight"] = _TensorSpec(("layers", i, "input_norm", "scale"),
                                                        (d,), _identity, _identity)
    specs[pre + "post_attention_layernorm.weight"] = _TensorSpec(
        ("layers", i, "post_norm", "scale"), (d,), _identity, _identity)
  return specs


def random_state_dict(config: ModelConfig, *, seed: int = 0, std: float = 0.02
                      ) -> dict[str, np.ndarray]:
  """Random HF-named f32 tensors for `config` (numpy only, so no compile): weights N(0, std),
  biases N(0, 0.3), norm weights U(0.5, 1.5) so that no layout error hides behind a 0 or a 1.
  Feed to `load_state_dict` for tests and benchmarks.
  """
  rng = np.random.default_rng(seed)
  out = {}
  for name, spec in hf_tensor_specs(config).items():
    if name.endswith(".bias"):
      value = rng.normal(0.0, 0.3, spec.hf_shape)
    elif name.endswith("norm.weight"):
      value = rng.uniform(0.5, 1.5, spec.hf_shape)
    else:
      value = rng.normal(0.0, std, spec.hf_shape)
    out[name] = value.astype(np.float32)
  return out


def _ignorable(name: str, config: ModelConfig) -> bool:
  """Tensors a valid checkpoint may carry that the model does not need."""
  if name.endswith("rotary_emb.inv_freq"):  # old checkpoints saved the RoPE table
    return True
  # Some tied checkpoints still store the head; the embedding is the truth.
  return config.tie_word_embeddings and name == "lm_head.weight"


def _get_path(tree, path):
  for key in path:
    tree = tree[key]
  return tree


def _set_path(tree, path, value):
  for key in path[:-1]:
    tree = tree[key]
  tree[path[-1]] = value


def _resolve_dtype(dtype) -> np.dtype:
  try:
    resolved = np.dtype(jnp.dtype(dtype))
  except TypeError as e:
    raise ValueError(f"dtype must be a floating dtype, got {dtype!r}") from e
  if not jnp.issubdtype(resolved, jnp.floating):
    raise ValueError(f"dtype must be a floating dtype, got {dtype!r}")
  return resolved


def param_shardings(config: ModelConfig, mesh: Mesh, rules: ShardingRules | None = None) -> dict:
  """NamedSharding per parameter of `CausalLM(config)`, as a nested pure dict.

  The structure equals `nnx.to_pure_dict(nnx.state(model, nnx.Param))`, so it zips with a
  model's state or a loaded state dict. Nothing is allocated: the model is built abstractly.
  """
  abstract = nnx.eval_shape(lambda: CausalLM(config, rngs=nnx.Rngs(0)))
  return shardings_for_state(nnx.state(abstract, nnx.Param), mesh, rules)


def load_state_dict(config: ModelConfig, tensors: Mapping[str, Any], *, dtype=None,
                    mesh: Mesh | None = None, rules: ShardingRules | None = None,
                    compute_dtype=None) -> CausalLM:
  """Builds a `CausalLM` from Hugging Face-named tensors, each placed straight on its sharding.

  Args:
    config: the architecture.
    tensors: HF name -> array-like in HF layout (numpy, or anything `np.asarray` accepts, read
      lazily one at a time), e.g. 'model.layers.0.self_attn.q_proj.weight': [N*H, D].
    dtype: parameter dtype (and compute dtype unless `compute_dtype`); None means float32.
    mesh: a ('data', 'model') mesh (salt_jax.sharding.make_mesh) to shard parameters over
      (FSDP + tensor parallel, see partitioning.py); None puts everything on the first device.
    rules: PartitionSpecs to use instead of the defaults.
    compute_dtype: activations' and matmuls' dtype when it differs from the parameters' (e.g.
      bfloat16 over float32 parameters: mixed precision, the optimizer updating float32 master
      weights); None: `dtype`.

  Returns:
    The model (its config is `model.config`).

  Raises:
    ValueError: a missing, unexpected or wrongly shaped tensor (named), or a bad dtype.
  """
  if not isinstance(config, ModelConfig):
    raise ValueError(f"config must be a ModelConfig, got {type(config).__name__}")
  np_dtype = _resolve_dtype(jnp.float32 if dtype is None else dtype)
  specs = hf_tensor_specs(config)
  names = set(tensors.keys())
  missing = sorted(set(specs) - names)
  if missing:
    raise ValueError(f"checkpoint lacks {len(missing)} tensor(s): {missing[:8]}"
                     f"{' ...' if len(missing) > 8 else ''}")
  unexpected = sorted(n for n in names - set(specs) if not _ignorable(n, config))
  if unexpected:
    raise ValueError(f"checkpoint has {len(unexpected)} unexpected tensor(s) for this config: "
                     f"{unexpected[:8]}{' ...' if len(unexpected) > 8 else ''}")

  compute = np_dtype if compute_dtype is None else _resolve_dtype(compute_dtype)
  abstract = nnx.eval_shape(lambda: CausalLM(config, rngs=nnx.Rngs(0), dtype=compute.type,
                                             param_dtype=np_dtype.type))
  graphdef, state = nnx.split(abstract)
  pure = nnx.to_pure_dict(state)
  if mesh is not None:
    rules = rules or ShardingRules()
    shardings = shardings_for_state(state, mesh, rules)
  else:
    device = SingleDeviceSharding(jax.devices()[0])
    shardings = jax.tree.map(lambda _: device, pure)

  for name, spec in specs.items():
    value = np.asarray(tensors[name])
    if tuple(value.shape) != spec.hf_shape:
      raise ValueError(f"tensor {name} has shape {tuple(value.shape)}, expected {spec.hf_shape}")
    if not (np.issubdtype(value.dtype, np.floating) or value.dtype == jnp.bfloat16):
      raise ValueError(f"tensor {name} has non-float dtype {value.dtype}")
    array = spec.to_model(value).astype(np_dtype)
    _set_path(pure, spec.path, jax.device_put(array, _get_path(shardings, spec.path)))
    del value, array  # keep host memory at about one tensor

  nnx.replace_by_pure_dict(state, pure)
  model = nnx.merge(graphdef, state)
  if mesh is not None:
    model.activation_sharding = ActivationSharding(mesh, rules)
  return model


class _SafetensorsReader(Mapping):
  """name -> np.ndarray over open safetensors files; each tensor is read only when asked for."""

  def __init__(self, handles: Mapping[str, Any], name_to_file: Mapping[str, str]):
    self._handles = handles
    self._files = dict(name_to_file)

  def __getitem__(self, name: str) -> np.ndarray:
    return self._handles[self._files[name]].get_tensor(name)

  def __iter__(self) -> Iterator[str]:
    return iter(self._files)

  def __len__(self) -> int:
    return len(self._files)


def _checkpoint_files(path: str) -> list[str]:
  """The safetensors files of a checkpoint folder (from its index when there is one)."""
  index = os.path.join(path, _INDEX_FILE)
  if os.path.exists(index):
    with open(index) as fh:
      weight_map = json.load(fh).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
      raise ValueError(f"{index} has no weight_map")
    files = sorted(set(weight_map.values()))
    absent = [f for f in files if not os.path.exists(os.path.join(path, f))]
    if absent:
      raise ValueError(f"{index} names shard file(s) that are not in {path}: {absent}")
    return files
  files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
  if files:
    return files
  pickled = sorted(f for f in os.listdir(path) if f.endswith(_PICKLE_SUFFIXES))
  if pickled:
    raise ValueError(f"{path} holds only pickle-based weights {pickled}; salt_jax loads "
                     "safetensors only and never unpickles. Convert them first (e.g. "
                     "transformers' save_pretrained(..., safe_serialization=True)).")
  raise ValueError(f"no *.safetensors files in {path}")


def _config_dtype(hf: Mapping[str, Any]):
  name = hf.get("dtype") or hf.get("torch_dtype")
  return _DTYPES.get(str(name).replace("torch.", ""), jnp.float32)


def from_pretrained(path: str | os.PathLike, *, dtype=None, mesh: Mesh | None = None,
                    rules: ShardingRules | None = None,
                    attention_impl: str | None = None,
                    remat_policy: str = "none", compute_dtype=None) -> CausalLM:
  """Loads a local Hugging Face Qwen2 / Llama checkpoint folder, or a GGUF file, into a `CausalLM`.

  The folder holds config.json and one `*.safetensors` file or several with
  `model.safetensors.index.json`. Both RoPE layouts of config.json are read (top-level
  `rope_theta`, transformers 5's `rope_parameters`). A `.gguf` file (llama.cpp's format, e.g.
  SmolLM2-135M-Instruct from `salt_jax.models.gguf.smollm2_path()`) is read by
  `load_gguf_state_dict`, its tensors dequantized to float32 (then cast to `dtype`, float32 when
  None).

  Args:
    path: the folder, or a .gguf file.
    dtype: parameter and compute dtype; None means the checkpoint's own (config.json `dtype` /
      `torch_dtype`: float32, bfloat16 or float16), float32 when it names none.
    mesh: shard parameters over this ('data', 'model') mesh; None: first device.
    rules: PartitionSpecs to use instead of the defaults.
    attention_impl: one of `ATTENTION_IMPLS` (not in config.json); None: the machine's default.
    remat_policy: one of `REMAT_POLICIES` (not in config.json).
    compute_dtype: activations' and matmuls' dtype when it differs from `dtype`
      (`load_state_dict`); None: the parameters' dtype.

  Returns:
    The model; its ModelConfig is `model.config`.

  Raises:
    ValueError: no folder or config.json, unsupported config, pickle-only weights, missing /
      unexpected / wrongly shaped tensors (named), or a tensor stored in two shards.
  """
  path = os.fspath(path)
  if is_gguf_file(path):
    hf_config, tensors = load_gguf_state_dict(path)  # dequantized to float32
    config = dataclasses.replace(ModelConfig.from_hf_dict(hf_config),
                                 attention_impl=attention_impl, remat_policy=remat_policy)
    return load_state_dict(config, tensors, dtype=dtype, mesh=mesh, rules=rules,
                           compute_dtype=compute_dtype)
  hf_config = read_hf_config(path)
  config = dataclasses.replace(ModelConfig.from_hf_dict(hf_config), attention_impl=attention_impl,
                               remat_policy=remat_policy)
  if dtype is None:
    dtype = _config_dtype(hf_config)
  files = _checkpoint_files(path)
  with contextlib.ExitStack() as stack:
    handles = {f: stack.enter_context(safe_open(os.path.join(path, f), framework="numpy"))
               for f in files}
    name_to_file: dict[str, str] = {}
    for f, handle in handles.items():
      for name in handle.keys():
        if name in name_to_file:
          raise ValueError(f"tensor {name} is stored in both {name_to_file[name]} and {f}")
        name_to_file[name] = f
    return load_state_dict(config, _SafetensorsReader(handles, name_to_file), dtype=dtype,
                           mesh=mesh, rules=rules, compute_dtype=compute_dtype)


def hf_tensors(params, config: ModelConfig, *, dtype=None) -> Iterator[tuple[str, np.ndarray]]:
  """(Hugging Face name, host array in HF layout) for every parameter, one tensor at a time.

  The one mapping from our parameters to HF tensors (`hf_tensor_specs`): `save_pretrained` writes
  it, a rollout engine loads it (`salt_jax.engines`).

  Args:
    params: a `CausalLM`, its `nnx.State` (e.g. the trainer's `nnx.split` params) or that state's
      pure dict.
    config: the model's architecture.
    dtype: cast each tensor to this ('float32', 'bfloat16', 'float16' or a dtype); None: as stored.
  """
  if isinstance(params, CausalLM):
    params = nnx.state(params, nnx.Param)
  pure = params if isinstance(params, dict) else nnx.to_pure_dict(params)
  cast = None if dtype is None else _DTYPES[_dtype_name(dtype)]
  for name, spec in hf_tensor_specs(config).items():
    value = spec.to_hf(np.asarray(jax.device_get(_get_path(pure, spec.path))))
    yield name, np.ascontiguousarray(value if cast is None else value.astype(cast))


def save_pretrained(model: CausalLM, path: str | os.PathLike, *, dtype=None,
                    generation: Mapping[str, Any] | None = None) -> None:
  """Writes a Hugging Face folder: config.json, model.safetensors and generation_config.json.

  `from_pretrained` and transformers' `AutoModelForCausalLM.from_pretrained` read it, in 5.x and
  in 4.x (`ModelConfig.to_hf_dict` writes the keys both read). Gathers each tensor to host.

  Args:
    model: the policy.
    path: the folder (created).
    dtype: the stored dtype ('float32', 'bfloat16', 'float16' or a jnp dtype); None: the model's
      parameter dtype.
    generation: fields of generation_config.json on top of the model's bos/eos ids (e.g.
      pad_token_id, do_sample, temperature, top_p, top_k).
  """
  if not isinstance(model, CausalLM):
    raise ValueError(f"model must be a CausalLM, got {type(model).__name__}")
  dtype_name = _dtype_name(model.param_dtype if dtype is None else dtype)
  path = os.fspath(path)
  os.makedirs(path, exist_ok=True)
  config = model.config
  tensors = dict(hf_tensors(model, config, dtype=dtype_name))
  with open(os.path.join(path, "config.json"), "w") as fh:
    json.dump(config.to_hf_dict(dtype=dtype_name), fh, indent=2)
  with open(os.path.join(path, "generation_config.json"), "w") as fh:
    json.dump(generation_config(config, **(generation or {})), fh, indent=2)
  # transformers refuses safetensors files without a 'format' entry.
  safetensors.numpy.save_file(tensors, os.path.join(path, "model.safetensors"),
                              metadata={"format": "pt"})


def generation_config(config: ModelConfig, **fields) -> dict[str, Any]:
  """generation_config.json's dict: the model's bos/eos ids (a list of eos ids when several, as
  transformers 4.x and 5.x both accept), then `fields` (None values dropped)."""
  eos = list(config.eos_token_ids)
  out = {"bos_token_id": config.bos_token_id,
         "eos_token_id": eos[0] if len(eos) == 1 else (eos or None)}
  out.update(fields)
  return {k: v for k, v in out.items() if v is not None}


def _dtype_name(dtype) -> str:
  """'float32' / 'bfloat16' / 'float16' for a name or a dtype; ValueError for anything else."""
  if isinstance(dtype, str) and dtype in _DTYPES:
    return dtype
  try:
    name = {np.dtype(v): k for k, v in _DTYPES.items()}.get(np.dtype(dtype))
  except TypeError:
    name = None
  if name is None:
    raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
  return name
