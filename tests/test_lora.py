"""LoRA through qwix (salt_jax.models.lora) and training with it (--lora-rank).

The adapters against plain numpy (W + A B alpha / R), every forward path of the model (log-probs,
the sampler) going through them, the trainer training them alone with the base frozen and the
reference the base, resume, export (merged, and PEFT's folder loaded by peft), SFT, bad settings.
"""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from salt_jax.config import TrainConfig
from salt_jax.logprobs import token_logprobs
from salt_jax.models import ModelConfig, lora
from salt_jax.models.loading import load_state_dict, random_state_dict
from salt_jax.sampling import Sampler
from salt_jax.sharding import make_mesh

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # qwix reads .value

PROJECTIONS = {"attn": ("q_proj", "k_proj", "v_proj", "o_proj"),
               "mlp": ("gate_proj", "up_proj", "down_proj")}


def _random_model(cfg, seed=3):
  return load_state_dict(cfg, random_state_dict(cfg, seed=seed, std=0.1))


def _ids(batch=2, length=9, seed=1, vocab=96):
  return np.random.RandomState(seed).randint(1, vocab, size=(batch, length)).astype(np.int32)


def _logp(model, ids):
  return np.asarray(token_logprobs(model, jnp.asarray(ids), jnp.asarray(np.roll(ids, -1, 1))))


def _randomize_b(model, seed=0, std=0.1):
  rng = np.random.default_rng(seed)
  for _, m in model.iter_modules():
    if hasattr(m, "w_lora_b"):
      m.w_lora_b[...] = rng.normal(0.0, std, m.w_lora_b[...].shape).astype(np.float32)


@pytest.mark.parametrize("bias", [True, False])  # Qwen2 (q/k/v bias) and Llama / SmolLM2
def test_adapters_on_every_projection_equal_numpy_merged_weights(bias):
  """A [in, R] and B [R, out] on all seven projections of every layer, nothing else; at init the
  log-probs equal the base's exactly (B = 0); with B random the model equals the base with each
  weight W + A B alpha / R (numpy), and `merged` builds that model."""
  cfg = ModelConfig.tiny(attention_bias=bias)
  ids = _ids()
  base, model = _random_model(cfg), _random_model(cfg)
  rank, alpha = 4, 8.0
  lora.apply_lora(model, rank=rank, alpha=alpha, seed=0)
  found = {jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(
      nnx.to_pure_dict(lora.lora_state(model)))[0]}
  assert found == {f"['layers'][{i}]['{part}']['{proj}']['w_lora_{ab}']"
                   for i in range(cfg.num_layers) for part, projs in PROJECTIONS.items()
                   for proj in projs for ab in "ab"}
  np.testing.assert_array_equal(_logp(model, ids), _logp(base, ids))

  _randomize_b(model)
  reference = _random_model(cfg)
  for i, layer in enumerate(model.layers):
    for part, projs in PROJECTIONS.items():
      for proj in projs:
        m = getattr(getattr(layer, part), proj)
        a, b = np.asarray(m.w_lora_a[...]), np.asarray(m.w_lora_b[...])
        assert a.shape == (int(np.prod(m.w.shape[:len(m.weight_axes)])), rank)
        target = getattr(getattr(reference.layers[i], part), proj).w
        target[...] = np.asarray(target[...]) + (a @ b).reshape(target.shape) * alpha / rank
  got = _logp(model, ids)
  assert np.abs(got - _logp(base, ids)).max() > 1e-2  # the adapters moved it
  np.testing.assert_allclose(got, _logp(reference, ids), atol=2e-5, rtol=1e-4)
  np.testing.assert_allclose(_logp(lora.merged(model), ids), got, atol=2e-5, rtol=1e-4)
  assert not lora.has_lora(lora.merged(model))
  np.testing.assert_array_equal(_logp(lora.merged(model, adapters=False), ids), _logp(base, ids))


def test_the_sampler_runs_through_the_adapters():
  """qwix wraps each projection, so the sampler's cached forward uses the adapters too: greedy
  tokens equal those of the merged model, log-probs to 1e-5."""
  cfg = ModelConfig.tiny(attention_bias=True)
  model = lora.apply_lora(_random_model(cfg), rank=4, alpha=4.0)
  _randomize_b(model, std=0.3)
  prompts = [list(range(5, 14)), list(range(20, 26))]
  outs = []
  for m in (model, lora.merged(model), _random_model(cfg)):
    s = Sampler(m, eos_token_ids=[0], pad_token_id=0, max_cache_len=64, prompt_buckets=(16,))
    outs.append(s(prompts, jax.random.key(0), max_new_tokens=8, greedy=True))
  for a, b in zip(outs[0].tokens, outs[1].tokens):
    np.testing.assert_array_equal(a, b)
  for a, b in zip(outs[0].policy_logprobs, outs[1].policy_logprobs):
    np.testing.assert_allclose(a, b, atol=1e-5)
  assert any(not np.array_equal(a, b) for a, b in zip(outs[0].tokens, outs[2].tokens))


