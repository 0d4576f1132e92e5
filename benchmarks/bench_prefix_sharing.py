"""How much of a rollout's prefill shared prompt prefixes could save, counted on noisy experts.

A rollout call holds a turn's step prompts for every live trajectory of its tasks' groups. The
built-in sampler prefills each distinct prompt once (a group's equal prompts share one row) and
pads the distinct prompts to its length buckets, in length groups where that pays. Rows that
took the same early actions still share long prefixes (the instructions, the goal, the step
counter, the pairs they agree on). This plays `--group-size` noisy experts (`--epsilon`, each its
own deviations) on each of the first `--tasks` training tasks, renders every step's prompt as the
agent loop does (verl-agent's layout: the goal line and the last `--history` pairs), forms the
calls (`--tasks-per-call` tasks' rows at each turn) and counts, over all calls, the prompt tokens:

  all         every row's prompt
  equal       each call's distinct prompts once (what the sampler prefills)
  trie        each call's distinct prefixes once (a prefix tree of its prompts: the least any
              sharing within a call can prefill)
  cached      every prefix prefilled in an earlier call kept too (vLLM's prefix cache, token-level)

and the positions the sampler computes, padding included (`Sampler._plan` over the calls, with
the run's prompt buckets and the model's shape, which sets when length groups and finer prefill
rows pay), with its prefill rows padded to powers of two (as before `prefill_batch_buckets`) and
as it pads them now; each against one level of stems: each call's sorted distinct prompts cut
into up to `--max-stems` runs, each run's common prefix prefilled once, then every row's suffix
after it in one bucket (how a continued conversation is prefilled), where that computes fewer
positions.

    python benchmarks/bench_prefix_sharing.py \\
        --model ~/.cache/salt_jax/SmolLM2-135M-Instruct.Q4_1.gguf --tasks 4 --epsilon 0.1 0.3 0.5

No model runs: the sampler's plan is made on the model's shapes alone (`nnx.eval_shape`).
"""

from __future__ import annotations

import argparse
import collections
import itertools
import os
import sys
import time
from typing import Optional, Sequence

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from envs.demos import play_expert  # noqa: E402
from envs.registry import make_expert_env, training_tasks  # noqa: E402
from salt_jax import sft  # noqa: E402
from salt_jax.agent.prompts import run_prompt_config  # noqa: E402
from salt_jax.config import TrainConfig  # noqa: E402
from salt_jax.metrics import write_json  # noqa: E402
from salt_jax.models.build import build_tokenizer  # noqa: E402


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
  """Length of the longest common prefix of two token lists."""
  n = min(len(a), len(b))
  differ = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
  return int(differ[0]) if differ.size else n


