"""Behaviour cloning on the toy env: the expert's actions get likelier and the policy wins more."""

import os
import sys

import jax
import numpy as np
import pytest
from flax import nnx

from envs.pool import EnvPool
from envs.toy import ToyEnv, toy_tasks
from envs import demos as demos_lib
from salt_jax import batching, sft
from salt_jax.agent.prompts import PromptConfig, toy_chat_tokenizer
from salt_jax.rollout import SamplingParams, collect
from salt_jax.sampling import Sampler
from salt_jax.sharding import make_mesh
from salt_jax.config import TrainConfig
from salt_jax.models.build import build_policy, load_params

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "experiments"))
import sft_warmstart  # noqa: E402  pylint: disable=wrong-import-position

# Trains or samples a policy: .ci/run runs it again under another XLA instruction set.
pytestmark = pytest.mark.samples

ENV_KW = dict(num_rooms=3, max_steps=4)
# Windowed single-turn prompts (one row per step): short rows, so a 2-layer, d_model-64 policy
# learns the format within a few dozen steps on a CPU.
PROMPTS = PromptConfig(history_window=1)


@pytest.fixture(scope="module")
def setup():
  tok = toy_chat_tokenizer()
  cfg = TrainConfig(env="toy", tokenizer="toy", max_cache_len=512, seed=0)
  env = ToyEnv(**ENV_KW)
  train = demos_lib.collect_demos(env, toy_tasks(12), seeds=range(2), max_steps=ENV_KW["max_steps"])
  held = demos_lib.collect_demos(env, toy_tasks(4, split="heldout"), seeds=[7],
                           max_steps=ENV_KW["max_steps"])
  return tok, cfg, train, held


def _win_rate(model, tok, tasks) -> tuple[float, float]:
  """(success rate, valid-action ratio) of greedy play, one trajectory per task."""
  sampler = Sampler(model, eos_token_ids=[tok.eos_token_id], pad_token_id=tok.pad_token_id,
                    max_cache_len=512, prompt_buckets=(128, 256))
  with EnvPool("toy", ENV_KW, 0) as pool:
    b = collect(pool, tasks, 1, sampler, tok, jax.random.key(0), max_steps=ENV_KW["max_steps"],
                max_new_tokens=24, prompt_config=PROMPTS,
                sampling=SamplingParams(greedy=True, stop_strings=("</action>",)),
                max_prompt_tokens=512 - 24)
  return float(b.success.mean()), float(b.metrics["valid_action_ratio"])


def test_demos_are_the_agent_loops_tokens(setup):
  tok, _, train, _ = setup
  assert train and all(d.won for d in train)
  prompts, responses, trajs = sft.demo_steps(train[:2], tok)
  assert len(prompts) == sum(len(d.actions) for d in train[:2])
  # whole-history prompts: each step's prompt extends the previous prompt + response
  for k in range(1, len(prompts)):
    if trajs[k] == trajs[k - 1]:
      prev = np.concatenate([prompts[k - 1], responses[k - 1]])
      assert np.array_equal(prompts[k][:len(prev)], prev)
  assert tok.decode(responses[0].tolist()) == (
      sft.RESPONSE_FORMAT.format(action=train[0].actions[0]))


def test_cloning_lowers_expert_nll_and_wins_more(setup):
  tok, cfg, train, held = setup
  model = build_policy(cfg, tok, make_mesh("1x1"))
  kw = dict(pad_id=tok.pad_token_id, min_length=64, layout="step", prompt_config=PROMPTS)
  batch = sft.demo_token_batch(train, tok, **kw)
  held_batch = sft.demo_token_batch(held, tok, **kw)
  eval_tasks = toy_tasks(12)  # the cloned tasks, at env seed 0 (one of the demos' seeds)
  nll0 = sft.nll(model, held_batch)
  win0, valid0 = _win_rate(model, tok, eval_tasks)
  losses = sft.behaviour_clone(model, batch, sft.SFTConfig(steps=60, rows=16, lr=1e-2))
  nll1 = sft.nll(model, held_batch)
  win1, valid1 = _win_rate(model, tok, eval_tasks)
  assert np.mean(losses[-10:]) < 0.5 * np.mean(losses[:10])
  assert nll1 < 0.5 * nll0, (nll0, nll1)  # on held-out tasks too: the format generalizes
  assert valid1 > valid0 and win1 > win0, (win0, valid0, win1, valid1)


