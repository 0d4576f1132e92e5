"""What a LoRA update would need on a TPU slice, compiled on a CPU host; the trainer has no LoRA.

  python benchmarks/tpu_aot_lora.py qwen2.5-32b v4:2x2x1 1x8 [--json FILE]

A stand-in for LoRA's update: the trainer's loss (token log-probs chunked as the trainer does,
PPO-clip with the k3 KL to the reference log-probs) on one row a data shard, differentiated only
with respect to the norm scales, which sit in every layer as LoRA's adapters would, so the backward
pass crosses every layer and keeps the same activations; the base is frozen, in bf16, an argument.
No AdamW state (the adapters' is negligible) and no reference copy (LoRA's reference is the base
with the adapters off). Prints per device: the base's bytes, the program's arguments and its
temporaries (or the compiler's needed figure where it refuses it), against the HBM allowed.
"""

from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# pylint: disable=wrong-import-position
import tpu_aot  # noqa: E402  (sets JAX_PLATFORMS and libtpu's lock before jax is imported)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

import salt_jax  # noqa: E402
from salt_jax import batching  # noqa: E402
from salt_jax.config import TrainConfig  # noqa: E402
from salt_jax.logprobs import token_logprobs_and_entropy  # noqa: E402
from salt_jax.models.config import PRESETS  # noqa: E402


def lora_step(graphdef, cfg: TrainConfig):
  """Gradients of the trainer's loss with respect to the norm scales alone (LoRA's stand-in)."""
  def step(state, mb, step_adv):
    scales = nnx.filter_state(state, lambda path, _: "scale" in map(str, path))

    def loss_fn(sc):
      model = nnx.merge(graphdef, nnx.merge_state(state, sc))
      logp, _ = token_logprobs_and_entropy(model, mb["input_ids"], mb["targets"],
                                           mb["attention_mask"], positions=mb["positions"],
                                           chunk_size=cfg.logprob_chunk)
      adv = salt_jax.token_advantages(step_adv, mb["token_step_ids"])
      loss, _ = salt_jax.policy_loss(logp, mb["old_logprobs"], adv, mb["loss_mask"],
                                     clip_eps=cfg.clip_eps, ref_logp=mb["ref_logprobs"],
                                     kl_coef=cfg.kl_coef, kl_estimator=cfg.kl_estimator,
                                     loss_agg=cfg.loss_agg)
      return loss
    return jax.grad(loss_fn)(scales)
  return jax.jit(step)


def main(argv: list[str]) -> int:
  model_name, topology, mesh_shape = argv[:3]
  json_path = argv[argv.index("--json") + 1] if "--json" in argv else None
  mesh = tpu_aot.topology_mesh(topology, mesh_shape)
  cfg = TrainConfig.from_recipe("verl-agent", param_dtype="bfloat16")
  rows = int(mesh.shape["data"])  # one row a data shard
  shape = tpu_aot.run_shape(cfg, mesh, 2048, jnp.dtype("bfloat16"))
  _, graphdef, state = tpu_aot.abstract_policy(PRESETS[model_name], mesh, jnp.bfloat16)
  mb = tpu_aot.minibatch(mesh, rows, shape.seq_len)
  adv = tpu_aot._on(mesh, (batching.bucket_length(  # pylint: disable=protected-access
      cfg.tasks_per_iter * cfg.group_size * cfg.max_steps, 64),), jnp.float32)
  start = time.time()
  report, _ = tpu_aot.compile_program("lora", lora_step(graphdef, cfg), (state, mb, adv), 0)
  out = dict(model=model_name, topology=topology, mesh=mesh_shape, rows=rows,
             seq_len=shape.seq_len, fits=report.fits, argument_bytes=report.argument_bytes,
             temp_or_needed=report.temp_bytes if report.fits else report.needed_bytes,
             total=report.total_bytes, base_bytes=tpu_aot.shard_bytes(state),
             limit=tpu_aot.compiler_hbm_limit(mesh), compile_s=time.time() - start)
  if json_path:
    with open(json_path, "w", encoding="utf-8") as f:
      json.dump(out, f, indent=1)
  print({k: round(v / tpu_aot.GIB, 2) if isinstance(v, int) and v > 2**20 else v
         for k, v in out.items()})
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
