"""Proof that the trainer learns: RL raises the success rate on the toy env's training tasks.

`experiments/learning_check.py` does the work (docs/study.md, "Proof that the trainer learns",
holds every figure): a tiny policy clones a noisy expert (a uniformly drawn admissible action in
place of the expert's at each step with chance 0.5) on 4 walk tasks of 3 rooms, which leaves it
weak (about 20% sampled success, half its steps invalid); then the trainer's own iterations
(`Trainer.iteration`) run GRPO on those tasks. Success is measured before and after, sampled at
temperature 1 with fixed keys and listing orders that neither the cloning nor any iteration used,
so the two measurements differ only in the policy.

The settings (`learning_check.LEARNS`): single-turn prompts without history (layout 'step',
prompt_history 0), statistics over the group's step rows, lr 5e-4 after 8 warm-up steps, one
epoch of 32-row mini-batches, no KL, and no invalid-action penalty: with it (0.1 on the step's
row, GRPO's std normalisation) a run went from 0.20 to 0.00, every step valid and none winning;
at lr 1e-3 3 of 10 runs lost every valid action within one iteration.

The assertions are on success only (SALT on or off is a parameter, not a condition). The fast
case (the per-seed clone above, seeds 1 and 2, GRPO, 12 iterations, 128-episode measurements)
must rise on each seed and by 8 points on average (about 50 s a seed alone). It can fail: a policy
that does not improve stays within a few points of its start, and with the 0.1 penalty (lr 1e-3)
a run fell to 0.

The slow cases start from one grounded clone (`learning_check.GROUNDED`: epsilon 0.7, 600
cloning steps, so it copies exits out of the prompt; sampled success 0.50) and vary RL's seed
alone, at lr 3e-4, 30 iterations, 128-episode measurements. Each must rise by the issue's 20
points; measured through the driver under the tests' 8 devices (docs/study.md, "Thirty
iterations"): +26.5 to +37.5 under GRPO, +30.5 to +32 under GRPO+SALT (about 4 minutes a run).
After 12 and 20 iterations some runs were still under +20 (+12.5 to +27).
"""

import dataclasses
import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "experiments"))

import learning_check  # pylint: disable=wrong-import-position

# Trains or samples a policy: .ci/run runs it again under another XLA instruction set.
pytestmark = pytest.mark.samples

SLOW_RISE = 0.20
FAST_RISE = 0.08
FAST = learning_check.Check(iters=12, eval_rounds=4)
FAST_SEEDS = (1, 2)


@pytest.fixture(scope="module")
def fast_clones(tmp_path_factory):
  """The fast check's warm start of each seed, cloned once for the module: the GRPO, LoRA and
  PPO checks change only the RL, so they start from the same clone (`warm_start_key`)."""
  folder = tmp_path_factory.mktemp("fast_clones")
  return {seed: learning_check.warm_start(FAST, str(folder / str(seed)), seed)
          for seed in FAST_SEEDS}


def _fast_runs(check, clones, tmp_path, seeds=FAST_SEEDS) -> list:
  """The check's run of each seed from that seed's clone (the check's own warm start)."""
  if check is not FAST:
    assert learning_check.warm_start_key(check, 0) == learning_check.warm_start_key(FAST, 0)
  return [learning_check.learning_run(check, seed=seed, salt=False, init=clones[seed],
                                      workdir=str(tmp_path / str(seed))) for seed in seeds]


