"""salt_jax.microbatched_value_and_grad, accumulate.microbatched_rows and aggregate_weight against
numpy references."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import salt_jax
from salt_jax.accumulate import microbatched_rows
from salt_jax.loss import LOSS_AGG_MODES
from salt_jax.sharding import DATA_AXIS, make_mesh

R, T, D = 8, 5, 3


def _batch(seed=0, rows=R):
  rng = np.random.default_rng(seed)
  mask = rng.random((rows, T)) < 0.7
  mask[1] = False       # a row with no tokens
  mask[5] = False       # with rows 1 and 5 empty, micro-batch 1 of 4 has no weight at all
  mask[2] = True
  return dict(x=rng.standard_normal((rows, T, D)).astype(np.float32),
              y=rng.standard_normal((rows, T)).astype(np.float32), mask=mask)


PARAMS = dict(w=np.array([0.5, -1.0, 2.0], np.float32), b=np.float32(0.3))


def _loss(params, batch, mode):
  r = jnp.einsum("rtd,d->rt", batch["x"], params["w"]) + params["b"] - batch["y"]
  sq = jnp.square(r)
  aux = dict(token_mean=salt_jax.aggregate(sq, batch["mask"], "token-mean"),
             mean_abs=salt_jax.aggregate(jnp.abs(r), batch["mask"], "token-mean"))
  return salt_jax.aggregate(sq, batch["mask"], mode), aux


def _numpy_reference(params, batch, mode):
  """Loss, grads and aux of the whole batch: loss = sum c r^2 with per-token weights c."""
  x, y, m = batch["x"].astype(np.float64), batch["y"].astype(np.float64), batch["mask"]
  r = x @ params["w"].astype(np.float64) + float(params["b"]) - y
  tokens = m.sum(1)
  live = max(int((tokens > 0).sum()), 1)
  if mode == "token-mean":
    c = m / max(m.sum(), 1)
  elif mode == "seq-mean-token-mean":
    c = m / np.maximum(tokens, 1)[:, None] / live
  else:
    c = m / live
  loss = float((c * r * r).sum())
  grads = dict(w=(2 * c * r)[..., None].__mul__(x).sum((0, 1)), b=float((2 * c * r).sum()))
  tm = m / max(m.sum(), 1)
  aux = dict(token_mean=float((tm * r * r).sum()), mean_abs=float((tm * np.abs(r)).sum()))
  return loss, grads, aux


def _fn(mode, n):
  return salt_jax.microbatched_value_and_grad(
      lambda p, b: _loss(p, b, mode), n, has_aux=True,
      weight_fn=lambda mb: salt_jax.aggregate_weight(mb["mask"], mode),
      aux_weight_fn=lambda mb: salt_jax.aggregate_weight(mb["mask"], "token-mean"))


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_matches_the_whole_batch_numpy_reference(mode, n):
  batch = _batch()
  (loss, aux), grads = jax.jit(_fn(mode, n))(PARAMS, batch)
  want_loss, want_grads, want_aux = _numpy_reference(PARAMS, batch, mode)
  np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
  for k in want_grads:
    np.testing.assert_allclose(grads[k], want_grads[k], rtol=1e-5, atol=1e-6, err_msg=k)
  for k in want_aux:  # token means, whatever the loss aggregates
    np.testing.assert_allclose(aux[k], want_aux[k], rtol=1e-5, err_msg=k)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_aggregate_weight_splits_aggregate_exactly(mode):
  """aggregate over a batch == weighted mean of aggregates over any split of its rows."""
  rng = np.random.default_rng(3)
  v = rng.standard_normal((12, 7)).astype(np.float32)
  m = rng.random((12, 7)) < 0.5
  m[4] = False
  whole = float(salt_jax.aggregate(v, m, mode))
  parts = [np.arange(0, 5), np.arange(5, 6), np.arange(6, 12)]
  w = np.array([float(salt_jax.aggregate_weight(m[i], mode)) for i in parts])
  a = np.array([float(salt_jax.aggregate(v[i], m[i], mode)) for i in parts])
  np.testing.assert_allclose((w * a).sum() / w.sum(), whole, rtol=1e-5, atol=1e-7)
  want = m.sum() if mode == "token-mean" else m.any(1).sum()
  assert float(salt_jax.aggregate_weight(m, mode)) == want
  assert float(salt_jax.aggregate_weight(m.astype(np.float32), mode)) == want  # 0/1 masks too


def test_aggregate_weight_bad_inputs():
  with pytest.raises(ValueError, match="loss_agg"):
    salt_jax.aggregate_weight(np.ones((2, 3)), "mean")
  with pytest.raises(ValueError, match="rank 2"):
    salt_jax.aggregate_weight(np.ones(3))


def test_a_batch_with_no_tokens_gives_zero_loss_and_gradient():
  batch = _batch()
  batch["mask"][:] = False
  (loss, aux), grads = _fn("token-mean", 4)(PARAMS, batch)
  assert float(loss) == 0.0 and float(aux["token_mean"]) == 0.0
  assert all(np.all(np.asarray(g) == 0) for g in jax.tree.leaves(grads))


def test_nan_reaches_the_result_only_from_a_micro_batch_with_weight():
  """A weightless micro-batch is dropped whole (even a NaN it makes); a NaN in a live one must
  surface, for the trainer's non-finite guard to skip the update."""
  def unmasked_mean(p, b):  # NaN wherever y is NaN, masked or not
    return jnp.mean(jnp.square(b["x"] @ p["w"] + p["b"] - b["y"]))
  weight = lambda mb: salt_jax.aggregate_weight(mb["mask"])  # noqa: E731
  f = salt_jax.microbatched_value_and_grad(unmasked_mean, 4, weight_fn=weight)
  batch = _batch()
  batch["y"][5, 0] = np.nan  # row 5: micro-batch 1 (rows 1 and 5), which has no tokens
  loss, grads = f(PARAMS, batch)
  assert np.isfinite(loss) and all(np.all(np.isfinite(g)) for g in jax.tree.leaves(grads))
  batch["y"][2, 0] = np.nan  # row 2: micro-batch 2, which has tokens
  loss, _ = f(PARAMS, batch)
  assert np.isnan(loss)


