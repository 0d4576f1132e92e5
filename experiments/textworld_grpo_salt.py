"""GRPO / RLOO / Dr.GRPO + SALT on generated TextWorld games (quest length 5, offline, seeded).

  python experiments/textworld_grpo_salt.py                # CPU-sized defaults, shows progress
  python experiments/textworld_grpo_salt.py --mesh=4x2 --sft-warmstart

Games are generated on first use and cached (`envs/textworld_games.py`); evaluation uses the
held-out seeds. Without --model the policy is the tiny random-init Qwen2 over the offline Qwen2.5
tokenizer. Every `TrainConfig` field is a flag (`salt_jax.cli`); see --help.
"""

import sys

from salt_jax.cli import main
from salt_jax.config import script_defaults

# The CPU-sized run (salt_jax/configs/textworld-cpu.toml says why each value).
CPU_DEFAULTS = script_defaults("textworld-cpu")

if __name__ == "__main__":
  sys.exit(main(defaults=CPU_DEFAULTS, runs_root="runs/textworld_grpo_salt",
                description=__doc__.splitlines()[0]))
