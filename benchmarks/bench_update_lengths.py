"""What one update mini-batch costs per padded length: compile time and step time.

The main job (experiments/alfworld_grpo_salt.py, no flags) pads each mini-batch to the bucket of
its own longest row, so its first iteration compiles the train step once per bucket. This times
the trainer's own `train_step` on mini-batches of `--rows` rows padded to each `--lengths` value
(random tokens, every position a loss position): first call (trace + compile + run) and the mean
of `--reps` later calls.

  python benchmarks/bench_update_lengths.py --lengths 384 512 768 [--set logprob_chunk=1024]
"""

import argparse
import dataclasses
import json
import os
import tempfile
import time

import jax
import numpy as np

from envs.alfworld import starter_defaults
from salt_jax.cli import config_from
from salt_jax.config import TrainConfig, parse_overrides
from salt_jax.phases import on_device, put
from salt_jax.train import Trainer

MAIN_JOB = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        "experiments", "alfworld_grpo_salt.py")


def main_job_config(out: str, overrides: dict) -> TrainConfig:
  """The main job's config with no flags (`cli.config_from` with its CPU defaults and the starter
  policy), writing to `out`, with `overrides` (TrainConfig fields) replaced."""
  import importlib.util  # pylint: disable=import-outside-toplevel
  spec = importlib.util.spec_from_file_location("main_job", MAIN_JOB)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  config, _ = config_from(["--out", out, "--no-progress", "--no-tensorboard"],
                          module.CPU_DEFAULTS, default_policy=starter_defaults)
  return dataclasses.replace(config, **overrides)


def minibatch(rows: int, length: int, vocab: int, seed: int) -> dict:
  rng = np.random.default_rng(seed)
  ids = rng.integers(3, vocab, size=(rows, length), dtype=np.int32)
  return dict(input_ids=ids, targets=np.roll(ids, -1, axis=1),
              loss_mask=np.ones((rows, length), bool),
              token_step_ids=np.repeat(np.arange(rows, dtype=np.int32)[:, None], length, 1),
              old_logprobs=np.full((rows, length), -2.0, np.float32),
              attention_mask=np.ones((rows, length), bool),
              positions=np.repeat(np.arange(length, dtype=np.int32)[None], rows, 0))


def main(argv=None) -> list[dict]:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--lengths", type=int, nargs="+", default=[384, 512, 768])
  p.add_argument("--reps", type=int, default=3)
  p.add_argument("--set", nargs="*", default=[], metavar="NAME=VALUE",
                 help="TrainConfig overrides (`config.parse_overrides`)")
  args = p.parse_args(argv)
  results = []
  try:
    overrides = parse_overrides(args.set)
  except ValueError as e:
    p.error(str(e))
  with tempfile.TemporaryDirectory() as out:
    trainer = Trainer(main_job_config(out, overrides)).setup()
    vocab = int(trainer.model.config.vocab_size)
    step_adv = put(np.linspace(-1, 1, 512).astype(np.float32), trainer.mesh)
    for length in args.lengths:
      mb = on_device(minibatch(trainer.rows, length, vocab, length), trainer.mesh)
      times = []
      for _ in range(args.reps + 1):
        t0 = time.perf_counter()
        params, opt_state, out_m = trainer.programs.train_step(
            trainer.state.params, trainer.state.opt_state, mb, step_adv)
        trainer.state = trainer.state._replace(params=params, opt_state=opt_state)
        jax.block_until_ready(out_m)
        times.append(time.perf_counter() - t0)
      results.append(dict(length=length, rows=trainer.rows, first_s=round(times[0], 2),
                          step_s=round(float(np.mean(times[1:])), 3), overrides=overrides,
                          loss=float(out_m["loss"])))
      print(json.dumps(results[-1]), flush=True)
    trainer.close()
  return results


if __name__ == "__main__":
  main()
