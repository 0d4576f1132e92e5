"""Tests for salt_jax.sampling: the KV-cache sampler against full forward passes of the model.

One tiny model and one sampler (batch bucket 4, prompt bucket 8) serve every test, so the whole
file compiles a handful of programs: greedy prefill + decode, the plain and the filtered sampling
decode, and the two on a 4x2 mesh.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from salt_jax.models import CausalLM, ModelConfig, shard_model
from salt_jax import sampling
from salt_jax.sampling import Sampler, SampleOutput
from salt_jax.sharding import make_mesh

CONFIG = ModelConfig.tiny(vocab_size=96)
PAD = 0
CACHE = 32
PROMPT_A = [5, 17, 42, 8, 33, 61, 2]
PROMPTS = [PROMPT_A, [11, 90], [7, 7, 30, 44, 81]]
MAX_NEW = 12


def _model():
  """The tiny model with all parameters N(0, 0.6): peaked, varied next-token distributions.

  Built abstractly and filled from numpy: jax's random initializers would compile one threefry
  program per parameter shape, which takes longer on this CPU than every sampler test together.
  """
  graphdef, state = nnx.split(nnx.eval_shape(lambda: CausalLM(CONFIG, rngs=nnx.Rngs(0))))
  rng = np.random.default_rng(0)
  state = jax.tree.map(lambda x: jnp.asarray(0.6 * rng.standard_normal(x.shape), x.dtype), state)
  return nnx.merge(graphdef, state)


@nnx.jit
def _full_forward(model, ids, mask):
  return jax.nn.log_softmax(model(ids, attention_mask=mask), axis=-1)


def _log_softmax_full(model, seq):
  """log_softmax of a full forward pass over one sequence: f32[len, V].

  The sequence is right-padded to CACHE so one compiled program serves every length; causal
  attention keeps the padding from touching the real positions.
  """
  ids = np.full((1, CACHE), PAD, np.int32)
  ids[0, :len(seq)] = seq
  return np.asarray(_full_forward(model, ids, _mask(len(seq))))[0, :len(seq)]


def _mask(n):
  m = np.zeros((1, CACHE), bool)
  m[0, :n] = True
  return m


def _first_new(ref, lo):
  """Indices i >= lo whose token does not occur before i."""
  return [i for i in range(lo, len(ref)) if ref[i] not in ref[:i]]


def _decode(ids):
  return "".join(f"w{i} " for i in ids)


@pytest.fixture(scope="module")
def setup():
  """(model, sampler, reference greedy continuation of PROMPT_A, eos id, its index there)."""
  model = _model()
  # Reference greedy decoding by full forward passes, with no EOS: the sampler must reproduce it.
  ref = []
  for _ in range(MAX_NEW):
    ref.append(int(np.argmax(_log_softmax_full(model, PROMPT_A + ref)[-1])))
  fresh = _first_new(ref, 6)
  assert fresh, f"the reference run {ref} repeats itself; pick another seed"
  eos_at = fresh[0]
  sampler = Sampler(model, eos_token_ids=[ref[eos_at]], pad_token_id=PAD, max_cache_len=CACHE,
                    prompt_buckets=(8,), batch_buckets=(4,), stop_check_every=4)
  return model, sampler, ref, ref[eos_at], eos_at


def _cut_at_eos(tokens, eos):
  tokens = list(tokens)
  return tokens[:tokens.index(eos) + 1] if eos in tokens else tokens


def test_greedy_is_argmax_of_full_forward_and_logprobs_match(setup):
  model, sampler, ref, eos, eos_at = setup
  out = sampler(PROMPTS, jax.random.key(0), max_new_tokens=MAX_NEW, greedy=True)
  assert isinstance(out, SampleOutput) and len(out.tokens) == len(PROMPTS)
  np.testing.assert_array_equal(out.tokens[0], ref[:eos_at + 1])
  for prompt, toks, lp, plp, reason in zip(PROMPTS, out.tokens, out.logprobs,
                                           out.policy_logprobs, out.finish_reasons):
    assert toks.dtype == np.int32 and lp.dtype == np.float32 and len(toks) >= 1
    full = _log_softmax_full(model, prompt + toks.tolist())
    steps = full[len(prompt) - 1:len(prompt) - 1 + len(toks)]  # predicts each new token
    np.testing.assert_array_equal(np.argmax(steps, axis=-1), toks)
    np.testing.assert_allclose(plp, steps[np.arange(len(toks)), toks], atol=1e-5)
    np.testing.assert_array_equal(lp, 0.0)  # greedy: a point mass
    assert reason == ("eos" if toks[-1] == eos else "length")
    assert reason == "eos" or len(toks) == MAX_NEW


def test_the_default_attention_is_cpu_chunked_on_a_cpu():
  from salt_jax.models import default_attention_impl
  assert default_attention_impl() == ("cpu_chunked" if jax.default_backend() == "cpu"
                                      else "batched")


@pytest.mark.parametrize("impl", ["cpu_chunked", "cpu_chunked_sum"])
def test_both_cpu_decode_paths_match_the_full_forward(setup, impl):
  """Batched attention dots with YNNPACK ('cpu_chunked', the default) and multiply-and-sum
  attention with Eigen dots ('cpu_chunked_sum') both give the full forward's greedy tokens and
  log-probs, whichever CPU runs the tests."""
  import dataclasses

  model, sampler, _, _, _ = setup
  on_cpu = jax.default_backend() == "cpu"
  assert (sampling._few_rows_compiler_options(impl) is None) == (impl == "cpu_chunked")
  config = dataclasses.replace(CONFIG, attention_impl=impl)
  graphdef = nnx.graphdef(nnx.eval_shape(lambda: CausalLM(config, rngs=nnx.Rngs(0))))
  this_cpu = nnx.merge(graphdef, nnx.state(model))
  assert this_cpu.config.attention_impl == impl
  if not on_cpu:
    pytest.skip("the CPU programs")
  fresh = Sampler(this_cpu, eos_token_ids=sampler.eos_token_ids, pad_token_id=PAD,
                  max_cache_len=CACHE, prompt_buckets=(8,), batch_buckets=(4,))
  out = fresh(PROMPTS, jax.random.key(0), max_new_tokens=MAX_NEW, greedy=True)
  for prompt, toks, plp in zip(PROMPTS, out.tokens, out.policy_logprobs):
    steps = _log_softmax_full(model, prompt + toks.tolist())[len(prompt) - 1:][:len(toks)]
    np.testing.assert_array_equal(np.argmax(steps, axis=-1), toks)
    np.testing.assert_allclose(plp, steps[np.arange(len(toks)), toks], atol=1e-5)


def test_length_buckets():
  assert sampling.length_buckets(16, 128) == [16, 32, 64, 128]  # one a doubling: powers of two
  assert sampling.length_buckets(16, 127) == [16, 32, 64]
  assert sampling.length_buckets(16, 8) == [16]  # the shortest even past the longest
  assert sampling.length_buckets(3, 3) == [3]
  assert sampling.length_buckets(128, 512, 4) == [128, 160, 192, 224, 256, 320, 384, 448, 512]
  fine = sampling.length_buckets(128, 2560, 8)
  assert fine[:3] == [128, 144, 160] and fine[-3:] == [2048, 2304, 2560]
  assert len(fine) == 35  # 8 a doubling: bounded by 8 * log2(2560 / 128) + 1
  for n in range(129, 2561):  # every length past the shortest is padded by at most 12.5%
    assert sampling._bucket(n, fine) <= n * 1.125, n
  assert all(b % 8 == 0 for b in fine)
  for bad in ((0, 64, 1), (16, 64, 0)):
    with pytest.raises(ValueError, match="length_buckets"):
      sampling.length_buckets(*bad)


def test_eos_stops_the_row_and_the_loop_exits_early(setup):
  _, sampler, ref, eos, eos_at = setup
  out = sampler([PROMPT_A], jax.random.key(0), max_new_tokens=MAX_NEW, greedy=True)
  np.testing.assert_array_equal(out.tokens[0], ref[:eos_at + 1])
  assert out.finish_reasons == ["eos"]
  assert out.num_steps == eos_at + 1 < MAX_NEW  # the while_loop ended when every row was done
  short = sampler([PROMPT_A], jax.random.key(0), max_new_tokens=3, greedy=True)
  np.testing.assert_array_equal(short.tokens[0], ref[:3])
  assert short.finish_reasons == ["length"] and short.num_steps == 3


def test_ragged_batch_equals_each_prompt_alone(setup):
  _, sampler, _, _, _ = setup
  batch = sampler(PROMPTS, jax.random.key(0), max_new_tokens=MAX_NEW, greedy=True)
  for i, prompt in enumerate(PROMPTS):
    alone = sampler([prompt], jax.random.key(0), max_new_tokens=MAX_NEW, greedy=True)
    np.testing.assert_array_equal(batch.tokens[i], alone.tokens[0])
    np.testing.assert_allclose(batch.policy_logprobs[i], alone.policy_logprobs[0], atol=1e-5)


def test_many_rows_decode_like_a_few(setup):
  """Batch buckets past `_FEW_ROWS` decode with the other compiled program: same answers."""
  model, sampler, _, _, _ = setup
  few_rows = sampling._FEW_ROWS
  big = Sampler(model, eos_token_ids=sampler.eos_token_ids, pad_token_id=PAD, max_cache_len=CACHE,
                prompt_buckets=(8,), batch_buckets=(4, 2 * few_rows))
  prompts = [PROMPTS[i % 3] for i in range(few_rows + 1)]
  many = big(prompts, jax.random.key(0), max_new_tokens=MAX_NEW, greedy=True)
  few = big(PROMPTS, jax.random.key(0), max_new_tokens=MAX_NEW, greedy=True)
  for i, toks in enumerate(many.tokens):
    np.testing.assert_array_equal(toks, few.tokens[i % 3])
    np.testing.assert_allclose(many.policy_logprobs[i], few.policy_logprobs[i % 3], atol=1e-5)


def test_stop_string_stops_and_is_included(setup):
  _, sampler, ref, _, eos_at = setup
  stop_at = [i for i in _first_new(ref, 2) if i < eos_at]
  assert stop_at, f"no fresh token before the EOS in {ref}"
  m = stop_at[0]
  stop = f"w{ref[m - 1]} w{ref[m]} "  # spans two tokens
  # Independent expectation: the shortest prefix whose text holds the stop string.
  want = next(k for k in range(1, len(ref) + 1) if stop in _decode(ref[:k]))
  assert want == m + 1
  plain = sampler(PROMPTS, jax.random.key(0), max_new_tokens=MAX_NEW, greedy=True)
  out = sampler(PROMPTS, jax.random.key(0), max_new_tokens=MAX_NEW, greedy=True,
                stop_strings=("</never>", stop), decode_fn=_decode)
  np.testing.assert_array_equal(out.tokens[0], ref[:want])
  assert out.finish_reasons[0] == "stop"
  assert out.texts[0] == _decode(ref[:want]) and out.texts[0].endswith(stop)
  assert len(out.logprobs[0]) == len(out.policy_logprobs[0]) == want
  for i in (1, 2):  # rows without the stop string run on as before
    hit = stop in _decode(plain.tokens[i].tolist())
    if not hit:
      np.testing.assert_array_equal(out.tokens[i], plain.tokens[i])
      assert out.finish_reasons[i] == plain.finish_reasons[i]
  assert plain.texts is None


def _filtered_logprobs(logp_row, temperature, top_k, top_p):
  """numpy reference of the sampling distribution: temperature, then top-k, then top-p."""
  z = logp_row / temperature
  order = np.argsort(-z, kind="stable")
  keep = np.zeros_like(z, bool)
  keep[order[:top_k]] = True
  zs = np.where(keep, z, -np.inf)
  probs = np.exp(zs - zs.max())
  probs /= probs.sum()
  sorted_p = probs[order]
  mass_before = np.cumsum(sorted_p) - sorted_p
  nucleus = np.zeros_like(keep)
  nucleus[order[(mass_before < top_p) & keep[order]]] = True
  zn = np.where(nucleus, z, -np.inf)
  return zn - np.logaddexp.reduce(zn[nucleus]), nucleus


def test_sampled_logprobs_equal_full_forward(setup):
  model, sampler, _, _, _ = setup
  t, k, p = 0.7, 20, 0.9
  out = sampler(PROMPTS, jax.random.key(3), max_new_tokens=MAX_NEW, temperature=t, top_k=k,
                top_p=p)
  for prompt, toks, lp, plp in zip(PROMPTS, out.tokens, out.logprobs, out.policy_logprobs):
    full = _log_softmax_full(model, prompt + toks.tolist())
    steps = full[len(prompt) - 1:len(prompt) - 1 + len(toks)]
    np.testing.assert_allclose(plp, steps[np.arange(len(toks)), toks], atol=1e-5)
    for i, tok in enumerate(toks):
      ref_lp, allowed = _filtered_logprobs(steps[i], t, k, p)
      assert allowed[tok], f"token {tok} at step {i} is outside the top-k/top-p set"
      np.testing.assert_allclose(lp[i], ref_lp[tok], atol=1e-5, rtol=1e-5)  # f32 rounding


def test_top_k_one_equals_greedy(setup):
  _, sampler, _, _, _ = setup
  greedy = sampler(PROMPTS, jax.random.key(0), max_new_tokens=MAX_NEW, greedy=True)
  top1 = sampler(PROMPTS, jax.random.key(5), max_new_tokens=MAX_NEW, temperature=1.3, top_k=1)
  for g, s, lp in zip(greedy.tokens, top1.tokens, top1.logprobs):
    np.testing.assert_array_equal(s, g)
    np.testing.assert_allclose(lp, 0.0, atol=1e-6)


def test_same_key_same_output_different_key_differs(setup):
  _, sampler, _, _, _ = setup
  run = lambda seed: sampler(PROMPTS, jax.random.key(seed), max_new_tokens=MAX_NEW,
                             temperature=1.0)
  a, b, c = run(7), run(7), run(8)
  for x, y in zip(a.tokens, b.tokens):
    np.testing.assert_array_equal(x, y)
  assert any(len(x) != len(z) or (x != z).any() for x, z in zip(a.tokens, c.tokens))
  # No filtering at temperature 1: the sampling policy is the raw model.
  for lp, plp in zip(a.logprobs, a.policy_logprobs):
    np.testing.assert_allclose(lp, plp, atol=1e-5)


def test_one_program_serves_all_ragged_prompt_sets_in_a_bucket(setup):
  _, sampler, _, _, _ = setup
  sampler([[1, 2, 3]], jax.random.key(0), max_new_tokens=4, greedy=True)
  traced = sampler.num_traces
  assert traced >= 2  # the counter does count traces (prefill and decode at least once)
  for prompts, n in (([[4], [9, 9, 9, 9, 9, 9, 9, 9]], 5), ([[3, 1], [2], [8, 8, 8], [6]], 9),
                     ([[50, 51, 52]], MAX_NEW)):
    sampler(prompts, jax.random.key(1), max_new_tokens=n, greedy=True)
  assert sampler.num_traces == traced


@pytest.mark.parametrize("kwargs, match", [
    (dict(prompts=[]), "non-empty"),
    (dict(prompts=[[1, 2], []]), "prompt 1 is empty"),
    (dict(prompts=[list(range(1, CACHE + 1))]), "prompt 0 has 32 tokens"),
    (dict(prompts=[[1] * 28]), "needs 39 cache slots"),
    (dict(prompts=[[1, 96]]), "outside"),
    (dict(prompts=[[-1, 3]]), "outside"),
    (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(temperature=-0.5), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_k=-1), "top_k"),
    (dict(stop_strings=("</action>",)), "decode_fn"),
])
def test_bad_inputs_raise(setup, kwargs, match):
  _, sampler, _, _, _ = setup
  args = dict(prompts=[[1, 2, 3]], max_new_tokens=MAX_NEW)
  args.update(kwargs)
  with pytest.raises(ValueError, match=match):
    sampler(args.pop("prompts"), jax.random.key(0), **args)


def test_sharded_model_on_mesh_and_in_place_updates(setup):
  base, sampler, _, _, _ = setup
  want = sampler(PROMPTS, jax.random.key(0), max_new_tokens=MAX_NEW, greedy=True)
  mesh = make_mesh("4x2")
  model = shard_model(_model(), mesh)
  sharded = Sampler(model, eos_token_ids=sampler.eos_token_ids, pad_token_id=PAD,
                    max_cache_len=CACHE, prompt_buckets=(8,), batch_buckets=(4,))
  got = sharded(PROMPTS, jax.random.key(0), max_new_tokens=MAX_NEW, greedy=True)
  for w, g, wl, gl in zip(want.tokens, got.tokens, want.policy_logprobs, got.policy_logprobs):
    np.testing.assert_array_equal(g, w)
    np.testing.assert_allclose(gl, wl, atol=1e-5)
  # Parameters updated in place (as an optimizer step does) are sampled without recompiling:
  # a negated output head makes greedy pick the least likely token of the original model.
  traced = sharded.num_traces
  model.lm_head[...] = -model.lm_head[...]
  flipped = sharded(PROMPTS, jax.random.key(0), max_new_tokens=1, greedy=True)
  assert sharded.num_traces == traced
  for prompt, toks in zip(PROMPTS, flipped.tokens):
    assert toks[0] == np.argmin(_log_softmax_full(base, prompt)[-1])


# ------------------------------------------------------------------ continuing a kept cache

REUSE_CACHE = 64
SUFFIX_BUCKET = 8
FULL_BUCKET = 48  # every grown prompt here fits it: one more program, not one per length
TURN_MAX_NEW = 8
# Tokens each later turn appends after a row's prompt + response (ragged user turns).
EXTRAS = [[[3, 4], [9], [20, 21, 22, 23, 24]],
          [[60, 61, 62, 63, 64, 65, 66], [12, 13, 14], [70]]]


@pytest.fixture(scope="module")
def reuse_sampler(setup):
  model, sampler, _, _, _ = setup
  return Sampler(model, eos_token_ids=sampler.eos_token_ids, pad_token_id=PAD,
                 max_cache_len=REUSE_CACHE, prompt_buckets=(SUFFIX_BUCKET, FULL_BUCKET),
                 batch_buckets=(4,), stop_check_every=4)


def _grow(prompts, out, extras):
  """The next turn's prompts: prompt + response + the new user turn, per row."""
  return [list(p) + t.tolist() + e for p, t, e in zip(prompts, out.tokens, extras)]


