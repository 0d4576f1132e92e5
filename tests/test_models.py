"""salt_jax.models against transformers' PyTorch Qwen2ForCausalLM / LlamaForCausalLM.

Every checkpoint is a random tiny model written by transformers' own `save_pretrained`, with biases
and norm weights randomized (HF init leaves them at 0 / 1, which would hide layout bugs).
"""

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
from flax import nnx

from salt_jax.models import (ATTENTION_IMPLS, CausalLM, KVCache, ModelConfig,
                             default_attention_impl, from_pretrained, load_state_dict,
                             param_shardings, save_pretrained, shard_model)
from salt_jax.models.loading import hf_tensor_specs, random_state_dict
from salt_jax.models.partitioning import fit_spec
from salt_jax.sharding import batch_sharding, make_mesh
from jax.sharding import PartitionSpec as P

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

VOCAB = 96
NEW_TOKENS = 32

# (name, family, tied, heads, kv_heads, head_dim, rope_theta, config layout)
PARITY_CASES = [
    ("qwen2-untied-gqa2", "qwen2", False, 4, 2, None, 1e4, "rope_parameters"),
    ("qwen2-tied-gqa4-legacy", "qwen2", True, 4, 1, None, 1e6, "rope_theta"),
    ("llama-tied-mha-hd16-legacy", "llama", True, 4, 4, 16, 5e5, "rope_theta"),
]


def _torch_checkpoint(path, family, tied, heads, kv_heads, head_dim, theta, layout, seed=0):
  """Saves a random tiny HF model to `path`; returns the torch model (eval mode, f32)."""
  kw = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=heads, num_key_value_heads=kv_heads, tie_word_embeddings=tied,
            rope_parameters={"rope_type": "default", "rope_theta": theta},
            max_position_embeddings=128, initializer_range=0.1, pad_token_id=0,
            bos_token_id=None, eos_token_id=None)
  if head_dim is not None:
    kw["head_dim"] = head_dim
  if family == "qwen2":
    model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**kw))
  else:
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**kw))
  gen = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for name, p in model.named_parameters():
      if name.endswith("bias"):
        p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
      elif "norm" in name:
        p.copy_(torch.rand(p.shape, generator=gen) + 0.5)
  model.eval()
  model.save_pretrained(path)
  if layout == "rope_theta":  # the pre-transformers-5 layout many hub checkpoints still have
    cfg_path = os.path.join(path, "config.json")
    with open(cfg_path) as fh:
      cfg = json.load(fh)
    cfg["rope_theta"] = cfg.pop("rope_parameters")["rope_theta"]
    with open(cfg_path, "w") as fh:
      json.dump(cfg, fh)
  return model


