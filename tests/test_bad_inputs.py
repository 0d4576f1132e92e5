"""Every bad input is refused before any work with one `error:` line naming it (issue #45).

The table runs each entry point as a user would (`python script args`, from the repository root)
with one bad input: a path that is a file, an unknown split, task id or environment argument, a
tiny-policy shape or a --model config.json that cannot build a model, an out-of-range number. Each
must exit non-zero without a traceback, its last line `error: ...` (argparse's `prog: error: ...`)
naming the flag or field. One or two rows per kind of input and family of entry points: each row
is a process that imports jax. Below the table, the checks behind it called directly.
"""

import dataclasses
import json
import os
import re
import subprocess
import sys

import pytest

from envs import registry
from salt_jax.config import (SECTIONS, AlgorithmConfig, EnvConfig, PolicyConfig, RolloutConfig,
                             RunConfig, TrainConfig, UpdateConfig, check_output_folder)
from salt_jax.models.config import ModelConfig, read_model_config, tiny_policy_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "experiments"))

import learning_check  # noqa: E402  pylint: disable=wrong-import-position

ALF, TW, WS = ("experiments/alfworld_grpo_salt.py", "experiments/textworld_grpo_salt.py",
               "experiments/webshop_grpo_salt.py")
SFT, LC, STUDY = ("experiments/sft_warmstart.py", "experiments/learning_check.py",
                  "experiments/study.py")
EXPORT = ("-m", "salt_jax.export")

# (entry point and arguments, texts the error line must hold). {file}: an existing file;
# {model}: a folder whose config.json lacks the architecture; {tmp}: a fresh folder.
CASES = [
    # the training scripts (salt_jax.cli.main)
    ((ALF, "--train-task-ids", "99999", "--out", "{tmp}/r"), ("train_task_ids", "'99999'")),
    ((TW, "--train-split", "bogus", "--out", "{tmp}/r"), ("train_split", "'bogus'", "heldout")),
    ((WS, "--eval-splits", "bogus", "--out", "{tmp}/r"), ("eval_splits", "'bogus'", "test")),
    ((ALF, "--env-kwargs", '{"bogus": 1}', "--out", "{tmp}/r"),
     ("env_kwargs", "bogus", "expert_type")),
    ((WS, "--env-kwargs", '{"data_dir": "/nope"}', "--out", "{tmp}/r"),
     ("env_kwargs", "/nope")),
    ((TW, "--tiny-policy", '{"layers": -1}', "--out", "{tmp}/r"), ("tiny_policy", "num_layers")),
    ((TW, "--tiny-policy", '{"num_heads": 3}', "--out", "{tmp}/r"), ("tiny_policy", "num_heads")),
    ((ALF, "--model", "{model}", "--out", "{tmp}/r"), ("--model", "vocab_size")),
    ((TW, "--weight-decay", "-0.1", "--out", "{tmp}/r"), ("weight_decay",)),
    ((WS, "--out", "{file}"), ("out", "{file}", "not a folder")),
    ((WS, "--sft-warmstart", "--sft-steps", "0", "--out", "{tmp}/r"), ("--sft-steps",)),
    ((ALF, "--lora-rank", "-1", "--out", "{tmp}/r"), ("lora_rank", "-1")),
    ((TW, "--lora-rank", "8", "--lora-targets", ".*qproj", "--out", "{tmp}/r"),
     ("lora_targets", "'.*qproj'", "matches no projection")),
    # the behaviour-cloning warm start
    ((SFT, "--out", "{file}"), ("out", "{file}")),
    ((SFT, "--model", "{model}", "--out", "{tmp}/r"), ("--model", "vocab_size")),
    ((SFT, "--demos", "0"), ("--demos",)),
    ((SFT, "--lora-rank", "4", "--lora-alpha", "0", "--out", "{tmp}/r"), ("lora_alpha",)),
    # the learning check (TrainConfig fields through --set)
    ((LC, "--set", 'env_kwargs={"bogus": 1}'), ("env_kwargs", "bogus", "num_rooms")),
    ((LC, "--warm-seed", "0", "--warm-dir", "{file}"), ("--warm-dir", "{file}")),
    # the study
    ((STUDY, "headline", "--out", "{file}"), ("--out", "{file}")),
    ((STUDY, "headline", "--seeds", "-1", "--out", "{tmp}/study"), ("seed", "-1")),
    # the export
    ((*EXPORT, "--run", "/nope", "--out", "{tmp}/e"), ("--run", "/nope")),
    ((*EXPORT, "--run", "{tmp}", "--out", "{file}"), ("--out", "{file}")),
    # the environments' own command lines
    (("envs/alfworld.py", "--split", "bogus"), ("--split", "'bogus'", "valid_unseen")),
    (("envs/alfworld.py", "--data-dir", "/nope"), ("--data-dir", "/nope")),
    (("envs/webshop.py", "--expert", "--data-dir", "/nope"), ("--data-dir", "/nope")),
]


