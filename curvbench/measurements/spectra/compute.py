"""Eigenvalue spectra of exact curvatures and their approximations.

`measure` compares one configured `Curvature` with the exact matrices
(GGN, Fisher, empirical Fisher, Hessian: the references asked for, and the
one it estimates, its `matrix`) at one point, over a `Data` (a batch, N
batches or the training split), and returns five tables:

- `spectra`: signed eigenvalues with weights (1/P for full spectra, Gauss
  weights for stochastic Lanczos quadrature), per matrix.
- `quality`: approximation-quality metrics against each reference
  (`reference`) for the whole network (`level='network'`, `block='all'`),
  for each layer block (`level='layer'`, `block` its name: the exact
  diagonal block against the approximation's) and for each block type
  (`level='role'`, `block` the role, e.g. 'attention': the sub-matrices
  over every parameter of the role's layers, cross-layer entries
  included; see `role_indices`). The natural-gradient cosine depends on
  the damping, so it is taken at each `relative_dampings` value rho
  (column `relative_damping`): each matrix damped by rho times its own
  largest eigenvalue (`scale`), so that matrices of different scale
  (K-FAC-reduce's trace is half the GGN's on some layers) are compared at
  the same effective damping. A reference that equals an earlier one (the
  Fisher and the GGN of the registered losses) gets no quality rows of
  its own: the `references` table says why. A metric the matrix-free
  method estimates from random probes (relative Frobenius and diagonal
  errors, the SLQ spectral distances) carries its standard error
  (`stderr`) and the probes that would bring that error to
  `target_precision` of its value (`probes_needed`); other metrics have
  NaN there (the dense method's are exact, Lanczos' and CG's no probe
  estimates).
- `statistics`: trace, condition number, outliers, negative mass, ... of
  each exact matrix and of the approximation (`stderr` 0 where exact);
  for each exact matrix M, how the mean gradient g lines up with it
  (`GRADIENT_SHARE`, `GRADIENT_ALIGNMENT`).
- `heatmaps`: the exact and approximate matrix and damped inverse over a
  few subsampled units of a few layers (as in Martens & Grosse 2015, Fig. 2).
- `references`: the relative Frobenius distance between each pair of
  exact matrices measured (`matrix` against `reference`; its standard
  error `relative_frobenius_stderr` where it is a probe estimate).

Two methods:

- `dense` (small models; `dense.py`): every matrix is formed; everything
  is exact.
- `lanczos` (large models; `lanczos.py`): only matrix-vector products.
  Top-k by Lanczos, densities by SLQ, Frobenius errors, traces
  (Hutchinson, XTrace) and diagonals by random probes
  (`curvbench.core.matrix_free`), exact directions by CG.

Both take the same two things: a `plan.Subject` (what is measured) and a
`plan.Plan` (the settings, read once by `plan.make`); the rows they write
are built in `rows.py`.

With `class_means` (a softmax cross-entropy classifier; `class_means.py`),
both add Papyan's class-mean test of the GGN's outliers: `spectra` rows of
source `class_means` (matrix `ggn`), the eigenvalues of the class-mean
matrix `G₁`, to set beside the exact GGN's top ones, and the `statistics`
row `class_mean_overlap` of the exact `ggn`.
"""

from __future__ import annotations

from curvbench.core.costs import Costs
from curvbench.core.data import Data
from curvbench.core.references import ReferenceStore
from curvbench.measurements.spectra import dense, lanczos, plan
from curvbench.measurements.spectra.dense import (
  MANY_CORES,
  dense_exact,
  dense_metrics,
  heatmap_units,
  joined_eigh,
)
from curvbench.measurements.spectra.plan import SAME
from curvbench.measurements.spectra.rows import (
  GRADIENT_ALIGNMENT,
  GRADIENT_SHARE,
  TABLES,
  floor,
  mean_gradient,
  role_indices,
  scale,
  spectrum_statistics,
)

METHODS = {"dense": dense.measure, "lanczos": lanczos.measure}
# The methods by their former names.
measure_dense = dense.measure
measure_lanczos = lanczos.measure


def measure(
  loss_fn,
  curvature,
  params,
  data,
  cfg,
  rng,
  costs: Costs | None = None,
  store: ReferenceStore | None = None,
  key: dict | None = None,
  layer_roles=(),
  examples_interact: bool = False,
  outputs=None,
) -> dict[str, list[dict]]:
  """The tables of `TABLES` by `cfg.method` (one of `METHODS`; `cfg` the
  spectra settings), over `data` (a batch or a `Data`); the dense method
  shares its exact references through `store` and forms them from
  products where the examples interact (see `dense.measure`); block types
  from the problem's `layer_roles` (`curvatures.block_role`); the class-
  mean test (`cfg.class_means`) from the network's `outputs(params,
  inputs)`, the problem's `outputs`."""
  planned = plan.make(cfg, curvature, params, outputs)
  subject = plan.Subject(
    loss_fn=loss_fn,
    curvature=curvature,
    params=params,
    data=Data.of(data),
    rng=rng,
    costs=costs or Costs(),
    store=store or ReferenceStore(None),
    key=key,
    layer_roles=layer_roles,
    examples_interact=examples_interact,
    outputs=outputs,
  )
  return METHODS[planned.method](subject, planned)


__all__ = [
  "GRADIENT_ALIGNMENT",
  "GRADIENT_SHARE",
  "MANY_CORES",
  "METHODS",
  "SAME",
  "TABLES",
  "dense_exact",
  "dense_metrics",
  "floor",
  "heatmap_units",
  "joined_eigh",
  "mean_gradient",
  "measure",
  "measure_dense",
  "measure_lanczos",
  "role_indices",
  "scale",
  "spectrum_statistics",
]
