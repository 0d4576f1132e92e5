"""The accelerator benchmark's arithmetic, and that the benchmarks run (tiny shapes on this CPU)."""

import importlib.util
import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import bench_gpu  # noqa: E402


def test_chip_limits_by_kind_and_flags():
  assert bench_gpu.chip_limits("NVIDIA H200", None, None) == (989e12, 4.8e12)
  assert bench_gpu.chip_limits("NVIDIA H100 80GB HBM3", None, None) == (989e12, 3.35e12)
  assert bench_gpu.chip_limits("TPU v5 lite", None, None) == (197e12, 0.82e12)
  assert bench_gpu.chip_limits("cpu", None, None) == (None, None)
  assert bench_gpu.chip_limits("NVIDIA H200", 100.0, 1.0) == (100e12, 1e12)  # flags win


def test_quick_run_prints_both_figures(capsys):
  assert bench_gpu.main(["--quick", "--repeats", "1", "--peak-tflops", "1",
                         "--bandwidth-tbs", "1"]) == 0
  out = capsys.readouterr().out
  assert "of the bandwidth bound" in out and "MFU" in out


def test_qwen_shape_has_1_5b_params():
  c = bench_gpu.QWEN25_1_5B
  d, f, n_layers = c["hidden_size"], c["intermediate_size"], c["num_layers"]
  q = c["num_heads"] * c["head_dim"]
  kv = c["num_kv_heads"] * c["head_dim"]
  per_layer = d * q + q + 2 * (d * kv + kv) + q * d + 3 * d * f + 2 * d
  total = c["vocab_size"] * d + n_layers * per_layer + d
  assert total == pytest.approx(1.54e9, rel=0.01)  # Qwen2.5-1.5B: 1.54 B parameters


def test_long_context_bench_runs_and_restores_the_block(capsys):
  import bench_long_context  # pylint: disable=import-outside-toplevel
  from salt_jax.models import qwen2  # pylint: disable=import-outside-toplevel
  block = qwen2._CAUSAL_QUERY_BLOCK  # pylint: disable=protected-access
  assert bench_long_context.main(["--lengths", "300", "--rows", "2", "--repeats", "1"]) == 0
  assert qwen2._CAUSAL_QUERY_BLOCK == block  # pylint: disable=protected-access
  rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 300 |")]
  assert [r.split(" | ")[1] for r in rows] == ["forward", "forward+backward"]


def test_bench_model_merges_rounds_by_best_and_keeps_errors():
  import bench_model
  r1 = {"gen": {"16": 100.0, "128": 300.0}, "gen_compile": {"16": 1.0}, "gen_tokens": {"16": [1]},
        "eos": 5}
  r2 = {"gen": {"16": 150.0, "128": 200.0}, "gen_compile": {"16": 0.1}, "gen_tokens": {"16": [2]}}
  train = {"gen": {}, "gen_compile": {}, "train": 7.0, "train_loss": 0.5}
  out = bench_model._merge([r1, r2], train)
  assert out["gen"] == {"16": 150.0, "128": 300.0}
  assert out["gen_rounds"] == {"16": [100.0, 150.0], "128": [300.0, 200.0]}
  assert out["gen_compile"] == {"16": 1.0} and out["gen_tokens"] == {"16": [1]}
  assert out["train"] == 7.0 and out["train_loss"] == 0.5
  assert bench_model._merge([], train) == train  # generation skipped
  assert bench_model._merge([r1, {"error": "tunix exited 1"}], train) == {"error": "tunix exited 1"}
  assert bench_model._merge([r1], {"error": "boom"}) == {"error": "boom"}


def test_bench_model_quick_run_without_peers():
  import subprocess
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  proc = subprocess.run([sys.executable, os.path.join(root, "benchmarks", "bench_model.py"),
                         "--quick", "--rounds", "2", "--skip", "tunix,torch"],
                        capture_output=True, text=True, timeout=600,
                        env=dict(os.environ, PYTHONPATH=root))
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "generate b=4, new tok/s in each round: salt-jax " in proc.stdout
  assert "train fwd+bwd b=4" in proc.stdout and "train loss" in proc.stdout


def test_bench_checkpoint_times_both_saves(capsys):
  import bench_checkpoint  # pylint: disable=import-outside-toplevel
  assert bench_checkpoint.main(["--params-mb", "1", "--repeats", "1"]) == 0
  out = capsys.readouterr().out
  assert "async: save returns in" in out and "sync : save returns in" in out


