"""Training runs, and the preconditioned-SGD transformation against its
definition."""

import dataclasses
import logging

import jax
import jax.flatten_util
import numpy as np
import optax
import pandas as pd
import pytest

from curvbench import approximations, config, optimizers, runs
from curvbench.core import curvatures, training
from curvbench.measurements import training as measurement
from curvbench.measurements.training import Training
from curvbench.optimizers.preconditioned_sgd import precondition_by_curvature
from tests.conftest import TINY_PROBLEM

STEPS = Training(
  num_steps=12, log_every=1, eval_every=5, eval_size=50, train_eval_size=100
)


def optimizer(tiny, *overrides):
  run = config.load(config.compose(*overrides))
  return run.optimizer.make(
    tiny[0].loss_fn, run.curvature.make(tiny[0].loss_fn)
  )


def test_training_same_order_and_loss_decreases(tiny):
  p, params, _ = tiny
  runs = {}
  for name, overrides in {
    "sgd": ["optimizer=sgd", "optimizer.learning_rate=0.05"],
    "adam": ["optimizer=adam", "optimizer.learning_rate=0.01"],
    "kfac": ["optimizer=kfac"],
    "preconditioned_sgd": [
      "optimizer=preconditioned_sgd",
      "curvature=explicit_exact",
    ],
  }.items():
    runs[name] = pd.DataFrame(
      training.run(
        p,
        optimizer(tiny, *overrides),
        params,
        STEPS,
        jax.random.PRNGKey(0),
        data_seed=0,
        progress=False,
      )
    )
  for name, df in runs.items():
    assert list(df.step) == list(range(13))  # 0: the initialisation
    assert df.wall_s.is_monotonic_increasing and df.wall_s.iloc[0] == 0
    evaluated = df.dropna(subset=["test_loss"])
    assert list(evaluated.step) == [0, 5, 10, 12]
    for column in ("train_loss", "train_error", "test_error"):
      assert evaluated[column].notna().all(), (name, column)
    assert evaluated.train_error.between(0, 1).all()  # misclassified share
    assert evaluated.train_loss.iloc[-1] < evaluated.train_loss.iloc[0], name
    assert np.isnan(df.batch_loss.iloc[0]) and not df.diverged.any()
  # Same initial parameters and first batch: the first losses agree.
  first = {n: df.batch_loss.iloc[1] for n, df in runs.items()}
  assert len(set(np.round(list(first.values()), 10))) == 1
  at_init = {n: df.train_loss.iloc[0] for n, df in runs.items()}
  assert len(set(np.round(list(at_init.values()), 10))) == 1


def test_preconditioned_sgd_steps_on_the_damped_inverse_of_the_average(
  tiny, tiny_ggn
):
  """Two steps against `-lr * (m v + (C + damping I)^-1 g)` with C the exact
  GGN: stale between refreshes, an average of the two batches' after one."""
  p, params, batch = tiny
  lr, momentum, damping, ema = 0.05, 0.9, 0.5, 0.95
  cfg = config.compose("curvature=explicit_exact").curvature
  cur = approximations.make(config.plain(cfg), p.loss_fn)
  second = next(b for i, b in enumerate(p.batches(dtype=np.float64)) if i == 1)
  flat = lambda t: np.asarray(jax.flatten_util.ravel_pytree(t)[0])
  eye = np.eye(len(tiny_ggn))
  for inverse_period in (5, 1):
    tx = optax.chain(
      precondition_by_curvature(
        cur,
        batch,
        jax.random.PRNGKey(0),
        damping=damping,
        curvature_ema=ema,
        curvature_update_period=1,
        inverse_update_period=inverse_period,
      ),
      optax.sgd(lr, momentum=momentum),
    )
    state = tx.init(params)
    g0 = jax.grad(p.loss_fn)(params, batch)
    update, state = tx.update(
      g0, state, params, batch=batch, rng=jax.random.PRNGKey(1)
    )
    d0 = np.linalg.solve(tiny_ggn + damping * eye, flat(g0))
    np.testing.assert_allclose(flat(update), -lr * d0, rtol=1e-8)
    params1 = optax.apply_updates(params, update)
    g1 = jax.grad(p.loss_fn)(params1, second)
    update, state = tx.update(
      g1, state, params1, batch=second, rng=jax.random.PRNGKey(2)
    )
    ggn1 = cur.to_dense(
      curvatures.estimate(cur, jax.random.PRNGKey(2), params1, second)
    )
    used = (
      tiny_ggn
      if inverse_period == 5
      else ema * tiny_ggn + (1 - ema) * np.asarray(ggn1)
    )
    d1 = np.linalg.solve(used + damping * eye, flat(g1))
    np.testing.assert_allclose(
      flat(update), -lr * (momentum * d0 + d1), rtol=1e-8
    )


