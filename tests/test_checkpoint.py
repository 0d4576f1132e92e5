"""The checkpoint fingerprints, the resume's config comparison and the asynchronous saves of
`salt_jax.checkpoint`; the trainer's resume paths (a kill while a checkpoint is written in the
background among them) are tested end to end in tests/test_train.py."""

import os
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P
from orbax.checkpoint._src.path import atomicity

from salt_jax import checkpoint
from salt_jax.config import TrainConfig
from salt_jax.sharding import make_mesh, replicated


def _tree():
  rng = np.random.default_rng(0)
  return {"w": rng.normal(size=(8, 6)).astype(np.float32),
          "h": rng.normal(size=(4, 2, 3)).astype(jnp.bfloat16),
          "count": np.int32(7), "key": np.array([3, 4], np.uint32)}


def test_fingerprints_do_not_depend_on_the_sharding():
  tree = _tree()
  mesh = make_mesh("4x2")
  sharded = {"w": jax.device_put(tree["w"], NamedSharding(mesh, P("data", "model"))),
             "h": jax.device_put(tree["h"], NamedSharding(mesh, P("data", None, None))),
             "count": jax.device_put(tree["count"], NamedSharding(mesh, P())),
             "key": jax.device_put(tree["key"], NamedSharding(mesh, P("model")))}
  one = checkpoint.fingerprints(jax.tree.map(jnp.asarray, tree))
  assert one == checkpoint.fingerprints(sharded)
  assert set(one) == {"['w']", "['h']", "['count']", "['key']"}
  assert checkpoint.damaged_leaves(sharded, one) == []
  assert checkpoint.damaged_leaves(sharded, None) == []  # a checkpoint without fingerprints


def test_any_flipped_bit_or_swap_changes_the_fingerprint():
  tree = _tree()
  want = checkpoint.fingerprints(tree)
  bits = tree["w"].view(np.uint32)
  for i, bit in ((0, 0), (17, 31), (47, 12)):
    w = bits.copy()
    w.reshape(-1)[i] ^= np.uint32(1 << bit)
    assert checkpoint.damaged_leaves({**tree, "w": w.view(np.float32)}, want) == ["['w']"]
  swapped = tree["w"].copy()
  swapped[[0, 1]] = swapped[[1, 0]]
  assert checkpoint.damaged_leaves({**tree, "w": swapped}, want) == ["['w']"]
  assert checkpoint.damaged_leaves({**tree, "w": np.zeros_like(tree["w"])}, want) == ["['w']"]


def test_config_differences_name_saved_and_new_values():
  saved = {"lr": 0.001, "group_size": 8, "gone": 1}
  now = {"lr": 0.001, "group_size": 4, "added_later": True}
  assert checkpoint.config_differences(saved, now) == [
      "gone: saved 1, now no such field", "group_size: saved 8, now 4"]


def _run_checkpoints(tmp_path, **changes) -> checkpoint.RunCheckpoints:
  cfg = TrainConfig(out=str(tmp_path), **changes)
  return checkpoint.RunCheckpoints(cfg, make_mesh(cfg.mesh)).open()


def _state(step: int, mesh) -> dict:
  """A small state whose every value depends on `step`, on the mesh."""
  put = lambda x: jax.device_put(x, replicated(mesh))  # noqa: E731
  return {"params": {"w": put(np.arange(48, dtype=np.float32).reshape(8, 6) * step)},
          "opt_state": {"count": put(np.int32(step))}, "key": put(np.array([step, 4], np.uint32))}


def _assert_reads_back(ck, step):
  state, meta = ck.read(step, _state(0, ck.mesh))
  jax.tree.map(np.testing.assert_array_equal, state, _state(step, ck.mesh))
  assert meta["iteration"] == step


def _names(ck) -> list[str]:
  return sorted(os.listdir(ck.dir))


def test_save_then_close_leaves_a_complete_checkpoint_of_the_values_saved(tmp_path):
  ck = _run_checkpoints(tmp_path)
  assert ck.config.async_checkpoint  # the default
  state = _state(3, ck.mesh)
  ck.save(3, state, {"iteration": 3})
  # The loop updates its arrays in place (donated) while the checkpoint is written: the
  # checkpoint holds the values at the save.
  overwrite = jax.jit(lambda tree: jax.tree.map(lambda x: x * 0 + 1, tree), donate_argnums=0)
  jax.block_until_ready(overwrite(state))
  ck.close()
  assert _names(ck) == ["3"]  # no temporary folder left
  _assert_reads_back(_run_checkpoints(tmp_path, resume=True), 3)


def test_a_save_right_after_another_waits_for_it(tmp_path):
  ck = _run_checkpoints(tmp_path, max_to_keep=2)
  for step in (1, 2, 3):
    ck.save(step, _state(step, ck.mesh), {"iteration": step})
  assert ck.latest_step() == 3  # a reader waits for the write in flight
  assert _names(ck) == ["2", "3"]
  for step in (3, 2):
    _assert_reads_back(ck, step)
  state, meta = ck.restore_latest_intact(_state(0, ck.mesh))
  assert meta["iteration"] == 3 and int(state["opt_state"]["count"]) == 3
  ck.close()


@pytest.mark.parametrize("async_checkpoint", [True, False])
def test_async_saves_return_before_the_commit_and_synchronous_ones_after(
    tmp_path, monkeypatch, async_checkpoint):
  """orbax's commit (the rename of the temporary folder) of checkpoint 1 is held until the test
  releases it: an asynchronous save has returned by then, a synchronous one has not."""
  release, committed_in = threading.Event(), []
  commit = atomicity.AtomicRenameTemporaryPath.finalize

  async def held_commit(self):
    if self.get_final().name == "1":
      committed_in.append(threading.current_thread())
      if async_checkpoint:
        release.wait(120)
    await commit(self)

  monkeypatch.setattr(atomicity.AtomicRenameTemporaryPath, "finalize", held_commit)
  ck = _run_checkpoints(tmp_path, async_checkpoint=async_checkpoint)
  try:
    ck.save(1, _state(1, ck.mesh), {"iteration": 1})
    assert checkpoint.complete_steps(ck.dir) == ([] if async_checkpoint else [1])
  finally:
    release.set()
  ck.wait()
  assert checkpoint.complete_steps(ck.dir) == [1] and len(committed_in) == 1
  assert (committed_in[0] is threading.current_thread()) != async_checkpoint
  _assert_reads_back(ck, 1)
  ck.close()
