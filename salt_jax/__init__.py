"""salt-jax: SALT step-level advantage assignment for LLM agents, in JAX.

Host side (numpy, no accelerator): `build_merge_ids`, `cross_prompt_merges`,
`gradient_changing_merges`.
Device side (pure, jittable, shardable along `data`): `grpo_advantages`, `rloo_advantages`,
`gigpo_advantages`, `gae_advantages`, `masked_whiten`, `refine`, `token_advantages`,
`policy_loss`, `rollout_is_weights`, `value_loss`, `microbatched_value_and_grad`.

The names are imported on first use (`salt_jax.refine` imports `salt_jax.salt`), so that
`import salt_jax.config` or the command line (`salt_jax.cli`) does not import jax.
"""

import importlib

from salt_jax import log as _log

_log.import_tqdm_auto_quietly()  # a notebook without ipywidgets: no tqdm warning from transformers

_EXPORTS = {
    "microbatched_value_and_grad": "salt_jax.accumulate",
    "count_invalid_rewards": "salt_jax.advantages",
    "gae_advantages": "salt_jax.advantages",
    "gigpo_advantages": "salt_jax.advantages",
    "grpo_advantages": "salt_jax.advantages",
    "masked_whiten": "salt_jax.advantages",
    "rloo_advantages": "salt_jax.advantages",
    "MergeIds": "salt_jax.graph",
    "build_merge_ids": "salt_jax.graph",
    "cross_prompt_merges": "salt_jax.graph",
    "gradient_changing_merges": "salt_jax.graph",
    "PolicyLossMetrics": "salt_jax.loss",
    "aggregate": "salt_jax.loss",
    "aggregate_weight": "salt_jax.loss",
    "kl_estimate": "salt_jax.loss",
    "policy_loss": "salt_jax.loss",
    "rollout_is_weights": "salt_jax.loss",
    "ValueLossMetrics": "salt_jax.loss",
    "value_loss": "salt_jax.loss",
    "refine": "salt_jax.salt",
    "token_advantages": "salt_jax.salt",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
  if name in _EXPORTS:
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value  # later lookups skip this function
    return value
  raise AttributeError(f"module 'salt_jax' has no attribute {name!r}")


def __dir__():
  return sorted(set(globals()) | set(_EXPORTS))
