"""experiments/build_alfworld_policy.py on 2 tasks with a very small policy: the folder it writes
loads in the trainer's loader and in transformers (same logits), its tokenizer holds ALFWorld's
words whole, build.json records what was cloned and how to play it (`starter_defaults`), and the
trainer plays it on the tasks it names."""

import json
import os
import sys

import jax
import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "experiments"))

pytest.importorskip("alfworld")

import build_alfworld_policy  # noqa: E402


@pytest.fixture(scope="module")
def built(tmp_path_factory):
  out = str(tmp_path_factory.mktemp("policy"))
  assert build_alfworld_policy.main(
      ["--num-tasks", "2", "--max-plan", "5", "--max-steps", "6", "--demos-per-task", "2",
       "--prompt-history", "1",
       "--steps", "12", "--rows", "2", "--hidden", "32", "--layers", "1", "--heads", "2",
       "--kv-heads", "1", "--intermediate", "64", "--eval-rounds", "1", "--out", out]) == 0
  return out


def test_build_json_records_the_cloning_and_how_to_play_it(built):
  from envs.alfworld import starter_defaults
  info = json.load(open(os.path.join(built, "build.json")))
  demos = info["demos"]
  assert demos["tasks"] == 2 and all(n <= 5 for n in demos["clean_plan_steps"])
  assert demos["noisy_episodes"] == 4 and 0 <= demos["noisy_won"] <= 4 and demos["rows"] > 0
  play = starter_defaults(built)
  assert play["model"] == built and len(play["train_task_ids"]) == 2
  assert play["layout"] == "step" and play["prompt_history"] == info["prompt_config"][
      "history_window"] == 1
  assert play["max_steps"] == 6
  sampled = info["sampled"]
  assert sampled["trajectories"] == 16 and 0 <= sampled["success"] <= 1
  assert 0 <= sampled["valid_steps"] <= 1


def test_the_tokenizer_holds_alfworld_words_whole(built):
  from salt_jax.models.tokenizer import load_tokenizer
  tok = load_tokenizer(built)
  assert len(tok) < 2048
  # Words of the two tasks' episodes (an alarm clock on a desk; a sink basin to clean at).
  for word in ("alarmclock", "sidetable", "desk", "drawer"):
    assert len(tok.encode(" " + word, add_special_tokens=False)) == 1, word
  text = "<think></think><action>take alarmclock 3 from sidetable 1</action>"
  assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
  assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                 add_generation_prompt=True).endswith("<|im_start|>assistant\n")


def test_transformers_reads_the_same_policy(built):
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  from salt_jax.models import from_pretrained
  ours = from_pretrained(built)
  theirs = transformers.AutoModelForCausalLM.from_pretrained(built, dtype=torch.float32).eval()
  tok = transformers.AutoTokenizer.from_pretrained(built)
  ids = tok("You arrive at sidetable 1. On the sidetable 1, you see a alarmclock 3.",
            add_special_tokens=False)["input_ids"]
  with torch.no_grad():
    want = theirs(torch.tensor([ids])).logits.numpy()
  got = ours(jax.numpy.asarray([ids], dtype=jax.numpy.int32))
  np.testing.assert_allclose(np.asarray(got), want, atol=1e-4, rtol=1e-4)
