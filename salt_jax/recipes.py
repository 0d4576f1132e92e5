"""Named training recipes: `TrainConfig` values that reproduce a published setting.

`RECIPES["verl-agent"]` is verl-agent's ALFWorld GRPO setting (Feng et al. 2025b, the baselines
the SALT paper compares against "under identical training conditions"), read in the fork
vanzll/verl-agent (upstream up to d0b9724). Each value names its source; "chosen here" marks
values neither verl-agent nor the paper states. The model (Qwen2.5-1.5B-Instruct there) is not
part of a recipe: pass `--model` with a local folder.

Apply one with `TrainConfig.from_recipe(name, **overrides)` or `--recipe NAME` on the command
line (explicit flags override the recipe).
"""

from __future__ import annotations

VERL_AGENT = {
    # Prompts: single-turn, the last 2 (observation, action) pairs (ppo_trainer.yaml
    # env.history_length: 2; agent_system/environments/prompts/alfworld.py,
    # agent_system/memory/memory.py), one training row per step.
    "prompt_history": 2,
    "layout": "step",
    # Rewards: 10 x won on every step row (agent_system/reward_manager/episode.py); 0.1 off the
    # invalid step's own row (ray_trainer.py apply_invalid_action_penalty, run_alfworld.sh
    # invalid_action_penalty_coef=0.1); invalid = no parsable <action> (env_manager.py's
    # projection; admissibility is not checked).
    "reward_scale": 10.0,
    "invalid_action_penalty": 0.1,
    "penalty_scope": "step",
    "invalid_step": "format",
    # GRPO/RLOO statistics over the group's step rows (core_algos.py,
    # compute_mean_std_cross_steps=True by default).
    "group_stats": "steps",
    # Scale (examples/grpo_trainer/run_alfworld.sh; the paper: G = 8, h = 3, 50 steps).
    "group_size": 8,
    "tasks_per_iter": 16,
    "max_steps": 50,
    "salt_history": 3,
    "max_new_tokens": 512,        # data.max_response_length=512
    "max_cache_len": 2560,        # max_prompt_length 2048 + 512 (longer prompts end the episode
                                  # here as truncated; verl errors on them)
    # Optimisation (run_alfworld.sh and verl's defaults).
    "lr": 1e-6,
    "kl_coef": 0.01,              # use_kl_loss=True, kl_loss_coef=0.01
    "kl_estimator": "k3",         # kl_loss_type=low_var_kl
    "minibatch_rows": 256,        # ppo_mini_batch_size=256 (rows are steps)
    "ppo_epochs": 1,
    "clip_eps": 0.2,              # verl's clip_ratio default
    "dual_clip": 3.0,             # verl's clip_ratio_c default
    "loss_agg": "token-mean",     # verl's loss_agg_mode default
    "max_grad_norm": 1.0,         # verl's grad_clip default
    "weight_decay": 0.01,         # verl's optim default
    "temperature": 1.0,           # verl's rollout default (its validation samples at 0.4;
                                  # evaluation here is greedy: chosen here)
    "algo": "grpo",
}

# The same on WebShop: 15 steps an episode and prompts up to 4,096 tokens (env.max_steps=15,
# data.max_prompt_length=4096 in the WebShop runs of verl-agent and its forks; read in forks' run
# scripts, verl-agent's own was not at hand). Apply with `--recipe verl-agent-webshop`.
VERL_AGENT_WEBSHOP = {**VERL_AGENT, "max_steps": 15, "max_cache_len": 4096 + 512}

# GiGPO as verl-agent runs it (gigpo/core_gigpo.py; examples/gigpo_trainer/run_alfworld.sh and
# run_webshop.sh): verl-agent's setting with the GiGPO estimator, step returns discounted by
# gamma = 0.95, the step advantage weighted 1.0, anchors by exact observation
# (enable_similarity=False); ALFWorld normalises by mean and std, WebShop by the mean alone.
GIGPO = {**VERL_AGENT, "algo": "gigpo", "gamma": 0.95, "gigpo_mode": "mean_std_norm",
         "step_advantage_w": 1.0, "anchor_similarity": 1.0}
GIGPO_WEBSHOP = {**VERL_AGENT_WEBSHOP, **{k: GIGPO[k] for k in (
    "algo", "gamma", "step_advantage_w", "anchor_similarity")}, "gigpo_mode": "mean_norm",
                 "minibatch_rows": 64}  # ppo_mini_batch_size=64 in run_webshop.sh

# PPO with a critic as verl-agent runs it (examples/ppo_trainer/run_alfworld.sh): GAE
# (algorithm.adv_estimator=gae, verl's gamma = lam = 1.0) over each step row on its own, the
# row's score on its last token; one trajectory per task (rollout.n = 1) for 128 tasks
# (train_batch_size=128); a critic from the actor's weights (critic.model.path) at a constant
# lr 1e-5 (critic.optim.lr), values clipped at 0.5 (verl's cliprange_value), no warm-up
# (trainer.critic_warmup=0); the actor as in the GRPO script (lr 1e-6, low_var_kl 0.01,
# 256-row mini-batches).
PPO = {**VERL_AGENT, "algo": "ppo", "group_size": 1, "tasks_per_iter": 128, "gamma": 1.0,
       "gae_lambda": 1.0, "gae_scope": "step", "critic_lr": 1e-5, "value_clip": 0.5,
       "critic_warmup": 0}

RECIPES = {"verl-agent": VERL_AGENT, "verl-agent-webshop": VERL_AGENT_WEBSHOP, "gigpo": GIGPO,
           "gigpo-webshop": GIGPO_WEBSHOP, "ppo": PPO}