@pytest.mark.parametrize("n, match", [(0, "num_microbatches"), (-2, "num_microbatches"),
                                      (1.5, "num_microbatches"), (True, "num_microbatches")])
def test_bad_microbatch_counts(n, match):
  with pytest.raises(ValueError, match=match):
    salt_jax.microbatched_value_and_grad(lambda p, b: 0.0, n, weight_fn=lambda mb: 1.0)


@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_microbatched_rows_gives_every_row_in_its_place(n):
  def per_row(p, b, scale):  # rows independent: [R, T] and [R]
    r = jnp.einsum("rtd,d->rt", b["x"], p["w"]) * scale
    return dict(r=r, total=jnp.sum(r * b["mask"], axis=1))
  batch = _batch()
  want = per_row(PARAMS, batch, 2.0)
  got = jax.jit(microbatched_rows(per_row, n))(PARAMS, batch, 2.0)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6), got, want)
  with pytest.raises(ValueError, match="num_microbatches"):
    microbatched_rows(per_row, 0)
  if n > 1:
    with pytest.raises(ValueError, match=f"do not split into {n}"):
      microbatched_rows(per_row, n)(PARAMS, _batch(rows=R + 1), 2.0)


def test_bad_batches_are_named():
  f = _fn("token-mean", 3)
  with pytest.raises(ValueError, match="do not split into 3"):
    f(PARAMS, _batch())
  f = _fn("token-mean", 2)
  bad = _batch()
  bad["y"] = bad["y"][:6]
  with pytest.raises(ValueError, match=r"\['y'\] has 6 rows"):
    f(PARAMS, bad)
  bad = _batch()
  bad["scale"] = np.float32(2.0)
  with pytest.raises(ValueError, match=r"\['scale'\] is a scalar"):
    f(PARAMS, bad)
  with pytest.raises(ValueError, match="no arrays"):
    f(PARAMS, {})
  g = salt_jax.microbatched_value_and_grad(lambda p, b: _loss(p, b, "token-mean")[0], 2,
                                           weight_fn=lambda mb: mb["mask"].sum(1))
  with pytest.raises(ValueError, match="one scalar per micro-batch"):
    g(PARAMS, _batch())


def test_extra_arguments_are_passed_whole():
  """Arguments after the batch (the trainer's per-step advantages) are not split."""
  batch = _batch()
  fun = lambda p, b, s: _loss(p, b, "token-mean")[0] * s  # noqa: E731
  f = salt_jax.microbatched_value_and_grad(
      fun, 4, weight_fn=lambda mb: salt_jax.aggregate_weight(mb["mask"]))
  loss, grads = f(PARAMS, batch, jnp.float32(3.0))
  want_loss, want_grads, _ = _numpy_reference(PARAMS, batch, "token-mean")
  np.testing.assert_allclose(loss, 3 * want_loss, rtol=1e-5)
  np.testing.assert_allclose(grads["w"], 3 * want_grads["w"], rtol=1e-5)


