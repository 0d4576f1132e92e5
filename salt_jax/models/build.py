"""A run's tokenizer and policy, built from its `TrainConfig`; policy params saved and loaded.

  build_tokenizer(config)          the --model folder's, the offline Qwen2.5, a toy BPE or a folder
  policy_config(config, tokenizer) (ModelConfig, parameter dtype), without building the model
  build_policy(config, tokenizer, mesh)  the `CausalLM` on `mesh`: loaded, or the tiny random one,
                                         with --init-params and LoRA adapters (--lora-rank)
  save_params(path, params) / load_params(path, like)   an orbax params tree (e.g. a warm start)
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os

import jax
import jax.numpy as jnp
from flax import nnx

from salt_jax.config import TrainConfig
from salt_jax.models.config import (  # noqa: F401  (TINY_POLICY: this module's name for it)
    TINY_POLICY, ModelConfig, read_model_config, tiny_policy_config)
from salt_jax.models.gguf import is_gguf_file, load_gguf_tokenizer
from salt_jax.models.loading import from_pretrained
from salt_jax.models.lora import apply_lora
from salt_jax.models.partitioning import shard_model
from salt_jax.models.qwen2 import CausalLM

# Expert episodes whose texts teach the toy tokenizer an environment's words (deterministic).
_TOY_CORPUS_TASKS, _TOY_CORPUS_STEPS = 4, 8


def build_tokenizer(config: TrainConfig):
  """The run's tokenizer: the --model folder's (or GGUF file's) own, else `config.tokenizer`
  ('toy' for an env other than the toy one is fitted to that env's words)."""
  if config.model is not None and (is_gguf_file(config.model) or os.path.exists(
      os.path.join(config.model, "tokenizer.json"))):
    return named_tokenizer(config.model)
  if config.tokenizer == "toy" and config.env != "toy":
    return named_tokenizer("toy", config.env, json.dumps(config.env_kwargs, sort_keys=True))
  return named_tokenizer(config.tokenizer)


def env_texts(env: str, env_kwargs: dict) -> list[str]:
  """Observations and admissible actions of a few expert episodes on `env`'s training split."""
  # pylint: disable=import-outside-toplevel  (environments are imported when one is chosen)
  from envs import registry
  from envs.demos import collect_demos, demo_texts
  tasks = registry.task_list(env, registry.entry(env).train_split,
                             **env_kwargs)[:_TOY_CORPUS_TASKS]
  game = registry.make_expert_env(env, **{**env_kwargs, "max_steps": _TOY_CORPUS_STEPS})
  try:
    demos = collect_demos(game, tasks, max_steps=_TOY_CORPUS_STEPS, only_won=False)
  finally:
    game.close()
  return demo_texts(demos)


@functools.lru_cache(maxsize=4)
def named_tokenizer(name: str, env: str = "toy", env_kwargs_json: str = "{}"):
  """Built once per process (the toy BPE trains for seconds); callers only read it.

  'toy' for an env other than the toy one also learns merges from that env's texts, so its
  prompts are a few times shorter than byte-level ones (what makes CPU-scale studies fit).
  """
  # pylint: disable=import-outside-toplevel  (heavy or optional: imported when chosen)
  if os.path.isdir(name):
    from salt_jax.models.tokenizer import load_tokenizer
    return load_tokenizer(name)
  if is_gguf_file(name):
    return load_gguf_tokenizer(name)
  if name == "qwen25":
    from salt_jax.models.tokenizer import build_qwen25_tokenizer
    return build_qwen25_tokenizer()
  if name == "toy":
    from salt_jax.agent.prompts import toy_chat_tokenizer
    if env == "toy":
      return toy_chat_tokenizer()
    return toy_chat_tokenizer(2048, extra_texts=env_texts(env, json.loads(env_kwargs_json)))
  raise ValueError(f"tokenizer must be 'qwen25', 'toy' or a local folder, got {name!r}")


def policy_config(config: TrainConfig, tokenizer) -> tuple[ModelConfig, jnp.dtype]:
  """(ModelConfig, parameter dtype) of the run's policy, without building it."""
  if config.model is not None:
    return (dataclasses.replace(read_model_config(config.model),
                                attention_impl=config.attention_impl,
                                remat_policy=config.remat_policy),
            jnp.dtype(config.param_dtype))
  vocab = -(-len(tokenizer) // 64) * 64  # rounded up, as real checkpoints pad their embedding
  eos = tokenizer.convert_tokens_to_ids(tokenizer.eos_token)
  return tiny_policy_config(config.tiny_policy, vocab_size=vocab, eos_token_id=eos,
                            max_position_embeddings=config.max_cache_len,
                            attention_impl=config.attention_impl,
                            remat_policy=config.remat_policy), jnp.dtype("float32")


def build_policy(config: TrainConfig, tokenizer, mesh) -> CausalLM:
  """The policy `CausalLM` on `mesh`: loaded from `config.model` (a folder or a .gguf file), else
  the tiny random Qwen2; then `config.init_params` loaded over it, then LoRA adapters on it when
  `config.lora_rank` (`salt_jax.models.lora`: the weights so far are the frozen base)."""
  if config.model is not None:
    # float32 by default whatever the checkpoint holds: AdamW steps of ~1e-6 on bf16 weights
    # round away (bf16 keeps 8 bits of mantissa), so a bf16 policy would not learn at the paper's lr.
    model = from_pretrained(config.model, mesh=mesh, dtype=jnp.dtype(config.param_dtype),
                            attention_impl=config.attention_impl,
                            remat_policy=config.remat_policy,
                            compute_dtype=config.compute_dtype)
  else:
    mcfg, param_dtype = policy_config(config, tokenizer)
    compute = param_dtype if config.compute_dtype is None else jnp.dtype(config.compute_dtype)
    model = shard_model(CausalLM(mcfg, rngs=nnx.Rngs(config.seed), dtype=compute,
                                 param_dtype=param_dtype), mesh)
  if config.init_params is not None:
    nnx.update(model, load_params(config.init_params, nnx.state(model, nnx.Param)))
  if config.lora_rank:
    apply_lora(model, rank=config.lora_rank, alpha=config.lora_alpha,
               targets=config.lora_targets, seed=config.seed)
    shard_model(model, mesh)  # the adapters on the mesh, as their base weights
  return model


def load_params(path: str, like):
  """Restores an orbax params tree saved by `save_params` onto `like`'s shardings."""
  import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel
  abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
  with ocp.StandardCheckpointer() as ckpt:
    return ckpt.restore(os.path.abspath(path), abstract)


def save_params(path: str, params) -> None:
  import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel
  with ocp.StandardCheckpointer() as ckpt:
    ckpt.save(os.path.abspath(path), params, force=True)