def test_epoch_order_covers_each_row_once_and_groups_lengths():
  rng = np.random.default_rng(1)
  live = np.sort(rng.choice(200, 108, replace=False))  # rows with response tokens
  lengths = rng.integers(100, 3000, 200)
  rows, spread = 4, {}
  for grouped in (False, True):
    orders = [sft._epoch_order(np.random.default_rng(s), live, lengths, rows, grouped)
              for s in (0, 0, 1)]
    assert orders[0] == orders[1] and orders[0] != orders[2]  # a seed fixes the order
    for o in orders:
      assert sorted(o) == sorted(live.tolist())
    draws = np.asarray(orders[0][:len(live) // rows * rows]).reshape(-1, rows)
    spread[grouped] = np.mean(lengths[draws].max(1) - lengths[draws].min(1))
  assert spread[True] < 0.3 * spread[False], spread


def test_trimmed_draws_keep_loss_and_update(setup):
  """Cutting a draw to its rows' own length changes no number, only the padding."""
  tok, cfg, train, _ = setup
  batch = sft.demo_token_batch(train, tok, pad_id=tok.pad_token_id, min_length=64,
                               layout="trajectory")
  width = batch.input_ids.shape[1]
  assert batching.trimmed_length(batch.attention_mask[:3], 16) < width  # there is padding to cut
  results = []
  for min_length in (16, width):  # trimmed / never trimmed
    model = build_policy(cfg, tok, make_mesh("1x1"))
    loss0 = sft.nll(model, batch, rows_per_call=3, min_length=min_length)
    steps = sft.behaviour_clone(model, batch, sft.SFTConfig(steps=3, rows=3, min_length=min_length))
    results.append((loss0, steps, jax.tree.leaves(nnx.state(model, nnx.Param))))
  (a0, a_steps, a_params), (b0, b_steps, b_params) = results
  np.testing.assert_allclose(a0, b0, rtol=1e-5)
  np.testing.assert_allclose(a_steps, b_steps, rtol=1e-5)
  for x, y in zip(a_params, b_params):
    np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-6)


def test_bad_sft_input():
  with pytest.raises(ValueError, match="steps"):
    sft.SFTConfig(steps=0)
  with pytest.raises(ValueError, match="min_length"):
    sft.SFTConfig(min_length=0)
  with pytest.raises(ValueError, match="layout"):
    sft.demo_token_batch([], None, pad_id=0, layout="rows")


def test_warm_start_script_saves_loadable_params(tmp_path, capsys):
  out = tmp_path / "toy_sft"
  assert sft_warmstart.main(["--env", "toy", "--steps", "6", "--demos", "4", "--lr", "1e-2",
                             "--group-by-length", "--out", str(out)]) == 0
  log = capsys.readouterr().out
  before, after = (float(x) for x in log.split("demo NLL ")[1].split(" nats")[0].split(" -> "))
  assert after < before, log
  cfg = TrainConfig(env="toy", tokenizer="toy", max_cache_len=512, seed=0)
  tok = toy_chat_tokenizer()
  fresh = nnx.state(build_policy(cfg, tok, make_mesh("1x1")), nnx.Param)
  loaded = load_params(str(out / sft.SFT_SUBDIR), fresh)
  assert jax.tree.structure(loaded) == jax.tree.structure(fresh)
  assert any(not np.allclose(a, b) for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(fresh)))


def test_demo_texts_hold_every_observation_and_admissible_list():
  env = ToyEnv(max_steps=8, num_rooms=3)
  demos = demos_lib.collect_demos(env, toy_tasks(2), max_steps=8, only_won=False)
  want = []
  for d in demos:  # the reference: the episode's texts in the order it saw them
    want.append(d.first_observation)
    want.append(" ".join(d.first_admissible))
    want.extend(d.observations)
    want.extend(" ".join(a) for a in d.admissible)
  assert demos_lib.demo_texts(demos) == want
  # The expert only plays admissible actions, so the corpus holds every action it took.
  for d in demos:
    lists = [d.first_admissible, *d.admissible]
    assert all(a in lists[t] for t, a in enumerate(d.actions))
  assert demos_lib.demo_texts([]) == []


def test_noisy_expert_demos_deviate_and_replan():
  """The warm start's demonstrations: epsilon=0 is the expert's plan; epsilon=1 draws only
  admissible actions; in between the expert replans after a deviation and still wins given room."""
  env = ToyEnv(num_rooms=3, max_steps=30)
  task = toy_tasks(1)[0]
  assert demos_lib.play_expert(env, task).actions == tuple(env.optimal_actions(task))
  noisy = [demos_lib.play_expert(env, task, seed=s, epsilon=0.5) for s in range(20)]
  assert all(d.won for d in noisy)  # 30 steps leave room to recover
  assert any(len(d.actions) > len(env.optimal_actions(task)) for d in noisy)
  rand = demos_lib.play_expert(env, task, seed=3, epsilon=1.0)
  listings = (rand.first_admissible,) + rand.admissible
  assert all(a in listings[t] for t, a in enumerate(rand.actions))
  assert demos_lib.play_expert(env, task, seed=7, epsilon=0.5) == demos_lib.play_expert(env, task, seed=7,
                                                                            epsilon=0.5)
  with pytest.raises(ValueError, match="epsilon"):
    demos_lib.play_expert(env, task, epsilon=1.5)
