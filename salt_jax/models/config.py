"""`ModelConfig`: the shape of a Qwen2 / Llama-family decoder, read from a Hugging Face config.json.

One dataclass serves both families: they differ only in whether q/k/v carry a bias (Qwen2 does,
Llama / SmolLM2 do not) and in config.json defaults. The config is frozen and hashable, so it can
sit on a module as static data and key jit caches.

Besides the architecture, the config names the attention implementation (`attention_impl`, one of
`ATTENTION_IMPLS`): which XLA program computes the same attention, and the remat policy
(`remat_policy`, one of `REMAT_POLICIES`): what the backward pass recomputes. Neither is part of
config.json; `default_attention_impl` is the one place that picks the first from the machine.
"""

from __future__ import annotations

import dataclasses
import json
import numbers
import os
from collections.abc import Mapping
from typing import Any

SUPPORTED_MODEL_TYPES = ("qwen2", "llama")

# Attention implementation name -> what it computes with. All give the same logits; they differ
# in the programs XLA gets, each suited to one kind of target.
ATTENTION_IMPLS: Mapping[str, str] = {
    "batched": "each product as one batched dot over the whole batch and the whole causal "
               "square (accelerators)",
    "cpu_chunked": "on one CPU device, a few batch rows and causal query blocks at a time so "
                   "scores stay in cache; decode steps as batched dots (the CPU default)",
    "cpu_chunked_sum": "as 'cpu_chunked', but a decode step's attention as multiply-and-sum "
                       "along contiguous axes, and the sampler decodes a few rows with Eigen "
                       "dots instead of YNNPACK (faster on some AVX2-only CPUs at short caches)",
    "query_blocks": "as 'batched', but a long sequence's queries a block at a time, each block "
                    "recomputed in the backward pass: a layer holds one block's scores instead "
                    "of the whole square (long rows on accelerators, e.g. AppWorld's); causal "
                    "blocks run as 4 loops over the keys up to each loop's last query",
}

# Remat policy name -> what a differentiated forward pass (`hidden_states` under jax.grad) keeps
# for the backward pass; names as MaxText's `remat_policy`. A forward pass alone is unchanged.
REMAT_POLICIES: Mapping[str, str] = {
    "none": "every decoder layer's activations (attention scores included): no recomputation",
    "full": "each decoder layer's input only; the backward pass recomputes the layer's forward, "
            "so one layer's activations are live at a time",
    "full_sequence_sharded": "as 'full', each kept input split along the sequence over the "
                             "mesh's model axis (a layer gathers it again when it runs): the "
                             "kept inputs take 1/model of the memory, for long rows",
}