def test_on_a_4x2_mesh_rows_split_over_data():
  mesh = make_mesh("4x2")
  batch = _batch(rows=16)
  sharded = {k: jax.device_put(v, NamedSharding(mesh, P(DATA_AXIS))) for k, v in batch.items()}
  f = jax.jit(_fn("seq-mean-token-mean", 4))
  (loss, aux), grads = f(PARAMS, sharded)
  want_loss, want_grads, want_aux = _numpy_reference(PARAMS, batch, "seq-mean-token-mean")
  np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
  np.testing.assert_allclose(grads["w"], want_grads["w"], rtol=1e-5)
  np.testing.assert_allclose(aux["token_mean"], want_aux["token_mean"], rtol=1e-5)


def test_aux_weights_per_value_and_bad_aux_weights():
  """A tree of aux weights: one aux value aggregated as the loss, another as a token mean."""
  batch = _batch()
  mode = "seq-mean-token-sum"

  def fun(p, b):
    loss, aux = _loss(p, b, mode)
    return loss, dict(token_mean=aux["token_mean"], same_as_loss=loss)

  def aux_weights(mb):
    return dict(token_mean=salt_jax.aggregate_weight(mb["mask"]),
                same_as_loss=salt_jax.aggregate_weight(mb["mask"], mode))
  f = salt_jax.microbatched_value_and_grad(
      fun, 4, has_aux=True, weight_fn=lambda mb: salt_jax.aggregate_weight(mb["mask"], mode),
      aux_weight_fn=aux_weights)
  (loss, aux), _ = f(PARAMS, batch)
  want_loss, _, want_aux = _numpy_reference(PARAMS, batch, mode)
  np.testing.assert_allclose(aux["same_as_loss"], want_loss, rtol=1e-5)
  np.testing.assert_allclose(aux["token_mean"], want_aux["token_mean"], rtol=1e-5)
  np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
  g = salt_jax.microbatched_value_and_grad(
      fun, 4, has_aux=True, weight_fn=lambda mb: salt_jax.aggregate_weight(mb["mask"]),
      aux_weight_fn=lambda mb: dict(token_mean=salt_jax.aggregate_weight(mb["mask"])))
  with pytest.raises(ValueError, match="tree shaped like aux"):
    g(PARAMS, batch)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_grad_accumulator_over_micro_batches_of_their_own_lengths(mode):
  """Rows grouped in any order into micro-batches each cut to its own last real token (the
  trainer's `batching.microbatch_plan`) give the whole batch's loss, gradient and aux."""
  batch = _batch()
  batch["mask"][:, 3:] = False  # rows 0-3 end by column 3, rows 4-7 run to the end
  batch["mask"][4:, 4] = True
  batch["mask"][5] = False
  acc = salt_jax.accumulate.grad_accumulator(
      lambda p, b: _loss(p, b, mode), has_aux=True,
      weight_fn=lambda mb: salt_jax.aggregate_weight(mb["mask"], mode),
      aux_weight_fn=lambda mb: salt_jax.aggregate_weight(mb["mask"], "token-mean"))
  groups = [(np.array([6, 4, 7]), T), (np.array([0, 2]), 3), (np.array([3, 1, 5]), 3)]
  micro = [{k: v[idx][:, :length] for k, v in batch.items()} for idx, length in groups]
  add = jax.jit(acc.add)
  sums = jax.jit(acc.init)(PARAMS, micro[0])
  for mb in micro:
    sums = add(sums, PARAMS, mb)
  (loss, aux), grads = jax.jit(acc.result)(sums)
  want_loss, want_grads, want_aux = _numpy_reference(PARAMS, batch, mode)
  np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
  for k in want_grads:
    np.testing.assert_allclose(grads[k], want_grads[k], rtol=1e-5, atol=1e-6, err_msg=k)
  for k in want_aux:
    np.testing.assert_allclose(aux[k], want_aux[k], rtol=1e-5, err_msg=k)
  # No micro-batch at all, or none with weight: loss 0 and zero gradients.
  (loss, _), grads = acc.result(acc.init(PARAMS, micro[0]))
  assert float(loss) == 0.0 and all(np.all(np.asarray(g) == 0) for g in jax.tree.leaves(grads))
