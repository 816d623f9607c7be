"""pytest-benchmark timings of the estimators (float32, jit-compiled).

`make bench` runs them; `make test` runs each once as a smoke test. Compile
time is excluded: every benchmarked function is compiled and run once before
timing, and each round ends with `block_until_ready`.
"""

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import estimators as kfac
from curvbench.approximations import CURVATURES, MATRIX_POWER_METHODS

F32 = jnp.float32
# The harness's block-structured approximations, from its registry.
BLOCK_FAMILIES = [n for n in CURVATURES if CURVATURES.get(n).is_block_diagonal]


def _dense_stack(params, x, sizes):
  for i in range(len(sizes) - 1):
    w, b = params[f"w{i}"], params[f"b{i}"]
    y = kfac.register_dense(x @ w + b, x, w, b)
    x = jnp.tanh(y) if i < len(sizes) - 2 else y
  return x


def mlp_problem(sizes=(100, 50, 50, 50, 10), batch=128, seed=0):
  rng = jax.random.PRNGKey(seed)
  params = {}
  for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
    params[f"w{i}"] = jax.random.normal(
      jax.random.fold_in(rng, i), (a, b), F32
    ) / jnp.sqrt(a)
    params[f"b{i}"] = jnp.zeros((b,), F32)
  x = jax.random.normal(jax.random.fold_in(rng, 100), (batch, sizes[0]), F32)
  labels = jax.random.randint(
    jax.random.fold_in(rng, 101), (batch,), 0, sizes[-1]
  )

  def loss_fn(p, data):
    x, labels = data
    logits = kfac.register_softmax_cross_entropy_loss(
      _dense_stack(p, x, sizes), labels
    )
    return -jnp.mean(
      jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], 1)
    )

  return loss_fn, params, (x, labels)


def convnet_problem(batch=32, seed=0):
  """Three stride-2 3x3 convolutions (8, 16, 16 channels) and a dense layer."""
  rng = jax.random.PRNGKey(seed)
  channels = (1, 8, 16, 16)
  shapes = {}
  for i, (c_in, c_out) in enumerate(zip(channels[:-1], channels[1:])):
    shapes |= {f"k{i}": (3, 3, c_in, c_out), f"kb{i}": (c_out,)}
  shapes |= {"w": (4 * 4 * 16, 10), "b": (10,)}
  params = {
    n: 0.1 * jax.random.normal(jax.random.fold_in(rng, i), s, F32)
    for i, (n, s) in enumerate(shapes.items())
  }
  x = jax.random.normal(jax.random.fold_in(rng, 100), (batch, 28, 28, 1), F32)
  labels = jax.random.randint(jax.random.fold_in(rng, 101), (batch,), 0, 10)

  def loss_fn(p, data):
    h, labels = data
    for i in range(3):
      y = lax.conv_general_dilated(
        h,
        p[f"k{i}"],
        (2, 2),
        "SAME",
        dimension_numbers=("NHWC", "HWIO", "NHWC"),
      )
      y = kfac.register_conv2d(
        y + p[f"kb{i}"],
        h,
        p[f"k{i}"],
        p[f"kb{i}"],
        window_strides=2,
        padding="SAME",
      )
      h = jax.nn.relu(y)
    h = h.reshape(h.shape[0], -1)
    logits = kfac.register_dense(h @ p["w"] + p["b"], h, p["w"], p["b"])
    kfac.register_softmax_cross_entropy_loss(logits, labels)
    return -jnp.mean(
      jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], 1)
    )

  return loss_fn, params, (x, labels)


PROBLEMS = {"mlp": mlp_problem, "convnet": convnet_problem}


def _run(benchmark, fn, *args):
  jax.block_until_ready(fn(*args))  # compile outside the timed rounds
  benchmark.pedantic(
    lambda: jax.block_until_ready(fn(*args)), rounds=10, warmup_rounds=1
  )


@functools.cache
def _setup(problem, family, matrix_power_method="decomposition"):
  loss_fn, params, batch = PROBLEMS[problem]()
  settings = dataclasses.replace(
    CURVATURES.defaults(family), matrix_power_method=matrix_power_method
  )
  est = settings.make(loss_fn).estimator
  coupled = isinstance(est, kfac.BlockTridiagonalCurvature)
  args = (params, batch)
  rng = jax.random.PRNGKey(0)
  state = est.init(
    rng,
    args,
    exact_powers_to_cache=None if coupled else -1,
    approx_powers_to_cache=-1,
  )
  batch_size = batch[0].shape[0]
  # The data are arguments, not closed-over constants, so XLA does not try
  # to constant-fold the statistics at compile time.
  update_jit = jax.jit(
    lambda s, a: est.update_curvature_matrix_estimate(
      s, 0.95, 0.05, batch_size, rng, a, estimation_mode="fisher_gradients"
    )
  )
  update = lambda s: update_jit(s, args)
  state = update(state)
  return est, state, params, update


@pytest.mark.benchmark(group="estimator-update")
@pytest.mark.parametrize("family", BLOCK_FAMILIES)
@pytest.mark.parametrize("problem", list(PROBLEMS))
def test_update_curvature_estimate(benchmark, problem, family):
  _, state, _, update = _setup(problem, family)
  _run(benchmark, update, state)


