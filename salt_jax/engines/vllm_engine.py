"""`VLLMEngine`: vLLM's engine as a rollout sampler, fed the trainer's JAX parameters.

Called as `salt_jax.sampling.Sampler` is (`salt_jax.rollout.SamplerFn`): prompts go in as token
ids (`TokensPrompt`, no second tokenization), and a `SampleOutput` comes back with the same
conventions: the tokens up to and including the EOS id or the token that completes a stop
string, `policy_logprobs` under the raw model at temperature 1 (vLLM's default
`logprobs_mode="raw_logprobs"`, `logprobs=0`: the sampled token's own), finish reasons 'eos',
'stop' or 'length'. Whole-history conversations reuse their previous turns through vLLM's prefix
cache (`reused_tokens` counts the prompt tokens it served), not through `continue_rows`.

Differences from the built-in sampler:
  - randomness: the call's `key` seeds torch's global generator, which vLLM's CPU sampler draws
    its noise from (the engine runs in this process), so a key reproduces a sample, as the
    built-in sampler's does, yet the two engines draw different samples from one key (a
    per-request `seed` would be vLLM's own way; it crashed the CPU engine). Without a key the
    generator goes on from where it was (seeded once, `seed`);
  - `logprobs` (under the sampling distribution) are exact for greedy (0) and for temperature 1
    without top-k / top-p (the raw ones); with other settings they are NaN: vLLM returns one kind
    per engine, and the raw ones are what a trainer compares with its own.
The trainer recomputes old log-probs from its own params when it samples with this engine; the
engine's serve as a check (their mismatch is logged).

`update_params(params)` loads new weights into the engine in place (`worker.reload_weights` over
`salt_jax.models.hf_tensors`, the same mapping `save_pretrained` writes), then resets the prefix
cache, whose keys and values belong to the old weights.

vLLM runs in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`) on the CPU, its KV cache taking
`kv_cache_gib` GiB (`VLLM_CPU_KVCACHE_SPACE`). Both are environment variables vLLM reads when the
engine starts; they are set here, before.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import sys
import tempfile
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import numpy as np

from salt_jax.engines import VLLM_MISSING, check_vllm_engine
from salt_jax.sampling import SampleOutput, _stop_cut, check_request

logger = logging.getLogger(__name__)

DEFAULT_KV_CACHE_GIB = 4  # beside a trainer on a 24 GB machine


@contextlib.contextmanager
def _environment(**values: str):
  """Sets environment variables for the block, restoring the old values after it."""
  old = {k: os.environ.get(k) for k in values}
  os.environ.update(values)
  try:
    yield
  finally:
    for k, v in old.items():
      if v is None:
        os.environ.pop(k, None)
      else:
        os.environ[k] = v


def _unscannable(value) -> bool:
  """Whether vLLM's start-up walk over module namespaces raises on `value`: it reads
  `vars(value).get(...)` of every value with a `__dict__`, and some answer `__dict__` through a
  `__getattr__` with something else (llvmlite's `ffi.lib`, which numba and so bm25s import)."""
  try:
    return hasattr(value, "__dict__") and not hasattr(vars(value), "get")
  except Exception:  # pylint: disable=broad-exception-caught
    return True


@contextlib.contextmanager
def _modules_vllm_can_scan() -> Iterator[list[str]]:
  """Takes the modules that hold an `_unscannable` value out of `sys.modules` for the block
  (vLLM's engine start-up, which walks them all to rebind its Triton kernels: none of those
  modules holds one) and puts them back after; yields their names."""
  hidden = {}
  for name, module in list(sys.modules.items()):
    namespace = getattr(module, "__dict__", None)
    if isinstance(namespace, dict) and any(_unscannable(v) for v in list(namespace.values())):
      hidden[name] = module
  for name in hidden:
    del sys.modules[name]
  try:
    yield sorted(hidden)
  finally:
    for name, module in hidden.items():
      sys.modules.setdefault(name, module)


def _remove(folders: Sequence[str]) -> None:
  for d in folders:
    shutil.rmtree(d, ignore_errors=True)


def _kv_cache_space(kv_cache_gib) -> str:
  """VLLM_CPU_KVCACHE_SPACE for a KV cache of `kv_cache_gib` GiB: vLLM parses it with `int()`,
  so "4.0" would stop the engine's start; a whole number >= 1 (4 or 4.0) is written as "4"."""
  ok = (not isinstance(kv_cache_gib, bool) and isinstance(kv_cache_gib, (int, float))
        and float(kv_cache_gib).is_integer() and kv_cache_gib >= 1)
  if not ok:
    raise ValueError(f"kv_cache_gib must be a whole number of GiB >= 1 (vLLM's CPU engine takes "
                     f"VLLM_CPU_KVCACHE_SPACE as an int), got {kv_cache_gib!r}")
  return str(int(kv_cache_gib))


def _torch_seed(key) -> int:
  """A 63-bit seed for torch from a JAX PRNG key (typed or raw uint32 data): a hash of the key's
  words, since torch's CPU generator keeps only a seed's low 32 bits (and keys 1 and 2 differ
  only in their high word)."""
  if isinstance(key, jax.Array) and jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
    key = jax.random.key_data(key)
  words = np.asarray(key, np.uint32).ravel()
  digest = hashlib.blake2b(words.tobytes(), digest_size=8).digest()
  return int.from_bytes(digest, "little") & (2**63 - 1)


class VLLMEngine:
  """vLLM's `LLM` over a Hugging Face folder, with the built-in sampler's call interface.

  Example:
    engine = VLLMEngine.from_model(model, tokenizer, max_model_len=2048)
    out = engine(prompts, key, max_new_tokens=256, stop_strings=("</action>",),
                 decode_fn=tokenizer.decode)
    seconds = engine.update_params(new_params)   # after an optimizer step
  """

  def __init__(self, model_path: str, tokenizer, *, model_config, eos_token_ids: Sequence[int],
               max_model_len: int, dtype: str = "float32",
               kv_cache_gib: int = DEFAULT_KV_CACHE_GIB, seed: int = 0,
               enable_prefix_caching: bool = True, cleanup: Sequence[str] = (), **llm_kwargs):
    """Starts the engine (about a minute on a CPU).

    Args:
      model_path: a Hugging Face folder (config.json + safetensors) of the policy's architecture;
        its weights are the engine's until the first `update_params`.
      tokenizer: the trainer's tokenizer; written beside the engine (`save_tokenizer`) so vLLM
        detokenizes (stop strings) with exactly it.
      model_config: the policy's `salt_jax.models.ModelConfig` (the HF names of `update_params`).
      eos_token_ids: ids that end a response (kept in the output), as the built-in sampler's.
      max_model_len: prompt + response tokens at most (the trainer's max_cache_len).
      dtype: the engine's weights and compute: 'float32' or 'bfloat16'.
      kv_cache_gib: the engine's KV cache, in whole GiB (VLLM_CPU_KVCACHE_SPACE).
      seed: the engine's sampling generator.
      enable_prefix_caching: reuse the keys and values of shared prompt prefixes (the previous
        turns of a whole-history conversation).
      cleanup: temporary folders written for the engine (e.g. `model_path`'s), removed once it
        has started.
      **llm_kwargs: more `vllm.LLM` arguments (e.g. enable_lora=True, max_lora_rank=16).
    Raises:
      ValueError: vllm is not installed, or the policy is one the CPU engine refuses.
    """
    check_vllm_engine(model_config)
    kv_cache_space = _kv_cache_space(kv_cache_gib)
    try:
      # pylint: disable=import-outside-toplevel
      import vllm
    except ImportError as e:
      raise ValueError(VLLM_MISSING) from e
    from salt_jax.models.tokenizer import save_tokenizer  # pylint: disable=import-outside-toplevel
    self.model_config = model_config
    self.eos_token_ids = tuple(int(t) for t in eos_token_ids)
    self.max_model_len = int(max_model_len)
    # The tokenizer alone in its own folder: beside a config.json, transformers' AutoTokenizer
    # would pick the model type's class and could detokenize differently from ours.
    self._tok_dir = tempfile.mkdtemp(prefix="salt_jax_vllm_tok_")
    self._cleanup = [*cleanup, self._tok_dir]
    weakref.finalize(self, _remove, tuple(self._cleanup))  # at exit, if `close` was not called
    save_tokenizer(tokenizer, self._tok_dir)
    # ... with the generation config vLLM reads instead of the model folder's: vLLM stops a row on
    # its eos ids too, so they are ours (a --model folder's could name others).
    with open(os.path.join(self._tok_dir, "generation_config.json"), "w", encoding="utf-8") as f:
      json.dump({"eos_token_id": list(self.eos_token_ids)}, f)
    t0 = time.perf_counter()
    with _environment(VLLM_ENABLE_V1_MULTIPROCESSING="0",
                      VLLM_CPU_KVCACHE_SPACE=kv_cache_space), _modules_vllm_can_scan():
      self.llm = vllm.LLM(model=model_path, tokenizer=self._tok_dir, dtype=dtype, seed=int(seed),
                          max_model_len=self.max_model_len, generation_config=self._tok_dir,
                          enable_prefix_caching=enable_prefix_caching, **llm_kwargs)
    self.start_seconds = time.perf_counter() - t0
    _remove(tuple(cleanup))  # a weights folder written for the start: read, no longer needed
    logger.info("vllm engine started in %.1fs (%s, %s GiB KV cache)", self.start_seconds,
                dtype, kv_cache_gib)

  @classmethod
  def from_model(cls, model, tokenizer, *, model_path: str | None = None, **kwargs
                 ) -> "VLLMEngine":
    """An engine for a `CausalLM`: over `model_path` (a Hugging Face folder of the same
    architecture: a run's --model), else over the model written to a temporary folder with
    `save_pretrained` (the tiny policy, a GGUF, --init-params), removed once the engine started.

    kwargs: as `__init__` (eos_token_ids default: `stop_token_ids(tokenizer)`).
    """
    # pylint: disable=import-outside-toplevel
    from salt_jax.agent.prompts import stop_token_ids
    from salt_jax.models import save_pretrained
    check_vllm_engine(model.config)  # before writing anything
    kwargs.setdefault("eos_token_ids", stop_token_ids(tokenizer))
    cleanup = []
    if model_path is None:
      model_path = tempfile.mkdtemp(prefix="salt_jax_vllm_model_")
      cleanup.append(model_path)
      save_pretrained(model, model_path, dtype="float32",
                      generation={"eos_token_id": list(kwargs["eos_token_ids"])})
    return cls(model_path, tokenizer, model_config=model.config, cleanup=cleanup, **kwargs)

  # ---------------------------------------------------------------- weights

  def update_params(self, params) -> float:
    """Loads `params` (a `CausalLM`, its nnx.State or pure dict) into the engine and resets its
    prefix cache; returns the seconds it took."""
    import torch  # pylint: disable=import-outside-toplevel  (vllm's own dependency)
    from salt_jax.models import hf_tensors  # pylint: disable=import-outside-toplevel
    t0 = time.perf_counter()
    weights = ((name, torch.from_numpy(np.array(value, np.float32)))
               for name, value in hf_tensors(params, self.model_config))

    tied = self.model_config.tie_word_embeddings

    def reload(worker):
      worker.reload_weights(weights_iterator=weights)
      if tied:
        # The reload gives the embedding new tensors but puts the head's old ones back (vLLM's
        # loader skips lm_head.* of a tied model): tie them again, and repack the head for the
        # CPU's matmul, which holds its own copy of the weight.
        model = worker.model_runner.get_model()
        head = model.lm_head
        head.weight = model.model.embed_tokens.weight
        head.quant_method.process_weights_after_loading(head)

    self.llm.collective_rpc(reload)
    self.reset_prefix_cache()  # its keys and values were computed with the old weights
    return time.perf_counter() - t0

  def reset_prefix_cache(self) -> None:
    """Forgets every cached prompt block: the next call prefills its prompts in full."""
    self.llm.reset_prefix_cache()

  # ---------------------------------------------------------------- sampling

  def _sampling_params(self, max_new_tokens, temperature, top_p, top_k, greedy, stop_strings):
    from vllm import SamplingParams  # pylint: disable=import-outside-toplevel
    return SamplingParams(
        n=1, temperature=0.0 if greedy else float(temperature), top_p=float(top_p),
        top_k=int(top_k), max_tokens=int(max_new_tokens), stop=list(stop_strings) or None,
        stop_token_ids=list(self.eos_token_ids), include_stop_str_in_output=True, logprobs=0,
        skip_special_tokens=False)

  def __call__(self, prompts: Sequence[Sequence[int]], key: Any = None, *, max_new_tokens: int,
               temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0,
               greedy: bool = False, stop_strings: Sequence[str] = (),
               decode_fn: Callable[[list[int]], str] | None = None) -> SampleOutput:
    """Samples up to `max_new_tokens` new tokens for each prompt (see `Sampler.__call__`; `key`
    seeds the draw, see the module docstring)."""
    import torch  # pylint: disable=import-outside-toplevel  (vllm's own dependency)
    from vllm.inputs import TokensPrompt  # pylint: disable=import-outside-toplevel
    if isinstance(prompts, np.ndarray):
      prompts = list(prompts)
    check_request(prompts, max_new_tokens, temperature, top_p, top_k, stop_strings, decode_fn,
                  vocab_size=self.model_config.vocab_size)
    stop_strings = tuple(stop_strings)
    for i, p in enumerate(prompts):
      if len(p) + max_new_tokens > self.max_model_len:
        raise ValueError(f"prompt {i} has {len(p)} tokens: with max_new_tokens={max_new_tokens} "
                         f"it does not fit max_model_len={self.max_model_len}")
    greedy = bool(greedy) or temperature == 0
    params = self._sampling_params(max_new_tokens, temperature, top_p, top_k, greedy,
                                   stop_strings)
    raw_is_sampling = temperature == 1.0 and top_p >= 1.0 and top_k in (0, -1)
    if key is not None:
      torch.manual_seed(_torch_seed(key))
    results = self.llm.generate(
        [TokensPrompt(prompt_token_ids=[int(t) for t in p]) for p in prompts], params,
        use_tqdm=False)
    out = SampleOutput(tokens=[], logprobs=[], policy_logprobs=[],
                       texts=[] if decode_fn is not None else None, finish_reasons=[])
    eos = np.asarray(self.eos_token_ids)
    steps = reused = 0
    for res in results:
      c = res.outputs[0]
      toks = np.asarray(list(c.token_ids), np.int32)
      plp = np.array([entry[int(t)].logprob for t, entry in zip(toks, c.logprobs or [])],
                     np.float32)
      m = len(toks)
      steps = max(steps, m)
      reason = "eos" if m and np.isin(toks[-1], eos) else "length"
      if stop_strings:  # the built-in sampler's cut: the shortest prefix holding a stop string
        cut = _stop_cut(toks, stop_strings, decode_fn)
        if cut is not None:
          m, reason = cut, "stop"
      toks, plp = toks[:m], plp[:m]
      if len(plp) != m:
        raise RuntimeError(f"vllm returned {len(plp)} log-probs for {m} tokens")
      lp = (np.zeros(m, np.float32) if greedy else plp.copy() if raw_is_sampling
            else np.full(m, np.nan, np.float32))
      out.tokens.append(toks)
      out.logprobs.append(lp)
      out.policy_logprobs.append(plp)
      out.finish_reasons.append(reason)
      if decode_fn is not None:
        out.texts.append(decode_fn(toks.tolist()))
      reused += int(getattr(res, "num_cached_tokens", 0) or 0)
    out.num_steps, out.reused_tokens = steps, reused
    out.prefilled_tokens = sum(len(p) for p in prompts) - reused
    return out

  def close(self) -> None:
    """Stops the engine and removes the temporary folders written for it."""
    llm, self.llm = getattr(self, "llm", None), None
    if llm is not None:
      # pylint: disable=import-outside-toplevel
      from vllm.distributed.parallel_state import cleanup_dist_env_and_memory
      with contextlib.suppress(Exception):
        llm.llm_engine.engine_core.shutdown()
      del llm
      cleanup_dist_env_and_memory()  # so that another engine can start in this process
    _remove(tuple(self._cleanup))
