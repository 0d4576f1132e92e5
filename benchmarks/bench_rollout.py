"""Rollout speed: environment steps/s with 1 and 2 workers, and where an agent rollout's time goes.

Two parts:
  envs     `bench_envs.bench` for ALFWorld and TextWorld with 1 and 2 worker processes: steps/s
           under random admissible commands (see bench_envs.py).
  rollout  `collect` on TextWorld (or ALFWorld) with a small policy: a tiny random Qwen2 and the
           toy byte-level tokenizer (its merges also learned from the tasks' first observations,
           so prompts are not all single bytes). Run with the KV cache reused across turns and
           without, it reports the time per rollout, the share of generate + env time spent
           waiting on environments, and the prompt tokens prefilled vs read from the kept cache.
           Each setting is run once untimed first (compiles: one program per bucket), then timed
           with the same key, so the timed run compiles nothing. A random policy's actions are
           mostly invalid ("Nothing happens."), cheaper steps than a trained agent's.

Measured on the shared 2-core dev machine at load average 11 to 15 (3 min 49 s wall, 1 min 8 s
of CPU; read the figures as a floor):
  envs     textworld 8 slots: 165 / 128 steps/s with 1 / 2 workers; alfworld 4 slots: 8.4 / 11.0
  rollout  textworld, 8 trajectories, 4 turns, 32 new tokens, 1 worker, cache 2048:
           reuse off: 12.2 s a rollout (generate 12.0 s, env 0.13 s: 1% waiting on envs),
                      17,726 prompt tokens prefilled
           reuse on:   4.7 s a rollout (generate 4.5 s, env 0.11 s: 2%), 5,451 prefilled and
                      12,275 read from the kept cache (69% of prompt tokens)

  python benchmarks/bench_rollout.py                          # everything
  python benchmarks/bench_rollout.py --parts rollout --rollout-env alfworld --rollout-workers 1 2
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from bench_envs import bench as env_bench
from envs import registry
from envs.pool import EnvPool
from salt_jax.agent.prompts import toy_chat_tokenizer
from salt_jax.models import CausalLM, ModelConfig
from salt_jax.rollout import SamplingParams, collect
from salt_jax.sampling import Sampler

_ENV_RUNS = {  # env name: (slots, turns): shorter than bench_envs' defaults
    "textworld": (8, 50),
    "alfworld": (4, 8),
}


def _tiny_policy(vocab_size: int, max_cache_len: int, eos: int, pad: int) -> Sampler:
  """A 2-layer random Qwen2 (hidden 64) and its sampler; numpy init avoids a compile per shape."""
  config = ModelConfig.tiny(vocab_size=vocab_size, max_position_embeddings=max_cache_len)
  graphdef, state = nnx.split(nnx.eval_shape(lambda: CausalLM(config, rngs=nnx.Rngs(0))))
  rng = np.random.default_rng(0)
  state = jax.tree.map(lambda x: jnp.asarray(0.3 * rng.standard_normal(x.shape), x.dtype), state)
  return Sampler(nnx.merge(graphdef, state), eos_token_ids=[eos], pad_token_id=pad,
                 max_cache_len=max_cache_len, batch_buckets=(8, 16))


def rollout_bench(env_name: str, workers: int, num_tasks: int, group_size: int, max_steps: int,
                  max_new_tokens: int, max_cache_len: int, seed: int = 0) -> list[dict]:
  """Times `collect` with reuse_cache on and off; one row of figures per setting."""
  tasks = registry.task_list(env_name, "train" if env_name == "textworld" else "valid_seen",
                             max_steps=50)
  tasks = [tasks[i] for i in np.random.default_rng(seed).permutation(len(tasks))[:num_tasks]]
  with EnvPool(env_name, {"max_steps": 50}, workers, step_timeout_s=120.0,
               reset_timeout_s=600.0) as pool:
    first = pool.reset_batch([(i, t, seed) for i, t in enumerate(tasks)])
    texts = [r.observation + " " + " ".join(r.admissible_actions or ()) for r in first]
    tok = toy_chat_tokenizer(vocab_size=1500, extra_texts=texts)
    sampler = _tiny_policy(len(tok), max_cache_len, tok.eos_token_id, tok.pad_token_id)
    rows = []
    for reuse in (False, True):
      run = lambda: collect(  # pylint: disable=cell-var-from-loop
          pool, tasks, group_size, sampler, tok, jax.random.key(seed), max_steps=max_steps,
          max_new_tokens=max_new_tokens, sampling=SamplingParams(temperature=1.0), seed=seed,
          max_prompt_tokens=max_cache_len - max_new_tokens, reuse_cache=reuse)
      t0 = time.perf_counter()
      run()  # compiles
      compile_s = time.perf_counter() - t0
      traces = sampler.num_traces
      t0 = time.perf_counter()
      b = run()
      wall = time.perf_counter() - t0
      m = b.metrics
      rows.append(dict(env=env_name, workers=workers, reuse=reuse, steps=b.num_total_steps,
                       turns=m["turns"], rollout_s=wall, first_s=compile_s,
                       gen_s=m["gen_time_s"], env_s=m["env_time_s"],
                       env_share=m["env_wait_fraction"], prompt_tokens=m["prompt_tokens"],
                       reused=m["reused_prompt_tokens"],
                       recompiled=sampler.num_traces != traces))
  return rows


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
  parser.add_argument("--parts", nargs="+", default=["envs", "rollout"],
                      choices=["envs", "rollout"])
  parser.add_argument("--envs", nargs="+", default=["textworld", "alfworld"], choices=_ENV_RUNS)
  parser.add_argument("--workers", nargs="+", type=int, default=[1, 2], help="envs part")
  parser.add_argument("--rollout-env", default="textworld", choices=_ENV_RUNS)
  parser.add_argument("--rollout-workers", nargs="+", type=int, default=[1])
  parser.add_argument("--tasks", type=int, default=2, help="rollout: tasks (groups)")
  parser.add_argument("--group-size", type=int, default=4, help="rollout: trajectories per task")
  parser.add_argument("--max-steps", type=int, default=4, help="rollout: turns at most")
  parser.add_argument("--max-new-tokens", type=int, default=32)
  parser.add_argument("--max-cache-len", type=int, default=2048)
  args = parser.parse_args(argv)
  print(f"jax {jax.__version__} on {jax.devices()[0].platform}", flush=True)
  if "envs" in args.parts:
    print(f"\n{'env':10s} {'workers':>7s} {'slots':>5s} {'steps':>6s} {'steps/s':>8s} "
          f"{'ms/turn':>8s} {'reset s':>8s}", flush=True)
    for env_name in args.envs:
      slots, turns = _ENV_RUNS[env_name]
      for w in args.workers:
        r = env_bench(env_name, w, slots, turns)
        print(f"{r['env']:10s} {r['workers']:7d} {r['slots']:5d} {r['steps']:6d} "
              f"{r['steps_per_s']:8.1f} {r['ms_per_turn']:8.1f} {r['reset_s']:8.2f}", flush=True)
  if "rollout" in args.parts:
    print(f"\nrollout: {args.rollout_env}, {args.tasks} tasks x {args.group_size} trajectories, "
          f"<= {args.max_steps} turns, {args.max_new_tokens} new tokens, tiny random Qwen2",
          flush=True)
    print(f"{'workers':>7s} {'kv reuse':>8s} {'steps':>5s} {'rollout s':>9s} {'gen s':>6s} "
          f"{'env s':>6s} {'env share':>9s} {'prompt tok':>10s} {'prefilled':>9s} "
          f"{'reused':>7s} {'1st run s':>9s}", flush=True)
    for w in args.rollout_workers:
      for r in rollout_bench(args.rollout_env, w, args.tasks, args.group_size, args.max_steps,
                             args.max_new_tokens, args.max_cache_len):
        note = "  (recompiled)" if r["recompiled"] else ""
        print(f"{r['workers']:7d} {'on' if r['reuse'] else 'off':>8s} {r['steps']:5d} "
              f"{r['rollout_s']:9.2f} {r['gen_s']:6.2f} {r['env_s']:6.2f} "
              f"{r['env_share']:9.0%} {r['prompt_tokens']:10d} "
              f"{r['prompt_tokens'] - r['reused']:9d} {r['reused']:7d} "
              f"{r['first_s']:9.1f}{note}", flush=True)


if __name__ == "__main__":
  main()
