"""benchmarks/tpu_aot.py: a tiny policy compiled for a TPU v4 topology on this CPU host, its
reported figures checked against the compiled programs' own memory and cost analyses.

Needs libtpu (`pip install -e ".[tpu-aot]"`); skipped without it.
"""

import dataclasses
import json
import os
import sys

import pytest

pytest.importorskip("libtpu")

# pylint: disable=wrong-import-position
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "benchmarks"))
import tpu_aot  # noqa: E402
from flax import nnx  # noqa: E402

from salt_jax import update  # noqa: E402
from salt_jax.config import TrainConfig  # noqa: E402
from salt_jax.models import ModelConfig  # noqa: E402

MODEL = ModelConfig.tiny(vocab_size=256)
# The verl-agent recipe cut down: 8-row mini-batches of 4-row micro-batches, 32-token prompts.
CONFIG = TrainConfig.from_recipe(
    "verl-agent", tasks_per_iter=2, group_size=2, max_steps=4, max_new_tokens=16,
    max_cache_len=64, prompt_bucket_min=16, minibatch_rows=8, microbatch_rows=4, min_seq_len=16,
    logprob_chunk=16)
PROMPT = 32


@pytest.fixture(scope="module")
def mesh():
  return tpu_aot.topology_mesh("v4:2x2x1", "4x2")


def _compiled(fn, args, **kwargs):
  return fn.lower(*args, **kwargs).compile()


@pytest.mark.slow  # four compiles of the update: 30 to 65 s on 2 shared cores
def test_update_and_logprobs_figures_are_the_compiled_programs(mesh):
  shape = tpu_aot.run_shape(CONFIG, mesh, PROMPT, jnp.dtype(jnp.float32))
  assert (shape.rows, shape.seq_len) == (8, 48)  # 32 + 16 tokens: a bucket of its own
  reports = tpu_aot.compile_update(shape, mesh, MODEL)
  state = reports.pop("_state")
  assert state["opt_state"] > 2 * state["params"]  # AdamW's two moments, plus step counts

  # The same programs, compiled here straight from the trainer's builder.
  _, graphdef, params = tpu_aot.abstract_policy(MODEL, mesh, jnp.float32)
  tx = update.optimizer(CONFIG, update.lr_schedule(CONFIG))
  opt = tpu_aot.abstract_opt_state(tx, params, mesh)
  shard_of = lambda t: jax.tree.map(lambda x: x.sharding, t)  # noqa: E731
  logprobs, step = update.update_programs(CONFIG, graphdef, tx, 8, shard_of(params),
                                         shard_of(opt))
  mb = tpu_aot.minibatch(mesh, 8, 48)
  adv = tpu_aot._on(mesh, (64,), jnp.float32)  # pylint: disable=protected-access
  update_mem = _compiled(step, (params, opt, mb, adv)).memory_analysis()
  lp = _compiled(logprobs, (params, mb["input_ids"], mb["targets"], mb["attention_mask"],
                            mb["positions"])).memory_analysis()
  for report, mem in ((reports["update"], update_mem), (reports["logprobs"], lp)):
    assert report.fits
    assert report.argument_bytes == mem.argument_size_in_bytes
    assert report.output_bytes == mem.output_size_in_bytes
    assert report.alias_bytes == mem.alias_size_in_bytes
    assert report.temp_bytes == mem.temp_size_in_bytes
  # Parameters, optimizer state and the batch are the update's arguments, byte for byte.
  batch_bytes = tpu_aot.device_bytes((mb, adv))
  assert update_mem.argument_size_in_bytes == state["params"] + state["opt_state"] + batch_bytes
  assert reports["update"].alias_bytes == state["params"] + state["opt_state"]  # donated
  assert reports["update"].resident_bytes == state["ref_params"]

  # FLOPs: the 4-row, one-chunk twin's compiled count, times 8 / 4.
  twin_cfg = TrainConfig(**{**CONFIG.__dict__, "microbatch_rows": 0, "logprob_chunk": 48})
  _, twin_step = update.update_programs(twin_cfg, graphdef, tx, 4, shard_of(params), shard_of(opt))
  twin = _compiled(twin_step, (params, opt, tpu_aot.minibatch(mesh, 4, 48), adv))
  assert reports["update"].flops == twin.cost_analysis()["flops"] * 2