def _assert_same(got, want, rtol=0.0):
  assert got.finish_reasons == want.finish_reasons
  for g, w, gl, wl in zip(got.tokens, want.tokens, got.policy_logprobs, want.policy_logprobs):
    np.testing.assert_array_equal(g, w)
    np.testing.assert_allclose(gl, wl, atol=1e-5, rtol=rtol)


@pytest.mark.parametrize("cache_buckets", [None, (16, 32)])
def test_continuing_equals_full_prefills_over_turns(setup, reuse_sampler, cache_buckets):
  """Three greedy turns: a row that hit EOS, one cut by a stop string, ragged suffixes, a batch
  that shrinks and reorders; reuse gives the tokens and log-probs of full prefills. With small
  cache buckets, the kept cache grows from 16 to 32 to 64 slots on the way."""
  _, _, _, eos, _ = setup
  s = reuse_sampler
  if cache_buckets is not None:
    s = Sampler(s.model, eos_token_ids=s.eos_token_ids, pad_token_id=PAD,
                max_cache_len=REUSE_CACHE, prompt_buckets=s.prompt_buckets,
                batch_buckets=(4,), stop_check_every=4, cache_buckets=cache_buckets)
    assert s.cache_buckets == (16, 32, REUSE_CACHE)
  kept_len = lambda: s._kept.cache.shape[3]  # pylint: disable=protected-access  # noqa: E731
  kw = dict(max_new_tokens=TURN_MAX_NEW, greedy=True, decode_fn=_decode)
  # Reference: full prefills. Turn 2 drops row 1 (finished) and puts row 2 first.
  ref1 = s(PROMPTS, jax.random.key(0), **kw)
  assert ref1.finish_reasons[0] == "eos" and ref1.tokens[0][-1] == eos
  keep = [2, 0]
  g2 = _grow([PROMPTS[r] for r in keep], _pick(ref1, keep), [EXTRAS[0][r] for r in keep])
  plain2 = s(g2, jax.random.key(0), **kw)
  cut_row = next(j for j, t in enumerate(plain2.tokens) if len(set(t[1:-1].tolist())
                                                              - set(t[:1].tolist())))
  toks = plain2.tokens[cut_row].tolist()
  stop = f"w{next(x for x in toks[1:-1] if x != toks[0])} "  # cuts that row mid-response
  ref2 = s(g2, jax.random.key(0), stop_strings=(stop,), **kw)
  assert ref2.finish_reasons[cut_row] == "stop"
  assert len(ref2.tokens[cut_row]) < len(plain2.tokens[cut_row])
  g3 = _grow(g2, ref2, EXTRAS[1][:2])
  ref3 = s(g3, jax.random.key(0), **kw)
  g4 = _grow(g3, ref3, [[5], [6, 7]])
  sample = dict(max_new_tokens=4, temperature=1.0, top_k=30)
  ref4 = s(g4, jax.random.key(4), **sample)

  out1 = s(PROMPTS, jax.random.key(0), keep_cache=True, **kw)
  _assert_same(out1, ref1)
  assert out1.reused_tokens == 0
  lengths = [kept_len()]
  out2 = s(g2, jax.random.key(0), continue_rows=keep, keep_cache=True, stop_strings=(stop,), **kw)
  _assert_same(out2, ref2)
  assert out2.reused_tokens == sum(len(PROMPTS[r]) + len(ref1.tokens[r]) - 1 for r in keep)
  lengths.append(kept_len())
  traced = s.num_traces
  out3 = s(g3, jax.random.key(0), continue_rows=[0, 1], keep_cache=True, **kw)
  _assert_same(out3, ref3)
  assert out3.reused_tokens == sum(len(g) + len(t) - 1 for g, t in zip(g2, ref2.tokens))
  lengths.append(kept_len())
  if cache_buckets is None:
    assert lengths == [REUSE_CACHE] * 3
    assert s.num_traces == traced  # a later turn in the same buckets compiles nothing
  else:
    assert lengths == [16, 32, REUSE_CACHE]
  # A sampled turn continues with the same key to the same draws.
  out4 = s(g4, jax.random.key(4), continue_rows=[0, 1], **sample)
  assert out4.reused_tokens > 0
  _assert_same(out4, ref4)
  np.testing.assert_allclose(np.concatenate(out4.logprobs), np.concatenate(ref4.logprobs),
                             atol=1e-5)


