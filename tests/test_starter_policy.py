"""The main job's default policy: the starter shipped in envs/alfworld_data/starter_policy.

It must load as a Hugging Face folder, name training tasks the bundled split has, be what the
main script plays when no policy flag is given (and not when one is), and play those tasks with
well-formed, admissible actions, winning some trajectories and losing others in its first groups
(so GRPO has mixed rewards to learn from from the first iteration).
"""

import json
import os
import sys

import jax
import numpy as np
import pytest

from envs import registry
from envs.alfworld import STARTER_POLICY, starter_defaults
from salt_jax import cli
from salt_jax.config import TrainConfig
from salt_jax.train import Trainer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "experiments"))

import alfworld_grpo_salt  # pylint: disable=wrong-import-position

# Trains or samples a policy: .ci/run runs it again under another XLA instruction set.
pytestmark = pytest.mark.samples


def test_starter_folder_and_its_play_settings():
  play = starter_defaults()
  assert play["model"] == str(STARTER_POLICY)
  for name in ("config.json", "model.safetensors", "tokenizer.json", "build.json"):
    assert (STARTER_POLICY / name).exists(), name
  build = json.loads((STARTER_POLICY / "build.json").read_text())
  assert build["play"]["prompt_history"] == build["prompt_config"]["history_window"]
  cfg = TrainConfig(**play)
  cfg.validate()
  tasks = registry.training_tasks(cfg)
  assert [t.task_id for t in tasks] == list(build["play"]["train_task_ids"])
  assert len(tasks) == build["demos"]["tasks"]


def test_main_script_plays_the_starter_unless_a_policy_is_named(tmp_path):
  def config(*flags):
    return cli.config_from(["--out", str(tmp_path), *flags], alfworld_grpo_salt.CPU_DEFAULTS,
                           default_policy=starter_defaults)[0]
  cfg = config()
  assert cfg.model == str(STARTER_POLICY)
  assert cfg.train_task_ids == starter_defaults()["train_task_ids"]
  assert cfg.layout == "step" and cfg.prompt_history == starter_defaults()["prompt_history"]
  cfg.validate()
  # flags still win over the starter's values
  assert config("--max-steps", "7").max_steps == 7
  # naming a policy drops the starter and its tasks and prompts
  for flags in (["--tokenizer", "toy"], ["--tiny-policy", '{"num_layers": 1}']):
    other = config(*flags)
    assert other.model is None and other.train_task_ids is None and other.prompt_history is None


def test_training_task_ids_select_and_order_and_unknown_ids_fail():
  ids = ("valid_train/look_at_obj_in_light-CD-None-DeskLamp-307/trial_T20190906_200435_424001",)
  some = registry.task_list("alfworld", "valid_train")[:3]
  cfg = TrainConfig(train_task_ids=tuple(t.task_id for t in reversed(some)))
  assert registry.training_tasks(cfg) == list(reversed(some))
  with pytest.raises(ValueError, match="not tasks of alfworld's 'valid_train'"):
    registry.training_tasks(TrainConfig(train_task_ids=ids + ("valid_train/nope",)))
  with pytest.raises(ValueError, match="train_task_ids"):
    TrainConfig(train_task_ids=()).validate()
  with pytest.raises(ValueError, match="train_task_ids"):
    TrainConfig(train_task_ids=("",)).validate()


def test_starter_plays_valid_actions_and_wins_some_of_its_first_groups(tmp_path):
  cfg = cli.config_from(["--out", str(tmp_path), "--env-workers", "0", "--no-progress",
                         "--no-tensorboard"], alfworld_grpo_salt.CPU_DEFAULTS,
                        default_policy=starter_defaults)[0]
  with Trainer(cfg) as tr:
    tr.setup()
    tasks = tr.task_sampler.tasks[:cfg.tasks_per_iter]
    batch = tr.collect_rollout(tasks, jax.random.key(0), seed=0, group_size=cfg.group_size)
  won = np.asarray(batch.success, dtype=float)
  print(f"success {won.mean():.2f}, valid {batch.metrics['valid_action_ratio']:.2f}")
  # Measured at build time (build.json "sampled"): 0.44 success, 0.66 valid steps over 64.
  assert batch.metrics["valid_action_ratio"] >= 0.5
  groups = won.reshape(len(tasks), cfg.group_size)
  assert any(0 < g.mean() < 1 for g in groups), groups  # a group with mixed rewards
