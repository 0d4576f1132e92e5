"""Speed of salt-jax's sampler and training step, side by side with Tunix and PyTorch (+ verl).

One run measures, on one Qwen2 config (4 layers, embed 256, MLP 1024, 4 heads, 2 KV heads,
head_dim 64, vocab 2048, f32) with the same random weights in all three frameworks:
  (a) generation: batch 16 and 128, prompt 64, 32 new greedy tokens -> new tokens/s of
      salt_jax.sampling.Sampler, Tunix's `Sampler` and transformers' `generate` (torch, sdpa);
  (b) training: forward + backward of completion-token log-probs and the PPO-clip loss, batch
      128, prompt 64 + completion 192 -> completion tokens/s of salt_jax (token_logprobs +
      policy_loss), Tunix (`grpo_loss_fn`) and PyTorch with verl's `compute_policy_loss`.
All three use the same loss settings: clip 0.2, dual clip 3.0 (verl's default), token-mean, no
KL term. Each figure is the best of `--repeats` timed runs (default 10; at most 3 for training)
after a warm-up (compile) run, because the machine is shared and noisy: a batch-16 call takes
0.1 to 0.3 s, and single calls of the same program vary by 10 to 20%. Its speed also drifts over
minutes, so generation runs in `--rounds` rounds (default 3), each timing all three frameworks
one after another, and each figure is its framework's best round; training runs once after.
Peers run one after another in subprocesses, in their own virtual environments, reading the
weights from a Hugging Face folder (config.json + model.safetensors) written by
`salt_jax.models.save_pretrained`.

Peer environments (Tunix 0.1.7 pins safetensors < 0.8, which clashes with transformers 5.19):

  python -m venv /work/main/.venv-tunix
  /work/main/.venv-tunix/bin/pip install google-tunix==0.1.7 jax==0.10.2 jaxlib==0.10.2 \
      flax==0.12.8
  # PyTorch + verl: sees the system torch 2.13 / transformers 5.19, keeps the system env clean.
  python -m venv --system-site-packages /work/main/.venv-verl
  /work/main/.venv-verl/bin/pip install --no-deps verl==0.9.1
  /work/main/.venv-verl/bin/pip install ray tensordict omegaconf codetiming orjson

Run (about 10 minutes on 2 cores):
  python benchmarks/bench_model.py            # everything
  python benchmarks/bench_model.py --quick    # small shapes, 1 repeat: a smoke test
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TUNIX_PY = os.path.join(ROOT, ".venv-tunix", "bin", "python")
VERL_PY = os.path.join(ROOT, ".venv-verl", "bin", "python")

# The benchmark config, in ModelConfig's field names.
CONFIG = dict(vocab_size=2048, hidden_size=256, intermediate_size=1024, num_layers=4,
              num_heads=4, num_kv_heads=2, head_dim=64, rope_theta=1_000_000.0,
              rms_norm_eps=1e-6, tie_word_embeddings=False, attention_bias=True)
PAD = 0
CLIP, DUAL_CLIP = 0.2, 3.0


def _shapes(quick: bool) -> dict:
  if quick:
    return dict(gen_batches=[4, 8], prompt=16, new=8, train_batch=4, train_prompt=16,
                completion=32, micro_rows=2)
  return dict(gen_batches=[16, 128], prompt=64, new=32, train_batch=128, train_prompt=64,
              completion=192, micro_rows=4)


def _best(fn, repeats: int) -> tuple[float, float]:
  """(first call seconds, best of `repeats` later calls)."""
  t = time.perf_counter()
  fn()
  first = time.perf_counter() - t
  best = float("inf")
  for _ in range(repeats):
    t = time.perf_counter()
    fn()
    best = min(best, time.perf_counter() - t)
  return first, best


def _train_repeats(repeats: int) -> int:
  """Training steps take seconds each, so fewer repeats than generation."""
  return max(1, min(repeats, 3))


def _inputs(shapes: dict, seed: int = 0):
  """Prompts per generation batch and the training batch, as numpy (shared by all frameworks)."""
  import numpy as np
  rng = np.random.default_rng(seed)
  v = CONFIG["vocab_size"]
  prompts = {b: rng.integers(1, v, (b, shapes["prompt"])).astype(np.int32)
             for b in shapes["gen_batches"]}
  # Training data from a generator of its own: the same batch whichever generation batches run.
  rng = np.random.default_rng([seed, 1])
  b, p, c = shapes["train_batch"], shapes["train_prompt"], shapes["completion"]
  seq = rng.integers(1, v, (b, p + c)).astype(np.int32)
  # Completions of varied length (at least half), padded on the right.
  lengths = rng.integers(c // 2, c + 1, (b,))
  resp_mask = np.arange(c)[None, :] < lengths[:, None]
  seq[:, p:][~resp_mask] = PAD
  train = dict(
      input_ids=seq,
      attention_mask=np.concatenate([np.ones((b, p), bool), resp_mask], axis=1),
      response_mask=resp_mask,
      old_logp=(-7.6 + 0.1 * rng.standard_normal((b, c))).astype(np.float32),
      advantages=rng.standard_normal((b,)).astype(np.float32),
  )
  return prompts, train


# ----------------------------------------------------------------------------- ours


def _make_weights(path: str) -> None:
  """Random weights (numpy RNG: no per-shape threefry compiles), saved as an HF folder."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from flax import nnx

  from salt_jax.models import CausalLM, ModelConfig, save_pretrained

  config = ModelConfig(**CONFIG)
  graphdef, state = nnx.split(nnx.eval_shape(lambda: CausalLM(config, rngs=nnx.Rngs(0))))
  rng = np.random.default_rng(0)

  def fill(path_, x):
    name = str(getattr(path_[-1], "key", path_[-1]))
    base = 1.0 if name == "scale" else 0.0  # norm scales near 1, everything else near 0
    std = 0.1 if name in ("scale", "q_bias", "k_bias", "v_bias") else 0.05
    return jnp.asarray(base + std * rng.standard_normal(x.shape), x.dtype)

  state = jax.tree_util.tree_map_with_path(fill, state)
  save_pretrained(nnx.merge(graphdef, state), path)


