"""Two processes on this machine train one model over JAX's CPU collectives: the multi-host path.

  python experiments/multihost_demo.py            # 2 processes x 2 CPU devices, toy env, 2 iters
  python experiments/multihost_demo.py --check    # and a 1-process run fed the same global batches
  python experiments/multihost_demo.py --algo ppo # PPO: the critic trained across the processes
  python experiments/multihost_demo.py --rollout-engine vllm  # each process samples with vLLM

A tiny policy is first behaviour-cloned on the toy env (so rewards differ within groups and the
update moves the params); then `--num-processes` workers join through a coordinator on a free
local port, each playing its share of every iteration's tasks, and train on one 'data' mesh over
all their devices. Each worker prints a checksum of its params (and with --algo ppo its critic's):
they must be identical.

With `--rollout-engine vllm` (the vllm extra) every process starts its own vLLM engine in its own
memory (a 1 GiB KV cache each here) and samples its share of the tasks with it; after every
update each engine is loaded from its process's copy of the new params. The tiny policy then has
one head of 64 dims, a size vLLM's CPU attention runs.

With --check, one process over the same total number of devices replays the recorded global
batches (`ReplayTrainer`), and its params and metrics are compared with the multi-process run's.

On a cluster, run one process per host with the experiment scripts' flags instead:
  python experiments/alfworld_grpo_salt.py --distributed --mesh 16x1 ...      # TPU pod / SLURM
  python experiments/alfworld_grpo_salt.py --coordinator host0:1234 --num-processes 2 \\
      --process-id 0 --mesh 16x1 ...                                          # on each host
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import pickle
import socket
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The toy run: 4 tasks x G=4 per iteration (2 tasks per process), a 2-layer d_model-64 policy.
TOY = dict(env="toy", env_kwargs={"num_rooms": 3}, tokenizer="toy", group_size=4,
           tasks_per_iter=4, num_train_tasks=8, max_steps=4, max_new_tokens=24,
           max_cache_len=512, prompt_bucket_min=128, env_workers=0, lr=3e-4, kl_coef=0.05,
           minibatch_rows=4, min_seq_len=64, seed=3, progress=False, tensorboard=False,
           checkpoint_every=1)
# What --rollout-engine vllm changes: a head size vLLM's CPU attention runs, a small KV cache.
VLLM = dict(rollout_engine="vllm", vllm_kv_cache_gib=1,
            tiny_policy={"head_dim": 64, "num_heads": 1, "num_kv_heads": 1})
RECORD = "rollouts.pkl"  # the global batches of the multi-process run, written by process 0


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def params_digest(arrays) -> tuple[str, float]:
  """(sha256 of the arrays' bytes, sum of their absolute values)."""
  import numpy as np  # pylint: disable=import-outside-toplevel
  h, total = hashlib.sha256(), 0.0
  for x in arrays:
    h.update(x.tobytes())
    total += float(np.abs(x.astype(np.float64)).sum())
  return h.hexdigest(), total


def toy_config(engine: str = "builtin", **kw):
  """The demo's TrainConfig, sampling with `engine`."""
  from salt_jax.config import TrainConfig  # pylint: disable=import-outside-toplevel
  return TrainConfig(**TOY, **(VLLM if engine == "vllm" else {}), **kw)


def warm_start(out: str, engine: str = "builtin") -> str:
  """Behaviour-clones the toy expert into the tiny policy (one process); returns the params path."""
  from salt_jax.sft import warm_start as clone  # pylint: disable=import-outside-toplevel
  return clone(toy_config(engine, out=out), steps=120, num_demos=18, lr=1e-2)


def worker(args) -> int:
  """One process of the run: trains up to iteration `args.iters` (from the last checkpoint with
  --resume), writes process_<i>.json (+ params)."""
  # Before jax is imported: the number of CPU devices is fixed then.
  os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.devices}"
  os.environ["JAX_PLATFORMS"] = "cpu"
  # pylint: disable=import-outside-toplevel
  import jax
  import numpy as np
  from salt_jax.multihost import to_host
  from salt_jax.train import Trainer

  class ReplayTrainer(Trainer):
    """Plays no environment: each iteration trains on the next recorded global batch."""

    def __init__(self, config, batches):
      super().__init__(config)
      self._batches = iter(batches)

    def collect_rollout(self, tasks, key, *, seed, group_size, greedy=False):
      batch = next(self._batches)
      assert batch.task_ids[::group_size] == [t.task_id for t in tasks]  # same task order
      return batch

  n = args.num_processes
  procs = dict(distributed=True, coordinator=args.coordinator, num_processes=n,
               process_id=args.process_id) if n > 1 else {}
  cfg = toy_config(args.rollout_engine, iters=args.iters, out=args.out,
                   init_params=args.init_params, mesh=f"{n * args.devices}x1",
                   resume=args.resume, algo=args.algo, **procs)
  replay = None
  if args.replay:
    with open(args.replay, "rb") as f:
      replay = pickle.load(f)
  with (ReplayTrainer(cfg, replay) if replay else Trainer(cfg)) as tr:
    tr.setup()
    rows, local_tasks, batches = [], [], []
    while tr.iteration_index < cfg.iters:
      rows.append(tr.iteration())
      if tr.last.local_rollout is not None:
        local_tasks.append(sorted(set(tr.last.local_rollout.task_ids)))
      batches.append(tr.last.rollout)
    # (a collective: all call it); with a critic (PPO) its params too
    leaves = [to_host(x) for x in jax.tree.leaves((tr.state.params, tr.state.critic))]
    engine_gap = engine_against_builtin(tr) if cfg.rollout_engine != "builtin" else None
  sha, total = params_digest(leaves)
  p = args.process_id
  np.savez(os.path.join(args.out, f"params_{p}.npz"), **{str(i): x for i, x in enumerate(leaves)})
  with open(os.path.join(args.out, f"process_{p}.json"), "w", encoding="utf-8") as f:
    json.dump({"process": p, "sha256": sha, "abs_sum": total, "local_tasks": local_tasks,
               "rows": rows, "engine_against_builtin": engine_gap}, f)
  if p == 0 and not replay:
    with open(os.path.join(args.out, RECORD), "wb") as f:
      pickle.dump(batches, f)
  print(f"[process {p}/{n}] {cfg.iters} iterations, tasks played {local_tasks}; params sha256 "
        f"{sha[:16]}, sum|w| {total:.6f} ({time.process_time():.0f} s of CPU)", flush=True)
  return 0