def test_rl_raises_success_fast(fast_clones, tmp_path):
  """Two seeds of GRPO, 12 iterations, 128-episode measurements: each rises, and by FAST_RISE
  on average. Settings chosen so that no CPU's rounding decides the outcome: across seeds 1 to 6
  with XLA capped at SSE4.2, at AVX2 or not at all, every such run rose (by 0.07 to 0.23), the
  mean of seeds 1 and 2 by 0.13 to 0.20 (docs/study.md); the earlier one seed, 6 iterations and
  64 episodes rose by 0.02 to 0.25."""
  runs = _fast_runs(FAST, fast_clones, tmp_path)
  rises = [run["after"]["all"] - run["before"]["all"] for run in runs]
  print(rises, runs)
  assert all(r > 0 for r in rises) and sum(rises) / len(rises) >= FAST_RISE, rises
  for run in runs:
    assert set(run["actions"]) == {1, FAST.iters} and run["actions"][1]["valid"], run["actions"]
    assert {k: len(v) for k, v in run["merges"].items()} == {
        k: FAST.iters for k in learning_check.MERGE_KEYS}


# LoRA: rank-8 adapters over the same warm start at twice the full run's lr (B starts at zero).
# Measured on seeds 1-4: at 1e-3 each rose by 0.10 to 0.15 (seed 1: 0.15, capped at AVX2 0.125);
# at the full run's 5e-4 seeds 1 and 2 rose by 0.08 and 0.02; at 3e-3 seed 4 stopped writing
# valid actions at iteration 5. The test runs seed 1, PPO's seed 2: the GRPO check above holds
# both seeds; these two show that the adapters and the critic learn, each on one clone.
FAST_LORA = dataclasses.replace(FAST, config=dataclasses.replace(FAST.config, lora_rank=8,
                                                                 lr=1e-3))


def test_rl_with_lora_raises_success_fast(fast_clones, tmp_path):
  """The fast check with LoRA adapters (the base frozen) on seed 1: success rises by FAST_RISE,
  as with full fine-tuning (docs/study.md has the two side by side)."""
  (run,) = _fast_runs(FAST_LORA, fast_clones, tmp_path, seeds=(1,))
  rise = run["after"]["all"] - run["before"]["all"]
  print(rise, run)
  assert rise >= FAST_RISE, rise


# PPO with a learned critic over the same warm starts, G = 8 as above (a critic needs no group):
# the critic is the clone with a new value head, trained at lr 1e-3. Measured on seeds 1-3: each
# rose by 0.16 to 0.23 (seed 2: 0.16), as GRPO's; capped at AVX2 seeds 1 and 2 by 0.20 and 0.17.
FAST_PPO = dataclasses.replace(FAST, config=dataclasses.replace(FAST.config, algo="ppo",
                                                                critic_lr=1e-3))


def test_ppo_with_a_critic_raises_success_fast(fast_clones, tmp_path):
  """The fast check with --algo ppo on seed 2: success rises by FAST_RISE."""
  (run,) = _fast_runs(FAST_PPO, fast_clones, tmp_path, seeds=(2,))
  rise = run["after"]["all"] - run["before"]["all"]
  print(rise, run)
  assert rise >= FAST_RISE, rise


def test_driver_resumes_a_study_from_its_out_file(tmp_path, monkeypatch):
  """A run already in --out with the same settings is not run again; other settings are."""
  calls = []

  def fake_run(check, seed, salt, workdir, init=None):
    calls.append((seed, salt, check.config.algo, check.reasoning, init is not None))
    return {"seed": seed, "salt": salt, "rise": 0.0}
  monkeypatch.setattr(learning_check, "learning_run", fake_run)
  monkeypatch.setattr(learning_check, "warm_start", lambda check, path, seed, inputs=None: path)
  out = str(tmp_path / "runs.jsonl")
  argv = ["--seeds", "0", "1", "--salt", "both", "--warm-seed", "0", "--iters", "3",
          "--set", "algo=rloo", "--reasoning", "templated", "--out", out]
  learning_check.main(argv)
  assert calls == [(0, False, "rloo", "templated", True), (0, True, "rloo", "templated", True),
                   (1, False, "rloo", "templated", True), (1, True, "rloo", "templated", True)]
  with open(out, encoding="utf-8") as f:
    lines = [json.loads(x) for x in f]
  assert [(r["seed"], r["salt"], r["algo"], r["iters"]) for r in lines] == [
      (0, False, "rloo", 3), (0, True, "rloo", 3), (1, False, "rloo", 3), (1, True, "rloo", 3)]
  calls.clear()
  with open(out, "a", encoding="utf-8") as f:
    f.write('{"seed": 1, "sa')  # a line cut short by a kill: not a run, not an error
  learning_check.main(argv)  # everything is there
  assert calls == []
  learning_check.main(argv[:2] + ["2"] + argv[2:])  # a new seed only
  assert [c[:2] for c in calls] == [(2, False), (2, True)]
  with open(out, encoding="utf-8") as f:  # the cut line is gone, every run is whole
    assert [(r["seed"], r["salt"]) for r in map(json.loads, f)] == [
        (0, False), (0, True), (1, False), (1, True), (2, False), (2, True)]
  calls.clear()
  learning_check.main([a if a != "algo=rloo" else "algo=grpo" for a in argv])  # another method
  assert len(calls) == 4 and {c[2] for c in calls} == {"grpo"}