def rollout_calls(env, tasks, tokenizer, config: TrainConfig, *, group_size: int,
                  epsilon: float, tasks_per_call: int, seed: int = 0) -> list[list[tuple]]:
  """Each call's prompts (token tuples): `tasks_per_call` tasks' groups at one turn, a group
  being `group_size` noisy-expert episodes of its task, each drawing its own deviations."""
  prompt_config = run_prompt_config(config)
  calls = collections.defaultdict(list)  # (call of tasks, turn) -> prompts
  for t, task in enumerate(tasks):
    for g in range(group_size):
      rng = np.random.default_rng([seed, t, g])
      demo = play_expert(env, task, seed, config.max_steps, epsilon=epsilon, rng=rng)
      prompts, _, _ = sft.demo_steps([demo], tokenizer, prompt_config)
      for turn, p in enumerate(prompts):
        calls[(t // tasks_per_call, turn)].append(tuple(int(x) for x in p))
  return [calls[k] for k in sorted(calls, key=lambda k: (k[1], k[0]))]


def shared_tokens(calls: Sequence[Sequence[tuple]]) -> dict:
  """Prompt tokens over the calls: all, each call's distinct prompts, each call's distinct
  prefixes (a prefix tree), and with every earlier call's prefixes kept too."""
  out = dict(all=0, equal=0, trie=0, cached=0)
  earlier: list[tuple] = []
  for prompts in calls:
    distinct = sorted(set(prompts))
    out["all"] += sum(map(len, prompts))
    out["equal"] += sum(map(len, distinct))
    # In sorted order a prompt shares the most with its predecessor: the tree's new tokens.
    out["trie"] += sum(len(p) - (common_prefix(p, distinct[i - 1]) if i else 0)
                       for i, p in enumerate(distinct))
    for p in distinct:
      out["cached"] += len(p) - max((common_prefix(p, q) for q in earlier), default=0)
      earlier.append(p)
  return out


def planned_positions(sampler, prompts, max_new_tokens: int) -> int:
  """Positions (rows x bucket, padding included) the sampler's plan prefills for a call."""
  plan = sampler._plan(prompts, None, None, sampler._pad_batch(len(prompts)), max_new_tokens)  # pylint: disable=protected-access
  if plan.groups is not None:
    return int(sum(tokens.size for tokens, _, _, _ in plan.groups))
  return int(plan.tokens.size)


def stem_positions(sampler, prompts, max_new_tokens: int, max_stems: int) -> Optional[int]:
  """The fewest positions of a one-level stem plan for a call: its sorted distinct prompts cut
  into up to `max_stems` runs, each run's common prefix (leaving every prompt a token) prefilled
  once at the stems' bucket, then every prompt's suffix at the suffixes' bucket. None when no
  run shares a prefix."""
  distinct = sorted(set(prompts))
  n = len(distinct)
  best = None
  for k in range(1, min(n, max_stems) + 1):
    for cuts in itertools.combinations(range(1, n), k - 1):
      bounds = (0, *cuts, n)
      runs = list(zip(bounds, bounds[1:]))
      stems = [min(common_prefix(distinct[a], distinct[b - 1]),
                   min(len(p) for p in distinct[a:b]) - 1) for a, b in runs]
      if max(stems) < 1:
        continue
      suffix = max(len(p) - s for s, (a, b) in zip(stems, runs) for p in distinct[a:b])
      # pylint: disable=protected-access
      stem_bucket = sampler._prompt_bucket(max(stems), max_new_tokens)
      suffix_bucket = sampler._prompt_bucket(suffix, max_new_tokens)
      cost = (sampler._prefill_batch(k, stem_bucket) * stem_bucket
              + sampler._prefill_batch(n, suffix_bucket) * suffix_bucket)
      best = cost if best is None else min(best, cost)
  return best


def abstract_sampler(config: TrainConfig, tokenizer, fine_rows: bool = True):
  """The run's built-in sampler over the policy's shapes only (its plans need no weights); with
  `fine_rows` False, its prefills pad rows to the call's batch buckets (powers of two) only."""
  # pylint: disable=import-outside-toplevel
  from flax import nnx
  from salt_jax.models import CausalLM
  from salt_jax.models.build import policy_config
  from salt_jax.sampling import _DEFAULT_BATCH_BUCKETS, Sampler, length_buckets
  model_config, dtype = policy_config(config, tokenizer)
  model = nnx.eval_shape(lambda: CausalLM(model_config, rngs=nnx.Rngs(0), param_dtype=dtype))
  return Sampler(model, eos_token_ids=[0], pad_token_id=0, max_cache_len=config.max_cache_len,
                 prefill_batch_buckets=None if fine_rows else _DEFAULT_BATCH_BUCKETS,
                 prompt_buckets=length_buckets(config.prompt_bucket_min, config.max_cache_len,
                                               config.prompt_buckets_per_doubling))


def main(argv: Optional[Sequence[str]] = None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
  p.add_argument("--env", default="alfworld")
  p.add_argument("--model", default=None, help="a GGUF file or HF folder: tokenizer and shapes")
  p.add_argument("--tasks", type=int, default=4, help="the first N training tasks")
  p.add_argument("--group-size", type=int, default=8)
  p.add_argument("--tasks-per-call", type=int, default=2)
  p.add_argument("--epsilon", type=float, nargs="+", default=[0.1, 0.3, 0.5])
  p.add_argument("--max-steps", type=int, default=8)
  p.add_argument("--history", type=int, default=2, help="the prompt's last k pairs")
  p.add_argument("--max-new-tokens", type=int, default=512)
  p.add_argument("--max-cache-len", type=int, default=2560)
  p.add_argument("--max-stems", type=int, default=4)
  p.add_argument("--out", default=None)
  args = p.parse_args(argv)

  config = TrainConfig(env=args.env, model=args.model, layout="step", prompt_history=args.history,
                       prompt_task="goal", max_steps=args.max_steps,
                       max_new_tokens=args.max_new_tokens, max_cache_len=args.max_cache_len)
  tokenizer = build_tokenizer(config)
  samplers = {"powers of two": abstract_sampler(config, tokenizer, fine_rows=False),
              "finer where it pays (default)": abstract_sampler(config, tokenizer)}
  result = {"env": args.env, "tokenizer": args.model or config.tokenizer, "tasks": args.tasks,
            "group_size": args.group_size, "tasks_per_call": args.tasks_per_call,
            "history": args.history, "runs": []}
  env = make_expert_env(args.env, max_steps=args.max_steps)
  try:
    tasks = training_tasks(config)[:args.tasks]
    for epsilon in args.epsilon:
      t0 = time.perf_counter()
      calls = rollout_calls(env, tasks, tokenizer, config, group_size=args.group_size,
                            epsilon=epsilon, tasks_per_call=args.tasks_per_call)
      tokens = shared_tokens(calls)
      run = {"epsilon": epsilon, "calls": len(calls), **tokens, "positions": {},
             "seconds": round(time.perf_counter() - t0, 1)}
      share = {k: tokens[k] / max(tokens["all"], 1) for k in ("equal", "trie", "cached")}
      print(f"epsilon {epsilon}: {len(calls)} calls, prompt tokens {tokens['all']}; prefilled: "
            f"equal prompts once {tokens['equal']} ({share['equal']:.2f}), a call's prefixes "
            f"once {tokens['trie']} ({share['trie']:.2f}), earlier calls' kept too "
            f"{tokens['cached']} ({share['cached']:.2f})")
      for rows, sampler in samplers.items():
        now = stems = 0
        for prompts in calls:
          planned = planned_positions(sampler, prompts, args.max_new_tokens)
          stem = stem_positions(sampler, prompts, args.max_new_tokens, args.max_stems)
          now += planned
          stems += planned if stem is None else min(planned, stem)
        run["positions"][rows] = {"plan": now, "with_stems": stems}
        print(f"  prefill rows, {rows}: positions with padding {now} "
              f"({now / max(tokens['equal'], 1):.2f}x the distinct prompts' tokens), with stems "
              f"where fewer {stems} ({stems / max(now, 1):.2f}x)")
      result["runs"].append(run)
  finally:
    env.close()
  if args.out:
    write_json(args.out, result)
  return 0


if __name__ == "__main__":
  sys.exit(main())
