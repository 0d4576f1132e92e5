"""Named training recipes: config files that reproduce a published setting.

Each is a file in `salt_jax/configs/` whose every value names its source ("chosen here" marks
values neither verl-agent nor the paper states):

  verl-agent          verl-agent's ALFWorld GRPO setting (the SALT paper's baselines)
  verl-agent-webshop  the same on WebShop
  gigpo               GiGPO as verl-agent runs it on ALFWorld
  gigpo-webshop       GiGPO on WebShop
  ppo                 PPO with a critic as verl-agent runs it on ALFWorld

The model (Qwen2.5-1.5B-Instruct there) is not part of a recipe: pass `--model` with a local
folder. Apply one with `TrainConfig.from_recipe(name, **overrides)`, or on the command line with
`--recipe NAME` or `--config NAME` (flags given win).
"""

from __future__ import annotations

from salt_jax.config import read_config_files
from salt_jax.configs import RECIPE_NAMES as NAMES

# name -> its TrainConfig fields
RECIPES = {name: read_config_files([name])[0] for name in NAMES}
