"""Where a decode step's time goes: one token for each of B rows through a SmolLM2-shaped policy.

A decode step must read every weight once and each row's filled cache; at the machine's read
bandwidth that is its bound (`bench_rollout_engines.py` reports a whole call against it). This
script splits a step (`CausalLM.forward_cached` of one token, jitted alone, cache donated) by
varying one thing at a time, each in this process:
  layers     the model with 1 and with all of its layers: the per-layer cost, and the rest (the
             embedding, the final norm and the vocabulary projection)
  slots      the cache at 128 slots and at --slots: the cost of a filled slot
  dots       the layer's seven projections alone on [B, D] rows (`jnp.einsum` as the model's),
             and the same weights as four: q|k|v and gate|up concatenated (fewer, wider dots)
  attention  a layer's attention alone over the filled cache, as the model computes it (the
             batched dots of `Attention._attend_rows`) and as multiply-and-sum
  sample     the sampler's token choice on [B, V] logits (`sampling._choose`, temperature 1)
and prints each with its bound (bytes / the read bandwidth measured here) and the compiled
step's instruction count.

  python benchmarks/bench_decode_step.py                     # SmolLM2 shapes, f32, B = 8
  python benchmarks/bench_decode_step.py --quick             # tiny shapes: checks the script
  XLA_FLAGS=... python benchmarks/bench_decode_step.py       # the same under an XLA flag
  python benchmarks/bench_decode_step.py --profile DIR       # + the full step's threads and ops
"""

from __future__ import annotations

import argparse
import os
import platform
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from bench_gpu import best_seconds  # noqa: E402
from bench_rollout_engines import SMOLLM2, cache_bytes, measure_limits, weight_bytes  # noqa: E402
from salt_jax.metrics import write_json  # noqa: E402
from salt_jax.models import CausalLM, ModelConfig  # noqa: E402
from salt_jax.sampling import _choose, _Knobs, _Mode  # noqa: E402

TINY = dict(SMOLLM2, vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2,
            num_heads=4, num_kv_heads=2, head_dim=16)


def best_ms(fn, *args, repeats: int) -> float:
  """Best of `repeats` timed calls after a compiling one, in ms."""
  return best_seconds(lambda: jax.block_until_ready(fn(*args)), repeats) * 1e3


def step_program(model: CausalLM, rows: int, slots: int, filled: int):
  """A jitted decode step of `model` at slot `filled` of a `slots`-slot cache, and its inputs."""
  graphdef, state = nnx.split(model)
  cache = model.init_cache(rows, slots)
  mask = jnp.zeros((rows, slots), bool).at[:, :filled + 1].set(True)

  def step(state, cache, tokens, positions, mask):
    m = nnx.merge(graphdef, state)
    logits, cache = m.forward_cached(tokens, positions, cache, jnp.int32(filled), mask)
    return logits[:, -1], cache

  fn = jax.jit(step, donate_argnums=(1,))
  tokens = jnp.ones((rows, 1), jnp.int32)
  positions = jnp.full((rows, 1), filled, jnp.int32)
  box = {"cache": cache}

  def call(*_):
    logits, box["cache"] = fn(state, box["cache"], tokens, positions, mask)
    return logits
  return call, entry_instructions(fn.lower(state, cache, tokens, positions, mask).compile())


def entry_instructions(compiled) -> int:
  """Instructions of the compiled program's entry computation: what the CPU runtime dispatches
  one by one (a fusion is one; parameters and tuples are not work)."""
  lines, inside = 0, False
  for line in compiled.as_text().splitlines():
    if line.startswith("ENTRY"):
      inside = True
    elif inside and line.startswith("}"):
      break
    elif inside and " = " in line and " parameter(" not in line and " tuple(" not in line \
            and " get-tuple-element(" not in line:
      lines += 1
  return lines


def config_of(shape: dict, layers: int, attention_impl=None) -> ModelConfig:
  return ModelConfig(**{**shape, "num_layers": layers, "attention_impl": attention_impl})