@pytest.mark.benchmark(group="cache-update")
@pytest.mark.parametrize("family", BLOCK_FAMILIES)
@pytest.mark.parametrize("problem", list(PROBLEMS))
def test_update_cache(benchmark, problem, family):
  est, state, _, _ = _setup(problem, family)
  cache = jax.jit(lambda s: est.update_cache(s, 1e-3, None, -1, False))
  _run(benchmark, cache, state)


@pytest.mark.benchmark(group="cache-update-method")
@pytest.mark.parametrize("method", MATRIX_POWER_METHODS)
@pytest.mark.parametrize("problem", list(PROBLEMS))
def test_kfac_refresh_by_matrix_power_method(benchmark, problem, method):
  """K-FAC's damped inverses by Cholesky against the Newton iteration."""
  est, state, _, _ = _setup(problem, "kfac", method)
  cache = jax.jit(lambda s: est.update_cache(s, 1e-3, None, -1, False))
  _run(benchmark, cache, state)


@pytest.mark.benchmark(group="multiply-inverse")
@pytest.mark.parametrize("family", BLOCK_FAMILIES)
@pytest.mark.parametrize("problem", list(PROBLEMS))
def test_multiply_inverse(benchmark, problem, family):
  est, state, params, _ = _setup(problem, family)
  state = jax.jit(lambda s: est.update_cache(s, 1e-3, None, -1, False))(state)
  apply = jax.jit(lambda s, v: est.multiply_inverse(s, v, 1e-3, False, True))
  _run(benchmark, apply, state, params)


@functools.cache
def _explicit_ggn():
  """The issue's reference problem: MLP 100-50-50-50-10, batch 128."""
  loss_fn, params, batch = mlp_problem()
  est = kfac.ExplicitExactCurvature(loss_fn)
  args = (params, batch)
  fresh_state = lambda: est.init(jax.random.PRNGKey(0), args)
  # The state is donated, as in a training loop (state = update(state)), so
  # the 10,660² output reuses the input's memory instead of fresh pages.
  update_jit = jax.jit(
    lambda s, a: est.update_curvature_matrix_estimate(
      s, 0.0, 1.0, 128, jax.random.PRNGKey(0), a, estimation_mode="ggn_exact"
    ),
    donate_argnums=0,
  )
  return est, fresh_state, lambda s: update_jit(s, args)


@pytest.mark.benchmark(group="explicit-exact-ggn")
def test_explicit_exact_ggn_build(benchmark):
  est, fresh_state, update = _explicit_ggn()
  carry = [jax.block_until_ready(update(fresh_state()))]
  assert est.dim == 10_660

  def step():
    carry[0] = jax.block_until_ready(update(carry[0]))

  benchmark.pedantic(step, rounds=5, warmup_rounds=0)


@pytest.mark.benchmark(group="explicit-exact-ggn")
def test_explicit_exact_ggn_eigenvalues(benchmark):
  est, fresh_state, update = _explicit_ggn()
  state = update(fresh_state())
  eig = est.eigenvalues  # not under jit: it picks the Gram route itself
  values = jax.block_until_ready(eig(state))
  assert values.shape == (10_660,)
  benchmark.pedantic(
    lambda: jax.block_until_ready(eig(state)), rounds=3, warmup_rounds=0
  )


@functools.cache
def _fresh_estimate(family):
  """One estimate from a fresh state (`ggn_exact`, the issue's MLP, batch
  128): for EKFAC the factors, their eigenbasis and the scalings."""
  loss_fn, params, batch = mlp_problem()
  est = CURVATURES.defaults(family).make(loss_fn).estimator
  args, rng = (params, batch), jax.random.PRNGKey(0)
  state = est.init(
    rng, args, exact_powers_to_cache=None, approx_powers_to_cache=None
  )
  update = jax.jit(
    lambda s, a: est.update_curvature_matrix_estimate(
      s, 0.0, 1.0, batch[0].shape[0], rng, a, estimation_mode="ggn_exact"
    )
  )
  run = lambda: jax.block_until_ready(update(state, args))
  run()
  return run


@pytest.mark.benchmark(group="ekfac-estimate")
def test_ekfac_estimate_against_kfac_factors(benchmark):
  """A K-FAC factor estimate on the same batch runs before every round;
  `time_ratio` is the median per-round ratio (the goal: at most 3)."""
  ekfac, kfac_factors = _fresh_estimate("ekfac"), _fresh_estimate("kfac")
  factor_times = []

  def time_factors():
    start = time.perf_counter()
    kfac_factors()
    factor_times.append(time.perf_counter() - start)

  benchmark.pedantic(ekfac, setup=time_factors, rounds=21, warmup_rounds=1)
  if not benchmark.disabled:
    ratios = np.asarray(benchmark.stats.stats.data) / np.asarray(
      factor_times[1:]
    )
    benchmark.extra_info.update(
      kfac_factors_ms=1e3 * float(np.median(factor_times[1:])),
      time_ratio=float(np.median(ratios)),
      time_ratio_iqr=[float(q) for q in np.quantile(ratios, [0.25, 0.75])],
    )
