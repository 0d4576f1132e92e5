"""The performance doc's TPU table from the JSON files `tpu_aot.py --json` wrote (docs/tpu_aot/).

  python benchmarks/tpu_aot_table.py docs/tpu_aot/*.json

A full-depth compile of 7B or 32B takes minutes to an hour on a shared 2-core host, so many
runs are compiled at 1 and 2 decoder layers (`--num-layers`, same widths) and carried to the
preset's depth linearly: the parameters, AdamW state and reference grow by the same bytes with
each layer, and so do the activations the backward pass keeps (the 1-layer figure holds the
embedding, the head and the log-probs' chunk). The carry is what the program needs without the
compiler's own rematerialization, which XLA:TPU applies only where a program would not fit: on
Qwen2.5-1.5B (v4-8, 4x2, 4-row micro-batches) 1, 2 and 3 layers carry to 14.3 GiB of
temporaries where the 28-layer compile rematerializes down to 11.8 GiB and fits. The carry is an
estimate, not a bound: against full-depth compiles it has been from 30% under (AppWorld's 32B
update) to 20% over (docs/performance.md); only a full-depth compile settles whether a run fits,
and a row compiled at full depth shows the carry beside it. Only programs with a
backward pass (the update, the LoRA stand-in) are carried: a forward pass (log-probs, the
sampler's prefill and decode) keeps no activations, its temporaries are one layer's working set
and do not grow with depth, so those rows come from full-depth compiles alone. A file written with
`--programs ,` holds the full-depth state alone (no program compiled), shown beside.

Rows: per device, in GiB, `total` = resident + arguments + outputs not aliased + temporaries
(the compiler's needed figure where it refused the program) at full depth, against the HBM the
compiler allows a device; `basis` says whether the figure is compiled at full depth or carried
from 1 and 2 layers. `rows a pass / mini-batch`: the program's micro-batch (`microbatch_rows`
for the update, `logprob_microbatch_rows` for the log-probs) and the mini-batch it covers (the
sampler's: its batch, every trajectory of the iteration); a
program compiled with layer remat says so after its name.

A second table follows where the files hold FLOPs (`tpu_aot.py` without `--no-flops`): per
device, a program's FLOPs (the update's and log-probs' for one mini-batch, the decode's for one
step), compiled at full depth or carried from 1 and 2 layers like the bytes, with the time they
take at the chip's peak and at 40% of it, and for the decode step the bytes it moves and their
time at the chip's memory bandwidth.
"""

from __future__ import annotations

import collections
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from salt_jax.models.config import PRESETS  # noqa: E402

GIB = 2**30
# Programs with a backward pass keep each layer's activations (or, with layer remat, its input):
# their bytes grow linearly with depth and carry. A forward pass reuses one layer's working set,
# so its temporaries do not, and it is tabulated only where compiled at full depth.
BACKWARD_PROGRAMS = ("update", "lora", "critic")
SAMPLER_PROGRAMS = ("prefill", "decode")
UTILISATION = 0.4  # the share of peak FLOP/s for the second step time


def _key(d: dict, name: str) -> tuple:
  """(model, slice, chip config, mesh, dtype, ref dtype, mini-batch rows, rows a pass of this
  program, "prompt + response" tokens, program label); the label names a remat policy,
  query-block attention and resident-state arguments."""
  c = d["config"]
  rows_a_pass, minibatch = c["microbatch_rows"], c["minibatch_rows"]
  if name in ("logprobs", "values"):  # a file without the field ran the mini-batch in one pass
    rows_a_pass = (c["logprob_microbatch_rows"] or rows_a_pass
                   if "logprob_microbatch_rows" in c else 0)
  if name in SAMPLER_PROGRAMS:  # the whole iteration's trajectories in one batch
    rows_a_pass = minibatch = c["tasks_per_iter"] * c["group_size"]
  label = name
  if name in BACKWARD_PROGRAMS and c.get("remat_policy", "none") != "none":
    label += f" (remat {c['remat_policy']})"
  if name and c.get("attention_impl") == "query_blocks":
    label += " (query blocks)"
  if name and d.get("resident_as_args"):
    label += " (state as args)"
  if name and d.get("state", {}).get("critic"):  # a critic and its AdamW state beside it
    label += " (PPO)"
  dtype = c["param_dtype"]
  if c.get("compute_dtype") not in (None, dtype):
    dtype += f" ({c['compute_dtype']} compute)"
  if c.get("lora_rank"):
    dtype += f" + LoRA {c['lora_rank']}"
  return (d["model"], d["topology"], d.get("chip_config"), d["mesh"], dtype,
          d["ref_dtype"], minibatch, rows_a_pass,
          f"{d.get('prompt_len', 2048):,} + {c['max_new_tokens']:,}", label)


