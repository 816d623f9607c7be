"""Dataset products against the same work done batch by batch (float32).

On every problem, a gradient, GGN-vector and Hessian-vector product over
the training split (`Data.mean`'s scan over its chunks, one program) is
timed against the sum of the same product on each chunk and on the
remainder, each its own compiled call (no loop) ending in
`block_until_ready`. A
round of the batches runs before every round of the dataset program, so
both see the same load; `time_ratio` is the median of the per-round ratios
(the goal: at most 1.2). The compiled programs' temporary memory is kept
too: the dataset program's should stay that of about one batch.

`make test` runs only the convnet's gradient, once; `make bench` runs all.
"""

import functools
import operator
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import estimators as kfac
import problems
from curvbench import config
from curvbench.core import curvatures, data

PROBLEMS = ("mlp", "autoencoder", "convnet", "transformer", "resnet")
WORKS = ("gradient", "ggn", "hessian")
SMOKE = ("convnet", "gradient")
ROUNDS = 15
WARMUP = 1


def _timed(fn):
  start = time.perf_counter()
  jax.block_until_ready(fn())
  return time.perf_counter() - start


def _batch_product(problem, work):
  """`fn(params, vector, batch)`: the work on one batch, with no loop."""
  if work == "gradient":
    return lambda p, v, b: jax.grad(problem.loss_fn)(p, b)
  implicit = kfac.ImplicitExactCurvature(problem.loss_fn)
  return lambda p, v, b: curvatures.IMPLICIT_PRODUCTS[work](implicit, (p, b), v)


def _dataset_product(problem, work):
  """`fn(params, vector, Data)`: the work's mean over the examples."""
  one = _batch_product(problem, work)
  return lambda p, v, d: d.mean(lambda b: one(p, v, b))


@functools.cache
def _setup(name):
  problem = problems.make(config.compose(f"problem={name}").problem)
  params = problem.init_params(jax.random.PRNGKey(0), jnp.float32)
  examples = data.select(problem, "train", dtype=np.float32)
  batches = [
    jax.tree.map(operator.itemgetter(i), examples.chunks)
    for i in range(examples.num_chunks)
  ]
  if examples.rest is not None:
    batches.append(examples.rest)
  return problem, params, examples, batches


@functools.cache
def _programs(name, work):
  """The compiled dataset program, the batch program per batch size, and
  the vector (the split's gradient)."""
  problem, params, examples, batches = _setup(name)
  vector = jax.jit(_dataset_product(problem, "gradient"))(
    params, None, examples
  )
  whole = (
    jax.jit(_dataset_product(problem, work))
    .lower(params, vector, examples)
    .compile()
  )
  one = jax.jit(_batch_product(problem, work))
  by_size = {}
  for batch in batches:
    size = jax.tree.leaves(batch)[0].shape[0]
    if size not in by_size:
      by_size[size] = one.lower(params, vector, batch).compile()
  return whole, by_size, vector


@pytest.mark.benchmark(group="dataset-vs-batches")
@pytest.mark.parametrize("work", WORKS)
@pytest.mark.parametrize("name", PROBLEMS)
def test_dataset_product_against_its_batches(benchmark, name, work):
  if benchmark.disabled and (name, work) != SMOKE:
    pytest.skip("timed by `make bench` only")
  _, params, examples, batches = _setup(name)
  whole, by_size, vector = _programs(name, work)
  runs = [
    functools.partial(
      by_size[jax.tree.leaves(b)[0].shape[0]], params, vector, b
    )
    for b in batches
  ]
  batch_times = []

  def run_batches():
    batch_times.append(sum(_timed(run) for run in runs))

  result = benchmark.pedantic(
    lambda: jax.block_until_ready(whole(params, vector, examples)),
    setup=run_batches,
    rounds=ROUNDS,
    warmup_rounds=WARMUP,
  )
  assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(result))
  if not benchmark.disabled:
    own = np.asarray(benchmark.stats.stats.data)
    ratios = own / np.asarray(batch_times[WARMUP:])
    temp = lambda c: c.memory_analysis().temp_size_in_bytes / 2**20
    benchmark.extra_info.update(
      batches_ms=1e3 * float(np.median(batch_times[WARMUP:])),
      time_ratio=float(np.median(ratios)),
      time_ratio_iqr=[float(q) for q in np.quantile(ratios, [0.25, 0.75])],
      num_chunks=examples.num_chunks,
      chunk_size=examples.chunk_size,
      rest_size=examples.rest_size,
      dataset_temp_mib=temp(whole),
      batch_temp_mib=max(temp(c) for c in by_size.values()),
    )