def test_bench_update_lengths_times_each_length():
  import bench_update_lengths  # pylint: disable=import-outside-toplevel
  rows = bench_update_lengths.main(["--lengths", "64", "128", "--reps", "1", "--set",
                                    "env_workers=0", "minibatch_rows=4"])
  assert [r["length"] for r in rows] == [64, 128] and all(r["rows"] == 4 for r in rows)
  assert all(r["first_s"] > 0 and r["step_s"] > 0 and r["loss"] == r["loss"] for r in rows)
  with pytest.raises(SystemExit):  # not a TrainConfig field: named before any work
    bench_update_lengths.main(["--lengths", "64", "--set", "minibatch_row=4"])


def test_rollout_engines_prompts():
  """The two cases' prompts (the model's work they cost: tests/test_cost.py)."""
  import numpy as np
  import bench_rollout_engines as bench  # pylint: disable=import-outside-toplevel
  group = bench.prompts_for("group", 4, 16, 512)
  assert len({tuple(p) for p in group}) == 1 and len(group) == 4
  assert len({tuple(p) for p in bench.prompts_for("distinct", 4, 16, 512)}) == 4
  assert np.all(np.asarray(group) < 512)


def test_rollout_engines_quick_run(capsys):
  import bench_rollout_engines as bench  # pylint: disable=import-outside-toplevel
  assert bench.main(["--quick", "--engines", "builtin,builtin-doubling",
                     "--dtypes", "float32"]) == 0
  out = capsys.readouterr().out
  for engine in ("builtin ", "builtin-doubling"):
    for case in ("group", "distinct"):
      assert any(line.split()[:2] == [engine.strip(), case] for line in out.splitlines())
  assert "of limit" in out
  # The built-in sampler under a 2-device mesh: its rows split over the data axis.
  assert bench.main(["--quick", "--engines", "builtin", "--dtypes", "float32", "--cases",
                     "distinct", "--mesh", "2x1"]) == 0
  assert any(line.split()[:2] == ["builtin", "distinct"]
             for line in capsys.readouterr().out.splitlines())


def test_rollout_engines_iteration_is_the_main_jobs_setting(tmp_path):
  """--iteration's flags, read by the main job's parser over its defaults, give the iteration
  the figures claim (verl-agent's recipe, 2 tasks x G = 8, at most 8 steps), and a valid
  config."""
  import bench_rollout_engines as bench  # pylint: disable=import-outside-toplevel
  from salt_jax.cli import config_from
  spec = importlib.util.spec_from_file_location(
      "alfworld_grpo_salt", os.path.join(ROOT, "experiments", "alfworld_grpo_salt.py"))
  script = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(script)
  cfg, _ = config_from([*bench.ITERATION_FLAGS, "--out", str(tmp_path / "run")],
                       defaults=script.CPU_DEFAULTS)
  assert (cfg.env, cfg.iters, cfg.tasks_per_iter, cfg.group_size, cfg.max_steps) == \
      ("alfworld", 1, 2, 8, 8)
  assert (cfg.prompt_history, cfg.reward_scale) == (2, 10.0)
  assert cfg.invalid_step == "admissible"  # groups differ without a win: an update to time
  assert cfg.microbatch_lengths == "own" and cfg.salt
  cfg.validate()
  assert {"time/rollout", "time/update", "time/weight_sync"} <= set(bench.ITERATION_METRICS)


def test_xla_cpu_dots_times_a_decode_steps_streamed_weights(tmp_path, capsys):
  """--decode-rows: jax and torch each time the 90 streamed products; the figures are the
  weights' bytes and the FLOPs over the measured seconds."""
  import bench_xla_cpu_dots as bench  # pylint: disable=import-outside-toplevel
  out = tmp_path / "decode.json"
  assert bench.main(["--decode-rows", "2", "--flag-sets", "default", "--repeats", "1",
                     "--json", str(out)]) == 0
  rows = json.loads(out.read_text())["decode"]
  assert [r["flags"] for r in rows] == ["torch", "default"]
  k, n = bench.STREAM_SHAPE
  for r in rows:
    seconds = r["ms"] / 1e3
    assert r["rows"] == 2 and seconds > 0
    assert r["weight_gb_per_s"] == pytest.approx(90 * k * n * 4 / seconds / 1e9)
    assert r["gflops"] == pytest.approx(2 * 2 * k * n * 90 / seconds / 1e9)
  assert "GB/s of weights" in capsys.readouterr().out