def _bench_ours(weights: str, shapes: dict, repeats: int, eos: int | None,
                train_too: bool = True) -> dict:
  import jax
  import jax.numpy as jnp
  import numpy as np
  from flax import nnx

  from salt_jax.models import from_pretrained
  from salt_jax.sampling import Sampler

  model = from_pretrained(weights)
  prompts, train = _inputs(shapes)
  out = {"gen": {}, "gen_compile": {}}
  p, n = shapes["prompt"], shapes["new"]
  if eos is None:
    # An EOS id that greedy decoding never produces here, so every row makes `n` tokens in all
    # three frameworks (the same weights give the same greedy tokens).
    probe = Sampler(model, eos_token_ids=[PAD], pad_token_id=PAD, max_cache_len=p + n,
                    prompt_buckets=(p,))
    seen = set()
    for b, pr in prompts.items():
      r = probe([row.tolist() for row in pr], jax.random.key(0), max_new_tokens=n, greedy=True)
      for t in r.tokens:
        seen.update(t.tolist())
    eos = next(i for i in range(CONFIG["vocab_size"] - 1, 0, -1) if i not in seen)
  out["eos"] = eos
  sampler = Sampler(model, eos_token_ids=[eos], pad_token_id=PAD, max_cache_len=p + n,
                    prompt_buckets=(p,))
  for b, pr in prompts.items():
    rows = [row.tolist() for row in pr]
    res = {}

    def run():
      res["out"] = sampler(rows, jax.random.key(0), max_new_tokens=n, greedy=True)

    first, best = _best(run, repeats)
    made = sum(len(t) for t in res["out"].tokens)
    out["gen"][b] = made / best
    out["gen_compile"][b] = first
    out.setdefault("gen_tokens", {})[b] = [t.tolist() for t in res["out"].tokens[:2]]

  if not train_too:
    return out
  # Training: forward + backward of completion log-probs and the PPO loss (gradients only).
  from salt_jax.logprobs import token_logprobs
  try:
    from salt_jax import policy_loss
  except ImportError:  # older tree: the loss module exists but is not exported yet
    from salt_jax.loss import policy_loss

  tp = shapes["train_prompt"]
  ids = jnp.asarray(train["input_ids"])
  mask = jnp.asarray(train["attention_mask"])
  batch = dict(ids=ids, mask=mask, resp=jnp.asarray(train["response_mask"]),
               old=jnp.asarray(train["old_logp"]), adv=jnp.asarray(train["advantages"]))

  def loss_fn(m, bt):
    # Position t predicts token t+1; completion token j sits at tp + j, predicted at tp + j - 1.
    logp = token_logprobs(m, bt["ids"][:, :-1], bt["ids"][:, 1:], bt["mask"][:, :-1])
    logp = logp[:, tp - 1:]
    loss, _ = policy_loss(logp, bt["old"], bt["adv"], bt["resp"], clip_eps=CLIP,
                          dual_clip=DUAL_CLIP, loss_agg="token-mean")
    return loss

  step = nnx.jit(nnx.value_and_grad(loss_fn))

  def train_step():
    loss, grads = step(model, batch)
    jax.block_until_ready((loss, grads))

  first, best = _best(train_step, _train_repeats(repeats))
  completion_tokens = int(np.sum(train["response_mask"]))
  out["train"] = completion_tokens / best
  out["train_compile"] = first
  out["train_loss"] = float(step(model, batch)[0])

  micro = shapes["micro_rows"]
  if micro:
    # The same gradient, micro-batch by micro-batch (a lax.scan), each weighted by its tokens.
    from salt_jax import aggregate_weight, microbatched_value_and_grad
    graphdef, params = nnx.split(model)
    micro_step = jax.jit(microbatched_value_and_grad(
        lambda p, bt: loss_fn(nnx.merge(graphdef, p), bt), ids.shape[0] // micro,
        weight_fn=lambda bt: aggregate_weight(bt["resp"])))

    def train_step_micro():
      jax.block_until_ready(micro_step(params, batch))

    first, best = _best(train_step_micro, _train_repeats(repeats))
    out["train_micro"] = completion_tokens / best
    out["train_micro_loss"] = float(micro_step(params, batch)[0])
  return out


