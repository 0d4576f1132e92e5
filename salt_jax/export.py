"""A training run's policy as a Hugging Face folder that transformers 5.x and 4.x load alike.

    python -m salt_jax.export --run runs/x --out exported/x [--step N] [--dtype bfloat16] [--peft]

Reads the run's config.json (the `TrainConfig` it ran with) to rebuild the policy's architecture
and tokenizer, restores only the policy parameters of one orbax checkpoint under
`<run>/checkpoints` (the newest by default; optimizer state and reference parameters are not
read), checks them against the fingerprints saved with them, and writes:

  config.json             both RoPE layouts (`rope_theta` for 4.x, `rope_parameters` for 5.x)
  model.safetensors       float32, bfloat16 or float16
  generation_config.json  the run's eos/pad ids and sampling (temperature, top_p, top_k)
  tokenizer files         tokenizer.json, a tokenizer_config.json 4.x's AutoTokenizer reads,
                          chat_template.jinja

Then `transformers.AutoModelForCausalLM.from_pretrained(folder)` and
`AutoTokenizer.from_pretrained(folder)` work in either version (tests/test_export.py checks the
logits of both against ours).

`--out` must be a new or empty folder, refused before any work otherwise: its config.json would
replace a training run's own (a run may be read while it trains: the newest complete checkpoint).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import Optional

import jax
from flax import nnx

from salt_jax import checkpoint
from salt_jax import log
from salt_jax import runlock
from salt_jax.agent.prompts import stop_token_ids
from salt_jax.config import TrainConfig

logger = logging.getLogger(__name__)

DTYPES = ("float32", "bfloat16", "float16")


def run_config(run: str):
  """The `TrainConfig` a run was trained with (its config.json; unknown fields are dropped)."""
  path = os.path.join(run, "config.json")
  if not os.path.exists(path):
    raise ValueError(f"--run {run} is not a training run: it has no config.json")
  return TrainConfig.load(path, ignore_unknown=True)


def check_out(out: str) -> None:
  """Raises ValueError unless `out` is a new or empty folder: the export writes config.json and
  tokenizer files, which would replace those of a training run (or of anything else) there."""
  if not os.path.exists(out):
    return
  if not os.path.isdir(out):
    raise ValueError(f"--out {out} is a file, not a folder")
  names = sorted(os.listdir(out))
  if not names:
    return
  held_by = runlock.holder(out) if runlock.LOCK_FILE in names else None
  if held_by is not None:
    raise runlock.in_use(out, held_by)
  if runlock.LOCK_FILE in names or "config.json" in names and (
      "checkpoints" in names or "metrics.jsonl" in names):
    raise ValueError(f"--out {out} is a training run's folder: the export would write its "
                     "config.json over the run's; pick a new or empty folder")
  shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
  raise ValueError(f"--out {out} is not empty (it holds {shown}); pick a new or empty folder")


def checkpoint_step(run: str, step: Optional[int] = None) -> int:
  """`step` if the run has that complete checkpoint, the newest one when `step` is None."""
  steps = checkpoint.complete_steps(os.path.join(run, "checkpoints"))
  if not steps:
    raise ValueError(f"{run} has no complete checkpoint under {run}/checkpoints")
  if step is None:
    return steps[0]
  if step not in steps:
    raise ValueError(f"{run} has no checkpoint {step}; it has {sorted(steps)}")
  return step


def load_policy(run: str, step: Optional[int] = None, *, merge: bool = True):
  """(policy CausalLM, tokenizer, TrainConfig, step) of checkpoint `step` (None: the newest).

  Only the `params` item of the checkpoint's state is read, onto the first device. A LoRA run's
  checkpoint holds the adapters: its base is rebuilt as the run built it (--model, --init-params)
  and checked against the reference fingerprints the run saved; the policy returned has the
  adapters merged into the base (`merge`, default) or kept as adapters.

  Raises:
    ValueError: no config.json, no such checkpoint, a LoRA run's base that changed.
    checkpoint.DamagedCheckpoint: the parameters do not read back, or read back other values
      than the fingerprints saved with them.
  """
  # pylint: disable=import-outside-toplevel
  import orbax.checkpoint as ocp
  from salt_jax.models import CausalLM, lora
  from salt_jax.models.build import build_policy, build_tokenizer, policy_config
  from salt_jax.sharding import make_mesh
  cfg = run_config(run)
  if cfg.lora_rank:  # the checkpoint holds adapters: the base comes from where the run read it
    for name, path in (("--model", cfg.model), ("--init-params", cfg.init_params)):
      if path is not None and not os.path.exists(path):
        raise ValueError(f"the LoRA run in {run} trained adapters on the base from {name} "
                         f"{path}, which is gone: put it back to export the run")
  step = checkpoint_step(run, step)
  tokenizer = build_tokenizer(cfg)
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  if cfg.lora_rank:
    model = build_policy(cfg, tokenizer, make_mesh("1x1"))
    graphdef, shapes, base = nnx.split(model, nnx.LoRAParam, ...)
  else:
    mcfg, param_dtype = policy_config(cfg, tokenizer)
    abstract = nnx.eval_shape(lambda: CausalLM(mcfg, rngs=nnx.Rngs(0), dtype=param_dtype,
                                               param_dtype=param_dtype))
    graphdef, shapes = nnx.split(abstract)
  item = {"params": jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device), shapes)}
  step_dir = os.path.abspath(os.path.join(run, "checkpoints", str(step)))
  try:
    with ocp.PyTreeCheckpointer() as ckptr:
      got = ckptr.restore(os.path.join(step_dir, "state"), args=ocp.args.PyTreeRestore(
          item=item, restore_args=ocp.checkpoint_utils.construct_restore_args(item),
          partial_restore=True))
  except Exception as e:  # pylint: disable=broad-except  (orbax raises bare Exception too)
    raise checkpoint.DamagedCheckpoint(
        f"checkpoint {step} of {run}: unreadable: {checkpoint.root_cause(e)}") from e
  with open(os.path.join(step_dir, checkpoint.META_ITEM, "metadata"), encoding="utf-8") as f:
    meta = json.load(f)
  saved = meta.get("fingerprints")
  if saved is not None:
    saved = {k: v for k, v in saved.items() if k.startswith("['params']")}
  bad = checkpoint.damaged_leaves({"params": got["params"]}, saved)
  if bad:
    raise checkpoint.DamagedCheckpoint(
        f"checkpoint {step} of {run}: {len(bad)} parameter array(s) differ from the fingerprints "
        f"saved with them, e.g. {bad[0]}")
  if not cfg.lora_rank:
    return nnx.merge(graphdef, got["params"]), tokenizer, cfg, step
  ref = meta.get("reference_fingerprints")
  changed = checkpoint.damaged_leaves({"base": base}, None if ref is None else {
      k: v for k, v in ref.items() if k.startswith("['base']")})
  if changed:
    raise ValueError(f"the LoRA base rebuilt from --model / --init-params differs from the one "
                     f"the run in {run} trained on ({len(changed)} arrays, e.g. {changed[0]}): "
                     "were those folders changed?")
  model = nnx.merge(graphdef, got["params"], base)
  return (lora.merged(model) if merge else model), tokenizer, cfg, step


def generation_fields(cfg, tokenizer) -> dict:
  """generation_config.json fields of a run: the ids its sampler stopped and padded with, and its
  sampling settings."""
  eos = stop_token_ids(tokenizer)
  pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
  return {"eos_token_id": eos[0] if len(eos) == 1 else eos, "pad_token_id": pad,
          "do_sample": True, "temperature": cfg.temperature, "top_p": cfg.top_p,
          "top_k": cfg.top_k or None}


def export_run(run: str, out: str, *, step: Optional[int] = None,
               dtype: Optional[str] = None, peft: bool = False) -> int:
  """Writes checkpoint `step` (None: the newest) of `run` to the Hugging Face folder `out`.

  Args:
    run: the run's folder (--out of the training).
    out: the folder to write: new (it is created) or empty; anything else is refused before any
      work (`check_out`).
    step: the checkpoint (iteration) to export; None: the newest complete one.
    dtype: 'float32', 'bfloat16' or 'float16'; None: the run's parameter dtype.
    peft: a LoRA run's adapters as a PEFT folder (`write_peft`) instead of the merged model.

  Returns:
    The exported step.
  """
  # pylint: disable=import-outside-toplevel
  from salt_jax.models import save_pretrained
  from salt_jax.models.tokenizer import save_tokenizer
  if dtype is not None and dtype not in DTYPES:
    raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
  check_out(out)
  if peft and not run_config(run).lora_rank:
    raise ValueError(f"--peft exports LoRA adapters; the run in {run} trained every parameter "
                     "(no --lora-rank): export the model without --peft")
  logger.info("export: reading checkpoint %s of %s", "(newest)" if step is None else step, run)
  model, tokenizer, cfg, step = load_policy(run, step, merge=not peft)
  logger.info("export: writing %s (%s)", out, dtype or cfg.param_dtype)
  if peft:
    write_peft(model, cfg, tokenizer, out, dtype=dtype)
  else:
    save_pretrained(model, out, dtype=dtype, generation=generation_fields(cfg, tokenizer))
  save_tokenizer(tokenizer, out)
  return step


PEFT_BASE_SUBDIR = "base"  # where `write_peft` puts a base that is not a --model folder


def write_peft(model, cfg, tokenizer, out: str, *, dtype: Optional[str] = None) -> None:
  """A PEFT adapter folder: adapter_config.json and adapter_model.safetensors (PEFT's names), for
  `peft.PeftModel.from_pretrained(base, out)`. The base is the run's --model folder when it
  trained on that alone; otherwise (the tiny policy, a .gguf file, or --init-params over the
  model) the base is written beside the adapters, in `out/base`, as a Hugging Face folder."""
  # pylint: disable=import-outside-toplevel
  import safetensors.numpy
  from salt_jax.models import lora, save_pretrained
  os.makedirs(out, exist_ok=True)
  if cfg.model is not None and cfg.init_params is None and os.path.isdir(cfg.model):
    base = os.path.abspath(cfg.model)
  else:
    base = os.path.abspath(os.path.join(out, PEFT_BASE_SUBDIR))
    save_pretrained(lora.merged(model, adapters=False), base, dtype=dtype,
                    generation=generation_fields(cfg, tokenizer))
  tensors = lora.peft_tensors(model)
  if dtype is not None:
    tensors = {k: v.astype(jax.numpy.dtype(dtype)) for k, v in tensors.items()}
  with open(os.path.join(out, "adapter_config.json"), "w", encoding="utf-8") as f:
    json.dump(lora.peft_config(model, base_model=base), f, indent=2)
  safetensors.numpy.save_file(tensors, os.path.join(out, "adapter_model.safetensors"),
                              metadata={"format": "pt"})


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(
      prog="python -m salt_jax.export", description=__doc__.split("\n\n")[0])
  parser.add_argument("--run", required=True, help="the training run's folder (its --out)")
  parser.add_argument("--out", required=True, help="the Hugging Face folder to write")
  parser.add_argument("--step", type=int, default=None,
                      help="checkpoint (iteration) to export; default: the newest")
  parser.add_argument("--dtype", choices=DTYPES, default=None,
                      help="stored dtype; default: the run's parameter dtype")
  parser.add_argument("--peft", action="store_true",
                      help="a LoRA run's adapters as a PEFT folder (adapter_config.json, "
                      "adapter_model.safetensors; its base in OUT/base unless it is the run's "
                      "--model) instead of the merged model")
  parser.add_argument("--log-level", default=None, choices=("debug", "info", "warning", "error"),
                      help="default: $SALT_JAX_LOG_LEVEL, else info")
  args = parser.parse_args(argv)
  log.configure(args.log_level)
  try:
    step = export_run(args.run, args.out, step=args.step, dtype=args.dtype, peft=args.peft)
  except (ValueError, checkpoint.DamagedCheckpoint) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  size = sum(os.path.getsize(os.path.join(args.out, f)) for f in os.listdir(args.out))
  print(f"exported checkpoint {step} of {args.run} to {args.out} ({size / 2**20:.1f} MiB)")
  return 0


if __name__ == "__main__":
  sys.exit(main())
