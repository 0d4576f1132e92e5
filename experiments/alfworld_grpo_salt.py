"""GRPO / RLOO / Dr.GRPO + SALT on real ALFWorld tasks (the shipped valid_train split).

  python experiments/alfworld_grpo_salt.py                 # CPU-sized defaults, shows progress
  python experiments/alfworld_grpo_salt.py --mesh=4x2      # 8 simulated CPU devices if needed
  python experiments/alfworld_grpo_salt.py --recipe verl-agent --model ~/Qwen2.5-1.5B-Instruct \\
      --iters 150                                          # the paper's setting
  python experiments/alfworld_grpo_salt.py --distributed --mesh 32x1 --out runs/pod ...  # one per
      # host (TPU pod, SLURM: auto-detected), or --coordinator host0:1234 --num-processes 4 ...

Without --model the policy is a tiny random-init Qwen2 (2 layers, d_model 64, tied embeddings)
over the offline Qwen2.5 tokenizer: it runs on a CPU in minutes but writes no valid action until
--sft-warmstart clones ALFWorld's handcoded expert first (or start from the policy
experiments/build_alfworld_policy.py clones, with --model). Every `TrainConfig` field is a flag
(`salt_jax.cli`); see --help.
"""

import sys

from salt_jax.cli import CPU_SIZED, main

CPU_DEFAULTS = dict(CPU_SIZED, env="alfworld", max_steps=6)

if __name__ == "__main__":
  sys.exit(main(defaults=CPU_DEFAULTS, runs_root="runs/alfworld_grpo_salt",
                description=__doc__.splitlines()[0]))
