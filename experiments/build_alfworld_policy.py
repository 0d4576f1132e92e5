"""Builds the starter ALFWorld policy the main job plays by default (in envs/alfworld_data/).

  python experiments/build_alfworld_policy.py   # the shipped starter: ~25 min on 2 busy cores

1. Picks the training tasks: the first `--num-tasks` tasks of `valid_train` of the chosen types
   (pick_and_place, look_at_obj_in_light) that alfworld's handcoded expert wins within
   `--max-plan` steps.
2. Plays the expert on them `--demos-per-task` times with noise (`envs.demos.play_expert`: with
   chance `--epsilon` a uniformly drawn admissible command in place of the expert's, the expert
   going on from where that led), so the clone knows the format and each state's commands but
   picks the winning one only part of the time: room for RL.
3. Fits a byte-level BPE tokenizer to those episodes' words, so an object or receptacle name is
   one or two tokens and the vocabulary projection stays small.
4. Clones the episodes into a small Qwen2 with the prompts the trainer renders for the main job
   (one prompt per step with the last `--prompt-history` (observation, action) pairs and the
   admissible commands; response `<think></think><action>X</action>`).
5. Measures its sampled success (temperature 1) on the training tasks through the trainer's own
   rollout, and writes a Hugging Face folder (config.json, model.safetensors, tokenizer files)
   with `build.json`: the settings, the figures, and `play`, the `TrainConfig` values it must be
   played with (`envs.alfworld.starter_defaults()` reads them for the main job).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pickle
import sys
import tempfile
import time


def pick_tasks(split: str, task_types, num_tasks: int, max_plan: int):
  """The first `num_tasks` tasks of `split` (types `task_types`) the handcoded expert wins within
  `max_plan` steps, in the split's order, with their expert episodes."""
  # pylint: disable=import-outside-toplevel
  from envs.alfworld import alfworld_tasks
  from envs.demos import play_expert
  from envs.registry import make_env
  env = make_env("alfworld", expert=True, max_steps=max_plan)
  chosen = []
  try:
    for task in alfworld_tasks(split, task_types=task_types):
      demo = play_expert(env, task, seed=0, max_steps=max_plan)
      if demo.won:
        chosen.append(demo)
      if len(chosen) == num_tasks:
        break
  finally:
    env.close()
  if len(chosen) < num_tasks:
    raise SystemExit(f"only {len(chosen)} tasks of {split} are won within {max_plan} steps")
  return chosen


def measure(config, rounds: int, seed: int) -> dict:
  """The policy's sampled success on its training tasks (`salt_jax.train.sampled_success`):
  success, trajectories counted and valid-step share."""
  from salt_jax.train import Trainer, sampled_success  # pylint: disable=import-outside-toplevel
  with Trainer(config) as tr:
    tr.setup()
    got = sampled_success(tr, rounds, seed)
  return {"success": got["all"], "trajectories": got["trajectories"],
          "valid_steps": got["valid_steps"]}