def engine_against_builtin(tr) -> dict:
  """This process's engine against the built-in sampler on its own copy of the current policy:
  greedy tokens of a few of its last prompts, equal or not, and the largest |log-prob gap| of
  the tokens both chose (so the engine holds the params of the last update)."""
  # pylint: disable=import-outside-toplevel
  import jax
  import numpy as np
  from salt_jax.sampling import Sampler
  prompts = [list(p) for p in tr.last.local_rollout.prompt_ids[:3]]
  args = dict(max_new_tokens=12, greedy=True, decode_fn=tr.tokenizer.decode)
  ref = Sampler(tr.sampler_model, eos_token_ids=tr.sampler.eos_token_ids, pad_token_id=tr.pad_id,
                max_cache_len=tr.config.max_cache_len)(prompts, jax.random.key(0), **args)
  out = tr.sampler(prompts, None, **args)
  same = all(np.array_equal(a, b) for a, b in zip(ref.tokens, out.tokens))
  gap = max(float(np.max(np.abs(a[:len(b)] - b[:len(a)]), initial=0.0))
            for a, b in zip(ref.policy_logprobs, out.policy_logprobs))
  return {"greedy_tokens_equal": same, "max_logprob_gap": gap}


def launch(out: str, *, num_processes: int, devices: int, iters: int, init_params: str,
           replay: str | None = None, resume: bool = False, timeout: float = 600,
           algo: str = "grpo", engine: str = "builtin") -> list[str]:
  """Runs `num_processes` workers on this machine (coordinator on a free port), resuming the run
  in `out` with `resume`; returns their outputs. Raises RuntimeError naming the worker that
  failed."""
  os.makedirs(out, exist_ok=True)
  coord = f"127.0.0.1:{free_port()}"
  procs = []
  for i in range(num_processes):
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", f"--process-id={i}",
           f"--num-processes={num_processes}", f"--coordinator={coord}", f"--devices={devices}",
           f"--iters={iters}", f"--out={out}", f"--init-params={init_params}", f"--algo={algo}",
           f"--rollout-engine={engine}"]
    if replay:
      cmd.append(f"--replay={replay}")
    if resume:
      cmd.append("--resume")
    procs.append(subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True))
  deadline = time.monotonic() + timeout
  try:
    # When one worker fails the others wait in a collective: stop them at once.
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
      if any(p.poll() not in (None, 0) for p in procs):
        break
      time.sleep(0.2)
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  outs = [p.communicate()[0] for p in procs]
  for i, (p, o) in enumerate(zip(procs, outs)):
    if p.returncode != 0:
      raise RuntimeError(f"worker {i} exited with {p.returncode}:\n{o[-4000:]}")
  return outs