def test_targets_pick_projections_and_sharding_follows_the_base():
  """A regex over 'layers/<i>/<attn|mlp>/<name>' picks the wrapped projections; on a 2x2 mesh
  each A / B is split as its base weight's first input / output axis, its rank over the other
  mesh axis, and the model's log-probs are the unsharded base's (B = 0)."""
  cfg = ModelConfig.tiny()
  model = lora.apply_lora(_random_model(cfg), rank=2, alpha=2.0, targets="layers/0/attn/.*")
  wrapped = {"/".join(map(str, p)) for p, m in model.iter_modules() if hasattr(m, "w_lora_a")}
  assert wrapped == {f"layers/0/attn/{p}" for p in PROJECTIONS["attn"]}
  peft = lora.peft_config(model)
  assert peft["target_modules"] == sorted(f"model.layers.0.self_attn.{p}"
                                          for p in PROJECTIONS["attn"])
  mesh = make_mesh("2x2")
  sharded = lora.apply_lora(load_state_dict(cfg, random_state_dict(cfg, seed=3, std=0.1),
                                            mesh=mesh),
                            rank=2, alpha=2.0)
  from salt_jax.models.partitioning import shard_model  # pylint: disable=import-outside-toplevel
  shard_model(sharded, mesh)
  attn, mlp = sharded.layers[0].attn, sharded.layers[0].mlp
  spec = lambda v: tuple(v[...].sharding.spec)  # noqa: E731
  # The in / out axis as the base weight's, the rank over the other mesh axis.
  assert spec(attn.q_proj.w_lora_a) == ("data", "model")  # A [D, r]
  assert spec(attn.q_proj.w_lora_b) == ("data", "model")  # B [r, N*H]
  assert spec(attn.o_proj.w_lora_a) == ("model", "data")  # A [N*H, r]
  assert spec(attn.o_proj.w_lora_b) == ("model", "data")  # B [r, D]
  assert spec(mlp.down_proj.w_lora_a) == ("model", "data")
  ids = _ids(batch=4)
  np.testing.assert_allclose(_logp(sharded, ids), _logp(_random_model(cfg), ids), atol=1e-5)


def test_bad_lora_settings_are_refused():
  cfg = ModelConfig.tiny()
  model = _random_model(cfg)
  for kw, match in ((dict(rank=0, alpha=1.0), "rank must be an int >= 1"),
                    (dict(rank=-2, alpha=1.0), "rank must be an int >= 1"),
                    (dict(rank=True, alpha=1.0), "rank must be an int >= 1"),
                    (dict(rank=2, alpha=0.0), "alpha must be > 0"),
                    (dict(rank=2, alpha=float("nan")), "alpha must be > 0"),
                    (dict(rank=2, alpha=1.0, targets="("), "not a regular expression"),
                    (dict(rank=2, alpha=1.0, targets=".*qproj"), "matches no projection")):
    with pytest.raises(ValueError, match=match):
      lora.apply_lora(model, **kw)
  assert not lora.has_lora(model)  # nothing half-applied
  lora.apply_lora(model, rank=2, alpha=1.0)
  with pytest.raises(ValueError, match="already has LoRA"):
    lora.apply_lora(model, rank=2, alpha=1.0)
  with pytest.raises(ValueError, match="no LoRA adapters"):
    lora.peft_config(_random_model(cfg))


# ---------------------------------------------------------------- training with --lora-rank

from tests.test_train import (  # noqa: E402  pylint: disable=wrong-import-position
    BASE, _kill_three_times_and_resume, _untimed, warm_params)
from salt_jax.models.build import build_policy, build_tokenizer  # noqa: E402
from salt_jax.train import Trainer  # noqa: E402

LORA_RANK = 4


def _sizes(tree):
  return sum(x.size for x in jax.tree.leaves(tree))


@pytest.fixture(scope="module")
def warm():
  """test_train.py's warm start (the same params, cloned once per test run)."""
  return warm_params()