def test_bench_lora_times_the_critic_beside_each_setting(tmp_path, capsys):
  """--critic adds PPO's critic to each setting: its value pass and step are timed, and its
  state is the trained state's size plus a head (a LoRA critic: adapters, not a second model)."""
  import bench_lora  # pylint: disable=import-outside-toplevel
  out = tmp_path / "rows.jsonl"
  assert bench_lora.main(["--random", "--ranks", "0", "4", "--critic", "--rows", "4",
                          "--microbatch-rows", "2", "--length", "64", "--response", "8",
                          "--reps", "1", "--out", str(out)]) == 0
  full, adapters = (json.loads(line) for line in out.read_text().splitlines())
  for row in (full, adapters):
    assert row["values_s"] > 0 and row["critic_step_s"] > 0 and row["loss_finite"]
    assert row["trained_mib"] <= row["critic_mib"] < row["trained_mib"] + 0.01
  assert adapters["critic_mib"] < full["critic_mib"] / 4
  assert "critic step s" in capsys.readouterr().out


def test_bench_lora_runs_the_step_under_a_mesh(tmp_path):
  """--mesh 2x1: the step on 2 simulated CPU devices (each micro-batch's rows split over them)
  gives the single device's loss up to rounding; a mesh that does not divide the rows is named."""
  import bench_lora  # pylint: disable=import-outside-toplevel
  losses = {}
  for mesh in ("1x1", "2x1"):
    out = tmp_path / f"{mesh}.jsonl"
    assert bench_lora.main(["--random", "--ranks", "0", "--rows", "4", "--microbatch-rows", "2",
                            "--length", "32", "--response", "8", "--reps", "1", "--mesh", mesh,
                            "--out", str(out)]) == 0
    (row,) = (json.loads(line) for line in out.read_text().splitlines())
    assert row["mesh"] == mesh and row["loss_finite"]
    losses[mesh] = row["loss"]
  assert losses["2x1"] == pytest.approx(losses["1x1"], rel=1e-4, abs=1e-6)
  with pytest.raises(SystemExit):
    bench_lora.main(["--random", "--rows", "3", "--microbatch-rows", "3", "--mesh", "2x1"])


def test_xla_cpu_profile_sweeps_each_threads_ops():
  """Busy time, concurrency and per-kind seconds from op events, against a timeline worked by
  hand: thread A runs dot.1 [0, 4) and add.2 [6, 8); thread B runs while.3 [2, 10) holding
  dot.4 [3, 5). Nested events count once toward busy time, under the inner op while alone."""
  import xla_cpu_profile as prof  # pylint: disable=import-outside-toplevel
  ev = prof.OpEvent
  events = [ev("A", "dot.1", 0, 4), ev("A", "add.2", 6, 2), ev("B", "while.3", 2, 8),
            ev("B", "dot.4", 3, 2)]
  s = prof.summarize(events, calls=2)
  assert s["span_s"] == pytest.approx(5e-9)  # [0, 10) over 2 calls
  assert s["threads"] == {"A": pytest.approx(3e-9), "B": pytest.approx(4e-9)}
  assert s["busy_fraction"] == pytest.approx(14 / 20)
  # 0 busy: none; 1 busy: [0,2) A, [4,6) B, [8,10) B; 2 busy: [2,4), [6,8).
  assert s["seconds_with_threads_busy"] == {0: 0.0, 1: pytest.approx(3e-9),
                                            2: pytest.approx(2e-9)}
  ops = {o["kind"]: o for o in s["ops"]}
  assert ops["dot"]["seconds"] == pytest.approx(3e-9) and ops["while"]["seconds"] == \
      pytest.approx(4e-9) and ops["add"]["seconds"] == pytest.approx(1e-9)
  # Alone: dot [0, 2) (A's dot.1), while [4, 6) and [8, 10) (B's while, dot.4 closed at 5; 4-5
  # is B's inner dot.4, alone too).
  assert ops["dot"]["alone_s"] == pytest.approx(1.5e-9)
  assert ops["while"]["alone_s"] == pytest.approx(1.5e-9)
  # three threads on two cores: busy over the cores, not the threads
  three = events + [ev("C", "fusion.5", 0, 2)]
  assert prof.summarize(three, calls=2, cores=2)["busy_fraction"] == pytest.approx(16 / 20)
  assert prof.summarize(three, calls=2)["busy_fraction"] == pytest.approx(16 / 30)
  with pytest.raises(ValueError, match="no op events"):
    prof.summarize([])
  with pytest.raises(ValueError, match="calls"):
    prof.summarize(events, calls=0)
  assert prof.op_kind("ynn_fusion.1084") == "ynn_fusion" and prof.op_kind("dot") == "dot"