@pytest.fixture(scope="module")
def places(tmp_path_factory):
  """{file}, {model} and {tmp} of the table."""
  root = tmp_path_factory.mktemp("bad_inputs")
  (root / "a_file").write_text("not a folder")
  model = root / "model"
  model.mkdir()
  (model / "config.json").write_text(json.dumps({"model_type": "qwen2", "hidden_size": 64}))
  tmp = root / "tmp"
  tmp.mkdir()
  return {"file": str(root / "a_file"), "model": str(model), "tmp": str(tmp)}


def _fill(text: str, places: dict) -> str:
  for name, value in places.items():  # not str.format: the JSON arguments hold braces
    text = text.replace("{" + name + "}", value)
  return text


@pytest.mark.parametrize("args, wanted", CASES, ids=[" ".join(a) for a, _ in CASES])
def test_a_bad_input_is_one_error_line(args, wanted, places):
  argv = [_fill(a, places) for a in args]
  p = subprocess.run([sys.executable, *argv], cwd=ROOT, env=dict(os.environ), timeout=120,
                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, check=False)
  out = p.stdout.strip()
  assert p.returncode != 0, out[-2000:]
  assert "Traceback" not in out, out[-3000:]
  last = out.splitlines()[-1] if out else ""
  assert re.match(r"(\S+: )?error: ", last), out[-2000:]
  for text in wanted:
    assert _fill(text, places) in last, last
  assert os.listdir(places["tmp"]) == []  # nothing was written


# ------------------------------------------------------------------ the checks, called directly


def test_env_arguments_are_the_constructors_and_its_params_fields():
  assert registry.env_arguments("alfworld") == ("data_dir", "expert", "expert_type",
                                                "fast_engine", "max_steps")
  tw = registry.env_arguments("textworld")  # TextWorldEnv(**params): GameParams' fields
  assert {"max_steps", "expert", "max_loaded", "quest_length", "world_size"} <= set(tw)
  assert "params" not in tw
  assert "task_types" in registry.env_arguments("toy")


@pytest.mark.parametrize("change, match", [
    (dict(env_kwargs={"num_tasks": 3}), r"unknown env_kwargs \['num_tasks'\] for the toy "
                                        r"environment; known: enable_test_faults, max_steps"),
    (dict(env_kwargs={"num_rooms": 99}), r"env_kwargs .* num_rooms must be in \[2, 12\]"),
    (dict(env_kwargs={"num_rooms": "3"}), "env_kwargs"),
    (dict(env_kwargs=[1]), "env_kwargs must be a dict"),
    (dict(env="textworld", env_kwargs={"quest_length": "5"}), "quest_length"),
    (dict(env="textworld", train_split="valid"), r"train_split 'valid' of textworld"),
    (dict(env="alfworld", eval_splits=("valid_seen", "nope")),
     r"eval_splits 'nope' of alfworld: .*available"),
    (dict(eval_splits="eval"), "eval_splits must be None or split names"),
    (dict(train_task_ids=("toy-train-0", "toy-train-8")),
     r"train_task_ids: 1 of 2 .* 'toy-train-8' .* like 'toy-train-0'"),
    (dict(num_train_tasks=0), "num_train_tasks"),
])
def test_env_config_refusals(change, match):
  cfg = dataclasses.replace(TrainConfig(env="toy", tokenizer="toy"), **change)
  with pytest.raises(ValueError, match=match):
    registry.check_env_config(cfg)
  with pytest.raises(ValueError, match=match):
    cfg.validate()