def main(argv=None) -> int:
  from envs.alfworld import STARTER_POLICY  # pylint: disable=import-outside-toplevel
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--out", default=str(STARTER_POLICY))
  p.add_argument("--split", default="valid_train")
  p.add_argument("--task-types", default="pick_and_place,look_at_obj_in_light")
  p.add_argument("--num-tasks", type=int, default=4)
  p.add_argument("--max-plan", type=int, default=6, help="tasks the expert wins within N steps")
  p.add_argument("--max-steps", type=int, default=10, help="steps an episode at most (played)")
  p.add_argument("--demos-per-task", type=int, default=32)
  p.add_argument("--epsilon", type=float, default=0.2)
  p.add_argument("--prompt-history", type=int, default=0)
  p.add_argument("--max-new-tokens", type=int, default=24)
  p.add_argument("--max-cache-len", type=int, default=1024)
  p.add_argument("--vocab", type=int, default=2048, help="upper bound of the fitted vocabulary")
  p.add_argument("--hidden", type=int, default=96)
  p.add_argument("--layers", type=int, default=3)
  p.add_argument("--heads", type=int, default=4)
  p.add_argument("--kv-heads", type=int, default=2)
  p.add_argument("--intermediate", type=int, default=384)
  p.add_argument("--steps", type=int, default=1000, help="behaviour-cloning optimizer steps")
  p.add_argument("--rows", type=int, default=16)
  p.add_argument("--lr", type=float, default=3e-3)
  p.add_argument("--eval-rounds", type=int, default=2)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--demo-cache", default=None,
                 help="a pickle of the tasks' episodes, written once and reused (a rebuild with "
                 "other cloning settings skips the minutes of play)")
  args = p.parse_args(argv)

  # pylint: disable=import-outside-toplevel  (jax and the model only once the flags are read)
  import jax
  from flax import nnx

  from envs.demos import collect_demos, demo_texts
  from envs.registry import make_env
  from salt_jax import sft
  from salt_jax.agent.prompts import env_prompt_config, toy_chat_tokenizer
  from salt_jax.config import TrainConfig
  from salt_jax.models import CausalLM, save_pretrained
  from salt_jax.models.build import policy_config
  from salt_jax.models.tokenizer import save_tokenizer

  t0 = time.perf_counter()
  if args.demo_cache and os.path.exists(args.demo_cache):
    with open(args.demo_cache, "rb") as fh:
      clean, noisy = pickle.load(fh)
  else:
    clean = pick_tasks(args.split, tuple(args.task_types.split(",")), args.num_tasks,
                       args.max_plan)
    env = make_env("alfworld", expert=True, max_steps=args.max_steps)
    try:
      noisy = collect_demos(env, [d.task for d in clean], seeds=range(1, args.demos_per_task + 1),
                            max_steps=args.max_steps, only_won=False, epsilon=args.epsilon)
    finally:
      env.close()
    if args.demo_cache:
      os.makedirs(os.path.dirname(os.path.abspath(args.demo_cache)), exist_ok=True)
      with open(args.demo_cache, "wb") as fh:
        pickle.dump((clean, noisy), fh)
  tasks = [d.task for d in clean]
  demos = clean + noisy
  print(f"[build] {len(tasks)} tasks; {len(noisy)} noisy expert episodes (epsilon "
        f"{args.epsilon}), {sum(d.won for d in noisy)} won within {args.max_steps} steps "
        f"[{time.perf_counter() - t0:.0f}s]", flush=True)

  # What the trainer must use to play the policy as it was cloned (the main job's defaults).
  play = dict(env="alfworld", train_task_ids=tuple(t.task_id for t in tasks), layout="step",
              prompt_history=args.prompt_history, max_steps=args.max_steps,
              max_new_tokens=args.max_new_tokens, max_cache_len=args.max_cache_len)
  tok = toy_chat_tokenizer(args.vocab, extra_texts=demo_texts(demos))
  prompt_config = env_prompt_config("alfworld", history_window=args.prompt_history)
  shape = dict(hidden_size=args.hidden, intermediate_size=args.intermediate,
               num_layers=args.layers, num_heads=args.heads, num_kv_heads=args.kv_heads,
               head_dim=args.hidden // args.heads)
  mcfg, _ = policy_config(TrainConfig(tiny_policy=shape, max_cache_len=args.max_cache_len), tok)
  model = CausalLM(mcfg, rngs=nnx.Rngs(args.seed))
  batch = sft.demo_token_batch(demos, tok, pad_id=tok.pad_token_id, prompt_config=prompt_config,
                               layout="step", min_length=64, max_length=args.max_cache_len)
  lengths = batch.attention_mask.sum(axis=1)
  n_params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
  print(f"[build] tokenizer: {len(tok)} tokens; {batch.input_ids.shape[0]} step rows, prompt+"
        f"response tokens mean {lengths.mean():.0f}, max {lengths.max()}; policy {n_params:,} "
        f"parameters", flush=True)
  t1 = time.perf_counter()
  losses = sft.behaviour_clone(model, batch, sft.SFTConfig(
      steps=args.steps, rows=args.rows, lr=args.lr, seed=args.seed, group_by_length=True),
      log_every=50)
  clone_s = time.perf_counter() - t1
  print(f"[build] cloned in {clone_s:.0f}s; last losses {[round(x, 3) for x in losses[-5:]]}",
        flush=True)

  os.makedirs(args.out, exist_ok=True)
  save_pretrained(model, args.out)
  save_tokenizer(tok, args.out)
  with tempfile.TemporaryDirectory() as run_dir:
    cfg = TrainConfig(**play, model=args.out, group_size=8, tasks_per_iter=len(tasks),
                      env_workers=0, progress=False, tensorboard=False, out=run_dir,
                      seed=args.seed)
    measured = measure(cfg, args.eval_rounds, seed=10_000)
  print(f"[build] sampled success on the training tasks: {measured}", flush=True)
  info = dict(
      command="python experiments/build_alfworld_policy.py " + " ".join(
          sys.argv[1:] if argv is None else argv),
      settings=vars(args) | {"out": os.path.relpath(args.out)},
      play=play, prompt_config=dataclasses.asdict(prompt_config),
      response_format=sft.RESPONSE_FORMAT, parameters=int(n_params), vocab=len(tok),
      demos=dict(tasks=len(tasks), clean_plan_steps=[len(d.actions) for d in clean],
                 noisy_episodes=len(noisy), noisy_won=int(sum(d.won for d in noisy)),
                 rows=int(batch.input_ids.shape[0]),
                 response_tokens=int(batch.num_loss_tokens)),
      clone=dict(seconds=round(clone_s), last_losses=[round(x, 4) for x in losses[-10:]]),
      sampled=measured)
  with open(os.path.join(args.out, "build.json"), "w", encoding="utf-8") as fh:
    json.dump(info, fh, indent=2)
  print(f"[build] wrote {args.out} [{time.perf_counter() - t0:.0f}s]", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
