"""The trainer's update step with LoRA adapters against full fine-tuning, side by side: step time
and memory of one model (default SmolLM2-135M-Instruct, `python -m salt_jax.models.gguf
fetch-smollm2`); with --critic, what PPO's critic adds to each (`salt_jax.critic`).

Each setting runs in its own process (so its peak memory is its own): the policy built as the
trainer builds it (`build_policy`: --lora-rank R adds qwix adapters), its trained / frozen split,
AdamW, and the trainer's jitted `train_step` (`salt_jax.update.update_programs`) on `--rows` rows
of `--length` random tokens, the last `--response` of each a loss position, in micro-batches of
`--microbatch-rows`, projecting only the loss positions onto the vocabulary as the trainer does
(`batching.logit_positions`; --all-positions: every position, the update before that).
Reported: the first call (trace + compile + run), the mean of `--reps` later calls, the bytes of
trained parameters, optimizer state, frozen base and reference copy the trainer holds, and the
process's peak resident memory during the steps (its high-water mark reset after setup; the
setup's own peak, e.g. dequantizing a GGUF, printed apart). With --critic the
critic is built as the trainer builds it for --algo ppo (the trained state copied, a value head;
its own AdamW) and its two programs are timed on the same rows the same way: the value pass over
the batch and the value-loss step.

  python benchmarks/bench_lora.py                       # full, rank 8, rank 64
  python benchmarks/bench_lora.py --ranks 0 8 --critic  # PPO: the critic's cost beside each
  python benchmarks/bench_lora.py --ranks 0 8 --rows 4 --length 256 --reps 1 --random
  python benchmarks/bench_lora.py --ranks 0 --rows 2 --microbatch-rows 2 --length 768 \
      --response 32 [--all-positions]                  # the ALFWorld step rows' shape
  python benchmarks/bench_lora.py --ranks 0 --rows 2 --microbatch-rows 2 --length 576 \
      --response 32 --profile /tmp/prof              # + each XLA thread's busy time, by op
  python benchmarks/bench_lora.py --ranks 0 --rows 2 --microbatch-rows 2 --length 576 \
      --response 32 --mesh 2x1                       # the rows split over 2 CPU devices

With --mesh DxM the step runs as the trainer runs it under that mesh (`--mesh` of the trainer;
on a CPU host D*M simulated devices sharing the cores), each micro-batch's rows split over D.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from salt_jax.cli import use_cpu_devices
from salt_jax.sharding import parse_mesh_shape


def _rss_kib(field: str) -> int:
  with open("/proc/self/status", encoding="utf-8") as f:
    for line in f:
      if line.startswith(field + ":"):
        return int(line.split()[1])
  return -1


def _reset_peak() -> bool:
  """Resets this process's resident-memory high-water mark (Linux >= 4.0)."""
  try:
    with open("/proc/self/clear_refs", "w", encoding="utf-8") as f:
      f.write("5")
    return True
  except OSError:
    return False


