"""A curvature block written as the reference's internals guide shows: it
reads `(batch, ...)` tangents (no sample axis) and updates its moving
averages in place. The estimators feed it one sample at a time, and it gives
the same estimate as the library's own K-FAC block (float64)."""

import jax
import jax.flatten_util
import jax.numpy as jnp
import numpy as np
import pytest

import estimators as kfac
from tests import groundtruth as gt

ravel = lambda t: jax.flatten_util.ravel_pytree(t)[0]


class GuideDenseBlock(kfac.TwoKroneckerFactored):
  """Dense K-FAC in the guide's style: factors from one sample's tangents,
  updated in place, the state returned as it came."""

  def input_size(self):
    return self.parameters_shapes[0][0] + self.has_bias

  def output_size(self):
    return self.parameters_shapes[0][1]

  def update_curvature_matrix_estimate(
    self, state, estimation_data, ema_old, ema_new, batch_size, pmap_axis_name
  ):
    del pmap_axis_name
    (x,) = estimation_data["inputs"]
    (dy,) = estimation_data["outputs_tangent"]
    if not (x.shape[0] == dy.shape[0] == batch_size):
      raise ValueError("expected per-sample data with the batch axis first")
    if self.has_bias:
      x = jnp.concatenate([x, jnp.ones_like(x[:, :1])], axis=1)
    state.inputs_factor.update(x.T @ x / batch_size, ema_old, ema_new)
    state.outputs_factor.update(dy.T @ dy / batch_size, ema_old, ema_new)
    return state


def test_a_block_overriding_the_update_is_fed_one_sample_at_a_time():
  assert not GuideDenseBlock.estimation_data_has_sample_axis
  assert kfac.DenseTwoKroneckerFactored.estimation_data_has_sample_axis
  assert kfac.DenseEKFAC.estimation_data_has_sample_axis


@pytest.mark.parametrize(
  "mode", ["ggn_exact", "fisher_gradients", "ggn_curvature_prop"]
)
def test_guide_block_estimates_what_the_library_block_does(mode):
  problem = gt.mlp(loss="softmax", batch=6, d_in=4, hidden=5, k=3)
  args = (problem.params, problem.batch)
  rng = jax.random.PRNGKey(3)

  def estimate(blocks, ema_old=0.0, previous=None):
    est = kfac.BlockDiagonalCurvature(
      problem.tagged,
      default_estimation_mode=mode,
      layer_tag_to_block_ctor=blocks,
    )
    state = est.init(rng, args) if previous is None else previous
    update = jax.jit(
      lambda s: est.update_curvature_matrix_estimate(
        s, ema_old, 1.0, 6, rng, args
      )
    )
    return est, update(state)

  ours, ours_state = estimate(None)
  guide, guide_state = estimate({"dense_tag": GuideDenseBlock})
  assert all(type(b) is GuideDenseBlock for b in guide.blocks)
  np.testing.assert_allclose(
    guide.to_dense_matrix(guide_state),
    ours.to_dense_matrix(ours_state),
    rtol=1e-10,
    atol=1e-13,
  )
  # A second batch averaged in (ema_old > 0) matches too.
  _, again = estimate({"dense_tag": GuideDenseBlock}, 0.5, guide_state)
  _, ours_again = estimate(None, 0.5, ours_state)
  np.testing.assert_allclose(
    guide.to_dense_matrix(again),
    ours.to_dense_matrix(ours_again),
    rtol=1e-10,
    atol=1e-13,
  )


def test_guide_block_exact_factors_match_brute_force():
  """In ggn_exact mode, `G = (1/B) Σ_i Σ_k (J_iᵀ h_ik)(J_iᵀ h_ik)ᵀ` over the
  columns `h_ik` of a square root of loss Hessian: the output factor of the
  last layer from the logits' Hessians directly."""
  problem = gt.mlp(loss="softmax", batch=5, d_in=3, hidden=4, k=3)
  est = kfac.BlockDiagonalCurvature(
    problem.tagged,
    default_estimation_mode="ggn_exact",
    layer_tag_to_block_ctor={"dense_tag": GuideDenseBlock},
  )
  args = (problem.params, problem.batch)
  state = est.init(jax.random.PRNGKey(0), args)
  state = est.update_curvature_matrix_estimate(
    state, 0.0, 1.0, 5, jax.random.PRNGKey(0), args
  )
  x, _ = problem.batch
  logits = problem.forward(problem.params, x)
  p = jax.nn.softmax(logits)
  # The last layer's outputs are the logits, whose loss Hessian per example
  # (of the batch-mean loss times B) is diag(p) - p pᵀ.
  want = np.mean([np.diag(q) - np.outer(q, q) for q in np.asarray(p)], 0)
  last = state.blocks_states[-1].outputs_factor.value
  np.testing.assert_allclose(last, want, rtol=1e-10, atol=1e-13)


def test_guide_block_trains_in_the_optimizer():
  problem = gt.mlp(loss="softmax", batch=8, d_in=4, hidden=6, k=3)
  opt = kfac.Optimizer(
    jax.value_and_grad(problem.tagged),
    l2_reg=0.0,
    use_adaptive_learning_rate=True,
    use_adaptive_momentum=True,
    use_adaptive_damping=True,
    initial_damping=1.0,
    num_burnin_steps=1,
    estimation_mode="ggn_exact",
    layer_tag_to_block_ctor={"dense_tag": GuideDenseBlock},
  )
  rng = jax.random.PRNGKey(0)
  params = problem.params
  state = opt.init(params, rng, problem.batch)
  losses = []
  for step in range(6):
    params, state, stats = opt.step(
      params, state, rng, batch=problem.batch, global_step_int=step
    )
    losses.append(float(stats["loss"]))
  assert all(type(b) is GuideDenseBlock for b in opt.estimator.blocks)
  assert losses[-1] < losses[0]
