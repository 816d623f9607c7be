"""Sharpness along training (Cohen et al. 2021): the recorded value against
the top eigenvalue of the dense Hessian, the steps it is recorded at, and
the setting off by default and checked."""

import dataclasses

import jax
import jax.flatten_util
import jax.numpy as jnp
import numpy as np
import pandas as pd
import pytest

import problems
from curvbench import config
from curvbench.components import SettingsError
from curvbench.core import training
from curvbench.measurements.training import Training
from curvbench.optimizers.sgd import SGD

CFG = Training(
  num_steps=7,
  log_every=2,
  eval_every=4,
  eval_size=20,
  train_eval_size=100,
  sharpness_every=3,
)


def top_eigenvalue(problem, params, batch) -> float:
  """The largest eigenvalue of jax.hessian of the training loss."""
  flat, unravel = jax.flatten_util.ravel_pytree(params)
  loss = lambda w: problem.loss_fn(unravel(w), batch)
  hessian = jax.jit(jax.hessian(loss))(flat)
  return float(np.linalg.eigvalsh(np.asarray(hessian))[-1])


def train(problem, params, cfg, seen=None):
  return pd.DataFrame(
    training.run(
      problem,
      SGD(learning_rate=0.5, momentum=None).make(problem.loss_fn),
      params,
      cfg,
      jax.random.PRNGKey(0),
      data_seed=0,
      progress=False,
      at_steps=range(cfg.num_steps + 1),
      on_step=lambda s, p, m: None if seen is None else seen.update({s: p}),
    )
  )


@pytest.fixture(scope="module")
def tiny():
  problem = problems.make(
    dict(name="mlp", width=3, depth=1, batch_size=8, loss="squared_error")
  )
  return problem, problem.init_params(jax.random.PRNGKey(0), jnp.float64)


def test_sharpness_is_the_top_hessian_eigenvalue_at_0_every_n_and_last(tiny):
  problem, params = tiny
  seen: dict = {}
  rows = train(problem, params, CFG, seen)
  # Steps 3 and 7 are logged for the sharpness whatever log_every.
  assert list(rows.step) == [0, 2, 3, 4, 6, 7]
  measured = rows.dropna(subset=["sharpness"])
  assert list(measured.step) == [0, 3, 6, 7]
  batch = problem.evaluation_batch(100, np.float64, split="train")
  for step, value in zip(measured.step, measured.sharpness):
    expected = top_eigenvalue(problem, seen[step], batch)
    np.testing.assert_allclose(value, expected, rtol=1e-6)
  assert measured.sharpness.nunique() == 4  # the parameters moved


def test_without_sharpness_every_nothing_else_changes(tiny):
  problem, params = tiny
  every = dataclasses.replace(CFG, log_every=1, sharpness_every=1)
  off = dataclasses.replace(every, sharpness_every=None)
  assert Training().sharpness_every is None
  measured, plain = train(problem, params, every), train(problem, params, off)
  assert "sharpness" not in plain and measured.sharpness.notna().all()
  keep = [c for c in plain if c not in ("wall_s", "compile_s")]  # clocks
  pd.testing.assert_frame_equal(measured[keep], plain[keep])


def test_batch_norm_sharpness_is_of_the_training_mode_loss():
  problem = problems.make(
    dict(name="resnet", widths=[2, 3], blocks=1, batch_size=4)
  )
  assert problem.has_state
  params = problem.init_params(jax.random.PRNGKey(0), jnp.float64)
  cfg = dataclasses.replace(CFG, train_eval_size=8)
  batch = problem.evaluation_batch(8, np.float64, split="train")
  np.testing.assert_allclose(
    training.sharpness(problem, cfg, np.float64)(params),
    top_eigenvalue(problem, params, batch),
    rtol=1e-6,
  )


@pytest.mark.parametrize("value", [0, -3])
def test_sharpness_every_below_one_is_refused(value):
  key = "measure.training.sharpness_every"
  message = (
    rf"{key}={value} is not allowed: {key} must be null or a whole "
    r"number >= 1"
  )
  with pytest.raises(SettingsError, match=message):
    Training.from_values(dict(sharpness_every=value), "measure.training")
  with pytest.raises(config.ConfigError, match=message):
    config.compose("measure=training", f"{key}={value}")