def test_sampler_figures_and_the_hbm_limit(mesh):
  shape = tpu_aot.run_shape(CONFIG, mesh, PROMPT, jnp.dtype(jnp.float32))
  reports = tpu_aot.compile_sampler(shape, mesh, MODEL, PROMPT, resident_bytes=123)
  assert reports["prefill"].note == "batch 4, prompt 32, cache 64"
  for r in reports.values():
    assert r.fits and r.resident_bytes == 123 and r.flops > 0
    assert r.total_bytes == (123 + r.argument_bytes + r.output_bytes - r.alias_bytes
                             + r.temp_bytes)
  # The decode step's loop state is donated: the cache is updated in place.
  assert reports["decode"].alias_bytes > 0
  # A v4 TensorCore: half a chip's 32 GiB, less what the runtime keeps.
  limit = tpu_aot.compiler_hbm_limit(mesh)
  assert 14 * tpu_aot.GIB < limit <= 16 * tpu_aot.GIB
  chip = tpu_aot.chip_figures(mesh)
  assert chip["devices_per_chip"] == 2 and chip["hbm"] == 16 * tpu_aot.GIB


@pytest.mark.slow  # six compiles of the sampler's programs
def test_a_refused_prefill_leaves_the_decode_the_layout_of_a_smaller_one(mesh, monkeypatch):
  # The decode step takes the prefill's output in the layout the compiler chose. Where the full
  # batch's prefill is refused (here: made to be), a smaller batch's prefill gives that layout,
  # and the decode compiles as it does behind the full prefill; with none compiled, the note says
  # that the layout is by batch.
  shape = tpu_aot.run_shape(dataclasses.replace(CONFIG, tasks_per_iter=4), mesh, PROMPT,
                            jnp.dtype(jnp.float32))
  assert shape.sampler_batch == 8
  want = tpu_aot.compile_sampler(shape, mesh, MODEL, PROMPT)["decode"]
  compile_program, prefill_rows = tpu_aot.compile_program, []

  def refuse_prefills_over(limit):
    def compile_or_refuse(name, fn, args, resident_bytes, **kwargs):
      if name == "prefill":
        prefill_rows.append(args[3].shape[0])
        if args[3].shape[0] > limit:
          return tpu_aot.ProgramReport(name, False, resident_bytes, 0, needed_bytes=1), None
      return compile_program(name, fn, args, resident_bytes, **kwargs)
    return compile_or_refuse

  monkeypatch.setattr(tpu_aot, "compile_program", refuse_prefills_over(4))
  got = tpu_aot.compile_sampler(shape, mesh, MODEL, PROMPT)
  assert prefill_rows == [8, 4] and not got["prefill"].fits  # 4: the data axis's size
  assert got["decode"].note == "one step of batch 8, cache 64; loop state laid out as the 4-row " \
                               "prefill's"
  for field in ("argument_bytes", "output_bytes", "alias_bytes", "temp_bytes", "flops"):
    assert getattr(got["decode"], field) == getattr(want, field), field
  prefill_rows.clear()
  monkeypatch.setattr(tpu_aot, "compile_program", refuse_prefills_over(0))
  got = tpu_aot.compile_sampler(shape, mesh, MODEL, PROMPT, programs=("decode",))
  assert prefill_rows == [8, 4] and set(got) == {"decode"} and got["decode"].fits
  assert got["decode"].note.endswith("; loop state laid out by batch (no prefill compiled)")


def test_a_program_larger_than_hbm_is_reported_not_raised(mesh):
  big = tpu_aot._on(mesh, (2**36,), jnp.float32)  # pylint: disable=protected-access
  # A PRNG key among the arguments (as the sampler's prefill takes one): its bytes count too.
  key = jax.eval_shape(lambda: jax.random.key(0))
  key = jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=tpu_aot.replicated(mesh))
  report, compiled = tpu_aot.compile_program(
      "big", jax.jit(lambda x, k: jnp.cumsum(x) * jax.random.uniform(k)), (big, key),
      resident_bytes=0)
  assert compiled is None and not report.fits
  assert report.needed_bytes > tpu_aot.compiler_hbm_limit(mesh)
  assert report.argument_bytes == 2**36 * 4 // 4 + 8  # x split over the 4 data shards; the key


@pytest.mark.slow  # two compiles of the update
def test_resident_state_as_kept_arguments(mesh):
  shape = tpu_aot.run_shape(CONFIG, mesh, PROMPT, jnp.dtype(jnp.float32))
  plain = tpu_aot.compile_update(shape, mesh, MODEL, ["update"], flops=False)
  held = tpu_aot.compile_update(shape, mesh, MODEL, ["update"], flops=False,
                                resident_as_args=True)
  state = held.pop("_state")
  p, h = plain["update"], held["update"]
  assert h.fits and h.resident_bytes == 0 and p.resident_bytes == state["ref_params"]
  # The reference is now an argument the compiler counts, and nothing else changed.
  assert h.argument_bytes == p.argument_bytes + state["ref_params"]
  assert h.alias_bytes == p.alias_bytes and h.output_bytes == p.output_bytes


