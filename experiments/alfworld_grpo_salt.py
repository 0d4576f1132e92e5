"""GRPO / RLOO / Dr.GRPO + SALT on real ALFWorld tasks (the shipped valid_train split).

  python experiments/alfworld_grpo_salt.py                 # the starter policy, CPU-sized
  python experiments/alfworld_grpo_salt.py --mesh=4x2      # 8 simulated CPU devices if needed
  python experiments/alfworld_grpo_salt.py --recipe verl-agent --model ~/Qwen2.5-1.5B-Instruct \\
      --iters 150                                          # the paper's setting
  python experiments/alfworld_grpo_salt.py --distributed --mesh 32x1 --out runs/pod ...  # one per
      # host (TPU pod, SLURM: auto-detected), or --coordinator host0:1234 --num-processes 4 ...

Without --model (or --init-params, --tokenizer, --tiny-policy, --config) the policy is the
starter shipped in envs/alfworld_data/starter_policy (experiments/build_alfworld_policy.py): a
small Qwen2 cloned from a noisy expert on 4 short valid_train tasks, with a tokenizer fitted to
ALFWorld's words; it is played on those tasks with the prompts it was cloned with
(`envs.alfworld.starter_defaults`). Every `TrainConfig` field is a flag (`salt_jax.cli`); see
--help.
"""

import sys

from envs.alfworld import starter_defaults
from salt_jax.cli import CPU_SIZED, main

# RL settings that raised the toy learning check's success (experiments/learning_check.py):
# statistics over step rows, several Adam steps an iteration, no KL, no invalid-action penalty
# (with GRPO's std normalisation it taught valid moves that do not win). 15 iterations, so that
# the run shows learning; lr 3e-4 after warm-up, since at 5e-4 one update of one seed in three
# moved the policy so far that it never wrote a valid action again (docs/performance.md).
# All 4 starter tasks every iteration: some of them the starter nearly always or never wins, and
# a group of equal rewards has no advantage (with 2 tasks the first iteration had none to learn).
# Compiles: the starter's step rows hold 380 to 770 tokens, so rows padded to at least 512 make
# two update programs (512, 768) where 384 would add a third (its compile costs the first
# iteration more than the padding costs a later one), and its 768-word vocabulary needs no chunked
# log-probs (one chunk compiles faster: benchmarks/bench_update_lengths.py, docs/performance.md).
CPU_DEFAULTS = dict(CPU_SIZED, env="alfworld", max_steps=6, group_size=8, tasks_per_iter=4,
                    group_stats="steps", iters=15, lr=3e-4, warmup_steps=4, kl_coef=0.0,
                    invalid_action_penalty=0.0, minibatch_rows=64, env_workers=2,
                    min_seq_len=512, logprob_chunk=1024)

if __name__ == "__main__":
  sys.exit(main(defaults=CPU_DEFAULTS, default_policy=starter_defaults,
                runs_root="runs/alfworld_grpo_salt", description=__doc__.splitlines()[0]))