def _parts(p: dict) -> tuple[float, float, float, float]:
  """(resident, arguments, outputs not aliased, temporaries or the compiler's needed figure)."""
  if p["fits"]:
    return (p["resident_bytes"], p["argument_bytes"], p["output_bytes"] - p["alias_bytes"],
            p["temp_bytes"])
  return p["resident_bytes"], p["argument_bytes"], 0, p["needed_bytes"]


def _load(files: list[str]) -> tuple[dict, dict]:
  """({program key: {layers: (file dict, program dict)}}, {run key: state-alone file dict})."""
  by_key = collections.defaultdict(dict)
  states = {}
  for f in files:
    with open(f, encoding="utf-8") as fh:
      d = json.load(fh)
    d["file"] = f
    if not d["programs"]:
      states[_key(d, None)[:6]] = d
    for name, p in d["programs"].items():
      by_key[_key(d, name)][d.get("num_layers")] = (d, p)
  return by_key, states


def _slice(d: dict) -> str:
  return d["topology"] + (f" ({d['chip_config']})" if d.get("chip_config") else "")


def rows(files: list[str]) -> list[dict]:
  """One row per (run, program): its figures at the preset's full depth."""
  by_key, states = _load(files)
  out = []
  for skey, d in states.items():  # the state alone: params + AdamW + reference against the limit
    if any(k[:6] == skey for k in by_key):
      continue
    st = d["state"]
    total = st["params"] + st["opt_state"] + st["ref_params"] + st.get("frozen", 0)
    out.append(dict(key=skey, model=d["model"], topology=_slice(d), mesh=d["mesh"], dtype=skey[4],
                    ref_dtype=skey[5], micro=None, minibatch=None, tokens="-",
                    program="(state alone)", parts=(total, 0, 0, 0), total=total,
                    limit=d["hbm_limit"], fits=total <= d["hbm_limit"],
                    basis=f"compiled, {d['num_layers']} layers", state=st, files=[d["file"]]))
  for key, runs in sorted(by_key.items(), key=lambda kv: str(kv[0])):
    d0 = next(iter(runs.values()))[0]
    full = PRESETS[d0["model"]].num_layers
    shallow = sorted((n, r) for n, r in runs.items() if n < full)[-2:]
    carried = None
    # The two deepest compiles below full depth, of a program with a backward pass.
    if len(shallow) == 2 and key[9].split(" ")[0] in BACKWARD_PROGRAMS:
      (a, (d, pa)), (b, (_, pb)) = shallow
      fa, fb = _parts(pa), _parts(pb)
      # Temporaries that fall with depth are the compiler's scheduling, not a per-layer cost:
      # nothing to carry.
      carried = (None if fb[3] < fa[3] else
                 tuple(_extrapolate(a, x, b, y, full) for x, y in zip(fa, fb)))
      carry_basis = f"carried from {a} and {b} layers" + (
          "" if pa["fits"] and pb["fits"] else " (compiler's needed figure)")
    if full in runs:
      d, p = runs[full]
      parts, basis, fits = _parts(p), f"compiled, {full} layers", p["fits"]
      if carried:
        basis += f" ({carry_basis}: {sum(carried) / GIB:.2f})"
    elif carried:
      parts, basis, fits = carried, carry_basis, None  # fits: decided against the limit below
    else:
      continue
    total = sum(parts)
    limit = d["hbm_limit"]
    if fits is None or total > limit:  # the program may fit while the state beside it does not
      if fits:
        basis += "; the program alone fits, not with the resident state beside it"
      fits = total <= limit
    state = states.get(key[:6], {}).get("state")
    out.append(dict(key=key, model=d["model"], topology=_slice(d), mesh=d["mesh"],
                    dtype=key[4], ref_dtype=key[5], micro=key[7], minibatch=key[6],
                    tokens=key[8], program=key[9], parts=parts, total=total, limit=limit,
                    fits=fits, basis=basis, state=state, files=[r[0]["file"] for r in
                                                               runs.values()]))
  return out