def test_mixed_precision_policy_computes_in_bfloat16_over_float32_parameters(mesh):
  model, _, params = tpu_aot.abstract_policy(MODEL, mesh, jnp.float32, jnp.bfloat16)
  assert {x.dtype for x in jax.tree.leaves(params)} == {jnp.dtype(jnp.float32)}
  assert model.dtype == jnp.bfloat16
  model, _, _ = tpu_aot.abstract_policy(MODEL, mesh, jnp.bfloat16)
  assert model.dtype == jnp.bfloat16 and model.param_dtype == jnp.bfloat16


def test_set_overrides_reach_the_shapes_and_bad_ones_are_refused(tmp_path, capsys):
  # AppWorld's lengths (verl-agent's run_appworld.sh: 16,384-token prompts, 2,048-token
  # responses) through --set; `--programs ,` builds the state alone, so nothing is compiled.
  base = ["--topology", "v4:2x2x1", "--mesh", "4x2", "--model", "qwen2.5-1.5b", "--programs", ","]
  out = tmp_path / "appworld.json"
  assert tpu_aot.main(base + ["--prompt-len", "16384", "--set", "max_new_tokens=2048",
                              "--set", "max_cache_len=18432", "--set", "tasks_per_iter=8",
                              "--json", str(out)]) == 0
  rec = json.loads(out.read_text())
  assert rec["prompt_len"] == 16384 and rec["config"]["max_new_tokens"] == 2048
  assert rec["seq_len"] >= 18432 and rec["config"]["tasks_per_iter"] == 8
  assert rec["programs"] == {}
  # A recipe's longest prompt is its cache less the response: WebShop's 4,096.
  assert tpu_aot.main(base + ["--recipe", "verl-agent-webshop", "--json", str(out)]) == 0
  rec = json.loads(out.read_text())
  assert rec["prompt_len"] == 4096 and rec["config"]["max_steps"] == 15
  # The model compiled runs the run's attention program, as the trainer's policy would.
  cfg = TrainConfig.from_recipe("verl-agent", attention_impl="query_blocks", remat_policy="full")
  model = tpu_aot.preset_config("qwen2.5-1.5b", cfg, num_layers=2)
  assert (model.attention_impl, model.remat_policy, model.num_layers) == ("query_blocks", "full", 2)
  assert tpu_aot.preset_config("qwen2.5-1.5b", CONFIG).attention_impl is None  # the mesh's default
  for bad, says in ((["--set", "no_such_field=1"], "not a TrainConfig field"),
                    (["--set", "max_new_tokens"], "FIELD=VALUE"),
                    (["--prompt-len", "4096"], "--set max_cache_len")):
    with pytest.raises(SystemExit):
      tpu_aot.main(base + bad)
    assert says in capsys.readouterr().err