def run_demo(out: str, *, num_processes: int = 2, devices: int = 2, iters: int = 2,
             check: bool = False, algo: str = "grpo", engine: str = "builtin",
             init_params: str | None = None) -> dict:
  """Warm start (unless `init_params` names saved params of the demo's policy), then the
  multi-process run (and with `check` the 1-process replay).

  Returns {"multi": [process_<i>.json contents], "single": process_0.json of the replay or None,
  "max_param_diff": max |multi - single| over all params (or None)}.
  """
  import numpy as np  # pylint: disable=import-outside-toplevel
  init = init_params
  if init is None:
    t0 = time.perf_counter()
    init = warm_start(os.path.join(out, "warm"), engine)
    print(f"[demo] warm start {time.perf_counter() - t0:.0f} s", flush=True)
  multi_dir = os.path.join(out, "multi")
  for o in launch(multi_dir, num_processes=num_processes, devices=devices, iters=iters,
                  init_params=init, algo=algo, engine=engine):
    print(o.strip().splitlines()[-1], flush=True)
  multi = [_read_json(os.path.join(multi_dir, f"process_{i}.json")) for i in range(num_processes)]
  res = {"multi": multi, "single": None, "max_param_diff": None}
  if check:
    single_dir = os.path.join(out, "single")
    (o,) = launch(single_dir, num_processes=1, devices=num_processes * devices, iters=iters,
                  init_params=init, replay=os.path.join(multi_dir, RECORD), algo=algo,
                  engine=engine)
    print(o.strip().splitlines()[-1], flush=True)
    res["single"] = _read_json(os.path.join(single_dir, "process_0.json"))
    a = np.load(os.path.join(multi_dir, "params_0.npz"))
    b = np.load(os.path.join(single_dir, "params_0.npz"))
    res["max_param_diff"] = max(float(np.abs(a[k] - b[k]).max()) for k in a.files)
  return res


def _read_json(path: str) -> dict:
  with open(path, encoding="utf-8") as f:
    return json.load(f)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--out", default=None, help="default: runs/multihost_demo/<timestamp>")
  p.add_argument("--num-processes", type=int, default=2)
  p.add_argument("--devices", type=int, default=2, help="CPU devices per process")
  p.add_argument("--iters", type=int, default=2)
  p.add_argument("--algo", default="grpo", help="the advantage estimator (e.g. ppo: a critic)")
  p.add_argument("--rollout-engine", default="builtin", choices=("builtin", "vllm"),
                 help="what samples the rollouts; vllm: one engine per process")
  p.add_argument("--check", action="store_true",
                 help="also run 1 process over the same devices on the recorded batches")
  # the worker's own flags (set by `launch`)
  p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
  p.add_argument("--process-id", type=int, default=0, help=argparse.SUPPRESS)
  p.add_argument("--coordinator", default=None, help=argparse.SUPPRESS)
  p.add_argument("--init-params", default=None, help=argparse.SUPPRESS)
  p.add_argument("--replay", default=None, help=argparse.SUPPRESS)
  p.add_argument("--resume", action="store_true", help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  if args.num_processes < 1 or args.devices < 1 or args.iters < 1:
    raise SystemExit("error: --num-processes, --devices and --iters must be >= 1")
  if args.worker:
    return worker(args)
  os.environ["JAX_PLATFORMS"] = "cpu"  # this process only warm-starts, on one CPU device
  out = args.out or os.path.join("runs", "multihost_demo", time.strftime("%Y%m%d-%H%M%S"))
  res = run_demo(out, num_processes=args.num_processes, devices=args.devices, iters=args.iters,
                 check=args.check, algo=args.algo, engine=args.rollout_engine)
  shas = {r["sha256"] for r in res["multi"]}
  rows = res["multi"][0]["rows"]
  print(f"[demo] success rate per iteration {[round(r['success_rate'], 3) for r in rows]}, "
        f"{rows[-1]['num_trajectories']} trajectories per iteration; params identical on all "
        f"{args.num_processes} processes: {len(shas) == 1}", flush=True)
  if res["single"] is not None:
    print(f"[demo] 1 process on the same batches: max |param difference| "
          f"{res['max_param_diff']:.3g}", flush=True)
  return 0 if len(shas) == 1 else 1


if __name__ == "__main__":
  sys.exit(main())