def test_kfac_needs_a_block_diagonal_curvature(tiny):
  with pytest.raises(ValueError, match="use optimizer=preconditioned_sgd"):
    optimizer(tiny, "optimizer=kfac", "curvature=explicit_exact")


def test_unknown_optimizer_names_the_choices(tiny):
  with pytest.raises(ValueError, match="Unknown optimizer.name 'lbfgs'.*adam"):
    optimizers.make(dict(name="lbfgs"), tiny[0].loss_fn)


def test_measurement_steps_lists_and_log_spacing():
  assert training.measurement_steps([200, 0, 20, 20], 200) == [0, 20, 200]
  assert training.measurement_steps("log:4", 1000) == [0, 1, 32, 1000]
  assert training.measurement_steps([], 10) == []
  for spec, message in [
    ([0, 300], "beyond the training run's length"),
    ([-1], "non-negative"),
    ("log:1", "log:N"),
    ("every:5", "log:N"),
    (["a"], "list of integers"),
  ]:
    with pytest.raises(ValueError, match=message):
      training.measurement_steps(spec, 200)


def test_batch_schedule_grows_exponentially_to_the_whole_set_on_rungs():
  """m_k = min(m_1 e^((k-1)/b), N) with m_500 = N (Martens & Grosse 2015,
  sec. 13), rounded down to m_1 2^j or N."""
  first, total, steps = 1000, 20000, 500
  size = training.batch_schedule(first, total, steps, 2.0)
  b = (steps - 1) / np.log(total / first)
  rungs = [1000, 2000, 4000, 8000, 16000, 20000]
  for k in range(1, 700):
    wanted = min(first * np.exp((k - 1) / b), total)
    assert size(k) == max(r for r in rungs if r <= wanted * (1 + 1e-9)), k
  assert size(1) == first and size(steps - 1) < total == size(steps)
  assert {size(k) for k in range(1, 700)} == set(rungs)
  assert training.batch_schedule(first, total, None, 2.0)(10**6) == first
  assert training.batch_schedule(total, total, steps, 2.0)(1) == total


def _rows(problem, trainer, params, cfg):
  """The records of `training.run` with `cfg`, seed 0, as a table."""
  return pd.DataFrame(
    training.run(
      problem,
      trainer,
      params,
      cfg,
      jax.random.PRNGKey(0),
      data_seed=0,
      progress=False,
    )
  )


class Shrinking:
  """A trainer whose step multiplies the parameters by 0.9 and records its
  batch sizes (the warm-up steps first)."""

  cycle = 1

  def __init__(self):
    self.sizes = []

  def init(self, params, batch, rng):
    return ()

  def step(self, params, state, batch, rng):
    self.sizes.append(len(batch[0]))
    return jax.tree.map(lambda p: 0.9 * p, params), state, np.float64(1.0)


def test_training_grows_the_batch_and_compiles_every_size_first(tiny):
  p, params, _ = tiny
  cfg = dataclasses.replace(STEPS, batch_growth_steps=8, eval_every=100)
  trainer = Shrinking()
  rows = _rows(p, trainer, params, cfg)
  size = training.batch_schedule(p.batch_size, len(p.data.x_train), 8, 2.0)
  schedule = [size(k) for k in range(1, cfg.num_steps + 1)]
  assert len(set(schedule)) > 2 and schedule[-1] == len(p.data.x_train)
  warm = 2 * len(set(schedule))  # cycle + 1 steps per size, off the clock
  assert sorted(set(trainer.sizes[:warm])) == sorted(set(schedule))
  assert trainer.sizes[warm:] == schedule
  assert list(rows.batch_size[1:]) == schedule
  assert "batch_size" not in _rows(p, Shrinking(), params, STEPS)