def test_bench_lora_profiles_the_step(tmp_path, capsys):
  """--profile traces the step on XLA's threads: busy time and op kinds come back per call."""
  import bench_lora  # pylint: disable=import-outside-toplevel
  out = tmp_path / "rows.jsonl"
  assert bench_lora.main(["--random", "--ranks", "0", "--rows", "2", "--microbatch-rows", "2",
                          "--length", "64", "--response", "8", "--reps", "2",
                          "--profile", str(tmp_path / "trace"), "--out", str(out)]) == 0
  (row,) = (json.loads(line) for line in out.read_text().splitlines())
  prof = row["profile"]
  assert prof["calls"] == 2 and prof["span_s"] > 0 and prof["ops"]
  assert 0 < prof["busy_fraction"] <= 1
  assert sum(prof["seconds_with_threads_busy"].values()) == pytest.approx(prof["span_s"],
                                                                           rel=1e-3, abs=1e-6)
  assert "threads busy" in capsys.readouterr().out


def test_bench_compiles_counts_each_programs_compiles():
  """One toy iteration with the compile log on: every compile is counted under its program
  (the cloning's apart), the sampler's settings reach the run's samplers, and a bad one is named
  before any work."""
  import bench_compiles  # pylint: disable=import-outside-toplevel
  import jax  # pylint: disable=import-outside-toplevel
  cache_on = jax.config.jax_enable_compilation_cache
  out = bench_compiles.main(["--iters", "1", "--eval-rounds", "1", "--sft-steps", "4",
                             "--sampler", "split_min_flops=0"])
  names = {r["program"] for r in out["programs"]}
  assert "jit(_decode_impl)" in names and names & {"jit(_prefill_impl)",
                                                    "jit(_prefill_rows_impl)"}, names
  assert out["run_compiles"] == sum(r["compiles"] for r in out["programs"]) > 0
  assert out["cloning_compiles"] > 0 and out["sampler"] == {"split_min_flops": 0}
  assert out["run_seconds"]["rl"] > 0 and out["run_seconds"]["eval"] > 0
  assert jax.config.jax_enable_compilation_cache == cache_on and not jax.config.jax_log_compiles
  with pytest.raises(SystemExit):
    bench_compiles.main(["--sampler", "split_min_flop=0"])
  with pytest.raises(SystemExit):
    bench_compiles.main(["--sampler", "split_min_flops"])


def test_bench_decode_step_splits_a_step(tmp_path, capsys):
  """Each case's bound is its bytes over the measured bandwidth: the weights of its layers (and
  the head) and the filled cache."""
  import bench_decode_step as bench  # pylint: disable=import-outside-toplevel
  out = tmp_path / "decode.json"
  assert bench.main(["--quick", "--out", str(out)]) == 0
  got = json.loads(out.read_text())
  shape, bw = bench.TINY, got["read_GBps"] * 1e9
  full = got["cases"]["step, 2 layers"]
  want = bench.step_bytes(bench.config_of(shape, 2), 8, 40, 4) / bw * 1e3
  assert full["bound_ms"] == pytest.approx(want) and full["ms"] > 0 and full["instructions"] > 0
  one = got["cases"]["step, 1 layer"]
  assert got["per_layer_ms"] == pytest.approx(full["ms"] - one["ms"])
  assert one["instructions"] < full["instructions"]  # a layer's ops are dispatched one by one
  # SmolLM2's weights: 134.5M parameters with the tied embedding counted once; its cache
  config = bench.config_of(bench.SMOLLM2, 30)
  assert bench.step_bytes(config, 8, 0, 1) == pytest.approx(134.5e6, rel=0.01)
  assert bench.step_bytes(config, 8, 10, 4) - bench.step_bytes(config, 8, 0, 4) == \
      2 * 30 * 8 * 3 * 64 * 10 * 4
  # the projections as 7 or 4 (fused) dots read the same weights: one bound
  assert got["cases"]["layer projections fused"]["bound_ms"] == pytest.approx(
      got["cases"]["layer projections"]["bound_ms"])
  for name in ("layer attention", "layer attention by sum"):  # one layer's filled cache
    assert got["cases"][name]["ms"] > 0
    assert got["cases"][name]["bound_ms"] == pytest.approx(
        bench.cache_bytes(bench.config_of(shape, 1), 8 * 40, 4) / bw * 1e3)
  assert "per layer" in capsys.readouterr().out