def _prompts(batch, length, seed):
  """Left-padded random prompts of different lengths: ids i32[B, P], mask bool[B, P]."""
  rng = np.random.RandomState(seed)
  ids = rng.randint(1, VOCAB, size=(batch, length)).astype(np.int32)
  lengths = np.linspace(length, max(2, length // 2), batch).astype(int)
  mask = np.arange(length)[None, :] >= (length - lengths)[:, None]
  return np.where(mask, ids, 0).astype(np.int32), mask


def _random_model(cfg, seed, **kw):
  """A model with random weights, biases and norm scales, built without any jax compile."""
  return load_state_dict(cfg, random_state_dict(cfg, seed=seed, std=0.1), **kw)


def _positions(mask):
  return np.maximum(np.cumsum(mask, axis=-1) - 1, 0).astype(np.int32)


@nnx.jit
def _forward(model, ids, mask):
  return model(ids, mask)


@nnx.jit(static_argnames="last_logits_only")
def _step(model, ids, positions, cache, index, mask_cache, last_logits_only=False):
  return model.forward_cached(ids, positions, cache, index, mask_cache,
                              last_logits_only=last_logits_only)


def _greedy(model, ids, mask, steps):
  """Greedy decoding with forward_cached: (new tokens [B, steps], logits of every fed token)."""
  b, p = ids.shape
  cache = model.init_cache(b, p + steps)
  mask_cache = np.zeros((b, p + steps), bool)
  mask_cache[:, :p] = mask
  positions = _positions(mask)
  logits, cache = _step(model, ids, positions, cache, jnp.int32(0), mask_cache)
  all_logits = [np.asarray(logits)]
  token = np.asarray(jnp.argmax(logits[:, -1], axis=-1), np.int32)
  pos = positions[:, -1]
  tokens = [token]
  for i in range(steps - 1):
    pos = pos + 1
    mask_cache[:, p + i] = True
    logits, cache = _step(model, token[:, None], pos[:, None], cache, jnp.int32(p + i),
                          mask_cache)
    all_logits.append(np.asarray(logits))
    token = np.asarray(jnp.argmax(logits[:, -1], axis=-1), np.int32)
    tokens.append(token)
  return np.stack(tokens, axis=1), np.concatenate(all_logits, axis=1)


@pytest.mark.parametrize("case", PARITY_CASES, ids=[c[0] for c in PARITY_CASES])
def test_parity_with_transformers(case, tmp_path):
  _, family, tied, heads, kv_heads, head_dim, theta, layout = case
  tm = _torch_checkpoint(tmp_path, family, tied, heads, kv_heads, head_dim, theta, layout)
  model = from_pretrained(tmp_path)
  c = model.config
  assert (c.model_type, c.tie_word_embeddings, c.num_kv_heads, c.rope_theta) == (
      family, tied, kv_heads, theta)
  assert c.attention_bias == (family == "qwen2")
  assert c.head_dim == (head_dim or 32 // heads)

  # 32 greedy tokens identical to torch generate on ragged, left-padded prompts.
  ids, mask = _prompts(3, 12, seed=1)
  with torch.no_grad():
    gen = tm.generate(input_ids=torch.tensor(ids, dtype=torch.long),
                      attention_mask=torch.tensor(mask, dtype=torch.long),
                      max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                      pad_token_id=0).numpy()
  tokens, cached_logits = _greedy(model, ids, mask, NEW_TOKENS)
  np.testing.assert_array_equal(tokens, gen[:, ids.shape[1]:])

  # Full forward over the whole sequence: logits within 1e-4 of torch's.
  seq_mask = np.concatenate([mask, np.ones_like(tokens, bool)], axis=1)
  with torch.no_grad():
    ref = tm(input_ids=torch.tensor(gen), attention_mask=torch.tensor(seq_mask),
             position_ids=torch.tensor(_positions(seq_mask), dtype=torch.long)).logits.numpy()
  full = np.asarray(_forward(model, gen.astype(np.int32), seq_mask))
  assert full.dtype == np.float32 and full.shape == gen.shape + (VOCAB,)
  assert np.abs(full - ref)[seq_mask].max() <= 1e-4
  # Cached prefill + 31 decode steps give the same logits as the full forward.
  fed = seq_mask[:, :-1]
  np.testing.assert_allclose(cached_logits[fed], full[:, :-1][fed], atol=2e-5, rtol=0)


def test_sharded_checkpoint_with_index(tmp_path):
  tm = _torch_checkpoint(tmp_path / "one", "qwen2", False, 4, 2, None, 1e4, "rope_parameters")
  tm.save_pretrained(tmp_path / "many", max_shard_size="40KB")
  files = os.listdir(tmp_path / "many")
  assert "model.safetensors.index.json" in files
  assert sum(f.endswith(".safetensors") for f in files) > 1
  ids, mask = _prompts(2, 7, seed=2)
  a = _forward(from_pretrained(tmp_path / "one"), ids, mask)
  b = _forward(from_pretrained(tmp_path / "many"), ids, mask)
  np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  # An index naming a shard file that is not there is a clear error.
  os.remove(tmp_path / "many" / sorted(f for f in files if f.endswith(".safetensors"))[0])
  with pytest.raises(ValueError, match="not in"):
    from_pretrained(tmp_path / "many")


def test_bf16_load_gives_f32_logits_close_to_f32(tmp_path):
  tm = _torch_checkpoint(tmp_path, "qwen2", True, 4, 2, None, 1e4, "rope_parameters")
  model = from_pretrained(tmp_path, dtype=jnp.bfloat16)
  assert model.layers[0].attn.q_proj.w[...].dtype == jnp.bfloat16
  ids, mask = _prompts(2, 9, seed=3)
  with torch.no_grad():
    ref = tm(input_ids=torch.tensor(ids, dtype=torch.long), attention_mask=torch.tensor(mask),
             position_ids=torch.tensor(_positions(mask), dtype=torch.long)).logits.numpy()
  ours = _forward(model, ids, mask)
  assert ours.dtype == jnp.float32
  err = np.abs(np.asarray(ours) - ref)[mask]
  assert np.isfinite(err).all() and err.max() <= 0.05 * np.abs(ref).max()
  # The bf16 KV cache (prefill) path agrees with the bf16 full forward.
  cache = model.init_cache(2, 12)
  assert all(a.dtype == jnp.bfloat16 for a in cache.k + cache.v)
  mask_cache = np.concatenate([mask, np.zeros((2, 3), bool)], axis=1)
  cached, _ = _step(model, ids, _positions(mask), cache, jnp.int32(0), mask_cache)
  assert cached.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(cached)[mask], np.asarray(ours)[mask],
                             atol=0.05 * np.abs(ref).max())
  last, new_cache = _step(model, ids, _positions(mask), cache, jnp.int32(0), mask_cache,
                          last_logits_only=True)
  assert last.shape == (2, 1, VOCAB) and new_cache.k[0].dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(last[:, 0]), np.asarray(cached[:, -1]),
                             atol=0.01 * np.abs(ref).max())


def test_last_logits_only_matches_the_full_cached_pass():
  # The last layer then runs attention and MLP for the last token alone; every layer's keys and
  # values are still written for all tokens.
  model = _random_model(ModelConfig.tiny(), 1)
  ids, mask = _prompts(3, 10, seed=4)
  cache = model.init_cache(3, 14)
  mask_cache = np.concatenate([mask, np.zeros((3, 4), bool)], axis=1)
  full, full_cache = _step(model, ids, _positions(mask), cache, jnp.int32(0), mask_cache)
  last, last_cache = _step(model, ids, _positions(mask), cache, jnp.int32(0), mask_cache,
                           last_logits_only=True)
  assert last.shape == (3, 1, model.config.vocab_size)
  np.testing.assert_allclose(np.asarray(last), np.asarray(full)[:, -1:], atol=1e-5, rtol=0)
  for a, b in zip(jax.tree.leaves(last_cache), jax.tree.leaves(full_cache)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_save_pretrained_round_trip_through_transformers(tmp_path):
  cfg = ModelConfig.tiny(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_heads=4,
                         num_kv_heads=2, head_dim=8, rope_theta=3e4)
  model = _random_model(cfg, 3)
  save_pretrained(model, tmp_path)
  back = from_pretrained(tmp_path)
  for a, b in zip(jax.tree.leaves(nnx.state(model)), jax.tree.leaves(nnx.state(back))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  tm = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
  assert type(tm).__name__ == "Qwen2ForCausalLM"
  ids, mask = _prompts(2, 8, seed=4)
  with torch.no_grad():
    ref = tm(input_ids=torch.tensor(ids, dtype=torch.long), attention_mask=torch.tensor(mask),
             position_ids=torch.tensor(_positions(mask), dtype=torch.long)).logits.numpy()
  assert np.abs(np.asarray(_forward(model, ids, mask)) - ref)[mask].max() <= 1e-4


# ---- loader errors ----


@pytest.fixture
def saved_tiny(tmp_path):
  model = _random_model(ModelConfig.tiny(), 0)
  path = tmp_path / "ckpt"
  save_pretrained(model, path)
  return path


def _rewrite(path, edit):
  file = path / "model.safetensors"
  tensors = safetensors.numpy.load_file(file)
  edit(tensors)
  safetensors.numpy.save_file(tensors, file, metadata={"format": "pt"})


def test_missing_tensor_is_named(saved_tiny):
  _rewrite(saved_tiny, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
  with pytest.raises(ValueError, match=r"lacks.*model\.layers\.1\.mlp\.up_proj\.weight"):
    from_pretrained(saved_tiny)


def test_wrong_shape_is_named(saved_tiny):
  def edit(t):
    t["model.layers.0.self_attn.k_proj.weight"] = np.zeros((16, 64), np.float32)
  _rewrite(saved_tiny, edit)
  with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.k_proj\.weight.*\(16, 64\)"):
    from_pretrained(saved_tiny)


def test_unexpected_tensor_is_named(saved_tiny):
  _rewrite(saved_tiny, lambda t: t.update({"model.layers.0.mlp.extra": np.zeros(3, np.float32)}))
  with pytest.raises(ValueError, match=r"unexpected.*model\.layers\.0\.mlp\.extra"):
    from_pretrained(saved_tiny)


def test_tied_checkpoint_may_carry_lm_head(tmp_path):
  cfg = ModelConfig.tiny(tie_word_embeddings=True)
  model = _random_model(cfg, 1)
  save_pretrained(model, tmp_path)
  _rewrite(tmp_path, lambda t: t.update({"lm_head.weight": t["model.embed_tokens.weight"]}))
  back = from_pretrained(tmp_path)
  np.testing.assert_array_equal(np.asarray(back.lm_head_weight()),
                                np.asarray(model.embed_tokens[...]))


def test_pickle_only_folder_is_refused_without_unpickling(saved_tiny):
  os.remove(saved_tiny / "model.safetensors")
  # Not a valid pickle: if the loader tried to unpickle it, the error would differ.
  (saved_tiny / "pytorch_model.bin").write_bytes(b"not a pickle")
  with pytest.raises(ValueError, match="pickle"):
    from_pretrained(saved_tiny)


def test_folder_errors(tmp_path, saved_tiny):
  with pytest.raises(ValueError, match="does not exist"):
    from_pretrained(tmp_path / "nope")
  empty = tmp_path / "empty"
  shutil.copytree(saved_tiny, empty)
  os.remove(empty / "model.safetensors")
  with pytest.raises(ValueError, match="no \\*.safetensors"):
    from_pretrained(empty)
  os.remove(saved_tiny / "config.json")
  with pytest.raises(ValueError, match="config.json"):
    from_pretrained(saved_tiny)


def test_eager_init_and_load_state_dict_round_trip():
  # Few distinct weight shapes and an rbg key: eager init compiles one program per shape, and
  # threefry programs are slow to compile on CPU.
  cfg = ModelConfig.tiny(vocab_size=64, hidden_size=32, intermediate_size=32, num_heads=2,
                         num_kv_heads=2, head_dim=16, tie_word_embeddings=True,
                         attention_bias=False, model_type="llama")
  model = CausalLM(cfg, rngs=nnx.Rngs(params=jax.random.key(2, impl="rbg")))
  assert not hasattr(model.layers[0].attn, "q_bias") and not hasattr(model, "lm_head")
  assert model.lm_head_weight() is model.embed_tokens[...]
  np.testing.assert_array_equal(np.asarray(model.final_norm.scale[...]), np.ones(32))
  assert 0.01 < float(jnp.std(model.embed_tokens[...])) < 0.03
  pure = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  tensors = {}
  for name, spec in hf_tensor_specs(cfg).items():
    leaf = pure
    for k in spec.path:
      leaf = leaf[k]
    tensors[name] = spec.to_hf(np.asarray(leaf))
  back = load_state_dict(cfg, tensors)
  for a, b in zip(jax.tree.leaves(nnx.state(model)), jax.tree.leaves(nnx.state(back))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  with pytest.raises(ValueError, match="floating"):
    load_state_dict(cfg, tensors, dtype=jnp.int32)
  with pytest.raises(ValueError, match="ModelConfig"):
    load_state_dict(cfg.to_hf_dict(), tensors)
  tensors["model.norm.weight"] = np.zeros(32, np.int32)
  with pytest.raises(ValueError, match="model.norm.weight"):
    load_state_dict(cfg, tensors)


# ---- config ----


def test_config_from_both_layouts_and_transformers():
  d = transformers.Qwen2Config(vocab_size=100, hidden_size=64, intermediate_size=96,
                               num_hidden_layers=3, num_attention_heads=8,
                               num_key_value_heads=2, rope_theta=1e6,
                               tie_word_embeddings=True, eos_token_id=[5, 7]).to_dict()
  new = ModelConfig.from_hf_dict(d)
  legacy = dict(d)
  legacy["rope_theta"] = legacy.pop("rope_parameters")["rope_theta"]
  assert ModelConfig.from_hf_dict(legacy) == new
  assert (new.vocab_size, new.hidden_size, new.intermediate_size, new.num_layers) == (
      100, 64, 96, 3)
  assert (new.num_heads, new.num_kv_heads, new.head_dim, new.rope_theta) == (8, 2, 8, 1e6)
  assert new.tie_word_embeddings and new.attention_bias and new.eos_token_ids == (5, 7)
  hash(new)  # static-arg safe
  assert ModelConfig.from_hf_dict(new.to_hf_dict()) == new
  llama = ModelConfig.from_hf_dict(transformers.LlamaConfig(
      vocab_size=50, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
      num_attention_heads=4, head_dim=32).to_dict())
  assert not llama.attention_bias and llama.head_dim == 32 and llama.num_kv_heads == 4
  assert llama.rope_theta == 10000.0 and llama.eos_token_ids == (2,)


@pytest.mark.parametrize("edit, match", [
    (lambda d: d.update(model_type="mistral"), "model_type"),
    (lambda d: d.update(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4}), "yarn"),
    (lambda d: d.update(rope_scaling={"type": "linear", "factor": 2.0}), "linear"),
    (lambda d: d.update(use_sliding_window=True), "sliding"),
    (lambda d: d.update(hidden_act="gelu"), "hidden_act"),
    (lambda d: d.pop("hidden_size"), "hidden_size"),
    (lambda d: d.update(num_key_value_heads=3), "multiple"),
    (lambda d: d.update(model_type="llama", attention_bias=True), "attention_bias"),
    (lambda d: d.update(model_type="llama", mlp_bias=True), "mlp_bias"),
])
def test_config_rejects_unsupported(edit, match):
  d = ModelConfig.tiny().to_hf_dict()
  edit(d)
  with pytest.raises(ValueError, match=match):
    ModelConfig.from_hf_dict(d)


def test_tiny_config_validation():
  assert ModelConfig.tiny(num_layers=3).num_layers == 3
  with pytest.raises(ValueError, match="vocab_size"):
    ModelConfig.tiny(vocab_size=0)
  with pytest.raises(ValueError, match="even"):
    ModelConfig.tiny(head_dim=15)
  with pytest.raises(ValueError, match="multiple"):
    ModelConfig.tiny(num_kv_heads=3)


# ---- attention implementations ----


def test_attention_impl_is_validated_and_stays_out_of_config_json():
  with pytest.raises(ValueError, match="attention_impl"):
    ModelConfig.tiny(attention_impl="flash")
  d = ModelConfig.tiny(attention_impl="batched").to_hf_dict()
  assert "attention_impl" not in json.dumps(d)
  assert ModelConfig.from_hf_dict(d) == ModelConfig.tiny()  # None: the machine's default
  model = nnx.eval_shape(lambda: CausalLM(ModelConfig.tiny(), rngs=nnx.Rngs(0)))
  assert model.config.attention_impl == default_attention_impl()
  assert set(ATTENTION_IMPLS) == {"batched", "cpu_chunked", "cpu_chunked_sum", "query_blocks"}


@nnx.jit
def _prefill_then_decode(model, ids, mask):
  """Logits of a full forward over ids[B, P], and of one decode step after a cached prefill."""
  b, p = ids.shape
  positions = jnp.maximum(jnp.cumsum(mask, axis=-1) - 1, 0)
  cache_mask = jnp.zeros((b, p + 1), bool).at[:, :p].set(mask)
  _, cache = model.forward_cached(ids, positions, model.init_cache(b, p + 1), 0, cache_mask)
  step, _ = model.forward_cached(ids[:, -1:], positions[:, -1:] + 1, cache, p,
                                 cache_mask.at[:, p].set(True))
  return model(ids, mask), step


@pytest.mark.parametrize("impl", sorted(ATTENTION_IMPLS))
def test_every_attention_impl_matches_batched(impl, monkeypatch):
  # One row per chunk and causal query blocks of 4, so that the CPU implementations' loops run at
  # these small shapes (10 tokens: blocks of 4, 4 and 2).
  from salt_jax.models import qwen2
  monkeypatch.setattr(qwen2, "_ATTENTION_CHUNK_BYTES", 1)
  monkeypatch.setattr(qwen2, "_CAUSAL_QUERY_BLOCK", 4)
  monkeypatch.setattr(qwen2, "_QUERY_BLOCK", 4)
  tensors = random_state_dict(ModelConfig.tiny(), seed=0, std=0.1)
  reference = load_state_dict(ModelConfig.tiny(attention_impl="batched"), tensors)
  model = load_state_dict(ModelConfig.tiny(attention_impl=impl), tensors)
  ids, mask = _prompts(4, 10, seed=3)
  want_full, want_step = _prefill_then_decode(reference, ids, mask)
  full, step = _prefill_then_decode(model, ids, mask)
  # Only real tokens: at left padding a query's output is an average over whatever keys it sees.
  np.testing.assert_allclose(np.asarray(full)[mask], np.asarray(want_full)[mask], atol=1e-5,
                             rtol=0)
  np.testing.assert_allclose(np.asarray(step), np.asarray(want_step), atol=1e-5, rtol=0)


@nnx.jit(static_argnames=("fresh", "last_logits_only", "width"))
def _prefill_at(model, ids, mask, cursor, *, fresh, last_logits_only, width):
  """A prefill of ids[B, T] written at slot `cursor` of a fresh `width`-slot cache, then one
  decode step after it: (prefill logits, cache, step logits)."""
  b, t = ids.shape
  positions = jnp.maximum(jnp.cumsum(mask, axis=-1) - 1, 0)
  cache_mask = jax.lax.dynamic_update_slice(jnp.zeros((b, width), bool), mask, (0, cursor))
  logits, cache = model.forward_cached(ids, positions, model.init_cache(b, width), cursor,
                                       cache_mask, last_logits_only=last_logits_only, fresh=fresh)
  step, _ = model.forward_cached(ids[:, -1:], positions[:, -1:] + 1, cache, cursor + t,
                                 cache_mask.at[:, cursor + t].set(True))
  return logits, cache, step


@pytest.mark.parametrize("impl", sorted(ATTENTION_IMPLS))
def test_a_fresh_prefill_attends_only_to_its_own_tokens(impl, monkeypatch):
  """fresh=True (the prompt's own causal square) gives the logits, cache and next step that
  attending over every slot of a longer cache gives, wherever the prompt is written, with the
  last position's logits alone or all of them; a longer cache than the prompt is the sampler's
  case (its slots after the prompt are for decoding)."""
  from salt_jax.models import qwen2
  monkeypatch.setattr(qwen2, "_ATTENTION_CHUNK_BYTES", 1)
  monkeypatch.setattr(qwen2, "_CAUSAL_QUERY_BLOCK", 4)
  monkeypatch.setattr(qwen2, "_QUERY_BLOCK", 4)
  model = _random_model(ModelConfig.tiny(attention_impl=impl), 1)
  ids, mask = _prompts(3, 10, seed=5)
  for cursor, last in ((0, True), (0, False), (5, True)):
    want = _prefill_at(model, ids, mask, jnp.int32(cursor), fresh=False, last_logits_only=last,
                       width=24)
    got = _prefill_at(model, ids, mask, jnp.int32(cursor), fresh=True, last_logits_only=last,
                      width=24)
    rows = mask if not last else np.ones((3, 1), bool)
    np.testing.assert_allclose(np.asarray(got[0])[rows], np.asarray(want[0])[rows], atol=1e-5,
                               rtol=0)
    # Keys and values at the real tokens' slots (a padding slot's are never read: a padding
    # query attends to nothing valid, so its output depends on the slots it is shown).
    real = np.zeros((3, 24), bool)
    real[:, cursor:cursor + 10] = mask
    for a, b in zip(got[1].k + got[1].v, want[1].k + want[1].v):
      slot_axis = 3 if a.shape[3] == 24 else 2
      keep = np.expand_dims(real, (1, 2) if slot_axis == 3 else (1, 3))
      np.testing.assert_allclose(np.where(keep, a, 0), np.where(keep, b, 0), atol=1e-5, rtol=0)
    np.testing.assert_allclose(np.asarray(got[2]), np.asarray(want[2]), atol=1e-5, rtol=0)


# ---- forward argument checks ----


def test_forward_rejects_bad_inputs():
  model = _random_model(ModelConfig.tiny(), 0)
  ids = jnp.zeros((2, 5), jnp.int32)
  with pytest.raises(ValueError, match="rank 2"):
    model(jnp.zeros((5,), jnp.int32))
  with pytest.raises(ValueError, match="integer"):
    model(jnp.zeros((2, 5), jnp.float32))
  with pytest.raises(ValueError, match="attention_mask"):
    model(ids, jnp.ones((2, 4), bool))
  with pytest.raises(ValueError, match="positions"):
    model(ids, positions=jnp.zeros((2, 5), jnp.float32))
  cache = model.init_cache(2, 8)
  assert isinstance(cache, KVCache) and cache.shape == (2, 2, 2, 8, 16) and len(cache.v) == 2
  assert cache.k[0].shape == (2, 2, 16, 8) and cache.v[0].shape == (2, 2, 8, 16)  # keys slots-last
  # take_rows (a continued sampler call) against numpy: rows gathered, then each array's slot
  # axis zero-padded.
  filled = jax.tree.map(lambda a: jnp.arange(a.size, dtype=a.dtype).reshape(a.shape) + 1, cache)
  grown = filled.take_rows(jnp.array([1, 1, 0]), 11)
  assert isinstance(grown, KVCache) and grown.shape == (2, 3, 2, 11, 16)
  for got, want, axis in ((grown.k, filled.k, 3), (grown.v, filled.v, 2)):
    pad = [(0, 0)] * 4
    pad[axis] = (0, 3)
    for g, w in zip(got, want):
      np.testing.assert_array_equal(g, np.pad(np.asarray(w)[[1, 1, 0]], pad))
  ok_mask = jnp.ones((2, 8), bool)
  with pytest.raises(ValueError, match="exceeds"):
    model.forward_cached(ids, ids, cache, 4, ok_mask)
  with pytest.raises(ValueError, match="attention_mask_cache"):
    model.forward_cached(ids, ids, cache, 0, jnp.ones((2, 7), bool))
  with pytest.raises(ValueError, match="cache shape"):
    model.forward_cached(ids, ids, model.init_cache(3, 8), 0, ok_mask)
  with pytest.raises(ValueError, match="scalar"):
    model.forward_cached(ids, ids, cache, jnp.zeros((2,), jnp.int32), ok_mask)
  for bad in (KVCache(cache.k, cache.v[:1]), KVCache(cache.k, (cache.v[0], cache.v[1][:, :, :4])),
              KVCache((), ()), KVCache(cache.v, cache.v)):  # last: keys in the values' layout
    with pytest.raises(ValueError, match="same-shaped"):
      model.forward_cached(ids, ids, bad, 0, ok_mask)
  with pytest.raises(ValueError, match="cache shape"):  # one layer short
    model.forward_cached(ids, ids, KVCache(cache.k[:1], cache.v[:1]), 0, ok_mask)
  with pytest.raises(ValueError, match="max_len"):
    model.init_cache(2, 0)


@pytest.mark.parametrize("mesh", [None, "1x1"])
@pytest.mark.parametrize("cut", ["rows", "query_blocks", "both"])
def test_cut_attention_matches_whole_batch(cut, mesh, monkeypatch):
  # The parity shapes are too small to be cut: force one row per chunk and/or causal query
  # blocks of 4 (10 tokens: blocks of 4, 4 and 2, each over the keys up to its end) and compare
  # logits and gradients with the whole-batch, whole-square path. "1x1": on the trainer's
  # one-device mesh, where the loops run too.
  from salt_jax.models import qwen2, shard_model
  model = _random_model(ModelConfig.tiny(), 0)
  if mesh is not None:
    shard_model(model, make_mesh(mesh))
  ids, mask = _prompts(4, 10, seed=3)

  def logits_and_grads():
    def loss(m):
      logits = m(ids, mask)
      return jnp.sum(jnp.where(mask[..., None], logits, 0.0) ** 2), logits
    (_, logits), grads = nnx.jit(nnx.value_and_grad(loss, has_aux=True))(model)
    return logits, grads

  loops = qwen2._loops_over_batch(model.config.attention_impl, model.activation_sharding)
  assert qwen2._attention_rows_per_chunk(4, 10 * 10 * 4, loops) == 4
  assert qwen2._CAUSAL_QUERY_BLOCK >= 10
  whole_logits, whole_grads = logits_and_grads()
  if cut in ("rows", "both"):
    monkeypatch.setattr(qwen2, "_ATTENTION_CHUNK_BYTES", 1)
    assert qwen2._attention_rows_per_chunk(4, 10 * 10 * 4, loops) == (1 if loops else 4)
  if cut in ("query_blocks", "both"):
    monkeypatch.setattr(qwen2, "_CAUSAL_QUERY_BLOCK", 4)
  logits, grads = logits_and_grads()
  # At left padding (no valid key at or before it) a query's output is a meaningless uniform
  # average over whatever keys its block sees; only real tokens must agree.
  np.testing.assert_allclose(np.asarray(logits)[mask], np.asarray(whole_logits)[mask],
                             atol=1e-5, rtol=0)
  for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(whole_grads)):
    b = np.asarray(b)  # f32 sums in another order: error relative to the gradient's scale
    np.testing.assert_allclose(np.asarray(a), b, atol=1e-5 * np.abs(b).max(), rtol=0)


@pytest.mark.parametrize("mesh,block,runs,bodies", [
    (None, 3, 2, 3),    # 10 tokens: runs of 1 and 2 blocks of 3 (keys up to 3 and 9), a tail of 1
    ("2x1", 2, 2, 2),   # runs of 2 and 3 blocks of 2, no tail
    ("1x2", 4, 4, 3)])  # more runs than blocks: 2 runs of one block, a tail of 2
def test_query_blocks_match_batched_attention_with_gradients(mesh, block, runs, bodies,
                                                             monkeypatch):
  # 'query_blocks' (long rows on accelerators) against 'batched' on the same weights: logits and
  # gradients, on one device and with the batch or the heads split over a mesh; each run of
  # blocks one loop whose body is under a checkpoint, a partial last block alone.
  from salt_jax.models import qwen2, shard_model
  monkeypatch.setattr(qwen2, "_QUERY_BLOCK", block)
  monkeypatch.setattr(qwen2, "_QUERY_BLOCK_RUNS", runs)
  tensors = random_state_dict(ModelConfig.tiny(), seed=0, std=0.1)
  ids, mask = _prompts(4, 10, seed=3)

  def logits_and_grads(impl):
    model = load_state_dict(ModelConfig.tiny(attention_impl=impl), tensors)
    if mesh is not None:
      shard_model(model, make_mesh(mesh))

    def loss(m):
      logits = m(ids, mask)
      return jnp.sum(jnp.where(mask[..., None], logits, 0.0) ** 2), logits
    (_, logits), grads = nnx.jit(nnx.value_and_grad(loss, has_aux=True))(model)
    jaxpr = str(jax.make_jaxpr(lambda i, m: nnx.merge(*nnx.split(model))(i, m))(ids, mask))
    return logits, grads, jaxpr.count("remat")

  want_logits, want_grads, plain = logits_and_grads("batched")
  logits, grads, blocked = logits_and_grads("query_blocks")
  assert blocked - plain == bodies * ModelConfig.tiny().num_layers  # checkpointed bodies a layer
  np.testing.assert_allclose(np.asarray(logits)[mask], np.asarray(want_logits)[mask],
                             atol=1e-5, rtol=0)
  for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)):
    b = np.asarray(b)
    np.testing.assert_allclose(np.asarray(a), b, atol=1e-5 * np.abs(b).max(), rtol=0)


def test_attention_loops_run_only_where_nothing_is_sharded():
  from salt_jax.models import qwen2
  from salt_jax.models.partitioning import ActivationSharding
  for mesh, loops in ((None, True), ("1x1", True), ("2x1", False), ("1x2", False)):
    shard = ActivationSharding(None if mesh is None else make_mesh(mesh))
    for impl in ("cpu_chunked", "cpu_chunked_sum"):
      assert qwen2._loops_over_batch(impl, shard) == loops, (impl, mesh)
    for impl in ("batched", "query_blocks"):  # accelerator programs: never the CPU loops
      assert not qwen2._loops_over_batch(impl, shard), (impl, mesh)
    chunked = qwen2._loops_over_batch("cpu_chunked", shard)
    assert qwen2._attention_rows_per_chunk(8, 1 << 30, chunked) == (1 if loops else 8), mesh


# ---- sharding ----


def test_fit_spec_drops_axes_that_do_not_divide():
  mesh = make_mesh("4x2")
  assert fit_spec(P("data", "model", None), (64, 1, 16), mesh) == P("data", None, None)
  assert fit_spec(P("model"), (6, 3), mesh) == P("model", None)
  with pytest.raises(ValueError, match="more entries"):
    fit_spec(P("data", None, None), (4, 4), mesh)
  with pytest.raises(ValueError, match="axis"):
    fit_spec(P("fsdp"), (4,), mesh)


def test_mesh_4x2_matches_one_device(tmp_path):
  """FSDP x TP on 8 simulated devices: same logits and greedy tokens as one device."""
  cfg = ModelConfig.tiny()
  model = _random_model(cfg, 5)
  save_pretrained(model, tmp_path)
  mesh = make_mesh("4x2")
  sharded = from_pretrained(tmp_path, mesh=mesh)
  q = sharded.layers[0].attn.q_proj.w[...]
  assert q.sharding.spec == P("data", "model", None)
  assert q.addressable_shards[0].data.shape == (64 // 4, 4 // 2, 16)  # no full copy per device
  expected = param_shardings(cfg, mesh)
  assert expected["layers"][1]["mlp"]["down_proj"]["w"].spec == P("model", "data")
  assert (sharded.layers[1].mlp.down_proj.w[...].sharding.spec ==
          expected["layers"][1]["mlp"]["down_proj"]["w"].spec)
  cache = sharded.init_cache(4, 16)
  assert all(a.sharding.spec == P("data", "model", None, None) for a in cache.k + cache.v)

  # Greedy on the mesh (prefill + decode through the sharded cache), then one full forward of
  # the result on one device and on the mesh: same logits, and its argmax reproduces the tokens.
  ids, mask = _prompts(4, 10, seed=6)
  steps = 6
  tokens, cached = _greedy(sharded, ids, mask, steps)
  seq = np.concatenate([ids, tokens], axis=1)
  seq_mask = np.concatenate([mask, np.ones_like(tokens, bool)], axis=1)
  ref = np.asarray(_forward(model, seq, seq_mask))
  np.testing.assert_array_equal(ref[:, -steps - 1:-1].argmax(-1), tokens)
  fed = seq_mask[:, :-1]  # padding rows attend to nothing real: their logits are arbitrary
  np.testing.assert_allclose(cached[fed], ref[:, :-1][fed], atol=1e-5, rtol=0)
  out = _forward(sharded, jax.device_put(seq, batch_sharding(mesh, 2)),
                 jax.device_put(seq_mask, batch_sharding(mesh, 2)))
  assert out.sharding.spec[0] == "data"
  np.testing.assert_allclose(np.asarray(out), ref, atol=1e-5, rtol=0)

  # shard_model on an in-memory model gives the same placement and logits.
  resharded = shard_model(_random_model(cfg, 5), mesh)
  assert resharded.embed_tokens[...].sharding.spec == P("model", "data")
  np.testing.assert_allclose(np.asarray(_forward(resharded, seq, seq_mask)), ref, atol=1e-5,
                             rtol=0)


def test_einsum_projection_against_numpy_and_bad_equations():
  """`Einsum` contracts x's trailing axes with the weight's in the weight's order, over any
  leading axes (as numpy's einsum does); an equation that is not 'T<contracted>,<weight>->T<kept>'
  over its weight's shape is refused."""
  from salt_jax.models.qwen2 import Einsum  # pylint: disable=import-outside-toplevel
  kw = dict(rngs=nnx.Rngs(0), dtype=jnp.float32, param_dtype=jnp.float32)
  o = Einsum("TNH,NHD->TD", (3, 4, 5), "o_weight_nhd", **kw)
  x = np.random.default_rng(0).normal(size=(2, 6, 3, 4)).astype(np.float32)
  np.testing.assert_allclose(o(x), np.einsum("btnh,nhd->btd", x, np.asarray(o.w[...])),
                             rtol=1e-5, atol=1e-5)
  q = Einsum("TD,DNH->TNH", (5, 3, 4), "q_weight_dnh", **kw)
  y = np.random.default_rng(1).normal(size=(7, 5)).astype(np.float32)
  np.testing.assert_allclose(q(y), np.einsum("td,dnh->tnh", y, np.asarray(q.w[...])),
                             rtol=1e-5, atol=1e-5)
  for equation, shape in (("TD,DF->TF", (4, 5, 6)), ("TD,DF->DF", (4, 5)),
                          ("TD,DF->TFX", (4, 5)), ("TX,DF->TF", (4, 5))):
    with pytest.raises(ValueError, match="must be 'T<contracted>"):
      Einsum(equation, shape, "ffw_weight_df", **kw)
