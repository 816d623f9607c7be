"""One EKFAC estimate: ours against curvlinops' `EKFACLinearOperator`.

The problem is the estimator benchmarks' MLP
(`tests/benchmarks/test_bench_estimators.mlp_problem`): 100-50-50-50-10
with tanh, softmax cross-entropy, one batch of 128, float32. On the same
weights and batch, three runs are timed in interleaved rounds in one
process, compile and warm-up excluded:

- `our EKFAC`: one jitted `update_curvature_matrix_estimate` of a fresh
  EKFAC state in `ggn_exact` mode: K-FAC's factors, their eigenbases (the
  first update sets them) and the corrected eigenvalues;
- `curvlinops EKFAC`: `compute_kronecker_factors` then
  `compute_eigenvalue_correction` of a fresh operator with
  `fisher_type="type-2"` (the exact GGN's factors) and each layer's weight
  and bias in one block, as ours (building the operator is not timed);
- `our K-FAC factors`: the same update of a K-FAC state, a reference for
  what the eigendecompositions and the correction add.

Before timing, both EKFAC products with a random vector must agree, to
1e-10 (relative) in float64 and 1e-4 in float32, or the script stops.

Run from the repository root (set-up: README.md here):

  CURVLINOPS_SITE_PACKAGES=/path/to/venv/lib/python3.11/site-packages \\
      .venv/bin/python benchmarks/curvlinops/ekfac.py [ROUNDS]   # 15
"""

import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

# First: puts this checkout and the torch venv on the path.
import side_by_side
from curvlinops import EKFACLinearOperator
from side_by_side import torch

from curvbench.approximations import CURVATURES
from tests.benchmarks.test_bench_estimators import mlp_problem

SIZES = (100, 50, 50, 50, 10)
BATCH = 128
TOLERANCE = {jnp.float64: 1e-10, jnp.float32: 1e-4}
TORCH_DTYPE = {jnp.float64: torch.float64, jnp.float32: torch.float32}


def our_estimate(family: str, dtype):
  """`(estimator, state, update, args)`: a fresh state of the harness's
  `family` estimator on the MLP, and its jitted one-batch update."""
  loss_fn, params, (x, labels) = mlp_problem(SIZES, BATCH)
  args = (
    jax.tree.map(lambda a: a.astype(dtype), params),
    (x.astype(dtype), labels),
  )
  estimator = CURVATURES.defaults(family).make(loss_fn).estimator
  rng = jax.random.PRNGKey(0)
  state = estimator.init(
    rng, args, exact_powers_to_cache=None, approx_powers_to_cache=None
  )
  update = jax.jit(
    lambda s, a: estimator.update_curvature_matrix_estimate(
      s, 0.0, 1.0, BATCH, rng, a, estimation_mode="ggn_exact"
    )
  )
  return estimator, state, update, args


def torch_layout(tree) -> list:
  """Our `{w_i: (in, out), b_i}` as torch's `[weight_0 (out, in), bias_0,
  ...]`, the order of the torch model's parameters."""
  return [
    a
    for i in range(len(SIZES) - 1)
    for a in (np.asarray(tree[f"w{i}"]).T, tree[f"b{i}"])
  ]


def torch_problem(args, dtype):
  """The MLP as a torch module holding `args`' weights, and its one batch."""
  params, (x, labels) = args
  layers = []
  for i in range(len(SIZES) - 1):
    layers.append(torch.nn.Linear(SIZES[i], SIZES[i + 1], dtype=dtype))
    if i < len(SIZES) - 2:
      layers.append(torch.nn.Tanh())
  model = torch.nn.Sequential(*layers)
  with torch.no_grad():
    for p, a in zip(
      model.parameters(),
      side_by_side.torch_tensors(torch_layout(params), dtype),
    ):
      p.copy_(a)
  batch = [
    (
      side_by_side.torch_tensors([x], dtype)[0],
      torch.tensor(np.asarray(labels), dtype=torch.int64),
    )
  ]
  return model, batch


def their_ekfac(model, batch):
  """A fresh curvlinops EKFAC operator: nothing computed yet."""
  return EKFACLinearOperator(
    model,
    torch.nn.CrossEntropyLoss(),
    list(model.parameters()),
    batch,
    check_deterministic=False,
    fisher_type="type-2",
    separate_weight_and_bias=False,
  )


def check_products(dtype, ours=None, torch_side=None):
  """Stops unless both EKFAC estimates multiply a random vector alike.

  `ours` (an `our_estimate`) and `torch_side` (a `torch_problem`) default to
  fresh ones in `dtype`.
  """
  estimator, state, update, args = ours or our_estimate("ekfac", dtype)
  model, batch = torch_side or torch_problem(args, TORCH_DTYPE[dtype])
  rng = np.random.default_rng(0)
  vector = {
    k: rng.normal(size=a.shape).astype(dtype) for k, a in args[0].items()
  }
  mine = estimator.multiply(update(state, args), vector, 0.0, True, False)
  op = their_ekfac(model, batch)
  theirs = op @ side_by_side.torch_tensors(
    torch_layout(vector), TORCH_DTYPE[dtype]
  )
  side_by_side.check(
    f"EKFAC products, {jnp.dtype(dtype).name}",
    side_by_side.relative_error(torch_layout(mine), theirs),
    TOLERANCE[dtype],
  )


def main(rounds: int):
  with jax.enable_x64(True):
    check_products(jnp.float64)
  ekfac, kfac = (
    our_estimate("ekfac", jnp.float32),
    our_estimate("kfac", jnp.float32),
  )
  model, batch = torch_problem(ekfac[3], torch.float32)
  check_products(jnp.float32, ekfac, (model, batch))

  def ours(estimate):
    _, state, update, args = estimate
    return side_by_side.timed(
      lambda: jax.block_until_ready(update(state, args))
    )

  def theirs():
    op = their_ekfac(model, batch)
    start = time.perf_counter()
    op.compute_kronecker_factors()
    op.compute_eigenvalue_correction()
    return time.perf_counter() - start

  seconds = side_by_side.interleaved(
    {
      "our K-FAC factors": lambda: ours(kfac),
      "our EKFAC": lambda: ours(ekfac),
      "curvlinops EKFAC": theirs,
    },
    rounds,
  )
  side_by_side.describe_machine(rounds)
  side_by_side.report(
    seconds,
    [("our EKFAC", "our K-FAC factors"), ("our EKFAC", "curvlinops EKFAC")],
  )


if __name__ == "__main__":
  main(int(sys.argv[1]) if len(sys.argv) > 1 else 15)