@pytest.fixture(scope="module")
def lora_run(warm, tmp_path_factory):
  """The trainer fixture's run (test_train's run A) with rank-4 adapters at lr 3e-3: (config,
  trainer, rows, base arrays and adapters before training, an iteration's mini-batch)."""
  cfg = dataclasses.replace(BASE, out=str(tmp_path_factory.mktemp("lora")), init_params=warm,
                            max_to_keep=3, lora_rank=LORA_RANK, lr=3e-3)
  with Trainer(cfg) as tr:
    tr.setup()
    frozen = jax.tree.map(np.asarray, tr.frozen)
    adapters = jax.tree.map(np.asarray, tr.state.params)
    rows, mbs = [], None
    for _ in range(cfg.iters):
      rows.append(tr.iteration())
      mbs = tr.last.minibatches or mbs
    tr.checkpoints.wait()
    yield cfg, tr, rows, frozen, adapters, mbs


@pytest.mark.samples  # its rollouts follow the CPU's rounding: CI reruns it at another ISA
def test_lora_trains_the_adapters_alone_and_the_reference_is_the_base(lora_run):
  """Every iteration updates; the base's arrays are bit-identical after it, every adapter moved;
  the optimizer holds the adapters' moments only; the reference is the adapters at init (no copy
  of the base), and its log-probs are the base model's."""
  cfg, tr, rows, frozen, adapters, mbs = lora_run
  assert all(r["num_updates"] >= 1 and r["skipped_updates"] == 0 for r in rows), rows
  assert rows[-1]["kl"] > 0.0
  jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, tr.frozen), frozen)
  moved = [float(np.abs(np.asarray(a) - b).max()) for a, b in
           zip(jax.tree.leaves(tr.state.params), jax.tree.leaves(adapters))]
  assert len(moved) == 2 * 7 * tr.model.config.num_layers and min(moved) > 0
  n_adapters = _sizes(tr.state.params)
  assert n_adapters < _sizes(tr.frozen) / 5
  assert _sizes(tr.ref_params) == n_adapters  # the reference holds no copy of the base
  float_moments = [x for x in jax.tree.leaves(tr.state.opt_state) if x.dtype == jnp.float32]
  assert sum(x.size for x in float_moments) == 2 * n_adapters  # AdamW's mu and nu
  plain = build_policy(dataclasses.replace(cfg, lora_rank=0), build_tokenizer(cfg),
                       make_mesh("1x1"))
  mb = mbs[0]
  # pylint: disable=protected-access
  (ref_lp,) = tr._logprobs_all(tr.ref_params, [mb])
  base_lp = np.asarray(token_logprobs(plain, mb["input_ids"], mb["targets"],
                                      mb["attention_mask"], positions=mb["positions"]))
  # another program: rounding; the trainer's passes read the loss positions alone
  np.testing.assert_allclose(ref_lp, np.where(mb["loss_mask"], base_lp, 0.0), rtol=1e-5,
                             atol=1e-5)
  (now_lp,) = tr._logprobs_all(tr.state.params, [mb])
  assert np.abs(now_lp - ref_lp)[mb["loss_mask"]].max() > 1e-4  # the policy moved off the base


def test_lora_run_killed_at_any_moment_resumes_as_if_never_stopped(lora_run, tmp_path):
  cfg, _, rows, _, _, _ = lora_run
  _kill_three_times_and_resume(cfg, rows, tmp_path)


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
  """A one-iteration full fine-tuning run of the untrained tiny policy (its checkpoint only)."""
  cfg = dataclasses.replace(BASE, out=str(tmp_path_factory.mktemp("full")), iters=1)
  with Trainer(cfg) as tr:
    tr.run()
  return cfg


def test_lora_and_full_runs_do_not_resume_each_other(lora_run, full_run):
  """A LoRA run resumed without LoRA (or at another rank) and a full fine-tuning run resumed with
  LoRA are refused before any work, naming lora_rank."""
  cfg = lora_run[0]
  for other in (0, 8):
    with pytest.raises(ValueError, match=f"lora_rank: saved {LORA_RANK}, now {other}"):
      Trainer(dataclasses.replace(cfg, resume=True, lora_rank=other))
  with pytest.raises(ValueError, match=f"lora_rank: saved 0, now {LORA_RANK}"):
    Trainer(dataclasses.replace(full_run, resume=True, iters=2, lora_rank=LORA_RANK))


