
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from jax.sharding import NamedSharding, PartitionSpec as P

import salt_jax
from salt_jax.sharding import batch_sharding, make_mesh
from tests import references as ref
from tests.test_graph import groups_of_trajectories

_BUCKET = 1024  # property tests pad to one shape: one compiled program for all examples
_refine = jax.jit(salt_jax.refine, static_argnums=2)


@settings(max_examples=50, deadline=None)
@given(groups_of_trajectories(), st.integers(1, 4), st.data())
def test_refine_matches_reference_on_real_merge_ids(trajectories_groups, history, data):
  trajectories, group_ids = trajectories_groups
  m = salt_jax.build_merge_ids(trajectories, group_ids, history=history)
  n = m.num_steps
  if n > _BUCKET:
    return
  adv = np.asarray(data.draw(st.lists(st.floats(-3, 3, width=32), min_size=n, max_size=n)),
                   np.float32)
  mask = np.asarray(data.draw(st.lists(st.booleans(), min_size=n, max_size=n)), bool)
  pad = _BUCKET - n
  got = _refine(np.concatenate([adv, np.full(pad, np.nan, np.float32)]),
                np.concatenate([m.ids, np.zeros(pad, np.int32)]), _BUCKET,
                np.concatenate([mask, np.zeros(pad, bool)]))
  got = np.asarray(got)
  np.testing.assert_allclose(got[:n], ref.refine(adv, m.ids, mask), rtol=1e-5, atol=1e-6)
  assert np.all(got[n:] == 0.0)


def test_singletons_keep_their_value_exactly_and_groups_average():
  adv = np.array([0.3, -1.7, 2.5, 1.0e-7], np.float32)
  ids = np.array([0, 1, 1, 2], np.int32)
  out = np.asarray(salt_jax.refine(adv, ids, 3))
  assert out[0] == adv[0] and out[3] == adv[3]
  np.testing.assert_allclose(out[1:3], [0.4, 0.4], rtol=1e-6)


def test_masked_steps_return_zero_and_nan_does_not_leak():
  adv = np.array([1.0, np.nan, 3.0, np.inf], np.float32)
  ids = np.array([0, 0, 0, 1], np.int32)
  out = np.asarray(salt_jax.refine(adv, ids, 2, mask=np.array([1, 0, 1, 0])))
  np.testing.assert_array_equal(out, [2.0, 0.0, 2.0, 0.0])


def test_out_of_range_ids_are_masked_and_empty_input():
  out = salt_jax.refine(np.array([1.0, 2.0], np.float32), np.array([0, 5], np.int32), 2)
  np.testing.assert_array_equal(out, [1.0, 0.0])
  assert salt_jax.refine(np.zeros(0, np.float32), np.zeros(0, np.int32), 1).shape == (0,)


def test_refine_bad_inputs():
  a = np.zeros(4, np.float32)
  i = np.zeros(4, np.int32)
  with pytest.raises(ValueError, match="rank 1"):
    salt_jax.refine(a.reshape(2, 2), i.reshape(2, 2), 1)
  with pytest.raises(ValueError, match="same shape"):
    salt_jax.refine(a, i[:2], 1)
  with pytest.raises(ValueError, match="integer"):
    salt_jax.refine(a, i.astype(np.float32), 1)
  with pytest.raises(ValueError, match="num_segments"):
    salt_jax.refine(a, i, 0)
  with pytest.raises(ValueError, match="static"):
    jax.jit(lambda n: salt_jax.refine(a, i, n))(3)
  with pytest.raises(ValueError, match="same shape"):
    salt_jax.refine(a, i, 1, mask=np.ones(3, bool))


def _user_loss(params, adv, ids, mask, num_segments):
  """What a user writes: SALT inside their own jitted loss, under a mesh."""
  refined = salt_jax.refine(adv, ids, num_segments, mask)
  return jnp.sum(refined * params), refined


