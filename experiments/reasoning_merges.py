"""Do a reasoning clone's merged steps differ? Plain vs stand-in-reasoning warm starts, one rollout.

For each reasoning ("none": `<think></think><action>X</action>` demonstrations; "templated": the
stand-in reasoning of `salt_jax.agent.reasoning`), the tiny toy policy is cloned with the learning
check's warm start (`learning_check.warm_start`: the noisy expert on the 4 training tasks, the same
budget), then the trainer plays one rollout (G = 8 on the 4 tasks, temperature 1, fixed key) and
its SALT merges are read as the trainer logs them (`Trainer.step_advantages`: merged_steps,
gradient_changing_merges), together with the merged steps whose edge holds more than one distinct
response (`response_differing_merges`), and the rollout's valid-action share and success.

  PYTHONPATH=. python experiments/reasoning_merges.py --out experiments/results/reasoning_merges.jsonl

One JSON line per reasoning (printed, and appended to --out).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import tempfile
import time

import jax
import numpy as np

from learning_check import LEARNS, REASONING_MAX_NEW_TOKENS, Check, emit, warm_start
from salt_jax.train import Trainer


def measure(check: Check, seed: int, workdir: str) -> dict:
  """Clones `check`'s warm start, plays one rollout of the training tasks, reads its merges."""
  t0 = time.time()
  init = warm_start(check, os.path.join(workdir, "warm"), seed)
  cfg = dataclasses.replace(check.config, seed=seed, salt=True, init_params=init,
                            out=os.path.join(workdir, "run"))
  with Trainer(cfg) as tr:
    tr.setup()
    batch = tr.collect_rollout(tr.task_sampler.tasks, jax.random.key(check.eval_seed),
                               seed=check.eval_seed, group_size=cfg.group_size)
    _, _, _, m = tr.step_advantages(batch)  # the trainer's own merge metrics
  differ = int(m["response_differing_merges"])
  merged = int(m["merged_steps"])
  ok = ~batch.failed
  return {
      "reasoning": check.reasoning or "none", "seed": seed, "sft_steps": check.sft_steps,
      "steps": int(batch.num_total_steps), "merged_steps": merged,
      "merge_rate": round(float(m["merge_rate"]), 4),
      "response_differing_merges": differ,
      "response_differing_share": round(differ / merged, 4) if merged else None,
      "gradient_changing_merges": int(m["gradient_changing_merges"]),
      "gradient_changing_share": round(float(m["gradient_changing_share"]), 4) if merged else None,
      "cross_prompt_merges": int(m["cross_prompt_merges"]),
      "valid_action_share": round(float(batch.metrics["valid_action_ratio"]), 4),
      "success": round(float(np.mean(batch.success[ok])), 4),
      "mean_response_tokens": round(float(np.mean([len(r) for r in batch.response_ids])), 1),
      "minutes": round((time.time() - t0) / 60, 2)}


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--reasoning", nargs="+", default=["none", "templated"])
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--sft-steps", type=int, default=Check.sft_steps)
  ap.add_argument("--out", default=None, help="append the JSON lines here")
  args = ap.parse_args(argv)
  config = dataclasses.replace(LEARNS, max_new_tokens=REASONING_MAX_NEW_TOKENS)
  for name in args.reasoning:
    check = Check(config=config, sft_steps=args.sft_steps, reasoning=name)
    with tempfile.TemporaryDirectory() as d:
      emit(measure(check, args.seed, d), args.out)


if __name__ == "__main__":
  main()
