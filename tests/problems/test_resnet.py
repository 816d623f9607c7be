"""The ResNet problem: automatic registration gives every parameter the
block meant for it; the exact GGN and Hessian products of the batch-norm
network (training mode: the batch's statistics) equal brute force; batch
norm's running averages after training steps equal a hand-written
reference; evaluation normalises by them; checkpoints and timing carry the
model state; a curvature that needs examples to stand alone, and batches
split over devices, are refused; the dense empirical Fisher comes through
the whole batch."""

import jax
import jax.flatten_util
import jax.numpy as jnp
import numpy as np
import pytest

import estimators as kfac
import problems
from curvbench import config
from curvbench.core import checkpoints, training
from curvbench.core.costs import Costs
from curvbench.core.data import Data
from curvbench.measurements.spectra import compute as spectra
from curvbench.measurements.timing import clock
from curvbench.optimizers.sgd import SGD
from tests import groundtruth as gt

# 8x8 digits -> 8x8, 4x4: conv_in, a block per stage, a projection shortcut.
TINY = dict(name="resnet", widths=[2, 3], blocks=1, batch_size=4)


def _tiny(**settings):
  problem = problems.make(dict(TINY, **settings))
  params = problem.init_params(jax.random.PRNGKey(0), jnp.float64)
  return problem, params, problem.fixed_batch(dtype=np.float64)


@pytest.fixture(scope="module")
def batch_norm():
  return _tiny()


@pytest.mark.parametrize("norm", ["batch", "group", "none"])
def test_every_parameter_gets_the_block_meant_for_it(norm):
  problem, params, batch = _tiny(norm=norm, groups=1)
  assert problem.has_state == (norm == "batch")
  report = kfac.registration_report(problem.loss_fn, (params, batch))
  assert len(report) == len(jax.tree.leaves(params))
  for row in report:
    path = row["path"]
    if "norm" in path:
      assert row["tag"] == "scale_and_shift_tag", path
    elif "logits" in path:
      assert row["tag"] == "dense_tag", path
    else:
      assert row["tag"] == "conv2d_tag", path
  curvature = config.load(
    config.compose("problem=resnet", "curvature=kfac")
  ).curvature.make(problem.loss_fn)
  curvature.init(jax.random.PRNGKey(0), params, batch)
  classes = {b["block_class"] for b in curvature.registration()}
  expected = {"Conv2DTwoKroneckerFactored", "DenseTwoKroneckerFactored"}
  if norm != "none":
    expected.add("ScaleAndShiftDiagonal")
  assert classes == expected
  assert sum(b["dim"] for b in curvature.registration()) == problem.num_params


def test_exact_ggn_and_hessian_products_equal_brute_force(batch_norm):
  problem, params, batch = batch_norm
  flat, unravel = jax.flatten_util.ravel_pytree(params)
  x, y = batch
  loss = lambda f: problem.loss_fn(unravel(f), batch)
  logits = lambda f: problem.outputs(unravel(f), x)  # training mode
  hessian = jax.jit(jax.hessian(loss))(flat)
  # The batch's outputs depend on every example (batch statistics): the GGN
  # is that of the whole batch's Jacobian, (B, C, P).
  jac = jax.jit(jax.jacobian(logits))(flat)
  ggn = gt.softmax_ggn(jac, logits(flat))
  # The batch really is coupled: one example's logits move with another's
  # input, which per-example gradients taken one at a time would miss.
  other = jax.jit(
    jax.jacobian(
      lambda x0: problem.outputs(params, jnp.asarray(x).at[0].set(x0))[1]
    )
  )
  assert np.abs(other(x[0])).max() > 1e-3
  gt.assert_exact_products_equal(
    problem.loss_fn, params, batch, {"ggn": ggn, "hessian": hessian}
  )


def _reference_forward(params, x, state, momentum=0.1, eps=1e-5):
  """The tiny ResNet's training-mode forward pass written out, returning
  the running averages PyTorch's batch norm would keep after it."""
  new = {}

  def conv(h, name, stride):
    return jax.lax.conv_general_dilated(
      h,
      params[name]["w"],
      (stride, stride),
      "SAME",
      dimension_numbers=("NHWC", "HWIO", "NHWC"),
    )

  def bn(h, name):
    mean = h.mean(axis=(0, 1, 2))
    var = ((h - mean) ** 2).mean(axis=(0, 1, 2))
    n = h.shape[0] * h.shape[1] * h.shape[2]
    new[name] = dict(
      mean=(1 - momentum) * state[name]["mean"] + momentum * mean,
      var=(1 - momentum) * state[name]["var"] + momentum * var * n / (n - 1),
    )
    z = (h - mean) / jnp.sqrt(var + eps)
    return z * params[name]["scale"] + params[name]["shift"]

  relu = jax.nn.relu
  h = relu(bn(conv(x, "conv_in", 1), "norm_in"))
  for s, stride in ((0, 1), (1, 2)):
    b = f"stage{s}_block0"
    u = relu(bn(conv(h, f"{b}_conv1", stride), f"{b}_norm1"))
    u = bn(conv(u, f"{b}_conv2", 1), f"{b}_norm2")
    if f"{b}_shortcut" in params:
      h = bn(conv(h, f"{b}_shortcut", stride), f"{b}_shortcut_norm")
    h = relu(h + u)
  return new