def markdown(table: list[dict]) -> str:
  g = lambda x: f"{x / GIB:.2f}"  # noqa: E731
  lines = ["| model | slice | mesh | params / ref | prompt + response | rows a pass / mini-batch | "
           "program | fits | state (params, AdamW, ref) | resident | args | out - alias | temp | "
           "total / allowed | basis |", "| " + " | ".join(["---"] * 15) + " |"]
  for r in table:
    st = r["state"]
    state = "-" if not st else (f"{g(st['params'])}, {g(st['opt_state'])}, {g(st['ref_params'])}"
                                + (f"; frozen base {g(st['frozen'])}" if st.get("frozen") else "")
                                + (f"; critic {g(st['critic'])}, its AdamW "
                                   f"{g(st['critic_opt_state'])}" if st.get("critic") else ""))
    micro = "-" if r["minibatch"] is None else f"{r['micro'] or r['minibatch']} / {r['minibatch']}"
    lines.append(
        f"| {r['model']} | {r['topology']} | {r['mesh']} | {r['dtype']} / {r['ref_dtype']} | "
        f"{r['tokens']} | {micro} | {r['program']} | {'yes' if r['fits'] else 'NO'}"
        f"{' (nothing else)' if r['program'] == '(state alone)' else ''} | {state} | "
        + " | ".join(g(x) for x in r["parts"])
        + f" | {g(r['total'])} / {g(r['limit'])} | {r['basis']} |")
  return "\n".join(lines)


def _extrapolate(a: int, x: float, b: int, y: float, full: int) -> float:
  """The value at `full` layers of the line through (a, x) and (b, y)."""
  return y + (full - b) * (y - x) / (b - a)


def _carry(by_layers: dict, full: int, field: str) -> tuple[float, str] | None:
  """A program's `field` at `full` layers: compiled there, else carried linearly from the two
  deepest shallower compiles (FLOPs and bytes moved grow by the same amount with each layer)."""
  have = {n: p[field] for n, (_, p) in by_layers.items() if p.get(field) is not None}
  if full in have:
    return have[full], f"compiled, {full} layers"
  shallow = sorted((n, v) for n, v in have.items() if n < full)[-2:]
  if len(shallow) < 2:
    return None
  (a, x), (b, y) = shallow
  return _extrapolate(a, x, b, y, full), f"carried from {a} and {b} layers"


def flop_rows(files: list[str], utilisation: float = UTILISATION) -> list[dict]:
  """One row per (run, program) with FLOPs: per device at the preset's full depth, the step time
  they imply at the chip's peak and at `utilisation` of it, and for the decode step the bytes it
  moves and their time at the chip's bandwidth (a decode step is bound by memory traffic)."""
  by_key, _ = _load(files)
  out = []
  for key, runs in sorted(by_key.items(), key=lambda kv: str(kv[0])):
    d = next(iter(runs.values()))[0]
    full = PRESETS[d["model"]].num_layers
    flops = _carry(runs, full, "flops")
    if flops is None:
      continue
    moved = _carry(runs, full, "bytes_accessed") if key[9].split(" ")[0] == "decode" else None
    peak, bandwidth = d["chip"]["peak"], d["chip"]["bandwidth"]
    out.append(dict(key=key, model=d["model"], topology=_slice(d), mesh=d["mesh"], dtype=key[4],
                    tokens=key[8], micro=key[7], minibatch=key[6], program=key[9],
                    flops=flops[0],
                    t_peak=flops[0] / peak if peak else None,
                    t_util=flops[0] / peak / utilisation if peak else None,
                    moved=moved and moved[0],
                    t_bandwidth=moved[0] / bandwidth if moved and bandwidth else None,
                    basis=flops[1]))
  return out


def flops_markdown(table: list[dict], utilisation: float = UTILISATION) -> str:
  f = lambda x, spec: "-" if x is None else format(x, spec)  # noqa: E731
  lines = ["| model | slice | mesh | params | prompt + response | rows a pass / mini-batch | "
           f"program | TFLOP a device | s at peak | s at {utilisation:.0%} | GB moved | "
           "s at bandwidth | basis |", "| " + " | ".join(["---"] * 13) + " |"]
  for r in table:
    micro = "-" if r["minibatch"] is None else f"{r['micro'] or r['minibatch']} / {r['minibatch']}"
    lines.append(
        f"| {r['model']} | {r['topology']} | {r['mesh']} | {r['dtype']} | {r['tokens']} | "
        f"{micro} | "
        f"{r['program']} | {f(r['flops'] / 1e12, ',.1f')} | {f(r['t_peak'], '.3g')} | "
        f"{f(r['t_util'], '.3g')} | {f(r['moved'] and r['moved'] / 1e9, '.1f')} | "
        f"{f(r['t_bandwidth'], '.3g')} | {r['basis']} |")
  return "\n".join(lines)


def main(argv=None) -> int:
  files = (argv if argv is not None else sys.argv[1:])
  print(markdown(rows(files)))
  flops = flop_rows(files)
  if flops:
    print("\n" + flops_markdown(flops))
  return 0


if __name__ == "__main__":
  sys.exit(main())
