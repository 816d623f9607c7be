"""`devices=N`: batches split across 2 host devices give the records of one
device (float64, to rounding), the split shows in the compiled programs,
and what cannot be split is refused by the setting to change."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from curvbench import approximations, config, optimizers, runs
from curvbench.core import curvatures, data, devices, matrix_free, records
from curvbench.measurements.timing import clock
from tests.conftest import TINY

pytestmark = pytest.mark.skipif(
  len(jax.devices("cpu")) < 2,
  reason="needs 2 host devices (tests/conftest.py asks XLA for them)",
)

TRAINING = [
  "step",
  "batch_loss",
  "train_loss",
  "train_error",
  "test_loss",
  "test_error",
  "diverged",
]


@pytest.fixture(scope="module")
def mesh():
  return devices.mesh("cpu", 2)


def run(tmp_path, count, *overrides):
  """The tables of a run of the tiny problem on `count` devices."""
  out = tmp_path / f"devices{count}"
  cfg = config.compose(*TINY, "device=cpu", f"devices={count}", *overrides)
  assert runs.run(cfg, out) == "complete"
  return records.RunDir(out).tables()


def both(tmp_path, *overrides):
  return [run(tmp_path, count, *overrides) for count in (1, 2)]


def assert_same_values(one, two, columns):
  """Equal rows, numbers to rounding (float64 sums in another order)."""
  assert len(one) == len(two) > 0
  for column in columns:
    a, b = one[column].to_numpy(), two[column].to_numpy()
    if a.dtype.kind == "f":
      # Entries near zero (a null space's eigenvalues) are rounding: the
      # tolerance is relative to the column's largest entry.
      scale = np.nanmax(np.abs(a), initial=0)
      np.testing.assert_allclose(
        b, a, rtol=1e-8, atol=1e-10 * scale, err_msg=column
      )
    else:
      assert list(a) == list(b), column


@pytest.mark.slow
@pytest.mark.parametrize(
  "overrides",
  [
    ("optimizer=kfac", "curvature.mode=ggn_exact"),  # no sampling
    ("optimizer=adam",),
  ],
  ids=["kfac", "adam"],
)
def test_training_on_two_devices_matches_one(tmp_path, overrides):
  one, two = both(
    tmp_path,
    "measure=training",
    "measure.training.precision=float64",
    *overrides,
  )
  assert_same_values(one["training"], two["training"], TRAINING)
  assert set(one["training"].devices_used) == {1}
  assert set(two["training"].devices_used) == {2}


@pytest.mark.slow
def test_kfac_trainer_steps_each_device_on_its_part(tiny, mesh):
  """The optimizer's multi-device step: state per device, params and loss
  back as ordinary arrays on every device, equal to one device's."""
  problem, params, batch = tiny
  cfg = config.compose(
    *TINY, "optimizer.num_burnin_steps=1", "optimizer.inverse_update_period=1"
  )
  curvature = approximations.make(config.plain(cfg.curvature), problem.loss_fn)
  rng = jax.random.PRNGKey(0)
  out = {}
  for name, on in (("one", None), ("two", mesh)):
    trainer = optimizers.make(
      config.plain(cfg.optimizer), problem.loss_fn, curvature, on
    )
    placed = batch if on is None else devices.split(batch, on, "batch")
    p, state = params, trainer.init(params, placed, rng)
    for step in range(2):
      p, state, loss = trainer.step(
        p, state, placed, jax.random.fold_in(rng, step)
      )
    out[name] = (p, float(loss))
    if on is not None:
      assert state[0].step_counter.shape == (2,)  # one state per device
      assert all(
        x.sharding.device_set == set(mesh.devices.flat) and x.shape == y.shape
        for x, y in zip(jax.tree.leaves(p), jax.tree.leaves(params))
      )
      programs = trainer.compiled_programs(p, state, placed, rng)
      assert len(programs) == trainer.cycle
      assert len({id(x) for x in programs}) == len(trainer.kinds)
  np.testing.assert_allclose(out["two"][1], out["one"][1], rtol=1e-10)
  for a, b in zip(
    jax.tree.leaves(out["one"][0]), jax.tree.leaves(out["two"][0])
  ):
    np.testing.assert_allclose(b, a, rtol=1e-8, atol=1e-12)


@pytest.mark.slow
def test_timing_on_two_devices_has_the_rows_of_one(tmp_path):
  # A cycle of one step: fewer kinds of K-FAC step to compile.
  one, two = both(
    tmp_path,
    "measure=timing",
    "optimizer.num_burnin_steps=0",
    "optimizer.inverse_update_period=1",
    "optimizer.damping_adaptation_interval=1",
  )
  assert (
    list(one["timing"].phase)
    == list(two["timing"].phase)
    == [*clock.PHASES, clock.BASELINE_PHASE]
  )
  assert set(one["timing"].devices_used) == {1}
  assert set(two["timing"].devices_used) == {2}
  assert (two["timing"].program_bytes > 0).all()
  assert (two["timing"].median_s > 0).all()


def leaves_close(a, b, rtol):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    x, y = np.asarray(x), np.asarray(y)
    assert x.shape == y.shape
    scale = max(np.abs(x).max(initial=0), 1e-30)
    np.testing.assert_allclose(y, x, rtol=0, atol=rtol * scale)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["kfac", "implicit_exact"])