def one_setting(args, rank: int) -> dict:
  """Times the update step of one setting in this process."""
  # pylint: disable=import-outside-toplevel
  import jax
  import numpy as np
  from flax import nnx
  from salt_jax import batching
  from salt_jax.config import TrainConfig
  from salt_jax.models.build import build_policy, build_tokenizer, policy_config
  from salt_jax.models import lora
  from salt_jax.sharding import make_mesh, on_mesh
  from salt_jax.critic import critic_optimizer, critic_programs, init_critic
  from salt_jax.phases import on_device
  from salt_jax.update import optimizer, update_programs

  t0 = time.perf_counter()
  mesh = make_mesh(args.mesh)
  cfg = TrainConfig(env="toy", tokenizer="toy", model=None if args.random else args.model,
                    tiny_policy=json.loads(args.tiny_policy), lora_rank=rank,
                    minibatch_rows=args.rows, microbatch_rows=args.microbatch_rows,
                    max_cache_len=max(8192, args.length + 32), lr=1e-5, out="/tmp/bench_lora")
  tok = build_tokenizer(cfg)
  model = build_policy(cfg, tok, mesh)
  graphdef, params, frozen = nnx.split(model, lora.trained_filter(model), ...)
  ref = jax.tree.map(lambda x: x.copy(), params)  # the trainer's reference copy
  tx = optimizer(cfg, lambda _: cfg.lr)
  opt_state = on_mesh(tx.init(params), mesh)  # as the trainer places it
  shard_of = lambda tree: jax.tree.map(lambda x: x.sharding, tree)  # noqa: E731
  _, train_step = update_programs(cfg, graphdef, tx, args.rows, shard_of(params),
                                  shard_of(opt_state))
  vocab = policy_config(cfg, tok)[0].vocab_size
  rng = np.random.default_rng(0)
  ids = rng.integers(0, vocab, (args.rows, args.length), dtype=np.int32)
  loss_mask = np.zeros(ids.shape, bool)
  loss_mask[:, -args.response:] = True
  mb = dict(input_ids=ids, targets=np.roll(ids, -1, 1), loss_mask=loss_mask,
            token_step_ids=np.where(loss_mask, np.arange(args.rows)[:, None], -1).astype(np.int32),
            old_logprobs=np.full(ids.shape, -5.0, np.float32),
            ref_logprobs=np.full(ids.shape, -5.0, np.float32),
            attention_mask=np.ones(ids.shape, bool),
            positions=np.broadcast_to(np.arange(args.length, dtype=np.int32), ids.shape).copy())
  if not args.all_positions:
    mb["logit_positions"] = batching.logit_positions(loss_mask)
  mb = on_device(mb, mesh)  # rows split over the mesh's data axis, as the trainer's
  step_adv = jax.numpy.asarray(rng.normal(size=args.rows).astype(np.float32))
  nbytes = lambda tree: sum(x.nbytes for x in jax.tree.leaves(tree))  # noqa: E731
  sizes = {"trained_mib": nbytes(params) / 2**20, "optimizer_mib": nbytes(opt_state) / 2**20,
           "frozen_mib": nbytes(frozen) / 2**20, "reference_mib": nbytes(ref) / 2**20}
  if args.critic:  # before the policy's params are donated to its first step
    critic = on_mesh(init_critic(params, model.config.hidden_size, jax.random.key(1)), mesh)
    critic_tx = critic_optimizer(cfg)
    critic_opt = on_mesh(critic_tx.init(critic), mesh)
    values_fn, critic_step = critic_programs(cfg, graphdef, critic_tx, args.rows,
                                             shard_of(critic), shard_of(critic_opt))
    critic_mb = {k: mb[k] for k in ("input_ids", "attention_mask", "positions", "loss_mask")}
    critic_mb.update(old_values=np.zeros(ids.shape, np.float32),
                     returns=rng.normal(size=ids.shape).astype(np.float32))
    sizes.update(critic_mib=nbytes(critic) / 2**20, critic_optimizer_mib=nbytes(critic_opt) / 2**20)
  setup_s, setup_peak = time.perf_counter() - t0, _rss_kib("VmHWM")
  reset = _reset_peak()
  t1 = time.perf_counter()
  params, opt_state, out = train_step(params, opt_state, mb, step_adv, frozen)
  jax.block_until_ready(out["loss"])
  first = time.perf_counter() - t1
  times = []
  for _ in range(args.reps):
    t1 = time.perf_counter()
    params, opt_state, out = train_step(params, opt_state, mb, step_adv, frozen)
    jax.block_until_ready(out["loss"])
    times.append(time.perf_counter() - t1)
  profile = None
  if args.profile:  # `--reps` more calls under the profiler: where the step's time goes
    import xla_cpu_profile  # pylint: disable=import-outside-toplevel

    def step():
      nonlocal params, opt_state
      params, opt_state, out = train_step(params, opt_state, mb, step_adv, frozen)
      return out["loss"]
    profile = xla_cpu_profile.profile_calls(step, args.reps,
                                            os.path.join(args.profile, f"rank{rank}"))
  timed = {}
  if args.critic:
    def run_values():
      return values_fn(critic, mb["input_ids"], mb["attention_mask"], mb["positions"], frozen)

    def run_critic_step():
      nonlocal critic, critic_opt
      critic, critic_opt, out = critic_step(critic, critic_opt, critic_mb, frozen)
      return out["value_loss"]

    for name, fn in (("values", run_values), ("critic_step", run_critic_step)):
      t1 = time.perf_counter()
      jax.block_until_ready(fn())
      timed[f"{name}_first_call_s"] = round(time.perf_counter() - t1, 2)
      spent = []
      for _ in range(args.reps):
        t1 = time.perf_counter()
        jax.block_until_ready(fn())
        spent.append(time.perf_counter() - t1)
      timed[f"{name}_s"] = round(float(np.mean(spent)), 3)
  return {"setting": f"lora rank {rank}" if rank else "full fine-tuning", "lora_rank": rank,
          "first_call_s": round(first, 2), "step_s": round(float(np.mean(times)), 3),
          "steps_s": [round(t, 3) for t in times], **timed,
          **{k: round(v, 1) for k, v in sizes.items()},
          "peak_rss_mib": round(_rss_kib("VmHWM") / 1024, 1) if reset else None,
          "setup_peak_rss_mib": round(setup_peak / 1024, 1), "setup_s": round(setup_s, 1),
          "loss_finite": bool(np.isfinite(float(out["loss"]))), "loss": float(out["loss"]),
          "rows": args.rows,
          "length": args.length, "response": args.response,
          "microbatch_rows": args.microbatch_rows, "mesh": args.mesh,
          "logits": "all positions" if args.all_positions else "loss positions",
          "model": "tiny random" if args.random else os.path.basename(args.model),
          **({"profile": profile} if profile else {})}


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--model", default=None, help="a HF folder or .gguf (default: SmolLM2's GGUF)")
  ap.add_argument("--random", action="store_true",
                  help="the tiny random policy instead of --model (a quick check)")
  ap.add_argument("--tiny-policy", default="{}", help="with --random: its shape (JSON)")
  ap.add_argument("--ranks", type=int, nargs="+", default=[0, 8, 64], help="0: full fine-tuning")
  ap.add_argument("--rows", type=int, default=8)
  ap.add_argument("--microbatch-rows", type=int, default=4)
  ap.add_argument("--length", type=int, default=512)
  ap.add_argument("--response", type=int, default=64)
  ap.add_argument("--reps", type=int, default=3)
  ap.add_argument("--all-positions", action="store_true",
                  help="project every position onto the vocabulary, not the loss positions alone")
  ap.add_argument("--critic", action="store_true",
                  help="also time PPO's critic: its value pass and value-loss step")
  ap.add_argument("--profile", default=None, metavar="DIR",
                  help="also trace --reps steps into DIR/rank<R> and report each XLA thread's "
                       "busy time and the ops' (benchmarks/xla_cpu_profile.py)")
  ap.add_argument("--mesh", default="1x1", help="DxM: the trainer's mesh (simulated CPU devices)")
  ap.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)  # a child's rank
  ap.add_argument("--out", default=None, help="append the JSON lines here")
  args = ap.parse_args(argv)
  if min(args.ranks) < 0 or args.rows < 1 or args.reps < 1 or not 0 < args.response < args.length:
    ap.error("ranks must be >= 0, rows and reps >= 1, 0 < response < length")
  if args.microbatch_rows < 0 or (args.microbatch_rows and args.rows % args.microbatch_rows):
    ap.error("--microbatch-rows must divide --rows")
  if args.model is None and not args.random:
    from salt_jax.models.gguf import smollm2_path  # pylint: disable=import-outside-toplevel
    args.model = str(smollm2_path())
  try:
    data, _ = parse_mesh_shape(args.mesh)
  except ValueError as e:
    ap.error(str(e))
  if args.microbatch_rows and args.microbatch_rows % data or args.rows % data:
    ap.error(f"--rows and --microbatch-rows must be multiples of the mesh's data axis ({data})")
  if args.one is not None:
    use_cpu_devices(args.mesh)  # before the backend starts
    if args.profile:  # XLA reads its flags when the backend starts: before the first array
      import xla_cpu_profile  # pylint: disable=import-outside-toplevel
      xla_cpu_profile.enable_tracing()
    print(json.dumps(one_setting(args, args.one)), flush=True)
    return 0
  rows = []
  for rank in args.ranks:  # one process each: its own peak memory, no shared caches
    child = [sys.executable, os.path.abspath(__file__), "--one", str(rank),
             *(a for a in (argv if argv is not None else sys.argv[1:]))]
    if args.model is not None and "--model" not in child:
      child += ["--model", args.model]
    res = subprocess.run(child, capture_output=True, text=True, check=False)
    if res.returncode:
      print(res.stdout + res.stderr, file=sys.stderr)
      return res.returncode
    rows.append(json.loads(res.stdout.strip().splitlines()[-1]))
    print(json.dumps(rows[-1]), flush=True)
  print(f"\n{'setting':<18} {'step s':>7} {'first s':>8} {'trained MiB':>12} "
        f"{'AdamW MiB':>10} {'reference MiB':>14} {'peak RSS MiB':>13}")
  for r in rows:
    print(f"{r['setting']:<18} {r['step_s']:>7.2f} {r['first_call_s']:>8.1f} "
          f"{r['trained_mib']:>12.1f} {r['optimizer_mib']:>10.1f} {r['reference_mib']:>14.1f} "
          f"{r['peak_rss_mib'] if r['peak_rss_mib'] is not None else '-':>13}")
  if args.critic:
    print(f"\n{'setting':<18} {'values s':>9} {'critic step s':>14} {'critic MiB':>11} "
          f"{'critic AdamW MiB':>17}")
    for r in rows:
      print(f"{r['setting']:<18} {r['values_s']:>9.2f} {r['critic_step_s']:>14.2f} "
            f"{r['critic_mib']:>11.1f} {r['critic_optimizer_mib']:>17.1f}")
  for r in rows:
    if "profile" in r:
      import xla_cpu_profile  # pylint: disable=import-outside-toplevel
      print(f"\n{r['setting']}: the step under the profiler")
      xla_cpu_profile.print_summary(r["profile"])
  if args.out:
    with open(args.out, "a", encoding="utf-8") as f:
      for r in rows:
        f.write(json.dumps({**r, "date": time.strftime("%Y-%m-%d")}) + "\n")
  return 0


if __name__ == "__main__":
  sys.exit(main())
