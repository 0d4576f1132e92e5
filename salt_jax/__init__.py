"""salt-jax: SALT step-level advantage assignment for LLM agents, in JAX.

Host side (numpy, no accelerator): `build_merge_ids`, `cross_prompt_merges`,
`gradient_changing_merges`.
Device side (pure, jittable, shardable along `data`): `grpo_advantages`, `rloo_advantages`,
`refine`, `token_advantages`, `policy_loss`, `microbatched_value_and_grad`.
"""

from salt_jax.accumulate import microbatched_value_and_grad
from salt_jax.advantages import count_invalid_rewards, grpo_advantages, rloo_advantages
from salt_jax.graph import MergeIds, build_merge_ids, cross_prompt_merges, gradient_changing_merges
from salt_jax.loss import PolicyLossMetrics, aggregate, aggregate_weight, kl_estimate, policy_loss
from salt_jax.salt import refine, token_advantages

__all__ = [
    "MergeIds",
    "PolicyLossMetrics",
    "aggregate",
    "aggregate_weight",
    "build_merge_ids",
    "count_invalid_rewards",
    "cross_prompt_merges",
    "gradient_changing_merges",
    "grpo_advantages",
    "kl_estimate",
    "microbatched_value_and_grad",
    "policy_loss",
    "refine",
    "rloo_advantages",
    "token_advantages",
]