def test_export_merged_and_as_a_peft_folder(lora_run, full_run, tmp_path):
  """The merged export's logits in transformers equal the adapter model's (to 1e-4); the PEFT
  folder (`--peft`) loads in peft onto the base written beside it with the same logits; --peft of
  a full fine-tuning run is refused."""
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  from salt_jax import export  # pylint: disable=import-outside-toplevel
  cfg = lora_run[0]
  adapted, _, _, step = export.load_policy(cfg.out, merge=False)
  assert step == cfg.iters and lora.has_lora(adapted)
  ids = _ids(batch=2, length=12, vocab=adapted.config.vocab_size)

  def ours(model):
    return np.asarray(model(jnp.asarray(ids), jnp.ones(ids.shape, bool)))

  def theirs(model):
    with torch.no_grad():
      return model(torch.tensor(ids, dtype=torch.long)).logits.numpy()

  want, base = ours(adapted), ours(lora.merged(adapted, adapters=False))
  assert np.abs(want - base).max() > 1e-3  # the trained adapters matter
  merged_dir, peft_dir = str(tmp_path / "merged"), str(tmp_path / "peft")
  export.export_run(cfg.out, merged_dir)
  hf = transformers.AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32)
  np.testing.assert_allclose(theirs(hf), want, atol=1e-4)

  peft = pytest.importorskip("peft")
  assert export.main(["--run", cfg.out, "--out", peft_dir, "--peft"]) == 0
  with open(os.path.join(peft_dir, "adapter_config.json"), encoding="utf-8") as f:
    config = json.load(f)
  assert (config["r"], config["lora_alpha"], config["target_modules"]) == (
      LORA_RANK, float(LORA_RANK), sorted(p for ps in PROJECTIONS.values() for p in ps))
  hf_base = transformers.AutoModelForCausalLM.from_pretrained(
      os.path.join(peft_dir, export.PEFT_BASE_SUBDIR), dtype=torch.float32)
  np.testing.assert_allclose(theirs(hf_base), base, atol=1e-4)
  with_adapters = peft.PeftModel.from_pretrained(hf_base, peft_dir)
  np.testing.assert_allclose(theirs(with_adapters), want, atol=1e-4)

  with pytest.raises(ValueError, match="--peft exports LoRA adapters"):
    export.export_run(full_run.out, str(tmp_path / "refused"), peft=True)
  # A LoRA run whose base folder is gone is refused by name, before any checkpoint is read.
  moved = tmp_path / "moved"
  moved.mkdir()
  with open(os.path.join(moved, "config.json"), "w", encoding="utf-8") as f:
    json.dump({**cfg.to_json(), "init_params": str(tmp_path / "gone")}, f)
  with pytest.raises(ValueError, match=r"base from --init-params .*gone, which is gone"):
    export.load_policy(str(moved))


def test_sft_with_lora_clones_into_the_adapters_and_saves_them_merged(tmp_path, capsys):
  """The warm-start script with --lora-rank: the demo NLL falls, only adapters train, and the
  saved params are a plain tree (adapters merged) that --init-params loads and that gives the
  adapter model's log-probs; a LoRA RL run starts from it with new adapters."""
  import sys  # pylint: disable=import-outside-toplevel
  sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "experiments"))
  import sft_warmstart  # pylint: disable=import-outside-toplevel
  from salt_jax import sft  # pylint: disable=import-outside-toplevel
  from salt_jax.models.build import load_params  # pylint: disable=import-outside-toplevel
  out = tmp_path / "toy_sft"
  assert sft_warmstart.main(["--env", "toy", "--steps", "8", "--demos", "4", "--lr", "3e-2",
                             "--lora-rank", "4", "--out", str(out)]) == 0
  log = capsys.readouterr().out
  before, after = (float(x) for x in log.split("demo NLL ")[1].split(" nats")[0].split(" -> "))
  assert after < before, log
  cfg = TrainConfig(env="toy", tokenizer="toy", max_cache_len=512, seed=0)
  tok = build_tokenizer(cfg)
  fresh = build_policy(cfg, tok, make_mesh("1x1"))
  loaded = load_params(str(out / sft.SFT_SUBDIR), nnx.state(fresh, nnx.Param))
  changed = {jax.tree_util.keystr(p) for (p, a), b in zip(
      jax.tree_util.tree_flatten_with_path(loaded)[0],
      jax.tree.leaves(nnx.state(fresh, nnx.Param))) if not np.array_equal(np.asarray(a), b)}
  # Only the projections moved (their adapters merged in); embeddings and norms are the base's.
  assert changed and all(any(p in k for ps in PROJECTIONS.values() for p in ps) for k in changed)

  # behaviour_clone on a LoRA model: the base stays bit-identical.
  model = build_policy(dataclasses.replace(cfg, lora_rank=4), tok, make_mesh("1x1"))
  base = jax.tree.map(np.asarray, nnx.state(model, nnx.Not(nnx.LoRAParam)))
  from envs import registry, demos as demos_lib  # pylint: disable=import-outside-toplevel
  from envs.toy import ToyEnv  # pylint: disable=import-outside-toplevel
  demos = demos_lib.collect_demos(ToyEnv(max_steps=6), registry.training_tasks(cfg)[:2],
                                  max_steps=6, only_won=False)
  batch = sft.demo_token_batch(demos, tok, pad_id=tok.pad_token_id, min_length=64)
  losses = sft.behaviour_clone(model, batch, sft.SFTConfig(steps=6, rows=4, lr=3e-2))
  assert losses[-1] < losses[0]
  jax.tree.map(np.testing.assert_array_equal,
               jax.tree.map(np.asarray, nnx.state(model, nnx.Not(nnx.LoRAParam))), base)


