"""A training run's policy as a Hugging Face folder that transformers 5.x and 4.x load alike.

    python -m salt_jax.export --run runs/x --out exported/x [--step N] [--dtype bfloat16]

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


def load_policy(run: str, step: Optional[int] = None):
  """(policy CausalLM, tokenizer, TrainConfig, step) of checkpoint `step` (None: the newest).

  Only the `params` item of the checkpoint's state is read, onto the first device.

  Raises:
    ValueError: no config.json, no such checkpoint.
    checkpoint.DamagedCheckpoint: the parameters do not read back, or read back other values
      than the fingerprints saved with them.
  """
  # pylint: disable=import-outside-toplevel
  import orbax.checkpoint as ocp
  from salt_jax.models import CausalLM
  from salt_jax.models.build import build_tokenizer, policy_config
  cfg = run_config(run)
  step = checkpoint_step(run, step)
  tokenizer = build_tokenizer(cfg)
  mcfg, param_dtype = policy_config(cfg, tokenizer)
  abstract = nnx.eval_shape(lambda: CausalLM(mcfg, rngs=nnx.Rngs(0), dtype=param_dtype,
                                             param_dtype=param_dtype))
  graphdef, shapes = nnx.split(abstract)
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
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
    saved = json.load(f).get("fingerprints")
  if saved is not None:
    saved = {k: v for k, v in saved.items() if k.startswith("['params']")}
  bad = checkpoint.damaged_leaves({"params": got["params"]}, saved)
  if bad:
    raise checkpoint.DamagedCheckpoint(
        f"checkpoint {step} of {run}: {len(bad)} parameter array(s) differ from the fingerprints "
        f"saved with them, e.g. {bad[0]}")
  return nnx.merge(graphdef, got["params"]), tokenizer, cfg, step


def generation_fields(cfg, tokenizer) -> dict:
  """generation_config.json fields of a run: the ids its sampler stopped and padded with, and its
  sampling settings."""
  eos = stop_token_ids(tokenizer)
  pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
  return {"eos_token_id": eos[0] if len(eos) == 1 else eos, "pad_token_id": pad,
          "do_sample": True, "temperature": cfg.temperature, "top_p": cfg.top_p,
          "top_k": cfg.top_k or None}


def export_run(run: str, out: str, *, step: Optional[int] = None,
               dtype: Optional[str] = None) -> int:
  """Writes checkpoint `step` (None: the newest) of `run` to the Hugging Face folder `out`.

  Args:
    run: the run's folder (--out of the training).
    out: the folder to write: new (it is created) or empty; anything else is refused before any
      work (`check_out`).
    step: the checkpoint (iteration) to export; None: the newest complete one.
    dtype: 'float32', 'bfloat16' or 'float16'; None: the run's parameter dtype.

  Returns:
    The exported step.
  """
  # pylint: disable=import-outside-toplevel
  from salt_jax.models import save_pretrained
  from salt_jax.models.tokenizer import save_tokenizer
  if dtype is not None and dtype not in DTYPES:
    raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
  check_out(out)
  logger.info("export: reading checkpoint %s of %s", "(newest)" if step is None else step, run)
  model, tokenizer, cfg, step = load_policy(run, step)
  logger.info("export: writing %s (%s)", out, dtype or cfg.param_dtype)
  save_pretrained(model, out, dtype=dtype, generation=generation_fields(cfg, tokenizer))
  save_tokenizer(tokenizer, out)
  return step


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(
      prog="python -m salt_jax.export", description=__doc__.split("\n\n")[0])
  parser.add_argument("--run", required=True, help="the training run's folder (its --out)")
  parser.add_argument("--out", required=True, help="the Hugging Face folder to write")
  parser.add_argument("--step", type=int, default=None,
                      help="checkpoint (iteration) to export; default: the newest")
  parser.add_argument("--dtype", choices=DTYPES, default=None,
                      help="stored dtype; default: the run's parameter dtype")
  parser.add_argument("--log-level", default=None, choices=("debug", "info", "warning", "error"),
                      help="default: $SALT_JAX_LOG_LEVEL, else info")
  args = parser.parse_args(argv)
  log.configure(args.log_level)
  try:
    step = export_run(args.run, args.out, step=args.step, dtype=args.dtype)
  except (ValueError, checkpoint.DamagedCheckpoint) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  size = sum(os.path.getsize(os.path.join(args.out, f)) for f in os.listdir(args.out))
  print(f"exported checkpoint {step} of {args.run} to {args.out} ({size / 2**20:.1f} MiB)")
  return 0


if __name__ == "__main__":
  sys.exit(main())