def _pick(out, rows):
  return SampleOutput(tokens=[out.tokens[r] for r in rows], logprobs=[], policy_logprobs=[],
                      texts=None, finish_reasons=[])


def test_continuing_falls_back_to_a_full_prefill(reuse_sampler):
  s = reuse_sampler
  kw = dict(max_new_tokens=TURN_MAX_NEW, greedy=True)
  g2 = _grow(PROMPTS, s(PROMPTS, jax.random.key(0), keep_cache=True, **kw), EXTRAS[0])
  want = s(g2, jax.random.key(0), **kw)  # a call that keeps nothing frees the kept cache
  got = s(g2, jax.random.key(0), continue_rows=[0, 1, 2], **kw)
  assert got.reused_tokens == 0
  _assert_same(got, want)

  def kept_then(prompts, rows, max_new=TURN_MAX_NEW):
    s(PROMPTS, jax.random.key(0), keep_cache=True, **kw)
    return s(prompts, jax.random.key(0), continue_rows=rows, max_new_tokens=max_new, greedy=True)

  # A prompt that does not extend its row (an edited token, a row that is the wrong one, a
  # prompt no longer than the cached tokens, a None): all rows are prefilled in full.
  edited = [list(g) for g in g2]
  edited[1][0] += 1
  for prompts, rows in ((edited, [0, 1, 2]), (g2, [0, 2, 1]), (g2, [0, 1, None]),
                        ([g2[0], PROMPTS[1], g2[2]], [0, 1, 2])):
    got = kept_then(prompts, rows)
    assert got.reused_tokens == 0
    _assert_same(got, s(prompts, jax.random.key(0), **kw))
  # Cache room: the last decode step writes slot cursor + SUFFIX_BUCKET - 1 + max_new - 1, where
  # the cursor is the first slot the previous call left unwritten.
  long = [[(7 * i) % 90 + 1 for i in range(36)]]
  first = s(long, jax.random.key(0), keep_cache=True, max_new_tokens=4, greedy=True)
  assert first.num_steps == 4
  cursor = FULL_BUCKET - 1 + first.num_steps
  fits = REUSE_CACHE - cursor - SUFFIX_BUCKET + 1
  assert 1 <= fits < TURN_MAX_NEW, "the test needs a turn that overflows the cache"
  grown = _grow(long, first, [[9]])
  assert s(grown, jax.random.key(0), continue_rows=[0], max_new_tokens=fits,
           greedy=True).reused_tokens > 0
  s(long, jax.random.key(0), keep_cache=True, max_new_tokens=4, greedy=True)
  over = s(grown, jax.random.key(0), continue_rows=[0], max_new_tokens=fits + 1, greedy=True)
  assert over.reused_tokens == 0
  _assert_same(over, s(grown, jax.random.key(0), max_new_tokens=fits + 1, greedy=True))
  s.clear_cache()
  assert s(g2, jax.random.key(0), continue_rows=[0, 1, 2], **kw).reused_tokens == 0


