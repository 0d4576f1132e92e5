"""Qwen2.5-1.5B-shaped speed on one accelerator, against the chip's own limits (bf16, random weights).

  python benchmarks/bench_gpu.py              # on a GPU or TPU: about 3 minutes
  python benchmarks/bench_gpu.py --quick      # tiny shapes: checks the script on a CPU

Two figures:
  decode   new tokens/s of `salt_jax.sampling.Sampler` at batch 128 (greedy, prompt 256, 128 new
           tokens), against the memory-bandwidth bound: every decode step reads all weights and
           the batch's KV cache once, so tokens/s <= B * bandwidth / (weight bytes + cache bytes).
  train    forward+backward tokens/s of token log-probs and the PPO loss (batch 8 x 2,048 tokens),
           as model FLOPs utilisation: (6 * matmul params + 12 * layers * D * L) FLOPs a token,
           divided by the chip's dense bf16 peak.
The chip's peak bf16 FLOP/s and memory bandwidth come from a table of known chips by
`device_kind`, or from --peak-tflops / --bandwidth-tbs.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Qwen2.5-1.5B-Instruct's shape.
QWEN25_1_5B = dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_layers=28,
                   num_heads=12, num_kv_heads=2, head_dim=128, rope_theta=1_000_000.0,
                   tie_word_embeddings=True, attention_bias=True)
QUICK = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
             num_kv_heads=2, head_dim=16, tie_word_embeddings=True, attention_bias=True)

# Dense bf16 peak (TFLOP/s) and HBM bandwidth (TB/s) by device_kind substring (vendor sheets).
CHIPS = {"H200": (989.0, 4.8), "H100": (989.0, 3.35), "A100": (312.0, 2.0), "L4": (121.0, 0.3),
         "A10": (125.0, 0.6), "TPU v4": (275.0, 1.2), "TPU v5 lite": (197.0, 0.82),
         "TPU v5e": (197.0, 0.82), "TPU v5p": (459.0, 2.76), "TPU v5": (459.0, 2.76),
         "TPU v6": (918.0, 1.64)}


def chip_limits(kind: str, peak_tflops, bandwidth_tbs):
  """(peak FLOP/s, bytes/s) for `kind`, the flags winning; None where unknown."""
  known = next((v for k, v in CHIPS.items() if k.lower() in kind.lower()), (None, None))
  peak = peak_tflops if peak_tflops is not None else known[0]
  bw = bandwidth_tbs if bandwidth_tbs is not None else known[1]
  return (peak * 1e12 if peak else None), (bw * 1e12 if bw else None)


def best_seconds(fn, repeats):
  fn()  # compile
  best = float("inf")
  for _ in range(repeats):
    t0 = time.perf_counter()
    fn()
    best = min(best, time.perf_counter() - t0)
  return best


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--quick", action="store_true", help="tiny shapes (a CPU smoke test)")
  ap.add_argument("--repeats", type=int, default=3)
  ap.add_argument("--peak-tflops", type=float, default=None)
  ap.add_argument("--bandwidth-tbs", type=float, default=None)
  args = ap.parse_args(argv)
  # pylint: disable=import-outside-toplevel
  import jax
  import jax.numpy as jnp
  import numpy as np
  from flax import nnx

  from salt_jax import policy_loss
  from salt_jax.logprobs import token_logprobs
  from salt_jax.models import CausalLM, ModelConfig
  from salt_jax.sampling import Sampler

  shape = QUICK if args.quick else QWEN25_1_5B
  b_dec, prompt, new = (8, 16, 16) if args.quick else (128, 256, 128)
  b_tr, seq = (2, 64) if args.quick else (8, 2048)
  dev = jax.devices()[0]
  peak, bw = chip_limits(dev.device_kind, args.peak_tflops, args.bandwidth_tbs)
  cfg = ModelConfig(**shape)
  model = CausalLM(cfg, rngs=nnx.Rngs(0), dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
  params = nnx.state(model, nnx.Param)
  n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
  weight_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
  # Matmul parameters: all but the embedding lookup (the tied head is a matmul, so counted once).
  matmul_params = n_params - (0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size)
  print(f"device {dev.device_kind} ({dev.platform}); {n_params / 1e9:.3f} B params, "
        f"{weight_bytes / 2**30:.2f} GiB bf16; peak {peak and peak / 1e12} TFLOP/s, "
        f"bandwidth {bw and bw / 1e12} TB/s", flush=True)

  # ---- decode
  rng = np.random.default_rng(0)
  prompts = [rng.integers(1, cfg.vocab_size, prompt).tolist() for _ in range(b_dec)]
  sampler = Sampler(model, eos_token_ids=[0], pad_token_id=0, max_cache_len=prompt + new,
                    prompt_buckets=(prompt,), batch_buckets=(b_dec,))
  key = jax.random.key(0)
  call = lambda n: sampler(prompts, key, max_new_tokens=n, greedy=True)  # noqa: E731
  t_all = best_seconds(lambda: call(new), args.repeats)
  t_one = best_seconds(lambda: call(1), args.repeats)
  dec = b_dec * (new - 1) / max(t_all - t_one, 1e-9)
  kv_bytes = 2 * cfg.num_layers * b_dec * (prompt + new / 2) * cfg.num_kv_heads * cfg.head_dim * 2
  bound = b_dec * bw / (weight_bytes + kv_bytes) if bw else None
  print(f"decode  batch {b_dec}, prompt {prompt}, {new} new: {dec:,.0f} tokens/s"
        + (f" = {100 * dec / bound:.1f}% of the bandwidth bound {bound:,.0f}" if bound else
           " (bandwidth unknown: pass --bandwidth-tbs)"), flush=True)

  # ---- train: forward + backward of log-probs and the PPO loss
  ids = jnp.asarray(rng.integers(1, cfg.vocab_size, (b_tr, seq)), jnp.int32)
  mask = jnp.ones((b_tr, seq - 1), bool)
  old = jnp.full((b_tr, seq - 1), -5.0, jnp.float32)
  adv = jnp.asarray(rng.standard_normal((b_tr, seq - 1)), jnp.float32)

  def loss_fn(m):
    logp = token_logprobs(m, ids[:, :-1], ids[:, 1:], mask)
    return policy_loss(logp, old, adv, mask, clip_eps=0.2)[0]

  step = nnx.jit(nnx.value_and_grad(loss_fn))
  t = best_seconds(lambda: jax.block_until_ready(step(model)), args.repeats)
  tokens = b_tr * (seq - 1)
  flops_per_token = 6 * matmul_params + 12 * cfg.num_layers * cfg.num_heads * cfg.head_dim * seq
  mfu = tokens / t * flops_per_token / peak if peak else None
  print(f"train   batch {b_tr} x {seq}: {tokens / t:,.0f} tokens/s"
        + (f", MFU {100 * mfu:.1f}% of {peak / 1e12:.0f} TFLOP/s" if mfu else
           " (peak unknown: pass --peak-tflops)"), flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