@pytest.mark.slow  # two compiles of the LoRA stand-in
def test_lora_stand_in_figures_are_the_compiled_programs(mesh):
  import dataclasses  # pylint: disable=import-outside-toplevel
  import tpu_aot_lora  # pylint: disable=import-outside-toplevel
  model = dataclasses.replace(MODEL, num_layers=2)
  config = dataclasses.replace(CONFIG, remat_policy="full")
  out = tpu_aot_lora.compile_lora("tiny", model, "v4:2x2x1", "4x2", config, PROMPT)
  p = out["programs"]["lora"]
  assert out["rows"] == 4 and out["config"]["microbatch_rows"] == 4  # one row a data shard
  assert out["config"]["remat_policy"] == "full" and out["config"]["param_dtype"] == "bfloat16"
  assert out["num_layers"] == 2 and out["hbm_limit"] == tpu_aot.compiler_hbm_limit(mesh)
  # The same program compiled here: its own memory analysis is what the figures say.
  cfg = TrainConfig.from_recipe("verl-agent", **{
      **{k: getattr(config, k) for k in ("tasks_per_iter", "group_size", "max_steps",
                                         "max_new_tokens", "max_cache_len", "min_seq_len",
                                         "logprob_chunk", "remat_policy")},
      "param_dtype": "bfloat16", "microbatch_rows": 4})
  _, graphdef, state = tpu_aot.abstract_policy(dataclasses.replace(model, remat_policy="full"),
                                               mesh, jnp.bfloat16)
  shape = tpu_aot.run_shape(cfg, mesh, PROMPT, jnp.dtype("bfloat16"))
  mb = tpu_aot.minibatch(mesh, 4, shape.seq_len)
  adv = tpu_aot.step_advantages(cfg, mesh)
  step = tpu_aot_lora.lora_step(graphdef, cfg)
  mem = _compiled(step, (state, mb, adv)).memory_analysis()
  assert p["fits"] and p["resident_bytes"] == 0 and p["flops"] is None  # see compile_lora
  assert p["argument_bytes"] == mem.argument_size_in_bytes
  assert p["temp_bytes"] == mem.temp_size_in_bytes
  assert p["total_bytes"] == (mem.argument_size_in_bytes + mem.output_size_in_bytes
                              - mem.alias_size_in_bytes + mem.temp_size_in_bytes)
  assert out["state"]["params"] == tpu_aot.device_bytes(state)
  # Layer remat is in the program: each decoder layer under a checkpoint (beyond the log-probs'
  # own recomputed logits chunk, there without layer remat too).
  _, plain_graphdef, _ = tpu_aot.abstract_policy(model, mesh, jnp.bfloat16)
  plain = dataclasses.replace(cfg, remat_policy="none")
  remats = [str(jax.make_jaxpr(tpu_aot_lora.lora_step(g, c))(state, mb, adv)).count("remat2[")
            for g, c in ((graphdef, cfg), (plain_graphdef, plain))]
  assert remats[0] - remats[1] == 2


def test_lora_update_takes_the_base_as_an_argument_and_donates_only_the_adapters(mesh):
  """With --lora-rank the compiled update is the trainer's LoRA step: the adapters and their
  AdamW state are donated, the frozen base is a plain argument, the reference is the adapters
  (resident); the sampler compiles with the adapters on."""
  cfg = dataclasses.replace(CONFIG, lora_rank=4)
  shape = tpu_aot.run_shape(cfg, mesh, PROMPT, jnp.dtype(jnp.float32))
  reports = tpu_aot.compile_update(shape, mesh, MODEL, ("update",), flops=False)
  state = reports.pop("_state")
  full = tpu_aot.compile_update(tpu_aot.run_shape(CONFIG, mesh, PROMPT, jnp.dtype(jnp.float32)),
                                mesh, MODEL, ("update",), flops=False).pop("_state")
  assert 0 < state["params"] < full["params"] and state["ref_params"] == state["params"]
  assert state["frozen"] == full["params"]  # the whole base, once
  batch_bytes = tpu_aot.device_bytes((tpu_aot.minibatch(mesh, 8, 48),
                                      tpu_aot.step_advantages(cfg, mesh)))
  update_report = reports["update"]
  assert update_report.fits and update_report.resident_bytes == state["ref_params"]
  assert update_report.argument_bytes == (state["params"] + state["opt_state"] + state["frozen"]
                                          + batch_bytes)
  assert update_report.alias_bytes == state["params"] + state["opt_state"]
  sampler = tpu_aot.compile_sampler(shape, mesh, MODEL, PROMPT, ("prefill",))
  assert sampler["prefill"].fits
  assert sampler["prefill"].argument_bytes > state["frozen"] + state["params"]


