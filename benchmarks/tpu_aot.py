"""Compiles the trainer's and the sampler's device programs for a TPU slice, on a CPU host.

  pip install -e ".[tpu-aot]"        # libtpu: the TPU compiler; no TPU needed
  python benchmarks/tpu_aot.py --topology v4:2x2x1 --mesh 4x2 --model qwen2.5-1.5b

Nothing is allocated and no weights are read: the policy is built abstractly (`nnx.eval_shape`) at
a Qwen2.5 preset's shape (`salt_jax.models.config.PRESETS`), its parameters and the batches are
`ShapeDtypeStruct`s on the mesh's `NamedSharding`s, and each program is lowered and compiled for
the topology's devices (`jax.experimental.topologies`). The programs are the ones a run jits:

  update    `salt_jax.update.update_programs`' train step: token log-probs (chunked over the
            sequence, each chunk's logits recomputed in the backward pass), the PPO-clip loss,
            micro-batched gradients, the optax (AdamW) update; one mini-batch of
            `minibatch_rows` rows of the step rows' bucketed length (`batching.bucket_length`).
  logprobs  the same call's log-prob program (old and reference log-probs) on one mini-batch.
  critic    with a critic's estimator (`--recipe ppo`, `--set algo=ppo`): `salt_jax.critic`'s
            critic step (the clipped value loss, micro-batched gradients, its AdamW) on one
            mini-batch; the critic is the policy's trained state plus a float32 value head.
  values    the critic's value program on one mini-batch.
  prefill   `Sampler`'s prefill of a full batch bucket (16 tasks x G rows) of longest prompts.
  decode    `Sampler`'s decode loop (its compiled while-loop body is one decode step).

The run's settings are `TrainConfig.from_recipe('verl-agent')` (G=8, 16 tasks, prompts up to
2048 tokens, responses up to 512, 256-row mini-batches; `--recipe verl-agent-webshop`: prompts up
to 4,096) with the flags below on top; `--set FIELD=VALUE` sets any other field, e.g. AppWorld's
lengths in verl-agent's `run_appworld.sh`: `--prompt-len 16384 --set max_new_tokens=2048
--set max_cache_len=18432`.

`--lora-rank R` compiles the trainer's LoRA programs (`--lora-rank` of a run): float32 qwix
adapters on the base's seven projections, the base frozen in `--param-dtype` and passed to the
update and log-probs as an argument, the adapters and their AdamW state donated, the reference the
initial adapters; the sampler runs with the adapters on.

`--num-layers N` compiles the preset with N decoder layers (same widths): a full-depth compile of
7B or 32B takes 20 minutes to hours on a shared 2-core host, while 1- and 2-layer compiles take
2 to 5 minutes and `tpu_aot_table.py` carries them to full depth (each layer adds the same bytes
until the compiler rematerializes to fit; see its docstring). `--programs ,` compiles no
program: the full-depth state a device holds (parameters, AdamW, reference), in seconds.

For each program it prints, per device: the resident training state (parameters, AdamW state,
reference parameters, whether or not the program takes them as arguments), the program's own
arguments, outputs and temporaries (`memory_analysis`), and their total against the HBM the
compiler allows a device; a program that does not fit fails to compile and its line says by how
much (the compiler's own figure). FLOPs come from `cost_analysis`, which counts a loop's body once:
the update and log-prob FLOPs are those of the same program compiled on `flop_rows` rows (one
micro-batch, or one row per data shard) with the whole sequence in one log-prob chunk, times
rows / flop_rows; the decode FLOPs are one step's. Step time at the chip's peak is FLOPs / peak;
at `--utilisation` it is that divided by the utilisation. The decode step is bound by memory
traffic instead, so its `bytes accessed` over the chip's bandwidth is printed beside it.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import re
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# This host compiles for the topology's devices; its own backend is the CPU (with libtpu
# installed and no TPU attached, jax would otherwise try to open a TPU first).
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Only compiling: libtpu's one-process lock (meant for a TPU's runtime) would stop a second
# compiling process, e.g. the tests beside a long compile.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

from bench_gpu import chip_limits  # noqa: E402
from salt_jax import batching, critic, sampling, update  # noqa: E402
from salt_jax.advantages import ESTIMATORS  # noqa: E402
from salt_jax.config import PARAM_DTYPES, TrainConfig, parse_overrides  # noqa: E402
from salt_jax.models import CausalLM, ModelConfig, default_attention_impl, lora  # noqa: E402
from salt_jax.models.config import PRESETS, REMAT_POLICIES  # noqa: E402
from salt_jax.models.partitioning import ActivationSharding, shardings_for_state  # noqa: E402
from salt_jax.recipes import RECIPES  # noqa: E402
from salt_jax.sharding import batch_sharding, make_mesh, replicated  # noqa: E402

PROGRAMS = ("update", "logprobs", "critic", "values", "prefill", "decode")
CRITIC_PROGRAMS = ("critic", "values")  # compiled only for an estimator with a critic (PPO)
CRITIC_TARGETS = ("old_values", "returns")  # mini-batch fields only the critic step reads
# HBM per chip (GiB, vendor sheets) by device_kind; a chip's TensorCores split it when the
# topology gives one device per core.
CHIP_HBM_GIB = {"TPU v4": 32, "TPU v5 lite": 16, "TPU v5": 95, "TPU v6 lite": 32}
GIB = 2**30

# The compiler's refusal of a program larger than a device's HBM.
_OOM_RE = re.compile(r"(?:required for|requires) .*?\(([\d.]+)([KMGT]?)\).*?exceeds available HBM "
                     r"\(([\d.]+)([KMGT]?)\)", re.S)
_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


@dataclasses.dataclass
class ProgramReport:
  """One compiled program's figures, per device (bytes, FLOPs, seconds).

  `fits` is False when the compiler refused the program for HBM; then `needed_bytes` is the
  compiler's figure for the temporaries it needed, `argument_bytes` the arguments' shards
  (unpadded), and `total_bytes` a lower bound.
  """

  name: str
  fits: bool
  resident_bytes: int          # training state that lives on the device but is not an argument
  argument_bytes: int | None = None
  output_bytes: int | None = None
  alias_bytes: int | None = None
  temp_bytes: int | None = None
  needed_bytes: int | None = None
  flops: float | None = None   # per step of the program (see the module docstring)
  bytes_accessed: float | None = None
  compile_s: float = 0.0
  note: str = ""

  @property
  def total_bytes(self) -> int:
    """Resident state + arguments + outputs not aliased to arguments + temporaries."""
    if not self.fits:
      return self.resident_bytes + self.argument_bytes + self.needed_bytes
    return (self.resident_bytes + self.argument_bytes + self.output_bytes - self.alias_bytes
            + self.temp_bytes)


def device_bytes(tree) -> int:
  """Bytes one device holds of a pytree of sharded ShapeDtypeStructs, as the compiler lays them
  out (TPU tiles pad small dimensions): the argument size of a program that takes the tree; the
  unpadded shards where the tree alone exceeds the device's HBM (the compiler refuses it)."""
  leaves = [x for x in jax.tree.leaves(tree) if x is not None]
  if not leaves:
    return 0
  try:
    compiled = jax.jit(lambda t: jax.tree.map(lambda x: x[(0,) * x.ndim], t)).lower(
        leaves).compile()
  except Exception as e:  # pylint: disable=broad-except
    if _OOM_RE.search(str(e)) is None:
      raise
    return shard_bytes(leaves)
  return int(compiled.memory_analysis().argument_size_in_bytes)