@pytest.mark.parametrize("kwargs, match", [
    (dict(continue_rows=[0]), "one kept row"),
    (dict(continue_rows="ab"), "one kept row"),
    (dict(continue_rows=[0, -1]), r"continue_rows\[1\]"),
    (dict(continue_rows=[0, 3]), r"kept 3 rows"),
    (dict(continue_rows=[True, 0]), r"continue_rows\[0\]"),
    (dict(continue_rows=[0, 1.0]), r"continue_rows\[1\]"),
    (dict(keep_cache=1), "keep_cache"),
])
def test_bad_continuation_inputs_raise(reuse_sampler, kwargs, match):
  s = reuse_sampler
  s(PROMPTS, jax.random.key(0), max_new_tokens=2, greedy=True, keep_cache=True)
  with pytest.raises(ValueError, match=match):
    s([[1, 2], [3]], jax.random.key(0), max_new_tokens=2, **kwargs)


def test_continuing_on_a_mesh(setup, reuse_sampler):
  _, _, _, eos, _ = setup
  kw = dict(max_new_tokens=TURN_MAX_NEW, greedy=True)
  model = shard_model(_model(), make_mesh("4x2"))
  sharded = Sampler(model, eos_token_ids=[eos], pad_token_id=PAD, max_cache_len=REUSE_CACHE,
                    prompt_buckets=(SUFFIX_BUCKET, FULL_BUCKET), batch_buckets=(4,))
  first = sharded(PROMPTS, jax.random.key(0), keep_cache=True, **kw)
  _assert_same(first, reuse_sampler(PROMPTS, jax.random.key(0), **kw))
  g2 = _grow(PROMPTS, first, EXTRAS[0])
  got = sharded(g2, jax.random.key(0), continue_rows=[0, 1, 2], **kw)
  assert got.reused_tokens > 0
  _assert_same(got, reuse_sampler(g2, jax.random.key(0), **kw))