def test_training_averages_the_iterates_and_reports_the_lower_error(tiny):
  p, params, _ = tiny
  decay = 0.7
  cfg = dataclasses.replace(STEPS, average_decay=decay)
  rows = _rows(p, Shrinking(), params, cfg).set_index("step")
  mean = params
  for k in range(1, cfg.num_steps + 1):  # iterate k is 0.9^k params
    mean = jax.tree.map(
      lambda m, q, k=k: decay * m + (1 - decay) * 0.9**k * q, mean, params
    )
  evaluate = training.evaluator(p, cfg, np.float64)
  last = rows.loc[cfg.num_steps]
  expected = evaluate(mean, None)
  iterate = evaluate(
    jax.tree.map(lambda q: 0.9**cfg.num_steps * q, params), None
  )
  for key in ("train_loss", "test_loss", "train_error", "test_error"):
    np.testing.assert_allclose(
      last[f"{key}_average"], expected[key], rtol=1e-10
    )
    np.testing.assert_allclose(last[f"{key}_iterate"], iterate[key], rtol=1e-10)
    assert last[key] == min(expected[key], iterate[key])
  assert last.train_loss_average != last.train_loss_iterate  # both seen


def test_batches_take_their_sizes_from_a_schedule(tiny):
  p = tiny[0]
  n, third = len(p.data.x_train), len(p.data.x_train) // 3
  fixed = list(p.batches(batch_size=third, seed=1, epochs=2))
  scheduled = list(p.batches(seed=1, epochs=2, sizes=iter([third] * 99)))
  assert len(fixed) == len(scheduled) == 6
  for (x, y), (u, v) in zip(fixed, scheduled):
    np.testing.assert_array_equal(x, u)
    np.testing.assert_array_equal(y, v)
  # A batch that no longer fits starts the next epoch: here the third.
  sizes = [2, 3, n - 4, 2]
  got = list(p.batches(seed=1, epochs=1, sizes=iter(sizes)))
  assert [len(x) for x, _ in got] == [2, 3]
  got = list(p.batches(seed=1, epochs=2, sizes=iter(sizes)))
  assert [len(x) for x, _ in got] == sizes  # the last two in epoch 2
  with pytest.raises(ValueError, match="does not fit"):
    next(p.batches(sizes=iter([n + 1])))


def test_every_kind_of_step_is_compiled_before_the_clock_starts(
  tmp_path, monkeypatch
):
  """In a run as the command line makes it (float32, the one-device mesh),
  no program compiles inside the timed loop: K-FAC's refresh and
  damping-adaptation steps, once the state has been through a step,
  included."""
  events: list = []

  class Compiles(logging.Handler):
    def emit(self, record):
      if "Finished XLA compilation" in record.getMessage():
        events.append(record.getMessage())

  monkeypatch.setattr(
    measurement, "save_checkpoint", lambda ctx, step, *_: events.append(step)
  )
  handler = Compiles()
  logging.getLogger("jax").addHandler(handler)
  cfg = config.compose(
    "measure=training",
    "optimizer=kfac",
    "optimizer.inverse_update_period=5",
    "optimizer.damping_adaptation_interval=5",
    "measure.training.num_steps=20",
    "measure.training.eval_every=100",
    "measure.training.checkpoint_steps=[1,20]",
    *TINY_PROBLEM,
  )
  try:
    with jax.log_compiles(True):
      assert runs.run(cfg, tmp_path / "run") == "complete"
  finally:
    logging.getLogger("jax").removeHandler(handler)
  # Steps 2-20 run each kind of step (a cycle of 5) three times or more.
  assert events.count(1) == events.count(20) == 1
  assert events[events.index(1) + 1 : events.index(20)] == []
