"""The dataset GGN-vector product per gradient: one product by the exact
GGN over the whole training split, against one gradient over the same
examples, as the spectra measurement's matrix-free methods run them.

Both are one jitted program each, the split chunked as `curvbench.core.data`
chunks it (`Data.mean`, chunks of the problem's batch size); the product
is `multiply` (a forward pass with every product, as a Lanczos or CG step
over the split runs it). Compile time is taken apart; then rounds
alternate one gradient and one product so that load on the machine hits
both alike. The figure is the ratio of their medians.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

import problems
from curvbench import config
from curvbench.core import costs, curvatures, data, stats
from curvbench.measurements.timing import clock


def _compiled(fn, *args):
  start = time.perf_counter()
  program = jax.jit(fn).lower(*args).compile()
  return program, time.perf_counter() - start


def _seconds(program, *args) -> float:
  start = time.perf_counter()
  jax.block_until_ready(program(*args))
  return time.perf_counter() - start


def measure(problem_name: str, rounds: int = 10, warmup: int = 1) -> list[dict]:
  """Rows `dataset gradient` and `dataset ggn product` for the problem
  `problem_name` at its defaults (float32, initial parameters, seed 0).

  Args:
    problem_name: a registered problem (`problem=NAME`).
    rounds: timed rounds, each one gradient then one product.
    warmup: untimed rounds first.

  Returns:
    Two rows with the problem, its size and split, `compile_s`,
    `median_s` (and quartiles, `repeats`), the memory columns of
    `costs.memory_columns` and `ratio_to_gradient` (the product's row:
    the ratio of the medians, with the quartiles of the rounds' own ratios).
  """
  problem = problems.make(config.compose(f"problem={problem_name}").problem)
  params = problem.init_params(jax.random.PRNGKey(0), jnp.float32)
  examples = data.select(problem, "train", dtype=np.float32)
  ggn = curvatures.exact("ggn", problem.loss_fn, matrix_free=True)

  def gradient(p, d):
    return d.mean(lambda batch: jax.grad(problem.loss_fn)(p, batch))

  def product(p, v, d):
    return ggn.multiply(ggn.estimate(jax.random.PRNGKey(0), p, d), v)

  grad_program, grad_compile_s = _compiled(gradient, params, examples)
  vector = jax.block_until_ready(grad_program(params, examples))
  prod_program, prod_compile_s = _compiled(product, params, vector, examples)
  times: dict[str, list[float]] = {"gradient": [], "product": []}
  for i in range(warmup + rounds):
    g = _seconds(grad_program, params, examples)
    p = _seconds(prod_program, params, vector, examples)
    if i >= warmup:
      times["gradient"].append(g)
      times["product"].append(p)
  common = dict(
    problem=problem_name,
    num_params=problem.num_params,
    num_examples=examples.num_examples,
    chunk_size=examples.chunk_size,
    num_chunks=examples.num_chunks,
  )
  grad_row = dict(
    common,
    phase="dataset gradient",
    compile_s=grad_compile_s,
    **clock.statistics(times["gradient"]),
    **costs.memory_columns(grad_program),
  )
  ratios = np.divide(times["product"], times["gradient"])
  prod_row = dict(
    common,
    phase="dataset ggn product",
    compile_s=prod_compile_s,
    **clock.statistics(times["product"]),
    **costs.memory_columns(prod_program),
  )
  # The median and quartiles of the same paired ratios, round by round.
  median, q25, q75 = stats.quartiles(ratios)
  prod_row.update(ratio_to_gradient=median, ratio_q25=q25, ratio_q75=q75)
  grad_row.update(ratio_to_gradient=1.0)
  return [grad_row, prod_row]