def test_running_averages_after_training_equal_a_hand_reference(batch_norm):
  problem, params, _ = batch_norm
  seen = {}
  cfg = config.load(
    config.compose(
      "problem=resnet",
      "measure=training",
      "measure.training.num_steps=3",
      "measure.training.eval_every=3",
      "measure.training.train_eval_size=8",
      "measure.training.eval_size=8",
    )
  ).measure.training
  training.run(
    problem,
    SGD(learning_rate=0.1).make(problem.loss_fn),
    params,
    cfg,
    jax.random.PRNGKey(0),
    data_seed=5,
    progress=False,
    at_steps=[0, 1, 2, 3],
    on_step=lambda s, p, m: seen.update({s: (p, m)}),
  )
  state = problem.init_model_state(jnp.float64)
  assert all(
    np.all(v["mean"] == 0) and np.all(v["var"] == 1) for v in state.values()
  )
  batches = problem.batches(seed=5, dtype=np.float64)
  for step in (1, 2, 3):
    before, _ = seen[step - 1]
    state = _reference_forward(before, next(batches)[0], state)
    got = seen[step][1]
    assert got.keys() == state.keys()
    for name in state:
      for k in ("mean", "var"):
        np.testing.assert_allclose(got[name][k], state[name][k], rtol=1e-12)
    # The parameters did move, so each step's statistics are new ones.
    assert not np.allclose(
      seen[step][0]["conv_in"]["w"], before["conv_in"]["w"]
    )


def test_evaluation_normalises_by_the_running_averages(batch_norm):
  problem, params, (x, y) = batch_norm
  train = problem.outputs(params, x)
  state = problem.init_model_state(jnp.float64)
  # The batch's own statistics, read back from one step of the running
  # averages (momentum 0.1 from mean 0, variance 1) with the variance's
  # unbiasing undone (training mode divides by the count): evaluation with
  # them gives training mode's outputs ...
  moved = problem.next_model_state(params, state, x)
  biased = {}
  for name, v in moved.items():
    side = x.shape[1] // (2 if name.startswith("stage1") else 1)
    count = x.shape[0] * side * side  # examples x positions averaged
    biased[name] = dict(
      mean=v["mean"] / 0.1, var=(v["var"] - 0.9) / 0.1 * (count - 1) / count
    )
  np.testing.assert_allclose(
    problem.outputs(params, x, biased), train, rtol=1e-9, atol=1e-12
  )
  # ... and the initial averages (mean 0, variance 1) other outputs.
  assert not np.allclose(problem.outputs(params, x, state), train, atol=1e-3)
  assert 0 <= float(problem.error(params, (x, y), state)) <= 1


def test_checkpoints_keep_the_model_state(batch_norm, tmp_path):
  problem, params, (x, _) = batch_norm
  state = problem.next_model_state(
    params, problem.init_model_state(jnp.float64), x
  )
  path = checkpoints.save(
    tmp_path / "c.safetensors",
    params,
    step=3,
    problem="resnet",
    model_state=state,
  )
  loaded, info = checkpoints.load(path)
  assert jax.tree.structure(loaded) == jax.tree.structure(params)
  assert jax.tree.structure(info["model_state"]) == jax.tree.structure(state)
  for a, b in zip(jax.tree.leaves(info["model_state"]), jax.tree.leaves(state)):
    np.testing.assert_array_equal(a, b)


def test_timing_times_the_model_state_update(batch_norm):
  problem, params, batch = batch_norm
  cfg = config.load(
    config.compose(
      "problem=resnet",
      "measure=timing",
      "optimizer=sgd",
      "measure.timing.phases=[grad_step]",
      "measure.timing.repeats=2",
      "measure.timing.warmup=0",
    )
  )
  tables = clock.measure(
    problem.loss_fn,
    None,
    params,
    batch,
    cfg.measure.timing,
    cfg.optimizer,
    jax.random.PRNGKey(0),
    model_state_update=(
      problem.next_model_state,
      problem.init_model_state(jnp.float64),
    ),
  )
  rows = tables["timing"]
  phases = [r["phase"] for r in rows]
  assert "model_state_update" in phases and phases[-1] == clock.BASELINE_PHASE
  row = rows[phases.index("model_state_update")]
  assert row["median_s"] > 0 and row["repeats"] == 2
  samples = [
    r for r in tables["timing_samples"] if r["phase"] == "model_state_update"
  ]
  assert [r["repeat"] for r in samples] == [0, 1]


def test_what_would_take_examples_apart_is_refused():
  with pytest.raises(ValueError, match="curvature=implicit_exact"):
    config.load(
      config.compose(
        "problem=resnet",
        "curvature=explicit_exact",
        "optimizer=preconditioned_sgd",
      )
    )
  with pytest.raises(ValueError, match="devices=2 splits each batch"):
    config.load(config.compose("problem=resnet", "devices=2"))
  config.load(
    config.compose("problem=resnet", "problem.norm=layer", "devices=2")
  )
  config.load(
    config.compose(
      "problem=resnet",
      "problem.norm=group",
      "curvature=explicit_exact",
      "optimizer=preconditioned_sgd",
    )
  )


def test_the_dense_empirical_fisher_comes_through_the_whole_batch():
  problem, params, batch = _tiny(widths=[2])
  flat, unravel = jax.flatten_util.ravel_pytree(params)
  x, y = batch

  def example_losses(f):  # each example's loss, its batch normalised together
    log_p = jax.nn.log_softmax(problem.outputs(unravel(f), x))
    return -jnp.take_along_axis(log_p, y[:, None], axis=1)[:, 0]

  rows = jax.jit(jax.jacobian(example_losses))(flat)  # (B, P)
  truth = rows.T @ rows / len(x)
  dense = spectra.dense_exact(
    problem.loss_fn,
    "empirical_fisher",
    params,
    Data.of(batch),
    jax.random.PRNGKey(0),
    Costs(),
    examples_interact=True,
  )
  np.testing.assert_allclose(
    dense, truth, rtol=1e-8, atol=1e-10 * np.abs(truth).max()
  )