def test_warm_dir_clones_once_per_warm_start(tmp_path, monkeypatch):
  """--warm-dir keys the warm start by what it clones from: commands that change only the RL
  (SALT's history, the group size) reuse it; another prompt history or epsilon clones anew."""
  base = learning_check.Check(warm_seed=0, reasoning="templated")
  key = learning_check.warm_start_key(base, 0)
  rl_only = dataclasses.replace(base, iters=3, config=dataclasses.replace(
      base.config, salt_history=1, group_size=4, lr=1e-3, algo="rloo"))
  assert learning_check.warm_start_key(rl_only, 0) == key
  assert learning_check.warm_start_key(dataclasses.replace(base, epsilon=0.2), 0) != key
  assert learning_check.warm_start_key(base, 1) != key
  assert learning_check.warm_start_key(dataclasses.replace(base, config=dataclasses.replace(
      base.config, prompt_history=2)), 0) != key
  assert learning_check.warm_start_key(dataclasses.replace(base, reasoning=None), 0) != key

  clones, inits = [], []

  def fake_clone(check, path, seed, inputs=None):
    assert inputs is not None  # the demonstrations the key was computed from, not played again
    clones.append(seed)
    os.makedirs(path)
    return path
  monkeypatch.setattr(learning_check, "warm_start", fake_clone)
  monkeypatch.setattr(learning_check, "learning_run",
                      lambda check, seed, salt, workdir, init=None: inits.append(init) or {})
  warm = str(tmp_path / "warm")
  argv = ["--seeds", "0", "--salt", "on", "--warm-seed", "0", "--reasoning", "templated",
          "--warm-dir", warm]
  for h in (1, 2):
    learning_check.main(argv + ["--set", f"salt_history={h}"])
  assert clones == [0] and len(set(inits)) == 1
  assert os.listdir(warm) == [os.path.basename(inits[0])]  # no half-saved copy left behind
  learning_check.main(argv + ["--epsilon", "0.3"])
  assert clones == [0, 0] and len(os.listdir(warm)) == 2
  with pytest.raises(SystemExit):  # one warm start per seed would not be one warm start
    learning_check.main(["--warm-dir", warm])
  with pytest.raises(SystemExit):  # an override without "=" is named, not a crash mid-parse
    learning_check.main(argv + ["--set", "salt_history"])