def shard_bytes(tree) -> int:
  """Bytes of one device's shards of a pytree of sharded ShapeDtypeStructs, unpadded."""
  # x.dtype.itemsize, not np.dtype's: a PRNG key's dtype (key<fry>) is not numpy's.
  return sum(int(np.prod(x.sharding.shard_shape(x.shape))) * x.dtype.itemsize
             for x in jax.tree.leaves(tree) if x is not None)


def topology_mesh(topology: str, mesh: str, chip_config: str | None = None) -> Mesh:
  """A ('data', 'model') mesh over the devices of TPU topology `topology` (e.g. 'v4:2x2x1')."""
  from jax.experimental import topologies  # pylint: disable=import-outside-toplevel
  kwargs = {} if chip_config is None else {"chip_config_name": chip_config}
  desc = topologies.get_topology_desc(topology_name=topology, platform="tpu", **kwargs)
  return make_mesh(mesh, desc.devices)


def devices_per_chip(mesh: Mesh) -> int:
  """Devices that share one chip (2 where a topology gives each TensorCore its own device)."""
  chips = {tuple(getattr(d, "coords", (d.id,))) for d in mesh.devices.flat}
  return mesh.devices.size // len(chips)


def preset_config(model_name: str, config: TrainConfig, num_layers: int | None = None
                  ) -> ModelConfig:
  """The preset's architecture (with `num_layers` decoder layers, if given) running the config's
  attention program and remat policy, as the trainer builds its policy
  (`models.build.policy_config`)."""
  model_config = dataclasses.replace(PRESETS[model_name], remat_policy=config.remat_policy,
                                     attention_impl=config.attention_impl)
  if num_layers:
    model_config = dataclasses.replace(model_config, num_layers=num_layers)
  return model_config


def abstract_policy(config: ModelConfig, mesh: Mesh, dtype, compute_dtype=None, *,
                    lora_rank: int = 0, lora_alpha: float | None = None
                    ) -> tuple[CausalLM, Any, Any]:
  """(model, graphdef, params) of `CausalLM(config)` with `dtype` parameters (computing in
  `compute_dtype`, default `dtype`) on `mesh`, allocating nothing: params are ShapeDtypeStructs
  on the trainer's parameter shardings, and the model constrains its activations as
  `shard_model` makes it. With `lora_rank` the model carries the trainer's qwix adapters on all
  seven projections (float32, alpha default the rank; `salt_jax.models.lora`) and params hold
  them beside the base. A config that names no attention implementation gets the one for the
  mesh's platform, not this host's."""
  if config.attention_impl is None:
    config = dataclasses.replace(config, attention_impl=default_attention_impl(mesh))
  compute = dtype if compute_dtype is None else jnp.dtype(compute_dtype)

  def build():
    model = CausalLM(config, rngs=nnx.Rngs(0), dtype=compute, param_dtype=dtype)
    if lora_rank:
      lora.apply_lora(model, rank=lora_rank, alpha=lora_alpha)
    return model
  model = nnx.eval_shape(build)
  model.activation_sharding = ActivationSharding(mesh)
  graphdef, state = nnx.split(model)
  shardings = shardings_for_state(nnx.state(model, nnx.Param), mesh)
  nnx.replace_by_pure_dict(state, jax.tree.map(
      lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
      nnx.to_pure_dict(state), shardings))
  return model, graphdef, state


