"""TrainState's saved form, `create`, and `update_step` / `update` with stand-in programs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from salt_jax.state import (CRITIC_FIELDS, CRITIC_METRICS, POLICY_METRICS, TrainState,
                            UpdatePrograms, create, no_update_metrics, update, update_step)
from salt_jax.update import MicrobatchPrograms, lr_schedule


def _state(critic: bool) -> TrainState:
  return TrainState(params={"w": jnp.ones(3)}, opt_state={"count": jnp.zeros((), jnp.int32)},
                    key=jax.random.key(7), critic={"v": jnp.zeros(2)} if critic else None,
                    critic_opt_state={"count": jnp.zeros((), jnp.int32)} if critic else None)


@pytest.mark.parametrize("critic", [False, True])
def test_checkpoint_tree_round_trip(critic):
  state = _state(critic)
  tree = state.checkpoint_tree()
  assert set(tree) == ({"params", "opt_state", "key"} | ({"critic", "critic_opt_state"}
                                                         if critic else set()))
  assert tree["key"].dtype == jnp.uint32  # raw key data: what orbax saves
  back = TrainState.from_checkpoint_tree(jax.tree.map(np.asarray, tree))
  assert jax.random.key_data(back.key).tolist() == jax.random.key_data(state.key).tolist()
  for a, b in zip(jax.tree.leaves(back._replace(key=None)), jax.tree.leaves(
      state._replace(key=None))):
    np.testing.assert_array_equal(a, b)
  assert (back.critic is None) == (not critic)


def _programs(calls):
  def train_step(params, opt_state, mb, step_adv, frozen):
    calls.append(("policy", sorted(mb), frozen))
    return ({"w": params["w"] + step_adv}, {"count": opt_state["count"] + 1},
            {"loss": jnp.float32(1.0)})

  def critic_step(critic, opt_state, mb, frozen):
    calls.append(("critic", sorted(mb), frozen))
    return ({"v": critic["v"] + 1.0}, {"count": opt_state["count"] + 1},
            {"value_loss": jnp.float32(2.0)})
  return UpdatePrograms(train_step, critic_step)


def test_update_step_runs_the_critic_then_the_policy():
  calls = []
  mb = {k: jnp.zeros((2, 4)) for k in (*CRITIC_FIELDS, "targets", "old_logprobs",
                                       "token_step_ids", "advantages")}
  state = _state(critic=True)
  new, out, critic_out = update_step(_programs(calls), state, mb, 2.0, frozen="base")
  assert [c[0] for c in calls] == ["critic", "policy"]
  assert calls[0][1] == sorted(CRITIC_FIELDS) and calls[0][2] == "base"
  # the critic's regression target and old values never reach the policy's step
  assert "returns" not in calls[1][1] and "old_values" not in calls[1][1]
  assert {"advantages", "old_logprobs", "targets"} <= set(calls[1][1])
  np.testing.assert_array_equal(new.params["w"], [3.0, 3.0, 3.0])
  np.testing.assert_array_equal(new.critic["v"], [1.0, 1.0])
  assert int(new.opt_state["count"]) == 1 and int(new.critic_opt_state["count"]) == 1
  assert new.key is state.key and set(out) == {"loss"} and set(critic_out) == {"value_loss"}


def test_update_step_in_the_critic_warm_up_and_without_a_critic():
  calls = []
  mb = {k: jnp.zeros((2, 4)) for k in (*CRITIC_FIELDS, "targets")}
  state = _state(critic=True)
  new, out, critic_out = update_step(_programs(calls), state, mb, 2.0, train_policy=False)
  assert [c[0] for c in calls] == ["critic"] and out == {} and set(critic_out) == {"value_loss"}
  assert new.params is state.params and new.opt_state is state.opt_state
  calls.clear()
  plain = _state(critic=False)
  new, out, critic_out = update_step(UpdatePrograms(_programs(calls).train_step), plain,
                                     {"targets": jnp.zeros((2, 4))}, 1.0)
  assert [c[0] for c in calls] == ["policy"] and critic_out == {} and new.critic is None


def test_update_step_with_micro_batch_programs_follows_the_plan():
  """With `UpdatePrograms.microbatch`, each planned micro-batch (rows, length) is cut from the
  mini-batch and its gradient added, then one step applied; without a plan it is an error."""
  seen = []

  def grad_init(params, part, step_adv, frozen):
    return {"n": jnp.float32(0), "total": jnp.float32(0)}

  def grad_add(sums, params, part, step_adv, frozen):
    seen.append({k: np.asarray(v) for k, v in part.items()})
    return {"n": sums["n"] + 1, "total": sums["total"] + jnp.sum(part["targets"])}

  def apply_grads(params, opt_state, sums):
    return ({"w": params["w"] + sums["total"]}, {"count": opt_state["count"] + 1},
            {"loss": sums["n"]})

  programs = UpdatePrograms(None, None, MicrobatchPrograms(grad_init, grad_add, apply_grads))
  targets = jnp.arange(12.0).reshape(3, 4)
  # logit_positions [rows, K] (K = 3 here, wider than the second micro-batch): rows only.
  logit_positions = jnp.asarray([[1, 2, -1], [0, 1, -1], [2, 3, -1]], jnp.int32)
  mb = {"targets": targets, "returns": jnp.ones((3, 4)), "logit_positions": logit_positions}
  plan = [(np.array([2, 0]), 3), (np.array([1]), 2)]
  new, out, _ = update_step(programs, _state(critic=False), mb, 0.0, plan=plan)
  # no critic-only field
  assert [sorted(p) for p in seen] == [["logit_positions", "targets"]] * 2
  np.testing.assert_array_equal(seen[0]["targets"], np.asarray(targets)[[2, 0], :3])
  np.testing.assert_array_equal(seen[1]["targets"], np.asarray(targets)[[1], :2])
  np.testing.assert_array_equal(seen[1]["logit_positions"], np.asarray(logit_positions)[[1]])
  assert int(out["loss"]) == 2 and int(new.opt_state["count"]) == 1
  np.testing.assert_allclose(new.params["w"], 1.0 + 8 + 9 + 10 + 0 + 1 + 2 + 4 + 5)
  with pytest.raises(ValueError, match="plan"):
    update_step(programs, _state(critic=False), mb, 0.0)


def _numbered_minibatches(losses, live):
  """Mini-batch i carries its index and whether it holds a trained token; its loss is losses[i]."""
  return [{"loss_mask": jnp.full((2, 4), bool(on)), "index": jnp.int32(i)}
          for i, on in enumerate(live)], losses


def _counting_programs(order, losses):
  """A policy step that records which mini-batch it ran and reports its loss (NaN: skipped)."""
  def train_step(params, opt_state, mb, step_adv, frozen):
    i = int(mb["index"])
    order.append(i)
    ok = np.isfinite(losses[i])
    return (params, {"count": opt_state["count"] + int(ok)},
            {"loss": jnp.float32(losses[i]), "grad_norm": jnp.float32(2 * i),
             "skipped": jnp.bool_(not ok)})
  return UpdatePrograms(train_step)


def test_update_runs_each_live_minibatch_once_per_epoch_and_averages_finite_steps():
  mbs, losses = _numbered_minibatches([1.0, 3.0, np.nan, 5.0, 7.0], [1, 1, 1, 0, 1])
  order = []
  state, m = update(_counting_programs(order, losses), _state(critic=False), mbs, 0.0,
                    jax.random.key(3), epochs=3)
  live = [0, 1, 2, 4]  # mini-batch 3 has no trained token: never stepped
  assert len(order) == 3 * len(live)
  for e in range(3):  # every epoch a permutation of the live mini-batches
    assert sorted(order[e * 4:(e + 1) * 4]) == live
  assert order[:4] != order[4:8] or order[4:8] != order[8:]  # reshuffled (fixed key)
  assert m["num_updates"] == 9 and m["skipped_updates"] == 3  # mini-batch 2 is NaN each epoch
  assert int(state.opt_state["count"]) == 9
  np.testing.assert_allclose(m["loss"], np.mean([1.0, 3.0, 7.0]))  # over the finite steps
  np.testing.assert_allclose(m["grad_norm"], np.mean([0.0, 2.0, 8.0]))
  again = []
  update(_counting_programs(again, losses), _state(critic=False), mbs, 0.0, jax.random.key(3),
         epochs=3)
  assert again == order  # the order is the key's


def test_update_with_nothing_to_step_and_all_skipped():
  mbs, losses = _numbered_minibatches([np.nan, np.nan], [1, 1])
  _, m = update(_counting_programs([], losses), _state(critic=False), mbs, 0.0,
                jax.random.key(0), epochs=2)
  assert m["num_updates"] == 0 and m["skipped_updates"] == 4 and np.isnan(m["loss"])
  order = []
  _, m = update(_counting_programs(order, losses), _state(critic=False), [], 0.0,
                jax.random.key(0))
  assert order == [] and set(m) == set(no_update_metrics(False)) and m["num_updates"] == 0
  assert all(np.isnan(m[k]) for k in POLICY_METRICS) and m["skipped_updates"] == 0
  _, m = update(_counting_programs(order, losses), _state(critic=False),
                _numbered_minibatches([1.0], [0])[0], 0.0, jax.random.key(0))
  assert order == [] and m["num_updates"] == 0


def test_update_in_the_critic_warm_up_reports_the_critics_steps_only():
  calls = []
  mb = {k: jnp.ones((2, 4)) for k in CRITIC_FIELDS}
  mb["loss_mask"] = jnp.ones((2, 4), bool)
  skipped = {"value_clip_fraction": 0.0, "value_mean": 0.0, "critic_grad_norm": 0.0}

  def critic_step(critic, opt_state, batch, frozen):
    calls.append("critic")
    return critic, opt_state, {"value_loss": jnp.float32(2.0), "skipped": jnp.bool_(False),
                               **{k: jnp.float32(v) for k, v in skipped.items()}}
  programs = UpdatePrograms(lambda *a: pytest.fail("no policy step in the warm-up"), critic_step)
  state, m = update(programs, _state(critic=True), [mb, mb], 0.0, jax.random.key(1), epochs=2,
                    train_policy=False)
  assert calls == ["critic"] * 4 and m["num_updates"] == 0 and np.isnan(m["loss"])
  assert m["value_loss"] == 2.0 and m["critic_skipped_updates"] == 0
  assert set(CRITIC_METRICS) <= set(no_update_metrics(True))
  assert not set(CRITIC_METRICS) & set(no_update_metrics(False))


@pytest.mark.parametrize("algo", ["grpo", "ppo"])
def test_create_splits_the_policy_and_copies_the_reference(algo):
  from flax import nnx  # pylint: disable=import-outside-toplevel
  from salt_jax.config import TrainConfig  # pylint: disable=import-outside-toplevel
  from salt_jax.models import CausalLM, ModelConfig  # pylint: disable=import-outside-toplevel
  from salt_jax.sharding import make_mesh  # pylint: disable=import-outside-toplevel
  cfg = TrainConfig(algo=algo, seed=5)
  model = CausalLM(ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
                               num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8),
                   rngs=nnx.Rngs(0))
  setup = create(cfg, model, make_mesh("1x1"))
  params = nnx.state(model, nnx.Param)
  for a, b, c in zip(jax.tree.leaves(setup.state.params), jax.tree.leaves(params),
                     jax.tree.leaves(setup.ref_params)):
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(c, b)
    assert c is not a  # the reference is a copy: the update donates the params
  assert jax.tree.leaves(setup.frozen) == []  # no LoRA: everything is trained
  assert jax.random.key_data(setup.state.key).tolist() == jax.random.key_data(
      jax.random.key(5)).tolist()
  assert (setup.state.critic is not None) == (algo == "ppo") == (setup.critic_tx is not None)
  assert float(setup.schedule(10**6)) == pytest.approx(float(lr_schedule(cfg)(10**6)))


def test_step_advantages_of_a_critic_needs_the_token_batch():
  from salt_jax.config import TrainConfig  # pylint: disable=import-outside-toplevel
  from salt_jax.phases import step_advantages  # pylint: disable=import-outside-toplevel
  from salt_jax.sharding import make_mesh  # pylint: disable=import-outside-toplevel
  with pytest.raises(ValueError, match="scores the token batch with its critic"):
    step_advantages(None, TrainConfig(algo="ppo"), mesh=make_mesh("1x1"))
