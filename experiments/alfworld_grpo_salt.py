"""GRPO / RLOO / Dr.GRPO + SALT on real ALFWorld tasks (the shipped valid_train split).

  python experiments/alfworld_grpo_salt.py                 # the starter policy, CPU-sized
  python experiments/alfworld_grpo_salt.py --mesh=4x2      # 8 simulated CPU devices if needed
  python experiments/alfworld_grpo_salt.py --recipe verl-agent --model ~/Qwen2.5-1.5B-Instruct \\
      --iters 150                                          # the paper's setting
  python experiments/alfworld_grpo_salt.py --distributed --mesh 32x1 --out runs/pod ...  # one per
      # host (TPU pod, SLURM: auto-detected), or --coordinator host0:1234 --num-processes 4 ...

Without --model (or --init-params, --tokenizer, --tiny-policy, or a --config setting one) the
policy is the starter shipped in envs/alfworld_data/starter_policy
(experiments/build_alfworld_policy.py): a small Qwen2 cloned from a noisy expert on 4 short
valid_train tasks, with a tokenizer fitted to ALFWorld's words; it is played on those tasks with
the prompts it was cloned with (`envs.alfworld.starter_defaults`). Every `TrainConfig` field is
a flag (`salt_jax.cli`); see --help.
"""

import sys

from envs.alfworld import starter_defaults
from salt_jax.cli import main
from salt_jax.config import script_defaults

# The CPU-sized run (salt_jax/configs/alfworld-cpu.toml says why each value).
CPU_DEFAULTS = script_defaults("alfworld-cpu")

if __name__ == "__main__":
  sys.exit(main(defaults=CPU_DEFAULTS, default_policy=starter_defaults,
                runs_root="runs/alfworld_grpo_salt", description=__doc__.splitlines()[0]))