def with_dtype(tree, dtype):
  """Floating leaves of a ShapeDtypeStruct tree in `dtype` (shardings kept)."""
  def one(x):
    if not jnp.issubdtype(x.dtype, jnp.floating):
      return x
    return jax.ShapeDtypeStruct(x.shape, dtype, sharding=x.sharding)
  return jax.tree.map(one, tree)


def abstract_opt_state(tx: optax.GradientTransformation, params, mesh: Mesh):
  """`tx.init(params)` as ShapeDtypeStructs: param-shaped leaves on their parameter's sharding,
  the rest (step counts) replicated, as the trainer places them."""
  shapes = jax.eval_shape(tx.init, params)
  shardings = optax.tree_map_params(tx, lambda _, s: s, shapes,
                                    jax.tree.map(lambda x: x.sharding, params),
                                    transform_non_params=lambda _: replicated(mesh))
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                      shapes, shardings)


def _on(mesh: Mesh, shape, dtype, batch: bool = True) -> jax.ShapeDtypeStruct:
  sharding = batch_sharding(mesh, len(shape)) if batch and shape else replicated(mesh)
  return jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=sharding)


def minibatch(mesh: Mesh, rows: int, length: int, with_critic: bool = False) -> dict:
  """The trainer's mini-batch dict (`phases.minibatches` plus ref_logprobs, less its
  logit_positions: the plan projects every position onto the vocabulary) as shapes; with a
  critic also each token's advantage, return and old value (`phases.fill_critic_batch`: the
  update reads the advantages, the critic step the returns and old values)."""
  ints = ("input_ids", "targets", "token_step_ids", "positions")
  bools = ("loss_mask", "attention_mask")
  floats = ("old_logprobs", "ref_logprobs") + (("advantages", "returns", "old_values")
                                                if with_critic else ())
  out = {k: _on(mesh, (rows, length), jnp.int32) for k in ints}
  out.update({k: _on(mesh, (rows, length), jnp.bool_) for k in bools})
  out.update({k: _on(mesh, (rows, length), jnp.float32) for k in floats})
  return out


def step_advantages(config: TrainConfig, mesh: Mesh) -> jax.ShapeDtypeStruct:
  """The update's step advantages: one per step row of an iteration, bucketed as the trainer
  pads them."""
  return _on(mesh, (batching.bucket_length(
      config.tasks_per_iter * config.group_size * config.max_steps, 64),), jnp.float32)


def compile_program(name: str, fn: Callable, args: Sequence, resident_bytes: int,
                    **kwargs) -> tuple[ProgramReport, Any]:
  """Lowers and compiles jitted `fn` on `args`; returns its report and the compiled program
  (None when the compiler refused it for HBM)."""
  start = time.perf_counter()
  try:
    compiled = fn.lower(*args, **kwargs).compile()
  except Exception as e:  # pylint: disable=broad-except  (XlaRuntimeError / JaxRuntimeError)
    m = _OOM_RE.search(str(e))
    if m is None:
      raise
    needed = float(m.group(1)) * _UNITS[m.group(2)]
    return ProgramReport(name, fits=False, resident_bytes=resident_bytes,
                         argument_bytes=shard_bytes(args),
                         needed_bytes=int(needed), compile_s=time.perf_counter() - start,
                         note="out of HBM (temporaries: the compiler's figure)"), None
  mem = compiled.memory_analysis()
  cost = compiled.cost_analysis() or {}
  return ProgramReport(name, fits=True, resident_bytes=resident_bytes,
                       compile_s=time.perf_counter() - start,
                       argument_bytes=int(mem.argument_size_in_bytes),
                       output_bytes=int(mem.output_size_in_bytes),
                       alias_bytes=int(mem.alias_size_in_bytes),
                       temp_bytes=int(mem.temp_size_in_bytes),
                       flops=cost.get("flops"), bytes_accessed=cost.get("bytes accessed")), compiled


def compiler_hbm_limit(mesh: Mesh) -> int | None:
  """The HBM (bytes) the TPU compiler allows one device of `mesh`: read from its refusal of a
  program that needs more than any chip has."""
  big = jax.ShapeDtypeStruct((2**38,), jnp.float32, sharding=replicated(mesh))
  try:
    jax.jit(lambda x: x * 2).lower(big).compile()
  except Exception as e:  # pylint: disable=broad-except
    m = _OOM_RE.search(str(e))
    if m:
      return int(float(m.group(3)) * _UNITS[m.group(4)])
  return None