# ----------------------------------------------------------------------------- Tunix


class _IdTokenizer:
  """What Tunix's TokenizerAdapter needs: text is space-separated token ids."""

  def __init__(self, eos: int):
    self._eos = eos

  def encode(self, text, **kwargs):
    return [int(t) for t in text.split()]

  def decode(self, ids, **kwargs):
    return " ".join(str(int(i)) for i in ids)

  def bos_id(self):
    return None  # no BOS prepended

  def eos_id(self):
    return self._eos

  def pad_id(self):
    return PAD


def _bench_tunix(weights: str, shapes: dict, repeats: int, eos: int,
                 train_too: bool = True) -> dict:
  import types

  import jax
  import jax.numpy as jnp
  import numpy as np
  from flax import nnx
  from tunix.generate import sampler as sampler_lib
  from tunix.models.qwen2 import model as qwen_model
  from tunix.models.qwen2 import params as qwen_params
  from tunix.rl import common
  from tunix.rl.algo_core import grpo_loss_fn

  cfg = qwen_model.ModelConfig(
      num_layers=CONFIG["num_layers"], vocab_size=CONFIG["vocab_size"],
      embed_dim=CONFIG["hidden_size"], hidden_dim=CONFIG["intermediate_size"],
      num_heads=CONFIG["num_heads"], head_dim=CONFIG["head_dim"],
      num_kv_heads=CONFIG["num_kv_heads"], rope_theta=int(CONFIG["rope_theta"]),
      norm_eps=CONFIG["rms_norm_eps"], use_tied_embedding=False)
  mesh = jax.make_mesh((1, 1), ("fsdp", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  with mesh:
    model = qwen_params.create_model_from_safe_tensors(weights, cfg, mesh=mesh)
  prompts, train = _inputs(shapes)
  p, n = shapes["prompt"], shapes["new"]
  out = {"gen": {}, "gen_compile": {}}
  cache = sampler_lib.CacheConfig(cache_size=p + n, num_layers=cfg.num_layers,
                                  num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim)
  sampler = sampler_lib.Sampler(model, _IdTokenizer(eos), cache)
  for b, pr in prompts.items():
    texts = [" ".join(map(str, row.tolist())) for row in pr]
    res = {}

    def run():
      res["out"] = sampler(texts, max_generation_steps=n, max_prompt_length=p,
                           eos_tokens=[eos], temperature=0.0)

    with mesh:
      first, best = _best(run, repeats)
    made = sum(len(t) for t in res["out"].tokens)
    out["gen"][b] = made / best
    out["gen_compile"][b] = first
    out.setdefault("gen_tokens", {})[b] = [np.asarray(t).tolist() for t in res["out"].tokens[:2]]

  if not train_too:
    return out
  tp = shapes["train_prompt"]
  ids = train["input_ids"]
  example = common.TrainExample(
      prompt_ids=jnp.asarray(ids[:, :tp]),
      prompt_mask=jnp.ones((ids.shape[0], tp), jnp.int32),
      completion_ids=jnp.asarray(ids[:, tp:]),
      completion_mask=jnp.asarray(train["response_mask"], jnp.int32),
      advantages=jnp.asarray(train["advantages"]),
      ref_per_token_logps=None,
      old_per_token_logps=jnp.asarray(train["old_logp"]))
  algo = types.SimpleNamespace(beta=0.0, epsilon=CLIP, epsilon_high=CLIP, epsilon_c=DUAL_CLIP,
                               loss_algo="grpo", loss_agg_mode="token-mean", temperature=1.0)

  def loss_fn(m, ex):
    return grpo_loss_fn(m, ex, algo, PAD, eos)[0]

  step = nnx.jit(nnx.value_and_grad(loss_fn))

  def train_step():
    jax.block_until_ready(step(model, example))

  with mesh:
    first, best = _best(train_step, _train_repeats(repeats))
    out["train_loss"] = float(step(model, example)[0])
  completion_tokens = int(np.sum(train["response_mask"]))
  out["train"] = completion_tokens / best
  out["train_compile"] = first

  micro = shapes["micro_rows"]
  if micro:
    # Gradient accumulation as salt-jax does it: a lax.scan over contiguous micro-batches, each
    # micro-batch's token-mean loss weighted by its share of the completion tokens.
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    n = ids.shape[0] // micro

    def micro_grads(params, ex):
      total = jnp.sum(ex.completion_mask)
      mbs = jax.tree.map(lambda x: x.reshape(n, micro, *x.shape[1:]), ex)

      def body(acc, mb):
        loss, g = jax.value_and_grad(
            lambda p: loss_fn(nnx.merge(graphdef, p, rest), mb))(params)
        w = jnp.sum(mb.completion_mask) / total
        return (acc[0] + w * loss, jax.tree.map(lambda a, b: a + w * b, acc[1], g)), None

      init = (jnp.float32(0), jax.tree.map(jnp.zeros_like, params))
      return jax.lax.scan(body, init, mbs)[0]

    micro_step = jax.jit(micro_grads)

    def train_step_micro():
      jax.block_until_ready(micro_step(params, example))

    with mesh:
      _, best = _best(train_step_micro, _train_repeats(repeats))
      out["train_micro_loss"] = float(micro_step(params, example)[0])
    out["train_micro"] = completion_tokens / best
  return out


# ----------------------------------------------------------------------------- PyTorch + verl


def _bench_torch(weights: str, shapes: dict, repeats: int, eos: int,
                 train_too: bool = True) -> dict:
  import numpy as np
  import torch
  from transformers import AutoModelForCausalLM

  torch.set_num_threads(2)
  model = AutoModelForCausalLM.from_pretrained(weights, dtype=torch.float32,
                                               attn_implementation="sdpa").eval()
  prompts, train = _inputs(shapes)
  n = shapes["new"]
  out = {"gen": {}, "gen_compile": {}}
  for b, pr in prompts.items():
    ids = torch.as_tensor(pr, dtype=torch.long)
    mask = torch.ones_like(ids)
    res = {}

    def run():
      with torch.inference_mode():
        res["out"] = model.generate(ids, attention_mask=mask, max_new_tokens=n, do_sample=False,
                                    eos_token_id=eos, pad_token_id=PAD)

    first, best = _best(run, repeats)
    new = res["out"][:, ids.shape[1]:].numpy()
    made = 0
    for row in new:
      hit = np.flatnonzero(row == eos)
      made += int(hit[0]) + 1 if hit.size else len(row)
    out["gen"][b] = made / best
    out["gen_compile"][b] = first
    out.setdefault("gen_tokens", {})[b] = new[:2].tolist()

  if not train_too:
    return out
  try:
    from verl.trainer.ppo.core_algos import compute_policy_loss
  except ImportError as e:
    out["train_error"] = f"verl not importable: {e}"
    return out

  model.train()
  tp = shapes["train_prompt"]
  ids = torch.as_tensor(train["input_ids"], dtype=torch.long)
  mask = torch.as_tensor(train["attention_mask"], dtype=torch.long)
  resp = torch.as_tensor(train["response_mask"], dtype=torch.float32)
  old = torch.as_tensor(train["old_logp"])
  adv = torch.as_tensor(train["advantages"])[:, None].expand_as(old)
  res = {}

  def forward_backward(rows: slice) -> float:
    """Backward of this slice's token-mean loss weighted by its share of the tokens (verl's
    gradient accumulation over micro-batches); gradients add up in .grad."""
    logits = model(input_ids=ids[rows], attention_mask=mask[rows]).logits[:, tp - 1:-1].float()
    logp = torch.log_softmax(logits, dim=-1).gather(-1, ids[rows, tp:, None])[..., 0]
    loss = compute_policy_loss(old_log_prob=old[rows], log_prob=logp, advantages=adv[rows],
                               response_mask=resp[rows], cliprange=CLIP, clip_ratio_c=DUAL_CLIP,
                               loss_agg_mode="token-mean")[0]
    loss = loss * resp[rows].sum() / resp.sum()
    loss.backward()
    return float(loss)

  def train_step(micro: int = 0):
    model.zero_grad(set_to_none=True)
    n = ids.shape[0]
    res["loss"] = sum(forward_backward(slice(s, s + (micro or n))) for s in range(0, n, micro or n))

  completion_tokens = int(np.sum(train["response_mask"]))
  first, best = _best(train_step, _train_repeats(repeats))
  out["train"] = completion_tokens / best
  out["train_compile"] = first
  out["train_loss"] = res["loss"]
  if shapes["micro_rows"]:
    _, best = _best(lambda: train_step(shapes["micro_rows"]), _train_repeats(repeats))
    out["train_micro"] = completion_tokens / best
    out["train_micro_loss"] = res["loss"]
  return out


# ----------------------------------------------------------------------------- driver


def _peer(python: str, name: str, weights: str, args, eos: int, *, gen: bool, train: bool) -> dict:
  if not os.path.exists(python):
    return {"error": f"{python} missing (see the setup commands at the top of this file)"}
  cmd = [python, os.path.abspath(__file__), "--peer", name, "--weights", weights,
         "--repeats", str(args.repeats), "--eos", str(eos)] + (["--quick"] if args.quick else []) \
      + ([] if train else ["--no-train"]) + ([] if gen else ["--no-gen"]) \
      + ["--micro-rows", str(args.micro_rows)]
  env = dict(os.environ, PYTHONPATH="")  # the peers must not see this checkout's salt_jax
  proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd="/tmp")
  if proc.returncode != 0:
    return {"error": f"{name} exited {proc.returncode}: {proc.stderr[-2000:]}"}
  return json.loads(proc.stdout.strip().splitlines()[-1])


def _merge(rounds: list[dict], train: dict) -> dict:
  """One framework's figures: each generation batch's best round, the training run's figures.

  The first error wins; compile times and greedy tokens come from the first round."""
  for res in rounds + [train]:
    if "error" in res:
      return {"error": res["error"]}
  if not rounds:
    return dict(train)
  out = {k: v for k, v in train.items() if k not in ("gen", "gen_compile", "gen_tokens")}
  out.update(gen_compile=rounds[0]["gen_compile"], gen_tokens=rounds[0].get("gen_tokens", {}))
  out["gen"] = {b: max(r["gen"][b] for r in rounds) for b in rounds[0]["gen"]}
  out["gen_rounds"] = {b: [r["gen"][b] for r in rounds] for b in rounds[0]["gen"]}
  return out


def _fmt(x):
  return f"{x:,.0f}" if isinstance(x, (int, float)) else "n/a"


def _table(shapes: dict, ours: dict, tunix: dict, torch_: dict) -> str:
  rows = []
  head = ("work", "salt-jax", "Tunix 0.1.7", "torch+transformers", "ours/Tunix", "ours/torch")
  p, n = shapes["prompt"], shapes["new"]

  def ratio(a, b):
    return f"{a / b:.2f}x" if isinstance(a, (int, float)) and isinstance(b, (int, float)) \
        else "n/a"

  for b in shapes["gen_batches"]:
    o = ours.get("gen", {}).get(b)
    t = tunix.get("gen", {}).get(str(b), tunix.get("gen", {}).get(b))
    pt = torch_.get("gen", {}).get(str(b), torch_.get("gen", {}).get(b))
    rows.append((f"generate b={b} prompt={p} new={n} (new tok/s)", _fmt(o), _fmt(t), _fmt(pt),
                 ratio(o, t), ratio(o, pt)))
  o, t, pt = ours.get("train"), tunix.get("train"), torch_.get("train")
  rows.append((f"train fwd+bwd b={shapes['train_batch']} {shapes['train_prompt']}+"
               f"{shapes['completion']} (completion tok/s)", _fmt(o), _fmt(t),
               _fmt(pt) + (" (verl loss)" if pt else ""), ratio(o, t), ratio(o, pt)))
  if shapes["micro_rows"]:
    o, t, pt = ours.get("train_micro"), tunix.get("train_micro"), torch_.get("train_micro")
    rows.append((f"  same, in micro-batches of {shapes['micro_rows']} rows", _fmt(o), _fmt(t),
                 _fmt(pt), ratio(o, t), ratio(o, pt)))
  widths = [max(len(str(r[i])) for r in rows + [head]) for i in range(len(head))]
  line = lambda r: "| " + " | ".join(str(c).ljust(w) for c, w in zip(r, widths)) + " |"  # noqa
  sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
  return "\n".join([line(head), sep] + [line(r) for r in rows])


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--quick", action="store_true", help="small shapes, for a smoke test")
  ap.add_argument("--repeats", type=int, default=None,
                  help="timed generation calls per figure, best kept (default 10; training: 3)")
  ap.add_argument("--skip", default="", help="comma list of peers to skip: tunix,torch")
  ap.add_argument("--no-train", action="store_true", help="generation only")
  ap.add_argument("--rounds", type=int, default=None,
                  help="generation rounds, the three frameworks one after another in each, so a "
                       "slow spell of the machine hits all of them (default 3; --quick: 1)")
  ap.add_argument("--no-gen", action="store_true", help=argparse.SUPPRESS)
  ap.add_argument("--micro-rows", type=int, default=None,
                  help="rows per micro-batch of the second training row (0: skip that row)")
  ap.add_argument("--peer", default=None, help=argparse.SUPPRESS)
  ap.add_argument("--weights", default=None, help=argparse.SUPPRESS)
  ap.add_argument("--eos", type=int, default=None, help=argparse.SUPPRESS)
  args = ap.parse_args()
  if args.repeats is None:
    args.repeats = 1 if args.quick else 10
  if args.rounds is None:
    args.rounds = 1 if args.quick else 3
  if args.rounds < 1:
    ap.error("--rounds must be >= 1")
  shapes = _shapes(args.quick)
  if args.micro_rows is not None:
    if args.micro_rows < 0 or (args.micro_rows and shapes["train_batch"] % args.micro_rows):
      ap.error(f"--micro-rows must divide the training batch ({shapes['train_batch']}) or be 0")
    shapes["micro_rows"] = args.micro_rows
  args.micro_rows = shapes["micro_rows"]

  if args.no_gen:
    shapes["gen_batches"] = []
  if args.peer:  # a subprocess in a peer's venv: print one JSON line
    fn = {"tunix": _bench_tunix, "torch": _bench_torch}[args.peer]
    print(json.dumps(fn(args.weights, shapes, args.repeats, args.eos, not args.no_train)))
    return

  sys.path.insert(0, ROOT)
  skip = set(filter(None, args.skip.split(",")))
  torch_py = VERL_PY if os.path.exists(VERL_PY) else sys.executable
  peers = [(name, py) for name, py in (("tunix", TUNIX_PY), ("torch", torch_py))
           if name not in skip]
  gen = {"salt-jax": [], **{name: [] for name, _ in peers}}
  train = {name: {} for name in gen}
  with tempfile.TemporaryDirectory() as weights:
    _make_weights(weights)
    eos = None
    # Generation first, in rounds: the machine's speed drifts over minutes, and a framework timed
    # alone in a slow spell would lose by more than its code deserves.
    for _ in range(args.rounds if shapes["gen_batches"] else 0):
      res = _bench_ours(weights, shapes, args.repeats, eos, train_too=False)
      eos = res["eos"]
      gen["salt-jax"].append(res)
      for name, py in peers:
        gen[name].append(_peer(py, name, weights, args, eos, gen=True, train=False))
    if not args.no_train:
      train_shapes = dict(shapes, gen_batches=[])
      train["salt-jax"] = _bench_ours(weights, train_shapes, args.repeats, eos or PAD)
      for name, py in peers:
        train[name] = _peer(py, name, weights, args, eos or PAD, gen=False, train=True)
  ours, tunix, torch_ = (_merge(gen[name], train[name]) if name in gen else {}
                         for name in ("salt-jax", "tunix", "torch"))

  print(_table(shapes, ours, tunix, torch_))
  print()
  for name, res in (("salt-jax", ours), ("tunix", tunix), ("torch", torch_)):
    if "error" in res or "train_error" in res:
      print(f"{name}: {res.get('error') or res.get('train_error')}")
      continue
    if res:
      comp = {k: f"{v:.1f}s" for k, v in res.get("gen_compile", {}).items()}
      print(f"{name}: first call (compile) per batch {comp}, train first step "
            f"{res.get('train_compile', 0):.1f}s, train loss {res.get('train_loss', 0):.6f}"
            + (f", micro-batched {res['train_micro_loss']:.6f}" if "train_micro_loss" in res
               else ""))
  if args.rounds > 1:
    for b in shapes["gen_batches"]:
      per = [f"{name} " + " / ".join(_fmt(x) for x in res["gen_rounds"].get(str(b),
                                                                           res["gen_rounds"].get(b)))
             for name, res in (("salt-jax", ours), ("tunix", tunix), ("torch", torch_))
             if "gen_rounds" in res]
      print(f"generate b={b}, new tok/s in each round: " + "; ".join(per))
  # Same weights, same greedy decoding: the first rows' tokens should agree across frameworks.
  for b in shapes["gen_batches"]:
    ref = ours.get("gen_tokens", {}).get(b)
    for name, res in (("tunix", tunix), ("torch", torch_)):
      got = res.get("gen_tokens", {}).get(str(b)) if res else None
      if ref and got:
        agree = sum(x == y for r, g in zip(ref, got) for x, y in zip(r, g))
        total = sum(len(r) for r in ref)
        print(f"greedy tokens, batch {b}, first 2 rows: salt-jax vs {name} agree on "
              f"{agree}/{total}")
  print(f"\ncommand: python benchmarks/{os.path.basename(__file__)} "
        + " ".join(sys.argv[1:]) + f"   (repeats={args.repeats}, rounds={args.rounds}, best kept)")


if __name__ == "__main__":
  main()