def test_cache_buckets_default_and_bad():
  model = _model()
  s = Sampler(model, eos_token_ids=[1], pad_token_id=PAD, max_cache_len=1000)
  assert s.cache_buckets == (128, 160, 192, 224, 256, 320, 384, 448, 512, 640, 768, 896, 1000)
  small = Sampler(model, eos_token_ids=[1], pad_token_id=PAD, max_cache_len=64)
  assert small.cache_buckets == (64,)
  with pytest.raises(ValueError, match="cache_buckets"):
    Sampler(model, eos_token_ids=[1], pad_token_id=PAD, max_cache_len=64, cache_buckets=(1, 8))


def test_argmax_matches_numpy_with_ties_infinities_and_nan():
  rng = np.random.default_rng(0)
  x = rng.standard_normal((9, 50)).astype(np.float32)
  x[1, [3, 40]] = x[1].max() + 1.0          # a tie: the first index wins
  x[2] = -np.inf                            # nothing finite
  x[3, [7, 9]] = np.inf
  x[4, [30, 5]] = np.nan                    # NaN counts as the max, first one wins
  x[5, 10] = np.nan
  x[5, 2] = np.inf
  x[6] = 0.0                                # all equal
  got = np.asarray(jax.jit(sampling._argmax)(x))
  assert got.dtype == np.int32
  np.testing.assert_array_equal(got, np.argmax(x, axis=-1))


# ------------------------------------------------------------------ prompts prefilled once

PROMPT_B, PROMPT_C = [11, 90], [7, 7, 30, 44, 81]
SHARE_CASES = {
    "one group": [PROMPT_A] * 8,
    "partly shared": [PROMPT_A, PROMPT_A, PROMPT_B, PROMPT_A, PROMPT_C, PROMPT_B, PROMPT_A,
                      PROMPT_A],
    "distinct": [[i + 1, (7 * i) % 90 + 2, 40 + i] for i in range(8)],
}


def _pair(model, eos, **kw):
  """The same sampler with and without prompt sharing (batch buckets small enough that a call's
  distinct prompts fit a smaller one)."""
  kw = dict(eos_token_ids=[eos], pad_token_id=PAD, batch_buckets=(1, 2, 4, 8), **kw)
  return Sampler(model, **kw), Sampler(model, share_prompts=False, **kw)


@pytest.mark.parametrize("case", list(SHARE_CASES))
@pytest.mark.parametrize("greedy", [True, False])
def test_shared_prompts_sample_what_separate_prefills_do(setup, case, greedy):
  """Repeated prompts of one call are prefilled once; every row still draws with its own key,
  so tokens and both log-probs equal those of one prefill a row."""
  model, _, _, eos, _ = setup
  shared, separate = _pair(model, eos, max_cache_len=CACHE, prompt_buckets=(8,))
  prompts = SHARE_CASES[case]
  kw = dict(max_new_tokens=MAX_NEW, greedy=greedy, temperature=1.0)
  got = shared(prompts, jax.random.key(3), **kw)
  want = separate(prompts, jax.random.key(3), **kw)
  _assert_same(got, want)
  for g, w in zip(got.logprobs, want.logprobs):
    np.testing.assert_allclose(g, w, atol=1e-5)
  distinct = {tuple(p) for p in prompts}
  assert got.prefilled_tokens == sum(len(p) for p in distinct)
  assert want.prefilled_tokens == sum(len(p) for p in prompts)
  if case == "one group" and not greedy:  # shared prefill, yet the rows' draws differ
    assert len({tuple(t.tolist()) for t in got.tokens}) > 1


