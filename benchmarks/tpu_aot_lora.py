"""What a LoRA update would need on a TPU slice, compiled on a CPU host: a norm-scale stand-in.

  python benchmarks/tpu_aot_lora.py --model qwen2.5-32b --topology v4:2x2x1 --mesh 1x8 \
      [--remat-policy full] [--num-layers N] [--json FILE]

A stand-in for LoRA's update: the trainer's loss (token log-probs chunked as the trainer does,
PPO-clip with the k3 KL to the reference log-probs) on one row a data shard, differentiated only
with respect to the norm scales, which sit in every layer as LoRA's adapters would, so the backward
pass crosses every layer and keeps the same activations (with `--remat-policy full`, each layer's
input, the layer recomputed); the base is frozen, in bf16, an argument. No AdamW state (the
adapters' is negligible) and no reference copy (LoRA's reference is the base with the adapters
off). Prints per device: the base's bytes, the program's arguments and its temporaries (or the
compiler's needed figure where it refuses it), against the HBM allowed. `--json` writes the file
`tpu_aot.py --json` writes (program "lora"), so `tpu_aot_table.py` tabulates it and carries 1- and
2-layer compiles to full depth.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# pylint: disable=wrong-import-position
import tpu_aot  # noqa: E402  (sets JAX_PLATFORMS and libtpu's lock before jax is imported)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

import salt_jax  # noqa: E402
from salt_jax.config import TrainConfig  # noqa: E402
from salt_jax.logprobs import token_logprobs_and_entropy  # noqa: E402
from salt_jax.models import ModelConfig  # noqa: E402
from salt_jax.models.config import PRESETS, REMAT_POLICIES  # noqa: E402


def lora_step(graphdef, cfg: TrainConfig):
  """Gradients of the trainer's loss with respect to the norm scales alone (LoRA's stand-in)."""
  def step(state, mb, step_adv):
    # The scales and the frozen base cross jax.grad as plain arrays; the model is merged inside.
    scales, base = map(nnx.to_pure_dict, nnx.split_state(
        state, lambda path, _: "scale" in map(str, path), ...))

    def loss_fn(sc, base):
      model = nnx.merge(graphdef, nnx.State(base), nnx.State(sc))
      logp, _ = token_logprobs_and_entropy(model, mb["input_ids"], mb["targets"],
                                           mb["attention_mask"], positions=mb["positions"],
                                           chunk_size=cfg.logprob_chunk)
      adv = salt_jax.token_advantages(step_adv, mb["token_step_ids"])
      loss, _ = salt_jax.policy_loss(logp, mb["old_logprobs"], adv, mb["loss_mask"],
                                     clip_eps=cfg.clip_eps, ref_logp=mb["ref_logprobs"],
                                     kl_coef=cfg.kl_coef, kl_estimator=cfg.kl_estimator,
                                     loss_agg=cfg.loss_agg)
      return loss
    return jax.grad(loss_fn)(scales, base)
  return jax.jit(step)


def compile_lora(model_name: str, model_config: ModelConfig, topology: str, mesh_shape: str,
                 config: TrainConfig, prompt_len: int = 2048,
                 chip_config: str | None = None) -> dict:
  """The LoRA stand-in of `model_config` (named `model_name`) compiled for the slice, one row a
  data shard, with `config`'s remat policy and loss settings: a dict in `tpu_aot.py --json`'s
  schema (program "lora"; the base's bytes as `state.params`)."""
  mesh = tpu_aot.topology_mesh(topology, mesh_shape, chip_config)
  rows = int(mesh.shape["data"])  # one row a data shard
  cfg = dataclasses.replace(config, param_dtype="bfloat16", microbatch_rows=rows)
  shape = tpu_aot.run_shape(cfg, mesh, prompt_len, jnp.dtype("bfloat16"))
  model_config = dataclasses.replace(model_config, remat_policy=cfg.remat_policy,
                                     attention_impl=cfg.attention_impl)
  _, graphdef, state = tpu_aot.abstract_policy(model_config, mesh, jnp.bfloat16)
  mb = tpu_aot.minibatch(mesh, rows, shape.seq_len)
  adv = tpu_aot.step_advantages(cfg, mesh)
  report, _ = tpu_aot.compile_program("lora", lora_step(graphdef, cfg), (state, mb, adv), 0)
  report.note = "LoRA stand-in: gradients for the norm scales, base frozen in bf16"
  # The compiled count holds one pass of the log-prob chunk loop: not the program's FLOPs.
  report.flops = report.bytes_accessed = None
  # No AdamW state and no reference copy: the base's bytes are the state.
  base = dict(params=tpu_aot.device_bytes(state), opt_state=0, ref_params=0)
  return tpu_aot.record(model_name, model_config, topology, chip_config, mesh_shape,
                        tpu_aot.chip_figures(mesh), cfg,
                        dataclasses.replace(shape, rows=rows, ref_dtype=None), base,
                        {"lora": report}, resident_as_args=False, prompt_len=prompt_len,
                        hbm_limit=tpu_aot.compiler_hbm_limit(mesh))


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--model", required=True, choices=sorted(PRESETS))
  ap.add_argument("--topology", required=True, help="e.g. v4:2x2x1")
  ap.add_argument("--chip-config", default=None)
  ap.add_argument("--mesh", required=True, help="DxM, e.g. 1x8")
  ap.add_argument("--remat-policy", default="none", choices=tuple(REMAT_POLICIES))
  ap.add_argument("--num-layers", type=int, default=None,
                  help="the preset with this many decoder layers (same widths)")
  ap.add_argument("--prompt-len", type=int, default=2048)
  ap.add_argument("--json", default=None, help="also write the figures here")
  args = ap.parse_args(argv)
  model_config = PRESETS[args.model]
  if args.num_layers:
    model_config = dataclasses.replace(model_config, num_layers=args.num_layers)
  config = TrainConfig.from_recipe("verl-agent", remat_policy=args.remat_policy)
  out = compile_lora(args.model, model_config, args.topology, args.mesh, config, args.prompt_len,
                     args.chip_config)
  if args.json:
    with open(args.json, "w", encoding="utf-8") as f:
      json.dump(out, f, indent=1)
  p = out["programs"]["lora"]
  gib = lambda b: f"{b / tpu_aot.GIB:.2f}"  # noqa: E731
  print(f"{args.model} ({out['num_layers']} layers) LoRA stand-in on {args.topology}, mesh "
        f"{args.mesh}, remat {args.remat_policy}: fits {p['fits']}; per device GiB: base "
        f"{gib(out['state']['params'])}, args {gib(p['argument_bytes'])}, temporaries "
        f"{gib(p['temp_bytes'] if p['fits'] else p['needed_bytes'])}, total "
        f"{gib(p['total_bytes'])} / {gib(out['hbm_limit'])} allowed; "
        f"compile {p['compile_s']:.0f} s")
  return 0


if __name__ == "__main__":
  sys.exit(main())