def test_driver_runs_other_envs_with_held_out_tasks(tmp_path, monkeypatch):
  """--env swaps in ENV_SETTINGS' games (RL settings kept), --heldout-tasks and --demos-per-task
  reach the Check, and the run records them; a toy run recorded before those settings existed
  still counts as done."""
  checks = []

  def fake_run(check, seed, salt, workdir, init=None):
    checks.append(check)
    return {"seed": seed, "salt": salt}
  monkeypatch.setattr(learning_check, "learning_run", fake_run)
  monkeypatch.setattr(learning_check, "warm_start", lambda check, path, seed, inputs=None: path)
  out = str(tmp_path / "runs.jsonl")
  argv = ["--seeds", "0", "--salt", "on", "--warm-seed", "0", "--iters", "2", "--out", out]
  learning_check.main(argv + ["--env", "textworld", "--heldout-tasks", "4",
                              "--demos-per-task", "3", "--set", "lr=1e-4"])
  (check,) = checks
  tw = learning_check.ENV_SETTINGS["textworld"]
  assert check.config.env == "textworld" and check.config.env_kwargs == tw["env_kwargs"]
  assert check.config.max_steps == tw["max_steps"] and check.config.lr == 1e-4
  assert check.config.group_stats == learning_check.LEARNS.group_stats
  assert check.heldout_tasks == 4 and check.demo_seeds == (1000, 1001, 1002)
  with open(out, encoding="utf-8") as f:
    (run,) = map(json.loads, f)
  assert (run["env"], run["heldout_tasks"], run["demos_per_task"]) == ("textworld", 4, 3)
  learning_check.main(argv)  # the toy env: another experiment
  assert len(checks) == 2 and checks[1].config.env == "toy"
  old = dict(run, env="toy", heldout_tasks=0, demos_per_task=learning_check.DEMOS_PER_TASK,
             overrides={}, seed=5)
  for k in ("env", "heldout_tasks", "demos_per_task"):
    del old[k]  # a toy run from before these settings were recorded
  with open(out, "a", encoding="utf-8") as f:
    f.write(json.dumps(old) + "\n")
  learning_check.main(argv[:1] + ["5"] + argv[2:])
  assert len(checks) == 2  # seed 5 was done
  with pytest.raises(SystemExit):
    learning_check.main(argv + ["--heldout-tasks", "-1"])


def test_held_out_tasks_are_the_eval_split():
  """The held-out measurement's tasks: the first N of the env's first eval split, none of them a
  training task; too few there is an error, not a shorter measurement."""
  check = dataclasses.replace(FAST, heldout_tasks=3)
  held = learning_check.heldout_task_list(check)
  assert [t.split for t in held] == ["eval"] * 3
  train_ids = {t.task_id for t in learning_check.training_tasks(check.config)}
  assert train_ids.isdisjoint(t.task_id for t in held)
  assert learning_check.heldout_task_list(FAST) == []
  tw = dataclasses.replace(FAST, heldout_tasks=2, config=dataclasses.replace(
      FAST.config, **learning_check.ENV_SETTINGS["textworld"]))
  held = learning_check.heldout_task_list(tw)
  assert len(held) == 2 and {t.split for t in held} == {"heldout"}
  alf = dataclasses.replace(FAST, heldout_tasks=10**6, config=dataclasses.replace(
      FAST.config, **learning_check.ENV_SETTINGS["alfworld"]))
  with pytest.raises(ValueError, match="fewer than"):
    learning_check.heldout_task_list(alf)


def test_run_measures_held_out_tasks_at_each_measurement(tmp_path):
  """A run with held-out tasks measures them before RL, at each `eval_at` and after the last
  iteration, on those tasks alone."""
  check = dataclasses.replace(FAST, iters=2, eval_at=(1,), heldout_tasks=2, sft_steps=10,
                              eval_rounds=1)
  run = learning_check.learning_run(check, seed=0, salt=True, workdir=str(tmp_path))
  assert sorted(run["heldout"]) == [0, 1, 2] and sorted(run["mid"]) == [1]
  held_ids = {t.task_id for t in learning_check.heldout_task_list(check)}
  for m in run["heldout"].values():
    assert set(m["tasks"]) == held_ids and m["trajectories"] <= 2 * check.config.group_size
  assert set(run["after"]["tasks"]).isdisjoint(held_ids)