def test_shared_prompts_continue_a_kept_cache(setup):
  """A group's identical first prompts, kept, then continued by turns in which pairs of rows
  repeat each other (the same response and the same new turn) and then part; each turn equals
  separate prefills, and each row keeps its own cache."""
  model, _, _, eos, _ = setup
  shared, separate = _pair(model, eos, max_cache_len=REUSE_CACHE,
                           prompt_buckets=(SUFFIX_BUCKET, FULL_BUCKET))
  kw = dict(max_new_tokens=TURN_MAX_NEW, greedy=True, keep_cache=True)
  turn, rows = [PROMPTS[2]] * 4, None
  for extras in ([[3, 4], [3, 4], [9], [9]], [[5], [5], [6, 7], [6, 7]], [[1], [2], [3], [3]],
                 None):
    got = shared(turn, jax.random.key(0), continue_rows=rows, **kw)
    want = separate(turn, jax.random.key(0), continue_rows=rows, **kw)
    _assert_same(got, want)
    if len({tuple(p) for p in turn}) <= 2:  # a smaller batch bucket: each pair prefilled once
      assert got.prefilled_tokens < want.prefilled_tokens
      assert got.reused_tokens < want.reused_tokens or rows is None
    if extras is not None:
      turn, rows = _grow(turn, got, extras), [0, 1, 2, 3]
  assert got.reused_tokens > 0 and got.prefilled_tokens == want.prefilled_tokens


def test_shared_prompts_on_a_mesh(setup):
  model, sampler, _, eos, _ = setup
  prompts = SHARE_CASES["partly shared"]
  want = sampler(prompts, jax.random.key(5), max_new_tokens=MAX_NEW, temperature=1.0)
  sharded = Sampler(shard_model(_model(), make_mesh("4x2")), eos_token_ids=[eos],
                    pad_token_id=PAD, max_cache_len=CACHE, prompt_buckets=(8,),
                    batch_buckets=(4,))
  got = sharded(prompts, jax.random.key(5), max_new_tokens=MAX_NEW, temperature=1.0)
  # The model axis sums partial products in another order: f32 rounding relative to the value
  # (1.5e-5 on a log-prob of -3.87 on an AMD EPYC with AVX-512).
  _assert_same(got, want, rtol=1e-5)
  assert got.prefilled_tokens == sum(len(p) for p in {tuple(p) for p in prompts})


# Six distinct prompts in a call of 16 rows (the rest repeat them); ten distinct ones, no repeats.
FINE_ROWS_CASES = {
    "repeated": [[i + 1, (7 * i) % 90 + 2, 40 + i] for i in range(6)] * 2
                + [PROMPT_A, PROMPT_B, PROMPT_C, PROMPT_A],
    "distinct": [[i + 3, (11 * i) % 90 + 2, 50 + i, 9] for i in range(10)],
}


def _rows_pair(model, eos, **kw):
  """The same sampler with a finer prefill batch bucket wherever it saves rows (a tiny model's
  rows never cost split_min_flops) and with the call's batch buckets only; one batch each (a
  length group of the finer rows is one too)."""
  kw = dict(eos_token_ids=[eos], pad_token_id=PAD, max_cache_len=CACHE, prompt_buckets=(8,),
            batch_buckets=(1, 2, 4, 8, 16), split_lengths=False, **kw)
  return (Sampler(model, split_min_flops=0, prefill_batch_buckets=(1, 2, 3, 4, 6, 8, 12, 16),
                  **kw),
          Sampler(model, **kw))


@pytest.mark.parametrize("case", list(FINE_ROWS_CASES))
@pytest.mark.parametrize("share", [True, False])
def test_prefill_rows_in_a_finer_bucket_sample_what_the_calls_batch_does(setup, case, share):
  """A prefill of 9 or 10 distinct prompts pads them to 12 rows, not the call's 16, then copies
  each row to its prompts' rows: the same tokens and log-probs for a fixed key."""
  model, _, _, eos, _ = setup
  fine, coarse = _rows_pair(model, eos, share_prompts=share)
  prompts = FINE_ROWS_CASES[case]
  kw = dict(max_new_tokens=MAX_NEW, temperature=1.0)
  got = fine(prompts, jax.random.key(6), **kw)
  want = coarse(prompts, jax.random.key(6), **kw)
  _assert_same(got, want, rtol=1e-5)  # other matmul shapes, other f32 rounding
  for g, w in zip(got.logprobs, want.logprobs):
    np.testing.assert_allclose(g, w, atol=1e-5, rtol=1e-5)
  rows = {tuple(p) for p in prompts} if share else prompts
  assert got.prefilled_tokens == sum(len(p) for p in rows)
  distinct = len(rows)
  plan = fine._plan(prompts, None, None, 16, MAX_NEW)
  assert distinct in (9, 10, 16) and plan.tokens.shape[0] == (16 if distinct == 16 else 12)
  if distinct < 16:  # each prompt's row copies its own prefilled row
    for i, p in enumerate(prompts):
      row = plan.tokens[plan.expand[i]]
      assert row[len(row) - len(p):].tolist() == p


def test_prefill_rows_take_a_finer_bucket_only_where_it_pays(setup):
  """The finer bucket is taken when the rows it saves cost split_min_flops (2 FLOPs a parameter
  a position), never for a tiny model by default; calls of 9 to 12 distinct prompts share one
  prefill program; a kept cache's continuation keeps the call's buckets; bad buckets raise."""
  model, _, _, eos, _ = setup
  prompts = FINE_ROWS_CASES["distinct"]
  params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
  saved = 2 * params * (16 - 12) * 8  # four rows of the 8-token bucket
  for flops, rows in ((saved, 12), (saved + 1, 16)):
    s = Sampler(model, eos_token_ids=[eos], pad_token_id=PAD, max_cache_len=CACHE,
                prompt_buckets=(8,), batch_buckets=(1, 2, 4, 8, 16), split_min_flops=flops,
                split_lengths=False)
    assert s._plan(prompts, None, None, 16, MAX_NEW).tokens.shape[0] == rows
  default = Sampler(model, eos_token_ids=[eos], pad_token_id=PAD, max_cache_len=CACHE,
                    prompt_buckets=(8,), batch_buckets=(1, 2, 4, 8, 16))
  assert default.prefill_batch_buckets[:8] == (1, 2, 3, 4, 6, 8, 12, 16)
  assert default._plan(prompts, None, None, 16, MAX_NEW).tokens.shape[0] == 16
  fine, _ = _rows_pair(model, eos)
  fine(prompts, jax.random.key(0), max_new_tokens=4, greedy=True)
  traced = fine.num_traces
  fine(prompts[:9] + prompts[:2], jax.random.key(1), max_new_tokens=4, greedy=True)
  assert fine.num_traces == traced  # 9 distinct of 11 rows: the same 12-row prefill and copy
  out = fine(prompts, jax.random.key(0), max_new_tokens=4, greedy=True, keep_cache=True)
  grown = _grow(prompts, out, [[3]] * len(prompts))
  kept = fine._kept
  plan = fine._plan(grown, list(range(len(grown))), kept, 16, MAX_NEW)
  assert plan.rows is not None and plan.tokens.shape[0] == 16  # continued: the call's bucket
  for bad in ((), (0, 4)):
    with pytest.raises(ValueError, match="prefill_batch_buckets"):
      Sampler(model, eos_token_ids=[eos], pad_token_id=PAD, max_cache_len=CACHE,
              prefill_batch_buckets=bad)


