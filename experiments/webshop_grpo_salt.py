"""GRPO / RLOO / Dr.GRPO + SALT on WebShop (`envs/webshop.py`): the shipped fixture catalog, or
WebShop's own data files in the folder `$WEBSHOP_DATA` points to.

  python experiments/webshop_grpo_salt.py                 # CPU-sized defaults, shows progress
  python experiments/webshop_grpo_salt.py --recipe verl-agent --model ~/Qwen2.5-1.5B-Instruct

Training uses the "train" goals and evaluation the "test" ones (verl-agent's split: goals 0-499
test). Without --model the policy is the tiny random-init Qwen2 over the offline Qwen2.5
tokenizer (see alfworld_grpo_salt.py). Flags -> `salt_jax.train.TrainConfig`.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from alfworld_grpo_salt import main  # noqa: E402  (the shared CLI; imports no jax)

CPU_DEFAULTS = dict(group_size=4, tasks_per_iter=2, iters=3, max_steps=8, max_new_tokens=32,
                    max_cache_len=4096, lr=1e-5, env_workers=1, minibatch_rows=4,
                    num_eval_tasks=4, num_train_tasks=16, out="runs/webshop_grpo_salt",
                    sft_demos=16, sft_steps=100)

if __name__ == "__main__":
  sys.exit(main("webshop", CPU_DEFAULTS))