def test_bench_decode_step_profiles_the_full_step(tmp_path):
  """--profile traces the full step's calls (in a fresh process: XLA reads the trace flag when
  its backend starts) and reports XLA's threads and op kinds per call."""
  import subprocess  # pylint: disable=import-outside-toplevel
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  out = tmp_path / "decode.json"
  proc = subprocess.run([sys.executable, os.path.join(root, "benchmarks", "bench_decode_step.py"),
                         "--quick", "--profile", str(tmp_path / "trace"), "--out", str(out)],
                        capture_output=True, text=True, timeout=600,
                        env=dict(os.environ, PYTHONPATH=root))
  assert proc.returncode == 0, proc.stderr[-3000:]
  prof = json.loads(out.read_text())["profile"]
  assert prof["calls"] == 2 and prof["ops"] and 0 < prof["busy_fraction"] <= 1
  assert "under the profiler" in proc.stdout and "threads busy" in proc.stdout


def test_bench_program_memory_reports_each_programs_share(tmp_path, capsys):
  """The quick run compiles its programs, reports resident memory after every few and after
  release_compiled_programs, and the per-program share from the first and last figures."""
  import bench_program_memory as bench  # pylint: disable=import-outside-toplevel
  out = tmp_path / "programs.json"
  assert bench.main(["--quick", "--out", str(out)]) == 0
  got = json.loads(out.read_text())
  assert [a["programs"] for a in got["after"]] == [4]
  assert got["mib_per_program"] == pytest.approx(
      (got["after"][-1]["mib"] - got["start_mib"]) / 4)
  assert got["cleared_mib"] > 0 and "a program" in capsys.readouterr().out


def test_bench_prompt_tokens_counts_each_task_line(tmp_path, capsys):
  """Each task line's rows are the same expert steps, rendered as the agent loop renders them:
  the goal line drops ALFWorld's room listing from every row after the first step."""
  import bench_prompt_tokens as bench  # pylint: disable=import-outside-toplevel
  out = tmp_path / "tokens.json"
  assert bench.main(["--env", "alfworld", "--tasks", "1", "--max-steps", "3",
                     "--out", str(out)]) == 0
  got = json.loads(out.read_text())
  obs, goal = got["observation"], got["goal"]
  assert obs["rows"] == goal["rows"] == 3 and got["episodes"] == 1
  assert goal["total"] < obs["total"] and goal["largest"] < obs["largest"]
  assert got["goal_over_observation"] == pytest.approx(goal["total"] / obs["total"])
  assert "--prompt-task goal" in capsys.readouterr().out


def test_bench_prefix_sharing_counts_what_each_sharing_prefills(tmp_path, capsys):
  """Prefix counts against hand-counted prompts, then a short ALFWorld run: each sharing
  prefills no more than the one before it, and the sampler's plan covers every distinct token."""
  import bench_prefix_sharing as bench  # pylint: disable=import-outside-toplevel
  assert bench.common_prefix([1, 2, 3], [1, 2, 4, 5]) == 2
  assert bench.common_prefix([1, 2], [1, 2, 3]) == 2 and bench.common_prefix([], [1]) == 0
  calls = [[(1, 2, 3, 4), (1, 2, 3, 4), (1, 2, 5)],  # equal: 4 + 3; trie: 4 + 1
           [(1, 2, 3, 9), (7,)]]                       # trie: 4 + 1; cached: 1 + 1
  assert bench.shared_tokens(calls) == {"all": 11 + 5, "equal": 7 + 5, "trie": 5 + 5,
                                        "cached": 5 + 2}
  out = tmp_path / "sharing.json"
  assert bench.main(["--env", "alfworld", "--tasks", "1", "--group-size", "3", "--max-steps",
                     "3", "--epsilon", "0.5", "--max-cache-len", "4096", "--out",
                     str(out)]) == 0
  (run,) = json.loads(out.read_text())["runs"]
  assert run["calls"] == 3 and run["all"] >= run["equal"] >= run["trie"] >= run["cached"] > 0
  for positions in run["positions"].values():
    assert positions["plan"] >= run["equal"] and positions["with_stems"] <= positions["plan"]
  assert "prefill rows" in capsys.readouterr().out