def test_env_config_accepts_what_runs():
  registry.check_env_config(TrainConfig(env="toy", train_split="anything",
                                        train_task_ids=("toy-anything-1",),
                                        env_kwargs={"num_rooms": 3, "task_types": ["walk"]}))
  registry.check_env_config(TrainConfig(env="textworld", env_kwargs={"quest_length": 6},
                                        eval_splits=("heldout", "train")))


@pytest.mark.parametrize("change, match", [
    (dict(weight_decay=-0.01), "weight_decay must be >= 0"),
    (dict(weight_decay=float("nan")), "weight_decay"),
    (dict(max_grad_norm=0.0), "max_grad_norm must be > 0"),
    (dict(clip_eps_high=-0.1), "clip_eps_high"),
    (dict(dual_clip=1.0), "dual_clip must be None or > 1"),
])
def test_update_number_refusals(change, match):
  with pytest.raises(ValueError, match=match):
    dataclasses.replace(TrainConfig(env="toy", tokenizer="toy"), **change).validate()


@pytest.mark.parametrize("section, change, match", [
    (EnvConfig, dict(env="nope"), "unknown env 'nope'"),
    (EnvConfig, dict(env="toy", max_steps=0), "max_steps must be an int >= 1"),
    (PolicyConfig, dict(param_dtype="float16"), "unknown param_dtype"),
    (PolicyConfig, dict(tokenizer="toy", lora_rank=2, lora_alpha=-1.0),
     "lora_alpha must be None or > 0"),
    (RolloutConfig, dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
    (RolloutConfig, dict(max_new_tokens=512, max_cache_len=520), "max_cache_len"),
    (AlgorithmConfig, dict(algo="nope"), "unknown algo 'nope'"),
    (AlgorithmConfig, dict(gae_lambda=1.5), r"gae_lambda must be in \[0, 1\]"),
    (UpdateConfig, dict(minibatch_rows=8, microbatch_rows=3),
     r"microbatch_rows \(3\) must divide minibatch_rows \(8\)"),
    (UpdateConfig, dict(critic_lr=float("nan")), "critic_lr must be > 0"),
    (UpdateConfig, dict(rollout_is_threshold=0.0), "rollout_is_threshold must be > 0"),
    (RunConfig, dict(iters=0), "iters must be an int >= 1"),
    (RunConfig, dict(num_processes=2), "need distributed=True"),
    (RunConfig, dict(clear_programs_above=1.5), r"must be a share of memory in \[0, 1\]"),
    (RunConfig, dict(clear_programs_above=float("nan")), "clear_programs_above must be a share"),
    (RunConfig, dict(clear_programs_above=True), "clear_programs_above must be a share"),
])
def test_each_config_section_validates_its_own_fields(section, change, match):
  """A section checks its fields on its own, and the whole config checks every section."""
  base = {EnvConfig: {"env": "toy"}, PolicyConfig: {"tokenizer": "toy"}}.get(section, {})
  section(**base).validate()
  with pytest.raises(ValueError, match=match):
    section(**{**base, **change}).validate()
  with pytest.raises(ValueError, match=match):
    dataclasses.replace(TrainConfig(env="toy", tokenizer="toy"), **change).validate()


def test_config_checks_what_sections_ask_of_each_other():
  """What no one section can check alone: a group of one without a critic, a trajectory layout
  with windowed prompts; each section's own fields are fine."""
  for change, match in ((dict(group_size=1), "group_size 1 gives grpo no baseline"),
                        (dict(layout="trajectory", prompt_history=2),
                         "layout 'trajectory' .* needs whole-history prompts"),
                        (dict(rollout_is_threshold=2.0), "set recompute_old_logprobs")):
    cfg = dataclasses.replace(TrainConfig(env="toy", tokenizer="toy"), **change)
    for section in SECTIONS:
      section.validate(cfg)
    with pytest.raises(ValueError, match=match):
      cfg.validate()
  dataclasses.replace(TrainConfig(env="toy", tokenizer="toy"), group_size=1,
                      algo="ppo").validate()


def test_tiny_policy_fields_and_values():
  cfg = tiny_policy_config({"num_layers": 1, "hidden_size": 32})
  assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads) == (1, 32, 4)
  got = tiny_policy_config({}, vocab_size=640, max_position_embeddings=512)
  assert (got.vocab_size, got.max_position_embeddings) == (640, 512)
  for bad, match in (({"layers": 2}, r"unknown tiny_policy fields \['layers'\]; known: "
                                     r"hidden_size, .*num_layers"),
                     ({"vocab_size": 5}, r"unknown tiny_policy fields \['vocab_size'\].*the run "
                                         r"sets vocab_size"),
                     ({"num_layers": -1}, "num_layers must be a positive int"),
                     ({"num_heads": 3}, "multiple of num_kv_heads"),
                     ({"rope_theta": "x"}, "rope_theta must be a number > 0"),
                     ({"tie_word_embeddings": "no"}, "tie_word_embeddings must be true or false"),
                     ([1], "tiny_policy must be a dict")):
    with pytest.raises(ValueError, match=match):
      tiny_policy_config(bad)
    with pytest.raises(ValueError, match=match):
      TrainConfig(env="toy", tokenizer="toy", tiny_policy=bad).validate()


