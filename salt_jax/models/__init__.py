"""Policy models: a Flax NNX Qwen2 / Llama decoder, Hugging Face loading, sharding rules."""

from salt_jax.models.config import (ATTENTION_IMPLS, REMAT_POLICIES, ModelConfig,
                                    default_attention_impl)
from salt_jax.models.loading import (from_pretrained, hf_tensors, load_state_dict,
                                     param_shardings, random_state_dict, save_pretrained)
from salt_jax.models.partitioning import ShardingRules, shard_model
from salt_jax.models.qwen2 import CausalLM, KVCache

__all__ = [
    "ATTENTION_IMPLS",
    "CausalLM",
    "KVCache",
    "ModelConfig",
    "REMAT_POLICIES",
    "ShardingRules",
    "default_attention_impl",
    "from_pretrained",
    "hf_tensors",
    "load_state_dict",
    "param_shardings",
    "random_state_dict",
    "save_pretrained",
    "shard_model",
]
