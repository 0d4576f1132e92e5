"""GRPO / RLOO / Dr.GRPO + SALT on WebShop (`envs/webshop.py`): the shipped fixture catalog, or
WebShop's own data files in the folder `$WEBSHOP_DATA` points to.

  python experiments/webshop_grpo_salt.py                 # CPU-sized defaults, shows progress
  python experiments/webshop_grpo_salt.py --recipe verl-agent-webshop \\
      --model ~/Qwen2.5-1.5B-Instruct

Training uses the "train" goals and evaluation the "test" ones (verl-agent's split: goals 0-499
test). Without --model the policy is the tiny random-init Qwen2 over the offline Qwen2.5
tokenizer. Every `TrainConfig` field is a flag (`salt_jax.cli`); see --help.
"""

import sys

from salt_jax.cli import main
from salt_jax.config import script_defaults

# The CPU-sized run (salt_jax/configs/webshop-cpu.toml says why each value).
CPU_DEFAULTS = script_defaults("webshop-cpu")

if __name__ == "__main__":
  sys.exit(main(defaults=CPU_DEFAULTS, runs_root="runs/webshop_grpo_salt",
                description=__doc__.splitlines()[0]))