def test_model_config_is_read_with_its_problems_named(tmp_path):
  good = tmp_path / "good"
  good.mkdir()
  (good / "config.json").write_text(json.dumps(ModelConfig.tiny().to_hf_dict()))
  assert read_model_config(good) == dataclasses.replace(ModelConfig.tiny(), eos_token_id=None)
  lacking = tmp_path / "lacking"
  lacking.mkdir()
  (lacking / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 8}))
  broken = tmp_path / "broken"
  broken.mkdir()
  (broken / "config.json").write_text("{not json")
  for path, match in ((tmp_path / "nope", "not a local folder or .gguf file"),
                      (tmp_path, "has no config.json"),
                      (lacking, r"lacks required field\(s\) \['hidden_size', 'intermediate_size'"),
                      (broken, "Expecting property name")):
    with pytest.raises(ValueError, match=f"--model {re.escape(str(path))}: .*{match}"):
      read_model_config(path)


def test_output_folder_checks(tmp_path):
  check_output_folder(str(tmp_path))
  check_output_folder(str(tmp_path / "new" / "deeper"))
  f = tmp_path / "f"
  f.write_text("x")
  with pytest.raises(ValueError, match="out '.*f' is a file, not a folder"):
    check_output_folder(str(f))
  with pytest.raises(ValueError, match=r"--warm-dir '.*f/x' cannot be made: .*f is a file"):
    check_output_folder(str(f / "x"), "--warm-dir")
  with pytest.raises(ValueError, match="out"):
    TrainConfig(env="toy", tokenizer="toy", out=str(f)).validate()


def test_learning_check_settings():
  learning_check.Check(iters=2, eval_at=(1,)).validate()
  for change, match in ((dict(eval_at=(12,)), r"eval_at \[12\]"), (dict(epsilon=1.5), "epsilon"),
                        (dict(sft_steps=0), "sft_steps"), (dict(eval_group_size=0), "eval_group"),
                        (dict(demo_seeds=()), "demo_seeds"), (dict(sft_rows=0), "sft_rows"),
                        (dict(sft_lr=0.0), "sft_lr"), (dict(clone=False), "clone=False")):
    with pytest.raises(ValueError, match=match):
      dataclasses.replace(learning_check.Check(), **change).validate()
  with pytest.raises(ValueError, match="seed"):
    learning_check.Check().validate(seeds=(-1,))