def test_timed_phases_on_two_devices_compute_what_one_does(tiny, mesh, name):
  """Each single-call phase gives one device's result; the estimator's
  statistics are averaged across devices (an all-reduce in the per-device
  program, whose batch is half the batch)."""
  problem, params, batch = tiny
  cfg = config.compose(*TINY, f"curvature={name}")
  curvature = approximations.make(config.plain(cfg.curvature), problem.loss_fn)
  settings = config.load(cfg).measure.timing
  rng = jax.random.PRNGKey(1)
  phase_calls = functools.partial(
    clock.phase_calls,
    problem.loss_fn,
    curvature,
    params,
    batch,
    settings.damping,
    settings.learning_rate,
    rng,
  )
  one, two = phase_calls(), phase_calls(mesh)
  assert list(one) == list(two) == ["grad_step", *clock.CURVATURE_PHASES]
  # CG (implicit_exact's preconditioning) magnifies the rounding.
  rtol = 1e-6 if name == "implicit_exact" else 1e-9
  for phase, (fn, args) in one.items():
    leaves_close(
      jax.jit(fn)(*args), jax.jit(two[phase][0])(*two[phase][1]), rtol
    )
  fn, args = two["curvature_update"]
  text = jax.jit(fn).lower(*args).compile().as_text()
  if curvature.takes_axis_name:
    assert "all-reduce" in text
  x = batch[0]
  assert f"f64[{len(x) // 2},{','.join(map(str, x.shape[1:]))}]" in text


@pytest.mark.slow
def test_spectra_on_two_devices_match_one(tmp_path):
  """Every sample of the data (two here), split across the devices, gives
  one device's records."""
  one, two = both(
    tmp_path,
    "measure=spectra",
    "measure.spectra.data=batches:2",
    "measure.spectra.samples=2",
  )
  assert set(two["quality"]["sample"]) == {0, 1}
  for name, keys in (
    ("spectra", ["sample", "source", "matrix", "index"]),
    ("quality", ["sample", "reference", "block", "metric", "relative_damping"]),
    ("statistics", ["sample", "source", "matrix", "statistic"]),
    ("heatmaps", ["sample", "source", "kind", "row", "col"]),
  ):
    a, b = (
      t[name].sort_values(keys).reset_index(drop=True) for t in (one, two)
    )
    value = "eigenvalue" if name == "spectra" else "value"
    assert_same_values(a, b, [*keys, value])
  assert set(two["quality"].devices_used) == {2}


def test_dataset_products_are_split_across_devices_and_summed(tiny, mesh):
  """A matrix-free product over two chunks: each device gets half of every
  chunk, the parts are summed by an all-reduce, and the result (and a
  Lanczos run on it) is one device's."""
  problem, params, _ = tiny
  examples = data.select(problem, "batches:2", batch_size=8, dtype=np.float64)
  split = examples.split(mesh, "measure.batch_size")
  implicit = curvatures.exact("ggn", problem.loss_fn, matrix_free=True)
  vector = jax.tree.map(
    lambda p: jnp.cos(jnp.arange(p.size).reshape(p.shape)), params
  )
  product = jax.jit(lambda s, v: implicit.multiply(s, v))
  states = [implicit.estimate(None, params, d) for d in (examples, split)]
  text = product.lower(states[1], vector).compile().as_text()
  assert "all-reduce" in text
  x = examples.chunks[0]  # (chunks, examples, ...)
  assert f"f64[2,4,{','.join(map(str, x.shape[2:]))}]" in text
  assert "f64[2,8," not in text  # no device holds a whole chunk
  leaves_close(*(product(s, vector) for s in states), 1e-12)

  def top(state):
    return matrix_free.top_k_eigenpairs(
      lambda v, op: op(v),
      params,
      3,
      30,
      jax.random.PRNGKey(0),
      implicit.operator(state),
    )[0]

  np.testing.assert_allclose(top(states[1]), top(states[0]), rtol=1e-9)


def test_a_rest_chunk_that_does_not_split_is_copied(mesh):
  even = jnp.arange(24.0).reshape(2, 4, 3)
  for rest, spec in ((jnp.ones((2, 3)), ("data",)), (jnp.ones((3, 3)), ())):
    placed = data.Data(even, rest).split(mesh, "measure.spectra.chunk_size")
    assert tuple(placed.chunks.sharding.spec) == (None, "data")
    assert tuple(placed.rest.sharding.spec) == spec


def test_more_devices_than_found_are_refused_with_the_fix():
  with pytest.raises(
    ValueError,
    match=r"devices=3, but JAX finds 2 local "
    r"CPU devices.*at most 2.*"
    r"xla_force_host_platform_device_count=3",
  ):
    devices.mesh("cpu", 3)
  with pytest.raises(ValueError, match="devices=3"):
    with devices.use("cpu", 3):
      pass
  with pytest.raises(ValueError, match=r"devices=0 must be a positive"):
    config.compose("devices=0")


@pytest.mark.parametrize(
  "overrides,setting",
  [
    (("measure=training", "problem.batch_size=7"), "problem.batch_size=7"),
    (("measure=timing", "measure.batch_size=7"), "measure.batch_size=7"),
    (
      (
        "measure=spectra",
        "measure.spectra.data=train",
        "measure.spectra.chunk_size=7",
      ),
      "measure.spectra.chunk_size=7",
    ),
  ],
  ids=["training", "timing", "spectra"],
)
def test_a_batch_that_does_not_split_names_its_setting(overrides, setting):
  """Refused when the config is composed, before anything is built."""
  with pytest.raises(
    ValueError,
    match=rf"{setting} does not split evenly "
    r"across devices=2: set .* to a multiple of 2",
  ):
    config.compose(*TINY, "devices=2", *overrides)