@pytest.mark.parametrize("explicit", [False, True])
def test_refine_inside_jitted_loss_sharded_equals_unsharded(explicit):
  rng = np.random.default_rng(0)
  n, segs = 4096, 700
  adv = rng.normal(size=n).astype(np.float32)
  ids = rng.integers(0, segs, n).astype(np.int32)
  mask = rng.random(n) > 0.1
  params = rng.normal(size=n).astype(np.float32)
  grad_fn = jax.jit(jax.value_and_grad(_user_loss, has_aux=True), static_argnums=4)
  (want_loss, want), want_grad = grad_fn(params, adv, ids, mask, segs)
  if explicit:
    mesh = jax.make_mesh((4, 2), ("data", "model"),
                         axis_types=(jax.sharding.AxisType.Explicit,) * 2)
  else:
    mesh = make_mesh("4x2")
  sh = NamedSharding(mesh, P("data"))
  args = [jax.device_put(x, sh) for x in (params, adv, ids, mask)]
  with jax.set_mesh(mesh):
    (loss, got), grad = grad_fn(*args, segs)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(grad, want_grad, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(loss, want_loss, rtol=1e-4)
  assert got.sharding.spec == P("data")


def test_token_advantages_both_layouts():
  step_adv = np.array([0.5, -1.0, 2.0], np.float32)
  # One row per step: prompt tokens -1, the row's response tokens carry its step index.
  rows = np.array([[-1, -1, 0, 0, -1], [-1, 1, 1, 1, 1], [-1, -1, -1, 2, -1]], np.int32)
  np.testing.assert_array_equal(
      salt_jax.token_advantages(step_adv, rows),
      [[0, 0, 0.5, 0.5, 0], [0, -1, -1, -1, -1], [0, 0, 0, 2.0, 0]])
  # One sequence per trajectory: observation tokens -1, each action carries its own step.
  seq = np.array([[-1, 0, 0, -1, -1, 1, 1, -1, 2, -1]], np.int32)
  np.testing.assert_array_equal(
      salt_jax.token_advantages(step_adv, seq), [[0, 0.5, 0.5, 0, 0, -1, -1, 0, 2.0, 0]])
  # Out of range ids and an empty step list give zeros.
  np.testing.assert_array_equal(salt_jax.token_advantages(step_adv, [[7, -3]]), [[0, 0]])
  np.testing.assert_array_equal(salt_jax.token_advantages(np.zeros(0, np.float32), rows), 0)


def test_token_advantages_bad_inputs():
  with pytest.raises(ValueError, match="rank 2"):
    salt_jax.token_advantages(np.zeros(3, np.float32), np.zeros(3, np.int32))
  with pytest.raises(ValueError, match="rank 1"):
    salt_jax.token_advantages(np.zeros((3, 1), np.float32), np.zeros((1, 3), np.int32))
  with pytest.raises(ValueError, match="integer"):
    salt_jax.token_advantages(np.zeros(3, np.float32), np.zeros((1, 3), np.float32))


# --- Mind the math: when does averaging advantages change the policy gradient? -----------------

def _tabular_policy_grad(prompt_ids, action_ids, advantages, num_prompts, num_actions):
  """Summed PPO gradient (ratio 1, no clipping hit) of a tabular softmax policy W[prompt, action]."""
  def loss(w):
    logp = jax.nn.log_softmax(w[prompt_ids], axis=-1)[jnp.arange(len(action_ids)), action_ids]
    l, _ = salt_jax.policy_loss(logp[:, None], jax.lax.stop_gradient(logp)[:, None],
                                advantages, jnp.ones((len(action_ids), 1)),
                                loss_agg="seq-mean-token-sum")
    return l
  w = jnp.asarray(np.random.default_rng(1).normal(size=(num_prompts, num_actions)), jnp.float32)
  return np.asarray(jax.grad(loss)(w))


def test_salt_leaves_gradient_unchanged_when_merged_steps_share_the_prompt():
  # The agent's prompt is exactly SALT's state (history h=1): merged steps have identical
  # (prompt, action), so their gradient terms are equal and averaging cannot change the sum.
  traj_a = [("go", "hall"), ("take key", "got key")]
  traj_b = [("go", "hall"), ("take key", "got key")]
  traj_c = [("go", "hall"), ("look", "hall")]
  trajs, groups = [traj_a, traj_b, traj_c], [0, 0, 0]
  m = salt_jax.build_merge_ids(trajs, groups, history=1)
  prompts = {}
  prompt_ids = [prompts.setdefault(tuple(t[max(0, i - 1):i]), len(prompts))
                for t in trajs for i in range(len(t))]
  actions = {}
  action_ids = [actions.setdefault(a, len(actions)) for t in trajs for a, _ in t]
  traj_adv = np.array([1.0, 0.2, -1.2], np.float32)
  step_adv = np.repeat(traj_adv, m.step_counts)
  refined = np.asarray(salt_jax.refine(step_adv, m.ids, m.num_segments))
  assert not np.allclose(refined, step_adv)  # SALT did change the advantages ...
  assert salt_jax.cross_prompt_merges(m.ids, np.array(prompt_ids)) == 0
  g_raw = _tabular_policy_grad(np.array(prompt_ids), np.array(action_ids), step_adv, 8, 8)
  g_salt = _tabular_policy_grad(np.array(prompt_ids), np.array(action_ids), refined, 8, 8)
  np.testing.assert_allclose(g_salt, g_raw, atol=1e-6)  # ... but not the summed gradient


def test_salt_changes_gradient_when_merged_steps_have_different_prompts():
  # SALT's state is the last h=1 pair, the agent's prompt the whole history: at step 3 the four
  # trajectories share the state ("wait", "room") but reached it through different first moves,
  # so merged steps have different prompts and averaging moves credit between them.
  trajs = [[("go north", "hall"), ("wait", "room"), ("take key", "won")],
           [("go east", "yard"), ("wait", "room"), ("take key", "won")],
           [("go north", "hall"), ("wait", "room"), ("look", "room")],
           [("go east", "yard"), ("wait", "room"), ("look", "room")]]
  groups = [0] * 4
  m = salt_jax.build_merge_ids(trajs, groups, history=1)
  prompts = {}
  prompt_ids = [prompts.setdefault(tuple(t[:i]), len(prompts)) for t in trajs
                for i in range(len(t))]
  actions = {}
  action_ids = [actions.setdefault(a, len(actions)) for t in trajs for a, _ in t]
  traj_adv = np.array([1.5, -0.5, 0.5, -1.5], np.float32)
  step_adv = np.repeat(traj_adv, m.step_counts)
  refined = np.asarray(salt_jax.refine(step_adv, m.ids, m.num_segments))
  # Step 3's two edges ("take key", "look") each join two different prompts.
  assert salt_jax.cross_prompt_merges(m.ids, np.array(prompt_ids)) == 4
  g_raw = _tabular_policy_grad(np.array(prompt_ids), np.array(action_ids), step_adv, 16, 8)
  g_salt = _tabular_policy_grad(np.array(prompt_ids), np.array(action_ids), refined, 16, 8)
  assert np.max(np.abs(g_salt - g_raw)) > 1e-2


def _token_policy_grad(prompt_ids, responses, advantages, num_prompts, vocab, length):
  """Summed PPO gradient (ratio 1) of a tabular token policy W[prompt, position, token] over
  whole responses (token lists), each token weighted by its step's advantage."""
  tokens = np.zeros((len(responses), length), np.int32)
  mask = np.zeros((len(responses), length), np.float32)
  for i, r in enumerate(responses):
    tokens[i, :len(r)], mask[i, :len(r)] = r, 1.0
  def loss(w):
    logits = w[np.asarray(prompt_ids)]  # [N, length, vocab]
    logp = jnp.take_along_axis(jax.nn.log_softmax(logits, -1), tokens[..., None], -1)[..., 0]
    adv = jnp.asarray(advantages, jnp.float32)[:, None] * mask
    l, _ = salt_jax.policy_loss(logp, jax.lax.stop_gradient(logp), adv, mask,
                                loss_agg="seq-mean-token-sum")
    return l
  w = jnp.asarray(np.random.default_rng(2).normal(size=(num_prompts, length, vocab)), jnp.float32)
  return np.asarray(jax.grad(loss)(w))


@pytest.mark.parametrize("reasoning", [False, True])
def test_same_prompt_and_action_change_the_gradient_only_when_responses_differ(reasoning):
  # Two trajectories of one group take the same first action from the same prompt (SALT merges
  # the steps); one wins. A policy that writes only the action has identical responses: the
  # summed gradient stays GRPO's. One that reasons writes different <think> tokens before the
  # same <action> tokens: averaging the advantages moves credit between the two responses.
  trajs = [[("open door", "hall")], [("open door", "hall")], [("look", "room")]]
  m = salt_jax.build_merge_ids(trajs, [0, 0, 0], history=1)
  action = [7, 8, 9]  # <action>open door</action>
  think = ([[1, 2]], [[1, 2]]) if not reasoning else ([[1, 2]], [[3, 4]])
  responses = [think[0][0] + action, think[1][0] + action, [5, 6, 9]]
  prompts = [0, 0, 0]
  step_adv = np.array([1.2, -0.6, -0.6], np.float32)
  refined = np.asarray(salt_jax.refine(step_adv, m.ids, m.num_segments))
  assert refined[0] == refined[1] == pytest.approx(0.3)
  samples = [0, 0 if not reasoning else 1, 2]
  g_raw = _token_policy_grad(prompts, responses, step_adv, 1, 10, 5)
  g_salt = _token_policy_grad(prompts, responses, refined, 1, 10, 5)
  changed = salt_jax.gradient_changing_merges(m.ids, samples, step_adv)
  if reasoning:
    assert changed == 2 and salt_jax.cross_prompt_merges(m.ids, prompts) == 0
    assert np.max(np.abs(g_salt - g_raw)) > 1e-2
  else:
    assert changed == 0
    np.testing.assert_allclose(g_salt, g_raw, atol=1e-6)


def test_token_advantages_sharded_equals_unsharded():
  rng = np.random.default_rng(3)
  step_adv = rng.normal(size=50).astype(np.float32)
  token_step_ids = rng.integers(-1, 50, (16, 12)).astype(np.int32)
  fn = jax.jit(salt_jax.token_advantages)
  want = fn(step_adv, token_step_ids)
  mesh = make_mesh("4x2")
  with jax.set_mesh(mesh):
    got = fn(step_adv, jax.device_put(token_step_ids, batch_sharding(mesh, ndim=2)))
  np.testing.assert_array_equal(got, want)
  np.testing.assert_array_equal(want, np.where(token_step_ids >= 0,
                                               step_adv[np.maximum(token_step_ids, 0)], 0.0))
