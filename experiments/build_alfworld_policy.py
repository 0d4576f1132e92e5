"""Builds a small ALFWorld policy with its own tokenizer, cloned from the planner's episodes.

  python experiments/build_alfworld_policy.py --demo-cache runs/alfworld_policy/demos.pkl
  python experiments/alfworld_grpo_salt.py --model runs/alfworld_policy/policy \
      --layout step --history-window 2 --max-cache-len 2048 --max-new-tokens 24 --max-steps 15

1. Plays ALFWorld's planner-backed expert on every task of the bundled `valid_train` split and
   keeps the episodes it wins within `--demo-max-steps`.
2. Fits a byte-level BPE tokenizer to those episodes' words (observations, admissible actions, the
   prompt's instructions), so that an ALFWorld object or receptacle name is one or two tokens and
   the vocabulary projection stays small.
3. Clones the expert's actions into a small Qwen2 policy with the prompts the trainer renders in
   the verl-agent recipe's layout (`salt_jax/recipes.py`: one prompt per step with the last 2
   (observation, action) pairs), response `<think></think><action>X</action>`.
4. Writes a Hugging Face folder (config.json, model.safetensors, tokenizer files) and
   `build.json` (the settings, the demonstrations' figures and the cloning loss), which
   `--model` and transformers both load.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pickle
import sys
import time

# The prompt window and row length the policy is cloned for: verl-agent's window
# (salt_jax/recipes.py); rows of ALFWorld's longest admissible lists fit in 2,048 tokens.
HISTORY_WINDOW, MAX_LENGTH = 2, 2048


def expert_demos(split: str, max_steps: int, cache: str | None, num_tasks: int | None = None):
  """Expert episodes on the first `num_tasks` (None: all) tasks of `split`, won or not, cached in
  `cache` (a pickle; None: not cached)."""
  if cache and os.path.exists(cache):
    with open(cache, "rb") as fh:
      return pickle.load(fh)
  # pylint: disable=import-outside-toplevel
  from envs.demos import collect_demos
  from envs.registry import make_env, task_list
  tasks = task_list("alfworld", split)[:num_tasks]
  env = make_env("alfworld", expert=True, max_steps=max_steps)
  try:
    demos = collect_demos(env, tasks, max_steps=max_steps, only_won=False)
  finally:
    env.close()
  if cache:
    os.makedirs(os.path.dirname(os.path.abspath(cache)), exist_ok=True)
    with open(cache, "wb") as fh:
      pickle.dump(demos, fh)
  return demos


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--out", default="runs/alfworld_policy/policy")
  p.add_argument("--split", default="valid_train")
  p.add_argument("--num-tasks", type=int, default=None, help="the split's first N tasks (all)")
  p.add_argument("--demo-max-steps", type=int, default=30,
                 help="keep the expert's episodes won within this many steps")
  p.add_argument("--demo-cache", default=None, help="a pickle of the episodes (reused if present)")
  p.add_argument("--vocab", type=int, default=3072, help="upper bound of the fitted vocabulary")
  p.add_argument("--hidden", type=int, default=96)
  p.add_argument("--layers", type=int, default=3)
  p.add_argument("--heads", type=int, default=4)
  p.add_argument("--kv-heads", type=int, default=2)
  p.add_argument("--intermediate", type=int, default=384)
  p.add_argument("--steps", type=int, default=400, help="behaviour-cloning optimizer steps")
  p.add_argument("--rows", type=int, default=16)
  p.add_argument("--lr", type=float, default=3e-3)
  p.add_argument("--seed", type=int, default=0)
  args = p.parse_args(argv)

  # pylint: disable=import-outside-toplevel  (jax and the model only once the flags are read)
  import jax
  from flax import nnx

  from envs.demos import demo_texts
  from salt_jax import sft
  from salt_jax.config import TrainConfig
  from salt_jax.models.build import policy_config
  from salt_jax.agent.prompts import PromptConfig, toy_chat_tokenizer
  from salt_jax.models import CausalLM, save_pretrained
  from salt_jax.models.tokenizer import save_tokenizer

  t0 = time.perf_counter()
  demos = expert_demos(args.split, args.demo_max_steps, args.demo_cache, args.num_tasks)
  won = [d for d in demos if d.won]
  print(f"[build] {len(demos)} expert episodes on {args.split}, {len(won)} won within "
        f"{args.demo_max_steps} steps ({sum(len(d.actions) for d in won)} steps) "
        f"[{time.perf_counter() - t0:.0f}s]", flush=True)

  tok = toy_chat_tokenizer(args.vocab, extra_texts=demo_texts(demos))
  prompt_config = PromptConfig(history_window=HISTORY_WINDOW)
  shape = dict(hidden_size=args.hidden, intermediate_size=args.intermediate,
               num_layers=args.layers, num_heads=args.heads, num_kv_heads=args.kv_heads,
               head_dim=args.hidden // args.heads)
  mcfg, _ = policy_config(TrainConfig(tiny_policy=shape, max_cache_len=MAX_LENGTH), tok)
  model = CausalLM(mcfg, rngs=nnx.Rngs(args.seed))

  def step_rows(episodes):
    return sft.demo_token_batch(episodes, tok, pad_id=tok.pad_token_id,
                                prompt_config=prompt_config, layout="step", min_length=64,
                                max_length=MAX_LENGTH)
  batch = step_rows(won)
  lengths = batch.attention_mask.sum(axis=1)
  print(f"[build] tokenizer: {len(tok)} tokens; {batch.input_ids.shape[0]} step rows, prompt+"
        f"response tokens mean {lengths.mean():.0f}, max {lengths.max()}; policy "
        f"{sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param))):,} parameters",
        flush=True)
  # The loss before and after, on the first 12 episodes' rows (all rows would take minutes).
  probe = step_rows(won[:12])
  before = sft.nll(model, probe)
  t1 = time.perf_counter()
  losses = sft.behaviour_clone(model, batch, sft.SFTConfig(
      steps=args.steps, rows=args.rows, lr=args.lr, seed=args.seed, group_by_length=True),
      log_every=20)
  after = sft.nll(model, probe)
  print(f"[build] demo NLL {before:.3f} -> {after:.3f} nats/token in "
        f"{time.perf_counter() - t1:.0f}s", flush=True)

  os.makedirs(args.out, exist_ok=True)
  save_pretrained(model, args.out)
  save_tokenizer(tok, args.out)
  info = dict(
      command="python experiments/build_default_policy.py " + " ".join(argv or sys.argv[1:]),
      settings=vars(args) | {"out": os.path.relpath(args.out)},
      prompt_config=dataclasses.asdict(prompt_config), layout="step",
      response_format=sft.RESPONSE_FORMAT,
      demos=dict(split=args.split, episodes=len(demos), won=len(won),
                 steps=int(sum(len(d.actions) for d in won)), rows=int(batch.input_ids.shape[0]),
                 response_tokens=int(batch.num_loss_tokens)),
      vocab=len(tok), nll_before=round(before, 4), nll_after=round(after, 4),
      last_losses=[round(x, 4) for x in losses[-10:]])
  with open(os.path.join(args.out, "build.json"), "w") as fh:
    json.dump(info, fh, indent=2)
  print(f"[build] wrote {args.out} [{time.perf_counter() - t0:.0f}s]", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
