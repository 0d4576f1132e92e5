"""What XLA compiles in a toy learning run, program by program, and what the run's phases cost.

A tiny policy's run is mostly compiling: each program shape (a prefill per prompt and batch
bucket, a decode loop, the train step) compiles once per process, and the test suite starts many
such runs. This runs the learning check's fast case (`experiments/learning_check.py`: the clone
of seed `--seed`, then `--iters` GRPO iterations and the 128-episode measurements before and
after) with jax's compile log on and no persistent compilation cache, and prints each jitted
function's compiles and seconds, and the run's evaluation and RL seconds.

  python benchmarks/bench_compiles.py [--iters 12] [--seed 1] [--sampler split_min_flops=0]

(`--sft-steps`, `--eval-rounds`: a shorter clone and measurement, for a quick run.)

`--sampler FIELD=VALUE` sets a `Sampler` argument for every sampler the run builds (e.g.
`split_min_flops=0` groups prompts by length whatever it saves, `split_lengths=False` never).
"""

import argparse
import ast
import collections
import inspect
import json
import logging
import os
import re
import sys
import tempfile

import jax

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "experiments"))

import learning_check  # noqa: E402  pylint: disable=wrong-import-position
from salt_jax import sampling  # noqa: E402  pylint: disable=wrong-import-position

_COMPILED = re.compile(r"Finished XLA compilation of (\S+) in ([0-9.e+-]+) sec")


class CompileLog(logging.Handler):
  """Counts jax's "Finished XLA compilation of F in S sec" records per function F."""

  def __init__(self):
    super().__init__()
    self.count, self.seconds = collections.Counter(), collections.Counter()

  def emit(self, record):
    m = _COMPILED.search(record.getMessage())
    if m:
      self.count[m.group(1)] += 1
      self.seconds[m.group(1)] += float(m.group(2))

  def table(self) -> list[dict]:
    return [{"program": k, "compiles": self.count[k], "seconds": round(s, 2)}
            for k, s in self.seconds.most_common()]


def sampler_overrides(pairs) -> dict:
  """FIELD=VALUE pairs (Python literals) as `Sampler` keyword arguments; SystemExit naming a
  bad one."""
  out = {}
  for pair in pairs:
    name, sep, value = pair.partition("=")
    if not sep or name not in inspect.signature(sampling.Sampler.__init__).parameters:
      raise SystemExit(f"error: --sampler takes a Sampler argument as NAME=VALUE, got {pair!r}")
    out[name] = ast.literal_eval(value)
  return out


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--iters", type=int, default=12)
  p.add_argument("--seed", type=int, default=1)
  p.add_argument("--eval-rounds", type=int, default=4)
  p.add_argument("--sft-steps", type=int, default=learning_check.Check.sft_steps,
                 help="the clone's cloning steps (its compiles are counted apart)")
  p.add_argument("--sampler", nargs="*", default=[], metavar="FIELD=VALUE")
  args = p.parse_args(argv)
  overrides = sampler_overrides(args.sampler)
  log = CompileLog()
  logger = logging.getLogger("jax")
  level, propagate = logger.level, logger.propagate
  logger.addHandler(log)
  logger.setLevel(logging.WARNING)
  logger.propagate = False  # counted here, not printed: a line per program and phase
  jax.config.update("jax_log_compiles", True)
  cache_on = jax.config.jax_enable_compilation_cache
  jax.config.update("jax_enable_compilation_cache", False)  # every program compiled, none loaded
  init = sampling.Sampler.__init__

  def patched(self, *a, **k):
    init(self, *a, **{**k, **overrides})
  sampling.Sampler.__init__ = patched
  try:
    check = learning_check.Check(iters=args.iters, eval_rounds=args.eval_rounds,
                                 sft_steps=args.sft_steps)
    with tempfile.TemporaryDirectory() as tmp:
      warm = learning_check.warm_start(check, os.path.join(tmp, "warm"), args.seed)
      cloning = log.table()
      log.count.clear()
      log.seconds.clear()
      run = learning_check.learning_run(check, args.seed, False, os.path.join(tmp, "run"),
                                        init=warm)
  finally:
    sampling.Sampler.__init__ = init
    jax.config.update("jax_log_compiles", False)
    jax.config.update("jax_enable_compilation_cache", cache_on)
    logger.removeHandler(log)
    logger.setLevel(level)
    logger.propagate = propagate
  out = {"iters": args.iters, "seed": args.seed, "sampler": overrides,
         "cloning_compiles": sum(r["compiles"] for r in cloning),
         "cloning_compile_s": round(sum(r["seconds"] for r in cloning), 2),
         "run_seconds": run["seconds"], "rise": run["rise"], "programs": log.table()}
  out["run_compiles"] = sum(r["compiles"] for r in out["programs"])
  out["run_compile_s"] = round(sum(r["seconds"] for r in out["programs"]), 2)
  print(json.dumps(out, indent=1))
  return out


if __name__ == "__main__":
  main()