def step_bytes(config: ModelConfig, rows: int, filled: int, itemsize: int) -> float:
  """What a decode step must read: every weight once and each row's filled cache."""
  return weight_bytes(config, itemsize) + cache_bytes(config, rows * filled, itemsize)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--rows", type=int, default=8)
  p.add_argument("--slots", type=int, default=768, help="cache slots of the full case")
  p.add_argument("--filled", type=int, default=672, help="slots holding tokens (prompt + new)")
  p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
  p.add_argument("--repeats", type=int, default=10)
  p.add_argument("--attention-impl", default=None,
                 help="a `salt_jax.models.ATTENTION_IMPLS` name (default: the machine's)")
  p.add_argument("--quick", action="store_true")
  p.add_argument("--out", default=None, help="also write the figures here as JSON")
  p.add_argument("--profile", default=None, metavar="DIR",
                 help="also trace --repeats calls of the full step into DIR and report each XLA "
                      "thread's busy time and the ops' (benchmarks/xla_cpu_profile.py)")
  args = p.parse_args(argv)
  if args.profile:  # before the backend starts: XLA reads its flags once
    import xla_cpu_profile  # pylint: disable=import-outside-toplevel
    xla_cpu_profile.enable_tracing()
  shape = TINY if args.quick else SMOLLM2
  if args.quick:
    args.slots, args.filled, args.repeats = 64, 40, 2
  dtype = getattr(jnp, args.dtype)
  item = jnp.dtype(dtype).itemsize
  full_layers, rows = shape["num_layers"], args.rows
  bw = measure_limits(config_of(shape, 1), 1, 8, jnp.float32)["read_bytes_per_s"]
  out = {"device": jax.devices()[0].device_kind, "cpu": platform.processor() or platform.machine(),
         "xla_flags": os.environ.get("XLA_FLAGS", ""), "rows": rows,
         "attention_impl": args.attention_impl, "dtype": args.dtype,
         "read_GBps": bw / 1e9, "cases": {}}

  def case(name, layers, slots, filled, profile=False):
    config = config_of(shape, layers, args.attention_impl)
    model = CausalLM(config, rngs=nnx.Rngs(0), dtype=dtype, param_dtype=dtype)
    call, n_instr = step_program(model, rows, slots, filled)
    ms = best_ms(call, repeats=args.repeats)
    bound = step_bytes(config, rows, filled, item) / bw * 1e3
    out["cases"][name] = {"ms": ms, "bound_ms": bound, "instructions": n_instr}
    print(f"{name:28s} {ms:8.2f} ms  bound {bound:6.2f} ms ({bound / ms:5.1%})  "
          f"{n_instr} dispatched ops", flush=True)
    if profile:
      out["profile"] = xla_cpu_profile.profile_calls(call, args.repeats, args.profile)

  case(f"step, {full_layers} layers", full_layers, args.slots, args.filled, bool(args.profile))
  case(f"step, {full_layers} layers, 128 slots", full_layers, 128, min(args.filled, 120))
  case("step, 1 layer", 1, args.slots, args.filled)
  c = out["cases"]
  per_layer = (c[f"step, {full_layers} layers"]["ms"] - c["step, 1 layer"]["ms"]) / (
      full_layers - 1) if full_layers > 1 else float("nan")
  print(f"per layer {per_layer:.3f} ms; the rest (embedding, head, one layer) "
        f"{c['step, 1 layer']['ms']:.2f} ms")
  out["per_layer_ms"] = per_layer

  d, f, n, k, h = (shape["hidden_size"], shape["intermediate_size"], shape["num_heads"],
                   shape["num_kv_heads"], shape["head_dim"])
  key = jax.random.key(0)
  ws = [jax.random.normal(key, s, dtype) for s in ((d, n, h), (d, k, h), (d, k, h), (n, h, d),
                                                    (d, f), (d, f), (f, d))]
  x = jax.random.normal(key, (rows, d), dtype)

  def dots(x, ws):
    q = jnp.einsum("bd,dnh->bnh", x, ws[0])
    kk = jnp.einsum("bd,dkh->bkh", x, ws[1])
    v = jnp.einsum("bd,dkh->bkh", x, ws[2])
    o = jnp.einsum("bnh,nhd->bd", q, ws[3])
    g = jnp.einsum("bd,df->bf", x, ws[4]) * jnp.einsum("bd,df->bf", x, ws[5])
    return o + jnp.einsum("bf,fd->bd", g, ws[6]) + kk.sum() + v.sum()
  def fused_dots(x, ws):
    qkv = x @ ws[0]
    q, kk, v = qkv[:, :n * h], qkv[:, n * h:(n + k) * h], qkv[:, (n + k) * h:]
    o = q @ ws[1]
    gu = x @ ws[2]
    return o + (gu[:, :f] * gu[:, f:]) @ ws[3] + kk.sum() + v.sum()
  fused = [jnp.concatenate([w.reshape(d, -1) for w in ws[:3]], axis=1), ws[3].reshape(n * h, d),
           jnp.concatenate(ws[4:6], axis=1), ws[6]]
  bound = sum(w.size for w in ws) * item / bw * 1e3
  for label, name, fn, args_ in (("a layer: 7 projections", "layer projections", dots, ws),
                                 ("a layer: 4 fused projections", "layer projections fused",
                                  fused_dots, fused)):
    ms = best_ms(jax.jit(fn), x, args_, repeats=args.repeats)
    print(f"{label:28s} {ms:8.3f} ms  bound {bound:6.3f} ms ({bound / ms:5.1%})")
    out["cases"][name] = {"ms": ms, "bound_ms": bound}

  # A layer's attention over the filled cache: q [B, K, G, H] against keys [B, K, H, S] and
  # values [B, K, S, H] (the cache's layouts), masked softmax between.
  g, s = n // k, args.slots
  q = jax.random.normal(key, (rows, k, g, h), dtype)
  keys_ = jax.random.normal(key, (rows, k, h, s), dtype)
  values = jax.random.normal(key, (rows, k, s, h), dtype)
  valid = jnp.arange(s) < args.filled

  def attention(q, keys_, values, by_sum):
    if by_sum:
      scores = jnp.sum(q[..., None] * keys_[:, :, None], axis=-2)
    else:
      scores = jnp.einsum("bkgh,bkhs->bkgs", q, keys_)
    probs = jax.nn.softmax(jnp.where(valid, scores * h ** -0.5, -1e30), axis=-1)
    if by_sum:
      return jnp.sum(probs[..., None] * values[:, :, None], axis=-2)
    return jnp.einsum("bkgs,bksh->bkgh", probs, values)
  bound = cache_bytes(config_of(shape, 1), rows * args.filled, item) / bw * 1e3
  for label, name, by_sum in (("a layer's attention: dots", "layer attention", False),
                              ("a layer's attention: sums", "layer attention by sum", True)):
    ms = best_ms(jax.jit(lambda *a, by_sum=by_sum: attention(*a, by_sum)), q, keys_, values,
                 repeats=args.repeats)
    print(f"{label:28s} {ms:8.3f} ms  bound {bound:6.3f} ms ({bound / ms:5.1%})")
    out["cases"][name] = {"ms": ms, "bound_ms": bound}

  v = shape["vocab_size"]
  logits = jax.random.normal(key, (rows, v), jnp.float32)
  keys = jax.random.split(key, rows)
  knobs = _Knobs(jnp.float32(1.0), jnp.float32(1.0), jnp.int32(v), jnp.int32(64))
  for label, mode in (("sample (temperature 1)", _Mode(False, False)),
                      ("sample (top-p/top-k)", _Mode(False, True)),
                      ("sample (greedy)", _Mode(True, False))):
    fn = jax.jit(lambda lg, ks, mode=mode: _choose(lg, ks, jnp.int32(3), knobs, mode))
    ms = best_ms(fn, logits, keys, repeats=args.repeats)
    print(f"{label:28s} {ms:8.3f} ms")
    out["cases"][label] = {"ms": ms}
  if args.profile:
    print(f"\nstep, {full_layers} layers, under the profiler")
    xla_cpu_profile.print_summary(out["profile"])
  if args.out:
    write_json(args.out, out)
  return 0


if __name__ == "__main__":
  sys.exit(main())
