"""The checkpoint fingerprints and the resume's config comparison (`salt_jax.checkpoint`); the
trainer's resume paths are tested end to end in tests/test_train.py."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from salt_jax import checkpoint
from salt_jax.sharding import make_mesh


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