def test_run_without_a_clone_measures_the_policy_as_built(tmp_path):
  """clone=False (`--no-clone`, a pretrained model's own play): no warm start is made, and with
  no iterations the one measurement is both before and after; the run's key tells it apart."""
  check = dataclasses.replace(FAST, iters=0, eval_rounds=1, clone=False)
  run = learning_check.learning_run(check, seed=0, salt=False, workdir=str(tmp_path))
  assert not (tmp_path / "warm").exists() and run["seconds"]["warm_start"] < 1.0
  assert run["after"] == run["before"] and run["rise"] == 0 and run["curve"] == []
  base = {"seed": 0, "salt": False, "sft_lr": FAST.sft_lr}
  keys = {learning_check._run_key({**base, **change}) for change in (
      {}, {"clone": True}, {"clone": False}, {"sft_rows": 2}, {"sft_lr": 5e-5})}
  assert len(keys) == 4  # a run recorded before these settings is the default one


def test_a_killed_resumable_run_goes_on_where_it_stopped(tmp_path, monkeypatch):
  """A resumable run (`--runs-dir`) killed inside its third iteration, after the measurement
  taken before it, then called again: it resumes from the checkpoint and gives the record of
  the same run uninterrupted (measurements, curves, merges, the first and last rollouts'
  actions)."""
  check = dataclasses.replace(FAST, iters=3, eval_at=(2,), eval_rounds=1, heldout_tasks=1,
                              sft_steps=20)
  warm = learning_check.warm_start(check, str(tmp_path / "warm"), 0)
  with pytest.raises(ValueError, match="saved warm start"):
    learning_check.learning_run(check, 0, True, str(tmp_path / "x"), resumable=True)
  whole = learning_check.learning_run(check, 0, True, str(tmp_path / "a"), init=warm,
                                      resumable=True)
  iteration, calls = learning_check.Trainer.iteration, []

  def dies_in_the_third(self):
    calls.append(self.iteration_index)
    if len(calls) == 3:
      raise KeyboardInterrupt
    return iteration(self)

  monkeypatch.setattr(learning_check.Trainer, "iteration", dies_in_the_third)
  with pytest.raises(KeyboardInterrupt):
    learning_check.learning_run(check, 0, True, str(tmp_path / "b"), init=warm, resumable=True)
  monkeypatch.undo()
  assert calls == [0, 1, 2]
  progress = json.loads((tmp_path / "b" / learning_check.PROGRESS_FILE).read_text())
  assert sorted(progress["mid"]) == ["2"] and sorted(progress["actions"]) == ["1"]
  resumed = learning_check.learning_run(check, 0, True, str(tmp_path / "b"), init=warm,
                                        resumable=True)
  for k in ("before", "after", "rise", "mid", "heldout", "curve", "valid", "merges", "actions"):
    assert resumed[k] == whole[k], k
  assert len(whole["curve"]) == 3 and sorted(whole["actions"]) == [1, 3]
  # Killed in its first iteration (no checkpoint yet): the call after it starts the RL again but
  # keeps the measurement before RL (training and held-out tasks) instead of taking it again.
  calls.clear()
  monkeypatch.setattr(learning_check.Trainer, "iteration", dies_in_the_third)
  calls.extend([None, None])  # the next call is the third
  with pytest.raises(KeyboardInterrupt):
    learning_check.learning_run(check, 0, True, str(tmp_path / "c"), init=warm, resumable=True)
  monkeypatch.undo()
  measured, sampled = [], learning_check.sampled_success
  monkeypatch.setattr(learning_check, "sampled_success",
                      lambda *a, **k: measured.append(1) or sampled(*a, **k))
  again = learning_check.learning_run(check, 0, True, str(tmp_path / "c"), init=warm,
                                      resumable=True)
  assert len(measured) == 4  # at eval_at 2 and after RL, each on both task lists
  for k in ("before", "after", "mid", "heldout", "curve", "merges", "actions"):
    assert again[k] == whole[k], k