def default_attention_impl(mesh=None) -> str:
  """The attention implementation for the machine a model runs on: 'batched' on an accelerator,
  'cpu_chunked' on a CPU.

  The platform is that of `mesh`'s devices when given (a TPU topology compiled ahead of time on a
  CPU host), else the default backend's. 'cpu_chunked_sum' is never the default: its decode-step
  multiply-and-sum materializes every (key slot, head dim) product, so its cost grows faster with
  the cache than the batched dots' (docs/performance.md has the measurements); it remains a
  choice for CPUs where it measures faster.
  """
  import jax  # pylint: disable=import-outside-toplevel  (keeps config.json parsing jax-free)

  platform = jax.default_backend() if mesh is None else mesh.devices.flat[0].platform
  return "batched" if platform != "cpu" else "cpu_chunked"


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Architecture of a decoder-only causal LM (Qwen2 or Llama family).

  Attributes:
    vocab_size: V, rows of the embedding and of the output head.
    hidden_size: D, the residual stream width.
    intermediate_size: F, the SwiGLU MLP width.
    num_layers: decoder blocks.
    num_heads: N, query heads.
    num_kv_heads: K, key/value heads (grouped-query attention: N % K == 0).
    head_dim: H, per-head width (need not equal D / N).
    rope_theta: RoPE base frequency.
    rms_norm_eps: epsilon inside RMSNorm's rsqrt.
    tie_word_embeddings: the output head reuses the input embedding (no `lm_head.weight`).
    attention_bias: q/k/v projections carry a bias (True for Qwen2, False for Llama / SmolLM2).
    max_position_embeddings: longest context the checkpoint was trained for (informational).
    bos_token_id: optional beginning-of-sequence id.
    eos_token_id: optional end-of-sequence id, or a tuple of them.
    model_type: 'qwen2' or 'llama'; only decides the config.json written by `to_hf_dict`.
    attention_impl: one of `ATTENTION_IMPLS`; None: `default_attention_impl()`, picked when a
      `CausalLM` is built. Not written to config.json (`to_hf_dict`), not read from it.
    remat_policy: one of `REMAT_POLICIES`; what training's backward pass recomputes instead of
      storing. Not written to config.json, not read from it.
  """

  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  rope_theta: float = 10000.0
  rms_norm_eps: float = 1e-6
  tie_word_embeddings: bool = False
  attention_bias: bool = True
  max_position_embeddings: int = 32768
  bos_token_id: int | None = None
  eos_token_id: int | tuple[int, ...] | None = None
  model_type: str = "qwen2"
  attention_impl: str | None = None
  remat_policy: str = "none"

  def __post_init__(self):
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                 "num_kv_heads", "head_dim", "max_position_embeddings"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"ModelConfig.{name} must be a positive int, got {value!r}")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                       f"({self.num_kv_heads}) for grouped-query attention")
    if self.head_dim % 2:
      raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
    for name in ("rope_theta", "rms_norm_eps"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, numbers.Real) or not value > 0:
        raise ValueError(f"ModelConfig.{name} must be a number > 0, got {value!r}")
    for name in ("tie_word_embeddings", "attention_bias"):
      if not isinstance(getattr(self, name), bool):
        raise ValueError(f"ModelConfig.{name} must be true or false, got "
                         f"{getattr(self, name)!r}")
    if self.model_type not in SUPPORTED_MODEL_TYPES:
      raise ValueError(f"model_type must be one of {SUPPORTED_MODEL_TYPES}, "
                       f"got {self.model_type!r}")
    if self.attention_impl is not None and self.attention_impl not in ATTENTION_IMPLS:
      raise ValueError(f"attention_impl must be one of {tuple(ATTENTION_IMPLS)} (or None for "
                       f"the machine's default), got {self.attention_impl!r}")
    if self.remat_policy not in REMAT_POLICIES:
      raise ValueError(f"remat_policy must be one of {tuple(REMAT_POLICIES)}, "
                       f"got {self.remat_policy!r}")
    if isinstance(self.eos_token_id, list):  # keep the dataclass hashable
      object.__setattr__(self, "eos_token_id", tuple(self.eos_token_id))

  @property
  def eos_token_ids(self) -> tuple[int, ...]:
    """The end-of-sequence ids as a tuple (empty when the config names none)."""
    if self.eos_token_id is None:
      return ()
    if isinstance(self.eos_token_id, int):
      return (self.eos_token_id,)
    return tuple(self.eos_token_id)

  @classmethod
  def from_hf_dict(cls, d: Mapping[str, Any]) -> ModelConfig:
    """Reads a Hugging Face config.json dict of `model_type` 'qwen2' or 'llama'.

    Accepts both RoPE layouts: a top-level `rope_theta` (older checkpoints) and transformers 5's
    `rope_parameters: {rope_theta, rope_type}`. Only plain RoPE (`rope_type` 'default') is
    implemented; scaled variants (yarn, linear, llama3, ...) raise rather than load silently wrong.

    Raises:
      ValueError: unsupported model type, activation, RoPE scaling, sliding window or bias layout,
        or a missing required field.
    """
    if not isinstance(d, Mapping):
      raise ValueError(f"expected a config dict, got {type(d).__name__}")
    model_type = d.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
      raise ValueError(f"model_type {model_type!r} is not supported; "
                       f"expected one of {SUPPORTED_MODEL_TYPES}")
    missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                           "num_attention_heads") if d.get(k) is None]
    if missing:
      raise ValueError(f"config.json lacks required field(s) {missing}")
    act = d.get("hidden_act", "silu")
    if act != "silu":
      raise ValueError(f"hidden_act {act!r} is not supported (only 'silu')")
    rope_theta = _rope_theta(d)
    if model_type == "qwen2":
      if d.get("use_sliding_window", False):
        raise ValueError("Qwen2 sliding-window attention (use_sliding_window=true) is not "
                         "supported")
      attention_bias = True  # Qwen2 always has q/k/v bias and no o_proj bias
    else:
      # Llama's attention_bias puts a bias on o_proj too, which this model does not have.
      if d.get("attention_bias", False):
        raise ValueError("Llama attention_bias=true (bias on q/k/v/o) is not supported")
      if d.get("mlp_bias", False):
        raise ValueError("Llama mlp_bias=true is not supported")
      attention_bias = False
    num_heads = int(d["num_attention_heads"])
    hidden = int(d["hidden_size"])
    head_dim = d.get("head_dim")
    if head_dim is None:
      if hidden % num_heads:
        raise ValueError(f"hidden_size {hidden} is not a multiple of num_attention_heads "
                         f"{num_heads} and config.json gives no head_dim")
      head_dim = hidden // num_heads
    num_kv = d.get("num_key_value_heads")
    eos = d.get("eos_token_id")
    return cls(
        vocab_size=int(d["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(d["intermediate_size"]),
        num_layers=int(d["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(num_heads if num_kv is None else num_kv),
        head_dim=int(head_dim),
        rope_theta=float(rope_theta),
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        attention_bias=attention_bias,
        max_position_embeddings=int(d.get("max_position_embeddings", 32768)),
        bos_token_id=d.get("bos_token_id"),
        eos_token_id=tuple(eos) if isinstance(eos, list) else eos,
        model_type=model_type,
    )

  def to_hf_dict(self, dtype: str = "float32") -> dict[str, Any]:
    """The config.json that transformers reads back as Qwen2Config / LlamaConfig, in 5.x and 4.x.

    RoPE's base is written in both layouts: transformers 5's `rope_parameters` and the top-level
    `rope_theta` that 4.x reads (4.57 ignores `rope_parameters` and would silently use 10000).
    The parameter dtype goes under both `dtype` (5.x) and `torch_dtype` (4.x before 4.56).
    """
    arch = "Qwen2ForCausalLM" if self.model_type == "qwen2" else "LlamaForCausalLM"
    d = {
        "architectures": [arch],
        "model_type": self.model_type,
        "vocab_size": self.vocab_size,
        "hidden_size": self.hidden_size,
        "intermediate_size": self.intermediate_size,
        "num_hidden_layers": self.num_layers,
        "num_attention_heads": self.num_heads,
        "num_key_value_heads": self.num_kv_heads,
        "head_dim": self.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": self.rms_norm_eps,
        "rope_theta": self.rope_theta,
        "rope_parameters": {"rope_theta": self.rope_theta, "rope_type": "default"},
        "tie_word_embeddings": self.tie_word_embeddings,
        "max_position_embeddings": self.max_position_embeddings,
        "bos_token_id": self.bos_token_id,
        "eos_token_id": list(self.eos_token_id) if isinstance(self.eos_token_id, tuple)
                        else self.eos_token_id,
        "dtype": dtype,
        "torch_dtype": dtype,
    }
    if self.model_type == "qwen2":
      d["use_sliding_window"] = False
    else:
      d["attention_bias"] = False
      d["mlp_bias"] = False
    return d

  @classmethod
  def tiny(cls, **overrides) -> ModelConfig:
    """A 2-layer model for tests (V=128, D=64, F=128, N=4, K=2, H=16); fields overridable."""
    fields = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=10000.0,
                  rms_norm_eps=1e-6, tie_word_embeddings=False, attention_bias=True,
                  max_position_embeddings=256)
    fields.update(overrides)
    return cls(**fields)


# The default small policy (`TrainConfig.tiny_policy` overrides its fields): Qwen2 architecture,
# random init; the run sets the rest (`TINY_POLICY_RUN_FIELDS`).
TINY_POLICY = dict(hidden_size=64, intermediate_size=256, num_layers=2, num_heads=4,
                   num_kv_heads=2, head_dim=16, tie_word_embeddings=True)
# Fields of the tiny policy that come from the run, not from `tiny_policy`: the tokenizer's
# vocabulary and end id, the KV cache length, and the attention and remat settings.
TINY_POLICY_RUN_FIELDS = ("vocab_size", "eos_token_id", "max_position_embeddings",
                          "attention_impl", "remat_policy")


def tiny_policy_config(overrides: Mapping[str, Any], **run_fields) -> ModelConfig:
  """The tiny policy's ModelConfig: `TINY_POLICY`, then `overrides` (`TrainConfig.tiny_policy`),
  then `run_fields` (those of `TINY_POLICY_RUN_FIELDS` the run sets; vocab_size and
  max_position_embeddings default to placeholders, for checking `overrides` alone).

  Raises:
    ValueError: an override that is no ModelConfig field or one the run sets (the settable ones
      listed), or a value ModelConfig refuses (wrong type, non-positive size, heads that do not
      group).
  """
  if not isinstance(overrides, Mapping):
    raise ValueError(f"tiny_policy must be a dict (a JSON object), got {overrides!r}")
  settable = [f.name for f in dataclasses.fields(ModelConfig)
              if f.name not in TINY_POLICY_RUN_FIELDS]
  unknown = sorted(set(overrides) - set(settable))
  if unknown:
    raise ValueError(f"unknown tiny_policy fields {unknown}; known: {', '.join(settable)} "
                     f"(the run sets {', '.join(TINY_POLICY_RUN_FIELDS)})")
  fields = {**TINY_POLICY, **overrides, "vocab_size": 64, "max_position_embeddings": 256,
            **run_fields}
  try:
    return ModelConfig(**fields)
  except (TypeError, ValueError) as e:
    raise ValueError(f"tiny_policy {dict(overrides)}: {e}") from None


def read_hf_config(path: str | os.PathLike) -> dict:
  """The config.json dict of a local Hugging Face folder.

  Raises:
    ValueError: no such folder, or a folder without config.json (naming it); json's own
      ValueError for a file that is not JSON.
  """
  path = os.fspath(path)
  if not os.path.isdir(path):
    raise ValueError(f"checkpoint folder {path!r} does not exist")
  config_path = os.path.join(path, "config.json")
  if not os.path.isfile(config_path):
    raise ValueError(f"{path} has no config.json")
  with open(config_path, encoding="utf-8") as f:
    return json.load(f)


def read_model_config(path: str | os.PathLike) -> ModelConfig:
  """The ModelConfig of a `--model`: a local Hugging Face folder's config.json or a .gguf
  file's metadata (reads no weights).

  Raises:
    ValueError: naming `path` and what is wrong: no such folder or file, no or unreadable
      config.json, a missing required field, an unsupported architecture.
  """
  # pylint: disable=import-outside-toplevel  (gguf needs numpy; config.json parsing does not)
  from salt_jax.models.gguf import is_gguf_file, load_gguf_config
  path = os.fspath(path)
  try:
    if is_gguf_file(path):
      return ModelConfig.from_hf_dict(load_gguf_config(path))
    if not os.path.isdir(path):
      raise ValueError("not a local folder or .gguf file (Hugging Face hub ids are not fetched)")
    return ModelConfig.from_hf_dict(read_hf_config(path))
  except (OSError, TypeError, ValueError) as e:  # JSONDecodeError is a ValueError
    raise ValueError(f"--model {path}: {e}") from None


def _rope_theta(d: Mapping[str, Any]) -> float:
  """RoPE base from either layout; rejects scaled RoPE variants."""
  params = d.get("rope_parameters")
  scaling = d.get("rope_scaling")  # transformers 4 name for the same idea
  for name, block in (("rope_parameters", params), ("rope_scaling", scaling)):
    if block is None:
      continue
    if not isinstance(block, Mapping):
      raise ValueError(f"{name} must be a dict, got {block!r}")
    rope_type = block.get("rope_type", block.get("type", "default"))
    if rope_type != "default":
      raise ValueError(f"{name}.rope_type {rope_type!r} is not supported (only 'default')")
  if isinstance(params, Mapping) and params.get("rope_theta") is not None:
    return float(params["rope_theta"])
  if d.get("rope_theta") is not None:
    return float(d["rope_theta"])
  return 10000.0


# The Qwen2.5 Instruct checkpoints' architectures, as their config.json files give them (no
# weights needed): for compiling and sizing programs ahead of time.
_QWEN25 = dict(rope_theta=1_000_000.0, rms_norm_eps=1e-6, attention_bias=True, head_dim=128,
               max_position_embeddings=32768, bos_token_id=151643, eos_token_id=151645)
PRESETS: Mapping[str, ModelConfig] = {
    "qwen2.5-1.5b": ModelConfig(vocab_size=151936, hidden_size=1536, intermediate_size=8960,
                                num_layers=28, num_heads=12, num_kv_heads=2,
                                tie_word_embeddings=True, **_QWEN25),
    "qwen2.5-7b": ModelConfig(vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                              num_layers=28, num_heads=28, num_kv_heads=4, **_QWEN25),
    "qwen2.5-32b": ModelConfig(vocab_size=152064, hidden_size=5120, intermediate_size=27648,
                               num_layers=64, num_heads=40, num_kv_heads=8, **_QWEN25),
}
