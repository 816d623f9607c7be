"""The estimators' `pmap_axis_name` under `jax.shard_map` as under `jax.pmap`:
an estimate over a batch split across 2 host devices equals the one-device
estimate of the whole batch (float64)."""

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec

import estimators as kfac
from tests import groundtruth as gt

ESTIMATORS = {
  "kfac": (kfac.BlockDiagonalCurvature, None),
  "ekfac": (kfac.BlockDiagonalCurvature, {"dense_tag": kfac.DenseEKFAC}),
  "tnt": (kfac.BlockDiagonalCurvature, {"dense_tag": kfac.DenseTNT}),
  "kfac_tridiagonal": (kfac.BlockTridiagonalCurvature, None),
}


@pytest.mark.parametrize("name", list(ESTIMATORS))
def test_split_batch_under_pmap_and_shard_map_equals_one_device(name):
  if jax.device_count() < 2:
    pytest.skip("needs 2 devices (tests/conftest.py asks XLA for 2 on CPU)")
  ctor, blocks = ESTIMATORS[name]
  problem = gt.mlp(loss="softmax", batch=8, d_in=6, hidden=12)
  estimator = ctor(
    problem.tagged,
    default_estimation_mode="ggn_exact",
    layer_tag_to_block_ctor=blocks,
  )
  rng = jax.random.PRNGKey(0)
  state = estimator.init(
    rng, (problem.params, problem.batch), approx_powers_to_cache=-1
  )

  def update(batch, size, axis=None):
    return estimator.update_curvature_matrix_estimate(
      state, 0.0, 1.0, size, rng, (problem.params, batch), pmap_axis_name=axis
    )

  split = jax.tree.map(lambda x: x.reshape((2, 4) + x.shape[1:]), problem.batch)
  one = update(problem.batch, 8)
  mapped = jax.pmap(lambda b: update(b, 4, "i"), axis_name="i")(split)
  mesh = Mesh(np.array(jax.devices()[:2]), ("i",))
  add_axis = lambda tree: jax.tree.map(lambda x: x[None], tree)
  sharded = jax.jit(
    jax.shard_map(
      lambda b: add_axis(update(jax.tree.map(lambda x: x[0], b), 4, "i")),
      mesh=mesh,
      in_specs=PartitionSpec("i"),
      out_specs=PartitionSpec("i"),
      check_vma=False,
    )
  )(split)
  # Dense matrices, not state leaves: an eigenbasis (EKFAC's) may differ in
  # the signs of its vectors from one rounding to another.
  dense = jax.jit(estimator.to_dense_matrix)
  want = np.asarray(dense(one))
  for states in (mapped, sharded):
    for device in range(2):
      got = dense(jax.tree.map(lambda x, d=device: x[d], states))
      np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-12)