def test_runs_of_one_start_share_its_measurement(tmp_path, monkeypatch):
  """Runs from one warm start that differ in seed and SALT measure it alike (fixed keys, the
  same policy): with a `start_file` the first run's measurement before RL (training and
  held-out tasks) is written once and the next run reads it instead of taking it again."""
  check = dataclasses.replace(FAST, iters=1, eval_rounds=1, heldout_tasks=1, sft_steps=10)
  warm = learning_check.warm_start(check, str(tmp_path / "warm"), 0)
  start_file = str(tmp_path / "start.json")
  first = learning_check.learning_run(check, 0, True, str(tmp_path / "a"), init=warm,
                                      resumable=True, start_file=start_file)
  alone = learning_check.learning_run(check, 1, False, str(tmp_path / "b"), init=warm,
                                      resumable=True)
  measured, sampled = [], learning_check.sampled_success
  monkeypatch.setattr(learning_check, "sampled_success",
                      lambda *a, **k: measured.append(1) or sampled(*a, **k))
  shared = learning_check.learning_run(check, 1, False, str(tmp_path / "c"), init=warm,
                                       resumable=True, start_file=start_file)
  assert len(measured) == 2  # after RL only, on both task lists
  assert first["before"] == alone["before"] == shared["before"]
  assert first["heldout"][0] == alone["heldout"][0] == shared["heldout"][0]
  for k in ("after", "heldout", "curve"):
    assert shared[k] == alone[k], k


def test_textworld_warm_start_clones_the_noisy_expert():
  """The warm start's demonstrations on TextWorld: the env's expert with deviations, in the
  run's prompts, with the stand-in reasoning (responses for one action differ)."""
  cfg = dataclasses.replace(learning_check.LEARNS, **{
      **learning_check.ENV_SETTINGS["textworld"], "num_train_tasks": 2, "prompt_history": 2,
      "max_new_tokens": learning_check.REASONING_MAX_NEW_TOKENS})
  check = learning_check.Check(config=cfg, epsilon=0.5, demo_seeds=(1000, 1001),
                               reasoning="templated", warm_seed=0)
  _, tok, batch, sft_config = learning_check._warm_start_inputs(check, 0)
  assert sft_config.steps == check.sft_steps
  rows = int((batch.row_traj_ids >= 0).sum())
  assert rows >= 4  # 2 tasks x 2 listing orders, one row a step
  responses = [tok.decode(batch.targets[r][batch.loss_mask[r]].tolist()) for r in range(rows)]
  assert all(r.startswith("<think>") and "</think><action>" in r for r in responses)
  by_action: dict = {}
  for r in responses:
    by_action.setdefault(r.split("<action>")[1], set()).add(r)
  assert any(len(v) > 1 for v in by_action.values()), by_action
  prompt = tok.decode(batch.input_ids[1][batch.attention_mask[1]].tolist())
  assert "Admissible actions" in prompt and "You have taken 1 step(s)" in prompt, prompt
  fewer = dataclasses.replace(check, demo_seeds=(1000,))
  assert learning_check.warm_start_key(fewer, 0) != learning_check.warm_start_key(check, 0)


@pytest.fixture(scope="module")
def grounded_start(tmp_path_factory):
  """The slow cases' one warm start (`learning_check.GROUNDED`), cloned once."""
  check = learning_check.GROUNDED
  return learning_check.warm_start(check, str(tmp_path_factory.mktemp("grounded") / "warm"),
                                   check.warm_seed)


@pytest.mark.slow
@pytest.mark.parametrize("salt", [False, True], ids=["grpo", "grpo+salt"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_rl_raises_success_on_every_seed(tmp_path, grounded_start, seed, salt):
  """3 RL seeds x {GRPO, GRPO+SALT}, 30 iterations each from one grounded warm start: at least
  SLOW_RISE of sampled success on the training tasks (figures shown with -rP)."""
  run = learning_check.learning_run(learning_check.GROUNDED, seed=seed, salt=salt,
                                    workdir=str(tmp_path), init=grounded_start)
  print(run)
  assert run["after"]["all"] - run["before"]["all"] >= SLOW_RISE, run