def test_bad_lora_flags_are_refused_by_the_config(tmp_path):
  base = dataclasses.replace(BASE, out=str(tmp_path / "r"))
  for kw, match in ((dict(lora_rank=-1), "lora_rank must be an int >= 0"),
                    (dict(lora_rank=4, lora_alpha=0.0), "lora_alpha must be None or > 0"),
                    (dict(lora_rank=4, lora_targets="layers/9/.*"), "matches no projection")):
    with pytest.raises(ValueError, match=match):
      dataclasses.replace(base, **kw).validate()
  dataclasses.replace(base, lora_rank=4, lora_targets="layers/0/mlp/.*").validate()


def test_lora_on_a_hugging_face_folder_in_bf16(tmp_path):
  """--model FOLDER --param-dtype bfloat16 --lora-rank 4: the base loads in bf16 and stays bf16,
  the adapters are float32 and the projections still compute in bf16; at init the log-probs are
  the plain bf16 model's exactly."""
  from salt_jax.models import save_pretrained  # pylint: disable=import-outside-toplevel
  cfg_m = ModelConfig.tiny(vocab_size=128)
  save_pretrained(_random_model(cfg_m), str(tmp_path / "m"))
  cfg = dataclasses.replace(BASE, model=str(tmp_path / "m"), param_dtype="bfloat16",
                            out=str(tmp_path / "r"))
  tok = build_tokenizer(cfg)
  plain = build_policy(cfg, tok, make_mesh("1x1"))
  model = build_policy(dataclasses.replace(cfg, lora_rank=4), tok, make_mesh("1x1"))
  assert {x.dtype for x in jax.tree.leaves(lora.lora_state(model))} == {jnp.dtype(jnp.float32)}
  assert {x.dtype for x in jax.tree.leaves(nnx.state(model, nnx.Not(nnx.LoRAParam)))} == {
      jnp.dtype(jnp.bfloat16)}
  ids = _ids(vocab=128)
  assert model.hidden_states(jnp.asarray(ids)).dtype == jnp.bfloat16
  np.testing.assert_array_equal(_logp(model, ids), _logp(plain, ids))


def test_the_command_line_warm_starts_and_trains_with_lora(tmp_path, capsys):
  """`--sft-warmstart --lora-rank 4` on the toy tasks: the clone trains adapters and saves them
  merged, the RL run starts from that with new adapters, and its checkpoint holds adapters only."""
  from salt_jax import cli  # pylint: disable=import-outside-toplevel
  from tests.test_cli import TOY  # pylint: disable=import-outside-toplevel
  out = str(tmp_path / "run")
  flags = [f"--{k.replace('_', '-')}={json.dumps(v) if isinstance(v, dict) else v}"
           for k, v in TOY.items() if not isinstance(v, bool)]
  assert cli.main([*flags, "--no-progress", "--no-tensorboard", "--sft-warmstart",
                   "--sft-steps", "4", "--sft-demos", "4", "--lora-rank", "4",
                   f"--out={out}"]) == 0
  assert "[sft] demo NLL" in capsys.readouterr().out
  saved = TrainConfig.load(os.path.join(out, "config.json"))
  assert saved.lora_rank == 4 and saved.init_params.endswith("sft_params")
  from salt_jax import export  # pylint: disable=import-outside-toplevel
  adapted, _, _, _ = export.load_policy(out, merge=False)
  assert lora.has_lora(adapted)