@pytest.mark.parametrize("lora_rank", [0, 4])
def test_critic_figures_are_the_compiled_programs(mesh, lora_rank):
  """With a critic's estimator (PPO) the critic step and the value program compile as the
  trainer builds them (`critic.critic_programs`): the critic (the trained state plus a float32
  head) and its AdamW state are donated by the step; with LoRA the frozen base is the critic's
  argument too, shared with the policy."""
  from salt_jax import critic  # pylint: disable=import-outside-toplevel
  cfg = dataclasses.replace(CONFIG, algo="ppo", lora_rank=lora_rank)
  shape = tpu_aot.run_shape(cfg, mesh, PROMPT, jnp.dtype(jnp.float32))
  policy = tpu_aot.compile_update(shape, mesh, MODEL, ("update",), flops=False)
  policy_state = policy.pop("_state")
  reports = tpu_aot.compile_critic(shape, mesh, MODEL, policy_bytes=1000)
  state = reports.pop("_state")

  _, graphdef, params = tpu_aot.abstract_policy(MODEL, mesh, jnp.float32, lora_rank=lora_rank)
  frozen = None
  if lora_rank:
    params, frozen = nnx.split_state(params, nnx.LoRAParam, ...)
  tree = tpu_aot.abstract_critic(params, MODEL.hidden_size, mesh)
  # The critic is the policy's trained state (its adapters with LoRA) plus a head of D + 1
  # floats (as the TPU pads them).
  assert state["critic"] == policy_state["params"] + tpu_aot.device_bytes(tree["head"])
  assert tpu_aot.device_bytes(tree["head"]) < policy_state["params"] / 10
  tx = critic.critic_optimizer(cfg)
  opt = tpu_aot.abstract_opt_state(tx, tree, mesh)
  assert state["critic_opt_state"] == tpu_aot.device_bytes(opt)
  shard_of = lambda t: jax.tree.map(lambda x: x.sharding, t)  # noqa: E731
  values, step = critic.critic_programs(cfg, graphdef, tx, 8, shard_of(tree), shard_of(opt))
  mb = tpu_aot.minibatch(mesh, 8, 48, with_critic=True)
  critic_mb = {k: mb[k] for k in ("input_ids", "attention_mask", "positions", "loss_mask",
                                  "old_values", "returns")}
  step_mem = _compiled(step, (tree, opt, critic_mb, frozen)).memory_analysis()
  values_mem = _compiled(values, (tree, mb["input_ids"], mb["attention_mask"], mb["positions"],
                                  frozen)).memory_analysis()
  for name, mem in (("critic", step_mem), ("values", values_mem)):
    report = reports[name]
    assert report.fits and report.flops > 0
    assert report.argument_bytes == mem.argument_size_in_bytes
    assert report.temp_bytes == mem.temp_size_in_bytes
    assert report.alias_bytes == mem.alias_size_in_bytes
  frozen_bytes = tpu_aot.device_bytes(frozen)
  assert frozen_bytes == policy_state["frozen"]
  # Values come from the hidden states: the frozen base's vocabulary head is never read, and the
  # compiler drops it (a full trunk's copy of it is donated, so it stays an argument).
  unread = tpu_aot.device_bytes(frozen["lm_head"]) if lora_rank else 0
  assert step_mem.argument_size_in_bytes == (state["critic"] + state["critic_opt_state"]
                                             + tpu_aot.device_bytes(critic_mb) + frozen_bytes
                                             - unread)
  assert reports["critic"].alias_bytes == state["critic"] + state["critic_opt_state"]
  assert reports["values"].alias_bytes == 0
  # Resident: the policy's state beside both; the critic's AdamW state beside the values.
  assert reports["critic"].resident_bytes == 1000
  assert reports["values"].resident_bytes == 1000 + state["critic_opt_state"]
  # The policy's update reads each token's advantage from the mini-batch: the step advantages
  # and the tokens' step ids that would broadcast them are unused, and the compiler drops them.
  no_critic = tpu_aot.compile_update(tpu_aot.run_shape(
      dataclasses.replace(CONFIG, lora_rank=lora_rank), mesh, PROMPT, jnp.dtype(jnp.float32)),
      mesh, MODEL, ("update",), flops=False)
  assert (policy["update"].argument_bytes - no_critic["update"].argument_bytes
          == tpu_aot.device_bytes(mb["advantages"]) - tpu_aot.device_bytes(mb["token_step_ids"])
          - tpu_aot.device_bytes(tpu_aot.step_advantages(cfg, mesh)))


def test_critic_programs_follow_the_estimator(tmp_path, capsys):
  """The default programs are the run's: the critic's only with a critic's estimator; asking
  for them without one is refused."""
  base = ["--topology", "v4:2x2x1", "--mesh", "4x2", "--model", "qwen2.5-1.5b", "--num-layers",
          "1", "--no-flops", "--set", "max_new_tokens=16", "--set", "max_cache_len=64",
          "--set", "tasks_per_iter=2", "--set", "minibatch_rows=8", "--set", "microbatch_rows=8",
          "--set", "min_seq_len=16", "--set", "logprob_chunk=16"]
  out = tmp_path / "ppo.json"
  assert tpu_aot.main(base + ["--recipe", "ppo", "--programs", "values", "--json",
                              str(out)]) == 0
  rec = json.loads(out.read_text())
  assert set(rec["programs"]) == {"values"} and rec["state"]["critic"] > rec["state"]["params"]
  assert rec["programs"]["values"]["resident_bytes"] == (
      rec["state"]["params"] + rec["state"]["opt_state"] + rec["state"]["ref_params"]
      + rec["state"]["critic_opt_state"])
  with pytest.raises(SystemExit):
    tpu_aot.main(base + ["--programs", "critic"])
  assert "need a critic's estimator" in capsys.readouterr().err