@dataclasses.dataclass(frozen=True)
class RunShape:
  """What one run puts on the device: the config's settings and the derived program shapes."""

  config: TrainConfig
  rows: int          # mini-batch rows (a multiple of the data axis, as the trainer rounds)
  seq_len: int       # the update's bucketed row length
  sampler_batch: int
  ref_dtype: Any


def run_shape(config: TrainConfig, mesh: Mesh, prompt_len: int, ref_dtype) -> RunShape:
  data = int(mesh.shape["data"])
  rows = -(-config.minibatch_rows // data) * data
  seq_len = batching.bucket_length(prompt_len + config.max_new_tokens, config.min_seq_len,
                                   per_doubling=2)
  return RunShape(config, rows, seq_len, config.tasks_per_iter * config.group_size, ref_dtype)


def compile_update(shape: RunShape, mesh: Mesh, model_config: ModelConfig,
                   programs: Sequence[str] = ("update", "logprobs"),
                   flops: bool = True, resident_as_args: bool = False
                   ) -> dict[str, ProgramReport]:
  """The trainer's update and log-prob programs at `shape`, compiled for `mesh`.

  resident_as_args: hand each program the state it does not take (the reference beside the
    update; the policy and AdamW state beside the log-probs) as a kept, unused argument, so the
    compiler's HBM limit counts it: XLA:TPU rematerializes only as far as a program needs to fit
    that limit, and otherwise fits a program that the device, holding the rest, would not.
  """
  cfg = shape.config
  dtype = jnp.dtype(cfg.param_dtype)
  _, graphdef, params = abstract_policy(model_config, mesh, dtype, cfg.compute_dtype,
                                        lora_rank=cfg.lora_rank, lora_alpha=cfg.lora_alpha)
  frozen = None
  if cfg.lora_rank:  # as the trainer splits it: the adapters train, the base is an argument
    params, frozen = nnx.split_state(params, nnx.LoRAParam, ...)
  tx = update.optimizer(cfg, update.lr_schedule(cfg))
  opt_state = abstract_opt_state(tx, params, mesh)
  # With LoRA the reference is the initial adapters on the same base.
  ref_params = params if cfg.lora_rank else with_dtype(params, shape.ref_dtype)
  param_b, opt_b, ref_b, frozen_b = map(device_bytes, (params, opt_state, ref_params, frozen))
  step_adv = step_advantages(cfg, mesh)

  def programs_for(config, rows):
    return update.update_programs(config, graphdef, tx, rows,
                                 jax.tree.map(lambda x: x.sharding, params),
                                 jax.tree.map(lambda x: x.sharding, opt_state))

  def args_for(name, rows, length, params_in):
    mb = minibatch(mesh, rows, length, with_critic=ESTIMATORS[cfg.algo].critic)
    for k in CRITIC_TARGETS:  # the trainer hands these to the critic step only
      mb.pop(k, None)
    if name == "update":
      return (params_in, opt_state, mb, step_adv, frozen)
    # Logits at every position (no logit_positions): an upper bound on the trainer's program,
    # which projects only the loss positions.
    return (params_in, mb["input_ids"], mb["targets"], mb["attention_mask"], mb["positions"],
            None, frozen)

  out = {}
  logprobs, train_step = programs_for(cfg, shape.rows)
  # The FLOP twin: one pass of `flop_rows` rows with one log-prob chunk (no loop to undercount).
  micro = cfg.microbatch_rows if cfg.microbatch_rows else int(mesh.shape["data"])
  for name in programs:
    fn = train_step if name == "update" else logprobs
    if name == "update":
      resident = ref_b
    else:  # the reference log-probs: the policy and its optimizer state stay resident
      resident = param_b + opt_b
    args = args_for(name, shape.rows, shape.seq_len, params if name == "update" else ref_params)
    if resident_as_args:
      held = ref_params if name == "update" else (params, opt_state)
      fn = jax.jit(lambda _held, *a, fn=fn: fn(*a), keep_unused=True,
                   donate_argnums=(1, 2) if name == "update" else (),
                   out_shardings=(jax.tree.map(lambda x: x.sharding, params),
                                  jax.tree.map(lambda x: x.sharding, opt_state), None)
                   if name == "update" else None)
      args, resident = (held, *args), 0
    report, _ = compile_program(name, fn, args, resident)
    if resident_as_args:
      report.note = "resident state passed as a kept argument"
    out[name] = report
    report.flops = None  # the compiled count holds one pass of each loop: not the step's
    if not flops:
      continue
    flop_rows = micro if name == "update" else int(mesh.shape["data"])
    twin_cfg = dataclasses.replace(cfg, microbatch_rows=0, logprob_microbatch_rows=0,
                                   logprob_chunk=shape.seq_len)
    twin_lp, twin_step = programs_for(twin_cfg, flop_rows)
    twin, _ = compile_program(name + "-flops", twin_step if name == "update" else twin_lp,
                              args_for(name, flop_rows, shape.seq_len,
                                       params if name == "update" else ref_params), 0)
    report.flops = (twin.flops * shape.rows / flop_rows if twin.fits and twin.flops is not None
                    else None)
    report.note = (report.note + f"; flops: {flop_rows}-row twin x {shape.rows // flop_rows}"
                   ).strip("; ")
  out["_state"] = dict(params=param_b, opt_state=opt_b, ref_params=ref_b, frozen=frozen_b)
  return out


def abstract_critic(params, hidden_size: int, mesh: Mesh) -> dict:
  """`critic.init_critic(params, ...)` as ShapeDtypeStructs: the trunk on the policy's
  parameter shardings (a copy of the trained state), the float32 head replicated."""
  head = {"kernel": _on(mesh, (hidden_size,), jnp.float32, batch=False),
          "bias": _on(mesh, (), jnp.float32, batch=False)}
  return {"trunk": params, "head": head}


def compile_critic(shape: RunShape, mesh: Mesh, model_config: ModelConfig,
                   programs: Sequence[str] = CRITIC_PROGRAMS, flops: bool = True,
                   policy_bytes: int = 0) -> dict[str, ProgramReport]:
  """PPO's critic programs (`salt_jax.critic.critic_programs`) at `shape`, compiled for `mesh`.

  policy_bytes: the policy's state the device holds beside them (params, AdamW state, reference
    and frozen base: `compile_update`'s `_state`), counted as resident. The critic step takes the
    critic and its AdamW state (donated); the value program takes the critic, its AdamW state
    resident. Returns the reports and `_state`: the critic's and its AdamW state's bytes.
  """
  cfg = shape.config
  _, graphdef, params = abstract_policy(model_config, mesh, jnp.dtype(cfg.param_dtype),
                                        cfg.compute_dtype, lora_rank=cfg.lora_rank,
                                        lora_alpha=cfg.lora_alpha)
  frozen = None
  if cfg.lora_rank:  # the critic's own adapters on the policy's frozen base
    params, frozen = nnx.split_state(params, nnx.LoRAParam, ...)
  tree = abstract_critic(params, model_config.hidden_size, mesh)
  tx = critic.critic_optimizer(cfg)
  opt_state = abstract_opt_state(tx, tree, mesh)
  critic_b, opt_b = device_bytes(tree), device_bytes(opt_state)
  shard_of = lambda t: jax.tree.map(lambda x: x.sharding, t)  # noqa: E731

  def programs_for(config, rows):
    return critic.critic_programs(config, graphdef, tx, rows, shard_of(tree),
                                  shard_of(opt_state))

  def args_for(name, rows):
    mb = minibatch(mesh, rows, shape.seq_len, with_critic=True)
    if name == "critic":  # the fields `state.update_step` hands the critic step
      fields = ("input_ids", "attention_mask", "positions", "loss_mask") + CRITIC_TARGETS
      return (tree, opt_state, {k: mb[k] for k in fields}, frozen)
    return (tree, mb["input_ids"], mb["attention_mask"], mb["positions"], frozen)

  values, critic_step = programs_for(cfg, shape.rows)
  micro = cfg.microbatch_rows if cfg.microbatch_rows else int(mesh.shape["data"])
  out = {}
  for name in programs:
    fn = critic_step if name == "critic" else values
    resident = policy_bytes + (0 if name == "critic" else opt_b)
    report, _ = compile_program(name, fn, args_for(name, shape.rows), resident)
    out[name] = report
    report.flops = None  # the compiled count holds one pass of each loop: not the step's
    if not flops:
      continue
    flop_rows = micro if name == "critic" else int(mesh.shape["data"])
    twin_values, twin_step = programs_for(
        dataclasses.replace(cfg, microbatch_rows=0, logprob_microbatch_rows=0), flop_rows)
    twin, _ = compile_program(name + "-flops", twin_step if name == "critic" else twin_values,
                              args_for(name, flop_rows), 0)
    report.flops = (twin.flops * shape.rows / flop_rows if twin.fits and twin.flops is not None
                    else None)
    report.note = f"flops: {flop_rows}-row twin x {shape.rows // flop_rows}"
  out["_state"] = dict(critic=critic_b, critic_opt_state=opt_b)
  return out


def compile_sampler(shape: RunShape, mesh: Mesh, model_config: ModelConfig, prompt_len: int,
                    programs: Sequence[str] = ("prefill", "decode"),
                    resident_bytes: int = 0) -> dict[str, ProgramReport]:
  """The sampler's prefill and decode programs for a full batch of `prompt_len`-token prompts."""
  cfg = shape.config
  dtype = jnp.dtype(cfg.param_dtype)
  model, _, params = abstract_policy(model_config, mesh, dtype, cfg.compute_dtype,
                                     lora_rank=cfg.lora_rank, lora_alpha=cfg.lora_alpha)
  sampler = sampling.Sampler(
      model, eos_token_ids=list(model_config.eos_token_ids) or [0], pad_token_id=0,
      max_cache_len=cfg.max_cache_len, mesh=mesh,
      prompt_buckets=sampling.length_buckets(cfg.prompt_bucket_min, cfg.max_cache_len,
                                            cfg.prompt_buckets_per_doubling))
  # pylint: disable=protected-access  (the sampler's own programs and bucketing)
  batch = sampler._pad_batch(shape.sampler_batch)
  prompt = sampler._prompt_bucket(prompt_len, cfg.max_new_tokens)
  cache = sampler._cache_len(prompt + cfg.max_new_tokens - 1)
  mode = sampling._Mode(greedy=False, filtered=cfg.top_k > 0 or cfg.top_p < 1.0)
  knobs = sampling._Knobs(*(_on(mesh, (), d, batch=False) for d in (jnp.float32, jnp.float32,
                                                                    jnp.int32, jnp.int32)))
  scalar = _on(mesh, (), jnp.int32, batch=False)
  key = jax.eval_shape(lambda: jax.random.key(0))
  key = jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=replicated(mesh))

  def prefill_args(rows):
    return (params, None, None, _on(mesh, (rows, cache), jnp.bool_),
            _on(mesh, (rows, prompt), jnp.int32), _on(mesh, (rows, prompt), jnp.int32),
            _on(mesh, (rows, prompt), jnp.bool_), scalar, None, scalar, key, knobs)

  out = {}
  prefill, prefill_compiled = compile_program("prefill", sampler._prefill, prefill_args(batch),
                                               resident_bytes, mode=mode)
  prefill.note = f"batch {batch}, prompt {prompt}, cache {cache}"
  if "prefill" in programs:
    out["prefill"] = prefill
  if "decode" in programs:
    # The decode step takes the prefill's output (the loop state) in the layout the compiler
    # chose for it. Where the full batch's prefill was refused, the largest smaller batch's
    # prefill that compiles gives that layout (a sharding does not depend on the batch size).
    layout_rows, layout = batch, prefill_compiled
    while layout is None and (smaller := sampler._pad_batch(layout_rows // 2)) < layout_rows:
      layout_rows = smaller
      _, layout = compile_program("prefill", sampler._prefill, prefill_args(layout_rows),
                                  resident_bytes, mode=mode)
    loop = jax.eval_shape(functools.partial(sampler._prefill, mode=mode), *prefill_args(batch))
    if layout is not None:
      loop = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                          loop, layout.output_shardings)
    else:
      loop = jax.tree.map(lambda x: jax.ShapeDtypeStruct(
          x.shape, x.dtype, sharding=batch_sharding(mesh, x.ndim) if x.ndim else
          replicated(mesh)), loop)
    decode, _ = compile_program("decode", sampler._decode, (params, loop, knobs, scalar),
                                resident_bytes, mode=mode)
    decode.note = f"one step of batch {batch}, cache {cache}"
    if layout is None:
      decode.note += "; loop state laid out by batch (no prefill compiled)"
    elif layout_rows != batch:
      decode.note += f"; loop state laid out as the {layout_rows}-row prefill's"
    out["decode"] = decode
  return out


def chip_figures(mesh: Mesh) -> dict:
  """Per-device peak FLOP/s, bandwidth and nominal HBM of the mesh's chips."""
  kind = mesh.devices.flat[0].device_kind
  per_chip = devices_per_chip(mesh)
  peak, bandwidth = chip_limits(kind, None, None)
  hbm = next((v for k, v in CHIP_HBM_GIB.items() if k.lower() == kind.lower()), None)
  return dict(kind=kind, devices_per_chip=per_chip,
              peak=peak / per_chip if peak else None,
              bandwidth=bandwidth / per_chip if bandwidth else None,
              hbm=hbm * GIB // per_chip if hbm else None)


def _gib(x) -> str:
  return "-" if x is None else f"{x / GIB:.2f}"


def format_report(reports: Mapping[str, ProgramReport], state: Mapping[str, int], chip: dict,
                  limit: int | None, utilisation: float) -> str:
  lines = [f"per device ({chip['kind']}, {chip['devices_per_chip']} device(s) per chip): "
           f"params {_gib(state['params'])} GiB, optimizer state {_gib(state['opt_state'])} GiB, "
           f"reference params {_gib(state['ref_params'])} GiB"
           + (f", frozen base {_gib(state['frozen'])} GiB" if state.get("frozen") else "")
           + (f", critic {_gib(state['critic'])} GiB, its optimizer state "
              f"{_gib(state['critic_opt_state'])} GiB" if state.get("critic") else "")
           + f"; HBM {_gib(chip['hbm'])} GiB "
           f"nominal, {_gib(limit)} GiB the compiler allows",
           f"{'program':9} {'fits':>4} {'resident':>8} {'args':>7} {'out-alias':>9} "
           f"{'temp':>7} {'total':>7} {'TFLOP':>8} {'s@peak':>8} {'s@' + format(utilisation, '.0%'):>8}"
           f" {'s@bw':>8}  note"]
  for r in reports.values():
    t_peak = r.flops / chip["peak"] if r.flops and chip["peak"] else None
    t_bw = r.bytes_accessed / chip["bandwidth"] if r.bytes_accessed and chip["bandwidth"] else None
    fmt = lambda x: "-" if x is None else f"{x:.4g}"  # noqa: E731
    total = r.total_bytes
    lines.append(
        f"{r.name:9} {'yes' if r.fits else 'NO':>4} {_gib(r.resident_bytes):>8} "
        f"{_gib(r.argument_bytes):>7} "
        f"{_gib(None if not r.fits else r.output_bytes - r.alias_bytes):>9} "
        f"{_gib(r.temp_bytes if r.fits else r.needed_bytes):>7} {_gib(total):>7}"
        f"{'' if r.fits else '+'} "
        f"{fmt(r.flops and r.flops / 1e12):>8} {fmt(t_peak):>8} "
        f"{fmt(t_peak and t_peak / utilisation):>8} {fmt(t_bw if r.name == 'decode' else None):>8}"
        f"  compile {r.compile_s:.0f} s; {r.note}")
  return "\n".join(lines)


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--topology", required=True, help="e.g. v4:2x2x1, v5e:2x4, v5p:2x2x2")
  ap.add_argument("--chip-config", default=None,
                  help="libtpu chip config, e.g. 'megacore' (one device per v4 chip)")
  ap.add_argument("--mesh", required=True, help="DxM over the topology's devices, e.g. 4x2")
  ap.add_argument("--model", required=True, choices=sorted(PRESETS))
  ap.add_argument("--recipe", default="verl-agent", choices=sorted(RECIPES),
                  help="the run's settings (salt_jax.recipes), before the options below")
  ap.add_argument("--programs", default=None,
                  help=f"comma-separated, of {','.join(PROGRAMS)} (default: all the run uses; "
                       "the critic's with a critic's estimator)")
  ap.add_argument("--num-layers", type=int, default=None,
                  help="the preset with this many decoder layers (same widths): a full-depth "
                       "compile takes 2 to 50 minutes here; memory grows linearly with layers")
  ap.add_argument("--prompt-len", type=int, default=None,
                  help="longest prompt (tokens; default: max_cache_len - max_new_tokens)")
  ap.add_argument("--param-dtype", default=None, choices=PARAM_DTYPES,
                  help="parameters, AdamW state and (without --compute-dtype) compute "
                       "(default: the recipe's)")
  ap.add_argument("--compute-dtype", default=None, choices=PARAM_DTYPES,
                  help="activations and matmuls, when not the parameters' (bfloat16 over "
                       "float32 parameters: mixed precision)")
  ap.add_argument("--ref-dtype", default=None, choices=PARAM_DTYPES,
                  help="reference parameters (default: as the parameters)")
  ap.add_argument("--minibatch-rows", type=int, default=None)
  ap.add_argument("--microbatch-rows", type=int, default=None)
  ap.add_argument("--logprob-microbatch-rows", type=int, default=None,
                  help="rows per log-prob pass (default: as --microbatch-rows)")
  ap.add_argument("--remat-policy", default=None, choices=tuple(REMAT_POLICIES),
                  help="what the update's backward pass recomputes (default: the recipe's)")
  ap.add_argument("--logprob-chunk", type=int, default=None)
  ap.add_argument("--lora-rank", type=int, default=None,
                  help="train qwix LoRA adapters of this rank on the frozen base, as the "
                       "trainer's --lora-rank does (the base in --param-dtype, adapters float32)")
  ap.add_argument("--utilisation", type=float, default=0.4,
                  help="share of peak FLOP/s assumed for the second step time")
  ap.add_argument("--resident-as-args", action="store_true",
                  help="the update and log-probs get the state they do not take as a kept, "
                       "unused argument, so the compiler's HBM limit counts it")
  ap.add_argument("--no-flops", action="store_true",
                  help="skip the update's and log-probs' FLOP twins (two fewer compiles)")
  ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                  help="any other TrainConfig field over the recipe's, e.g. max_new_tokens=2048 "
                       "max_cache_len=18432 (AppWorld's lengths) or tasks_per_iter=8 (the "
                       "sampler's batch is tasks_per_iter x group_size)")
  ap.add_argument("--json", default=None, help="also write the figures here")
  args = ap.parse_args(argv)

  overrides = {k: v for k, v in dict(param_dtype=args.param_dtype,
                                     compute_dtype=args.compute_dtype,
                                     minibatch_rows=args.minibatch_rows,
                                     microbatch_rows=args.microbatch_rows,
                                     logprob_microbatch_rows=args.logprob_microbatch_rows,
                                     remat_policy=args.remat_policy,
                                     logprob_chunk=args.logprob_chunk,
                                     lora_rank=args.lora_rank).items() if v is not None}
  try:
    overrides = {**parse_overrides(args.set), **overrides}
  except ValueError as e:
    ap.error(str(e))
  config = TrainConfig.from_recipe(args.recipe, **overrides)
  has_critic = config.algo in ESTIMATORS and ESTIMATORS[config.algo].critic
  if args.programs is None:
    programs = [p for p in PROGRAMS if has_critic or p not in CRITIC_PROGRAMS]
  else:
    programs = [p.strip() for p in args.programs.split(",") if p.strip()]
  unknown = set(programs) - set(PROGRAMS)
  if unknown:
    ap.error(f"unknown programs {sorted(unknown)}; known: {PROGRAMS}")
  if not has_critic and set(programs) & set(CRITIC_PROGRAMS):
    ap.error(f"the programs {CRITIC_PROGRAMS} need a critic's estimator (--recipe ppo or --set "
             f"algo=ppo); algo {config.algo!r} has none")
  mesh = topology_mesh(args.topology, args.mesh, args.chip_config)
  data = int(mesh.shape["data"])
  try:
    config.validate()
  except ValueError as e:
    ap.error(str(e))
  for name in ("microbatch_rows", "logprob_microbatch_rows"):
    if getattr(config, name) % data:  # as the trainer requires
      ap.error(f"--{name.replace('_', '-')} must be a multiple of the data axis ({data})")
  if args.prompt_len is None:
    args.prompt_len = config.max_cache_len - config.max_new_tokens
  if args.prompt_len + config.max_new_tokens > config.max_cache_len:
    ap.error(f"--prompt-len {args.prompt_len} + max_new_tokens {config.max_new_tokens} exceeds "
             f"max_cache_len {config.max_cache_len}: raise it with --set max_cache_len=N")
  # With LoRA the reference is the initial adapters, float32 whatever the base's dtype.
  ref_dtype = jnp.dtype("float32" if config.lora_rank
                        else args.ref_dtype or config.param_dtype)
  shape = run_shape(config, mesh, args.prompt_len, ref_dtype)
  model_config = preset_config(args.model, config, args.num_layers)
  chip = chip_figures(mesh)
  limit = compiler_hbm_limit(mesh)
  print(f"{args.model} ({model_config.num_layers} layers) on {args.topology} "
        f"({mesh.devices.size} devices), mesh {args.mesh}; "
        f"params {config.param_dtype}, compute {config.compute_dtype or config.param_dtype}, "
        + (f"LoRA rank {config.lora_rank} (float32 adapters; the reference: their initial "
           "values)" if config.lora_rank else f"reference {ref_dtype.name}")
        + f"; mini-batch {shape.rows} rows "
        f"x {shape.seq_len} tokens, micro-batch {config.microbatch_rows or shape.rows} rows, "
        f"log-prob pass {config.logprob_microbatch_rows or config.microbatch_rows or shape.rows} "
        f"rows, remat {config.remat_policy}, "
        f"log-prob chunk {config.logprob_chunk}; sampler batch {shape.sampler_batch}, "
        f"cache {config.max_cache_len}", flush=True)
  reports = compile_update(shape, mesh, model_config,
                           [p for p in programs if p in ("update", "logprobs")],
                           flops=not args.no_flops, resident_as_args=args.resident_as_args)
  state = reports.pop("_state")
  if has_critic:
    critic_reports = compile_critic(
        shape, mesh, model_config, [p for p in programs if p in CRITIC_PROGRAMS],
        flops=not args.no_flops,
        # with LoRA the frozen base is the critic's argument, not resident
        policy_bytes=state["params"] + state["opt_state"] + state["ref_params"])
    state.update(critic_reports.pop("_state"))
    reports.update(critic_reports)
    # The policy's programs: the critic and its optimizer state stay resident beside them.
    for name in ("update", "logprobs"):
      if name in reports:
        reports[name].resident_bytes += state["critic"] + state["critic_opt_state"]
  # the sampler takes the params (with LoRA the base and the adapters)
  resident = (state["opt_state"] + state["ref_params"] + state.get("critic", 0)
              + state.get("critic_opt_state", 0))
  sampler_programs = [p for p in programs if p in ("prefill", "decode")]
  if sampler_programs:
    reports.update(compile_sampler(shape, mesh, model_config, args.prompt_len, sampler_programs,
                                   resident_bytes=resident))
  reports = {k: reports[k] for k in PROGRAMS if k in reports}
  print(format_report(reports, state, chip, limit, args.utilisation), flush=True)
  if args.json:
    with open(args.json, "w", encoding="utf-8") as f:
      json.dump(record(args.model, model_config, args.topology, args.chip_config, args.mesh, chip,
                       config, shape, state, reports, resident_as_args=args.resident_as_args,
                       prompt_len=args.prompt_len, hbm_limit=limit), f, indent=1)
  return 0


def record(model_name: str, model_config: ModelConfig, topology: str, chip_config: str | None,
           mesh_shape: str, chip: Mapping, config: TrainConfig, shape: RunShape,
           state: Mapping[str, int], reports: Mapping[str, ProgramReport], *,
           resident_as_args: bool, prompt_len: int, hbm_limit: int | None) -> dict:
  """The `--json` file: one compile's settings and figures, as `tpu_aot_table.py` reads them."""
  return dict(model=model_name, num_layers=model_config.num_layers, topology=topology,
              prompt_len=prompt_len, mesh=mesh_shape, chip_config=chip_config,
              resident_as_args=resident_as_args, chip=dict(chip), hbm_limit=hbm_limit,
              state=dict(state), rows=shape.rows, seq_len=shape.seq_len, config=config.to_json(),
              ref_dtype=jnp.dtype(shape.ref_dtype).name if shape.ref_dtype is not None
              else "none",
              programs={k: {**dataclasses.asdict(v), "total_bytes": v.total_bytes}
                        for k, v in reports.items()})


if __name__ == "__main__":
  sys.exit(main())
