"""GRPO / RLOO / Dr.GRPO + SALT on WebShop (`envs/webshop.py`): the shipped fixture catalog, or
WebShop's own data files in the folder `$WEBSHOP_DATA` points to.

  python experiments/webshop_grpo_salt.py                 # CPU-sized defaults, shows progress
  python experiments/webshop_grpo_salt.py --recipe verl-agent-webshop \
      --model ~/Qwen2.5-1.5B-Instruct

Training uses the "train" goals and evaluation the "test" ones (verl-agent's split: goals 0-499
test). Without --model the policy is the tiny random-init Qwen2 over the offline Qwen2.5
tokenizer (see alfworld_grpo_salt.py). Flags -> `salt_jax.train.TrainConfig`.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from alfworld_grpo_salt import main  # noqa: E402  (the shared CLI; imports no jax)
import textworld_grpo_salt  # noqa: E402  (its CPU-sized defaults suit WebShop's short episodes)

if __name__ == "__main__":
  sys.exit(main("webshop", dict(textworld_grpo_salt.CPU_DEFAULTS, out="runs/webshop_grpo_salt")))