def test_decode_compiles_once_for_every_prompt_bucket(setup):
  """The decode program's shapes hold no prompt length: a new prompt bucket compiles a prefill
  only."""
  model, _, _, eos, _ = setup
  s = Sampler(model, eos_token_ids=[eos], pad_token_id=PAD, max_cache_len=CACHE,
              prompt_buckets=(8, 16), batch_buckets=(4,), cache_buckets=(CACHE,))
  s([[1, 2, 3]], jax.random.key(0), max_new_tokens=4, greedy=True)
  traced = s.num_traces
  s([list(range(1, 13))], jax.random.key(0), max_new_tokens=4, greedy=True)
  assert s.num_traces == traced + 1


# ---- length groups (`split_lengths`) ----

LONG = [3 + (5 * i) % 80 for i in range(29)]
LENGTH_CASES = {
    # two short prompts beside long ones: a 32-token bucket for all, or 8 for the short
    "short and long": [PROMPT_B, LONG, [4, 9, 12], LONG[:27], PROMPT_C, LONG[3:]],
    # repeated prompts of both lengths (each prefilled once, then copied to its rows)
    "repeated": [LONG, PROMPT_B, LONG, PROMPT_B, PROMPT_A, LONG, PROMPT_B, LONG[1:]],
    # three lengths: 8, 16 and 32-token buckets
    "three lengths": [PROMPT_B, LONG[:14], LONG, PROMPT_C, LONG[:12], LONG[2:], [6], LONG[:15]],
}


LENGTH_SAMPLER = dict(pad_token_id=PAD, max_cache_len=48, batch_buckets=(1, 2, 4, 8),
                      prompt_buckets=(8, 16, 32))


def _length_pair(model, eos):
  """The same sampler with and without length groups: prompt buckets of 8, 16 and 32 tokens;
  in groups whatever FLOPs they save (the test model is tiny)."""
  kw = dict(eos_token_ids=[eos], **LENGTH_SAMPLER)
  return Sampler(model, split_min_flops=0, **kw), Sampler(model, split_lengths=False, **kw)


@pytest.mark.parametrize("case", list(LENGTH_CASES))
@pytest.mark.parametrize("greedy", [True, False])
def test_length_groups_sample_what_one_padded_batch_does(setup, case, greedy):
  """Prompts of very different lengths prefilled in groups of their own buckets give the
  tokens and both log-probs of one batch padded to the longest, for a fixed key."""
  model, _, _, eos, _ = setup
  grouped, padded = _length_pair(model, eos)
  prompts = LENGTH_CASES[case]
  kw = dict(max_new_tokens=MAX_NEW, greedy=greedy, temperature=1.0)
  got = grouped(prompts, jax.random.key(4), **kw)
  want = padded(prompts, jax.random.key(4), **kw)
  # Other matmul shapes, other f32 rounding, relative to the value (1.3e-5 on -1.87 here).
  _assert_same(got, want, rtol=1e-5)
  for g, w in zip(got.logprobs, want.logprobs):
    np.testing.assert_allclose(g, w, atol=1e-5, rtol=1e-5)
  assert got.prefilled_tokens == want.prefilled_tokens


def test_length_groups_are_chosen_where_they_save_padding(setup):
  """The plan: groups only when they save at least 15% of the padded positions, with no more
  rows in all than one batch (each group's rows in the finer prefill buckets); each group's
  bucket holds its longest prompt; every prompt's row gathers its own prefilled row."""
  model, _, _, eos, _ = setup
  grouped, _ = _length_pair(model, eos)
  prompts = LENGTH_CASES["three lengths"]
  split = grouped._length_groups(prompts, 8, MAX_NEW)
  assert split is not None and 2 <= len(split) <= 3
  groups = [g for g, _ in split]
  assert sorted(np.concatenate(groups).tolist()) == list(range(len(prompts)))
  longest = [max(len(prompts[i]) for i in g) for g in groups]
  assert longest == sorted(longest)
  assert [pb for _, pb in split] == [grouped._prompt_bucket(m, MAX_NEW) for m in longest]
  cost = sum(grouped._prefill_batch(len(g), pb) * pb for g, pb in split)
  assert cost <= 0.85 * 8 * 32
  assert sum(grouped._prefill_batch(len(g), pb) for g, pb in split) <= 8
  plan = grouped._plan(prompts, None, None, 8, MAX_NEW)
  assert plan.groups is not None
  rows = [row for part in plan.groups for row in part[0]]  # the groups' token rows, in turn
  for i, p in enumerate(prompts):  # the gathered row ends with the prompt, left-padded
    row = rows[plan.gather[i]]
    assert row[len(row) - len(p):].tolist() == p and not row[:len(row) - len(p)].any()
  # every group ends at the slot of the longest group's bucket
  assert {cursor + part.shape[1] for part, _, _, cursor in plan.groups} == {32}
  # only when the positions saved cost split_min_flops (2 FLOPs a parameter a position); rows
  # in the call's buckets here, so that the bar gates the groups alone
  params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
  coarse = dict(LENGTH_SAMPLER, prefill_batch_buckets=LENGTH_SAMPLER["batch_buckets"])
  split = Sampler(model, eos_token_ids=[eos], split_min_flops=0, **coarse)._length_groups(
      prompts, 8, MAX_NEW)
  saved = 8 * 32 - sum(grouped._pad_batch(len(g)) * pb for g, pb in split)
  for flops, grouped_too in ((2 * params * saved, True), (2 * params * saved + 1, False)):
    gated = Sampler(model, eos_token_ids=[eos], split_min_flops=flops, **coarse)
    assert (gated._length_groups(prompts, 8, MAX_NEW) is not None) == grouped_too
  default = Sampler(model, eos_token_ids=[eos], **LENGTH_SAMPLER)
  assert default._length_groups(prompts, 8, MAX_NEW) is None  # tiny: never worth it
  # equal lengths, one bucket, a kept cache, one prompt: one batch
  assert grouped._length_groups([LONG] * 4 + [LONG[1:]] * 4, 8, MAX_NEW) is None
  assert grouped._plan(prompts, None, None, 8, MAX_NEW, keep_cache=True).groups is None
  assert grouped._plan([LONG], None, None, 1, MAX_NEW).groups is None


def test_length_groups_compile_a_bounded_set_of_programs(setup):
  """A second call in the same buckets and group sizes compiles nothing; the prefill programs
  are one per (rows, bucket) of a group, shared by calls that group differently."""
  model, _, _, eos, _ = setup
  grouped, _ = _length_pair(model, eos)
  prompts = LENGTH_CASES["short and long"]
  grouped(prompts, jax.random.key(0), max_new_tokens=4, greedy=True)
  traced = grouped.num_traces
  shuffled = [prompts[i] for i in (3, 0, 5, 2, 1, 4)]
  grouped(shuffled, jax.random.key(1), max_new_tokens=4, greedy=True)
  assert grouped.num_traces == traced


def test_length_groups_on_a_mesh(setup):
  model, _, _, eos, _ = setup
  _, padded = _length_pair(model, eos)
  prompts = LENGTH_CASES["three lengths"]
  want = padded(prompts, jax.random.key(5), max_new_tokens=MAX_NEW, temperature=1.0)
  sharded = Sampler(shard_model(_model(), make_mesh("4x2")), eos_token_ids=[eos],
                    pad_token_id=PAD, max_cache_len=48, batch_buckets=(4, 8),
                    prompt_buckets=(8, 16, 32), split_min_flops=0)
  assert sharded._plan(prompts, None, None, 8, MAX_NEW).groups is not None
  got = sharded(prompts, jax.random.key(5), max_new_tokens=MAX_NEW, temperature=1.0)
  _assert_same(got, want, rtol=1e-5)  # the model axis sums in another order (as above)


@pytest.mark.parametrize("ties", [False, True])
def test_filter_cutoff_keeps_what_a_sorted_filter_keeps(ties):
  """The cutoff found by bisection keeps exactly the tokens a descending sort's top-k then top-p
  keeps (the numpy reference above), ties at the boundary included, for k from 1 to past V."""
  from salt_jax.sampling import _filter_cutoff  # pylint: disable=import-outside-toplevel
  rng = np.random.default_rng(0)
  v = 300
  z = rng.normal(size=(24, v)).astype(np.float32) * 3
  if ties:  # few distinct values: many ties at every threshold
    z = np.round(z).astype(np.float32)
  z[0, :] = 0.0  # one row all equal
  z[1, :5] = -0.0  # signed zeros are one value
  cut = jax.jit(_filter_cutoff)
  for k, p in [(1, 1.0), (5, 1.0), (v, 0.5), (v + 7, 0.9), (40, 0.3), (40, 0.999), (v, 1.0),
               (2, 1e-6)]:
    got = np.asarray(cut(jnp.asarray(z), jnp.int32(k), jnp.float32(p)))
    for r in range(z.shape[0]):
      _, ref = _filtered_logprobs(z[r].astype(np.float64), 1.0, min(k, v), p)
      cutoff = z[r][ref].min()  # the reference keeps a prefix of the sorted values: all >= this
      np.testing.assert_array_equal(z[r] >= got[r, 0], z[r] >= cutoff, err_msg=f"k={k} p={p} "
                                                                                 f"row {r}")


def test_calls_report_their_phases_time_and_work(setup):
  """Each call splits its time into prefill and decode and reports the model work of each: the
  FLOPs of the prompts it prefilled (each distinct prompt once; a continued row's suffix after
  its cached tokens) and the bytes its decode had to read."""
  from salt_jax.models import cost  # pylint: disable=import-outside-toplevel
  model, _, _, eos, _ = setup
  s = Sampler(model, eos_token_ids=[eos], pad_token_id=PAD, max_cache_len=REUSE_CACHE,
              prompt_buckets=(SUFFIX_BUCKET, FULL_BUCKET), batch_buckets=(1, 2, 4))
  prompts = [PROMPTS[0], PROMPTS[0], PROMPTS[1]]
  out = s(prompts, jax.random.key(0), max_new_tokens=TURN_MAX_NEW, greedy=True, keep_cache=True)
  assert out.prefill_seconds > 0 and out.decode_seconds > 0
  assert out.prefill_flops == pytest.approx(cost.forward_flops(CONFIG, [7, 2]))
  new = [len(t) for t in out.tokens]  # greedy, no stop strings: the loop's own row lengths
  assert out.decode_bytes == pytest.approx(cost.decode_bytes(
      CONFIG, [len(p) for p in prompts], new, out.num_steps - 1, 4, 4))
  grown = _grow(prompts, out, [[3, 4], [5], [6, 7, 8]])
  more = s(grown, jax.random.key(0), max_new_tokens=2, greedy=True, continue_rows=[0, 1, 2])
  bases = [len(p) + len(t) - 1 for p, t in zip(prompts, out.tokens)]
  assert more.reused_tokens == sum(bases)
  assert more.prefill_flops == pytest.approx(
      cost.forward_flops(CONFIG, [len(g) - b for g, b in zip(grown, bases)], bases))
  # A new sampler's first call compiles its programs inside its two phases; the same call again
  # compiles nothing.
  assert 0 < out.prefill_compile_seconds <= out.prefill_seconds
  assert 0 < out.decode_compile_seconds <= out.decode_seconds
  again = s(prompts, jax.random.key(0), max_new_tokens=TURN_MAX_NEW, greedy=True, keep_cache=True)
  assert again.prefill_compile_seconds == 0.0 and again.decode_compile_seconds == 0.0
  assert [t.tolist() for t in again.tokens] == [t.tolist() for t in out.tokens]
