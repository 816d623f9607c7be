"""What the dense and the matrix-free method share: the rows of each table,
the statistics of a spectrum, the mean gradient and the class sums."""

from __future__ import annotations

import functools

import jax
import jax.flatten_util
import numpy as np

from curvbench.core import matrix_free, metrics
from curvbench.core.data import Data
from curvbench.measurements.spectra import class_means

TABLES = ("spectra", "quality", "statistics", "heatmaps", "references")
# The statistic of each exact matrix: the share of the mean gradient's
# squared norm in the span of its top_k eigenvectors.
GRADIENT_SHARE = "gradient_in_top_k"
# And `gᵀ M g / (||g|| ||M g||)` (Gur-Ari, Roberts & Dyer 2018, eq. 2).
GRADIENT_ALIGNMENT = "gradient_curvature_alignment"


def empty() -> dict[str, list[dict]]:
  """Every table of `TABLES`, without rows."""
  return {name: [] for name in TABLES}


def flat(tree) -> np.ndarray:
  """A pytree as one float64 vector, in `ravel_pytree`'s order."""
  return np.asarray(jax.flatten_util.ravel_pytree(tree)[0], np.float64)


def traced_mean_gradient(loss_fn, params, data: Data):
  """`mean_gradient` unjitted, for a phase of `Costs` (which jits it)."""
  return data.mean(lambda b: jax.grad(loss_fn)(params, b))


def mean_gradient(loss_fn, params, data: Data):
  """The gradient of the loss averaged over every example of `data`."""
  return jax.jit(functools.partial(traced_mean_gradient, loss_fn))(params, data)


def class_sums(outputs, params, data, costs):
  """`class_means.sums` over `data` as float64 numpy arrays, a phase of
  `costs`."""
  found = costs.call(
    "class means", lambda p, d: class_means.sums(outputs, p, d), params, data
  )
  return tuple(np.asarray(x, np.float64) for x in found)


def spectrum(source, matrix, values, weights=None, reference=None):
  """`spectra` rows of eigenvalues `values` with `weights` (None: each
  1/P, a full spectrum)."""
  values = np.asarray(values, np.float64)
  weights = (
    np.full(len(values), 1 / len(values))
    if weights is None
    else np.asarray(weights, np.float64)
  )
  return [
    dict(
      source=source,
      matrix=matrix,
      reference=reference or matrix,
      index=i,
      eigenvalue=float(v),
      weight=float(w),
    )
    for i, (v, w) in enumerate(zip(values, weights))
  ]


def quality(
  reference,
  level,
  block,
  values: dict,
  errors: dict | None = None,
  precision: float = np.nan,
):
  """Rows of `values`, `{metric: value}` or `{(metric, rho): value}` for
  metrics taken at a relative damping; `errors`, `{metric: (standard
  error, probes)}` of the probe estimates among them, fills their
  `stderr` and `probes_needed` (for a relative standard error of
  `precision`: `matrix_free.probes_needed`), NaN for the others."""
  rows, errors = [], errors or {}
  for key, v in values.items():
    metric, rho = key if isinstance(key, tuple) else (key, np.nan)
    stderr, probes = errors.get(key, (np.nan, None))
    needed = (
      np.nan
      if probes is None
      else matrix_free.probes_needed(v, stderr, probes, precision)
    )
    rows.append(
      dict(
        reference=reference,
        level=level,
        block=block,
        metric=metric,
        relative_damping=rho,
        value=float(v),
        stderr=float(stderr),
        probes_needed=needed,
      )
    )
  return rows


def statistics(source, matrix, values: dict, stderr: dict | None = None):
  """`statistics` rows of `values`, `{statistic: value}`, with their
  standard errors (`stderr`; 0 where absent: exact)."""
  stderr = stderr or {}
  return [
    dict(
      source=source,
      matrix=matrix,
      statistic=k,
      value=float(v),
      stderr=float(stderr.get(k, 0.0)),
    )
    for k, v in values.items()
  ]


def gradient_statistics(matrix, in_top, g, product) -> list[dict]:
  """The `statistics` rows of how the mean gradient `g` lines up with exact
  `matrix`: its share in the span of the columns `in_top` (the top
  eigenvectors), and its alignment with `product`, the matrix times `g`."""
  return statistics(
    "exact",
    matrix,
    {
      GRADIENT_SHARE: metrics.share_in_span(in_top, g),
      GRADIENT_ALIGNMENT: metrics.gradient_curvature_alignment(g, product),
    },
  )


def scale(eigenvalues) -> float:
  """The largest eigenvalue: the scale a relative damping multiplies (the
  same from a dense eigendecomposition and from Lanczos, which finds the
  top of a spectrum first)."""
  return float(np.max(np.asarray(eigenvalues, np.float64)))


def role_indices(blocks, roles: dict[str, str]) -> dict[str, np.ndarray]:
  """`{role: sorted ravel_pytree indices}` of the layer `blocks` (`(name,
  indices)`, as `curvatures.layer_blocks`) of each role (`roles`, by block
  name: `curvatures.block_roles`). Empty where one role holds every block:
  its parameters are the whole network's, measured already."""
  out: dict[str, list[np.ndarray]] = {}
  for name, idx in blocks:
    out.setdefault(roles[name], []).append(idx)
  if len(out) < 2:
    return {}
  return {role: np.sort(np.concatenate(idx)) for role, idx in out.items()}


def floor(cfg, values) -> float:
  """The magnitude below which an eigenvalue counts as zero: the configured
  `relative_floor`, or ten round-offs of the measurement's precision where
  that is larger, times the largest magnitude in `values`. (A float32
  Lanczos run puts the null space at +-1e-8 of the top eigenvalue, which
  would otherwise read as negative mass.) `cfg`: the settings or a
  `plan.Plan`."""
  eps = float(np.finfo(np.dtype(cfg.precision)).eps)
  relative = max(cfg.relative_floor, 10 * eps)
  return relative * float(np.nanmax(np.abs(values)))


def spectrum_statistics(values, cfg, weights=None, top=None) -> dict:
  """Statistics of a signed spectrum (weighted samples for SLQ); `top`: the
  largest eigenvalues where they are known better than from `values`;
  `cfg`: the settings or a `plan.Plan`.

  `condition_number` is over the eigenvalues above the relative floor (the
  rest count as the null space). Where the smallest of those lies within a
  decade of the floor, the spectrum runs on into the floor and the number
  measures the floor as much as the matrix: it is recorded as
  `condition_number_at_least` instead. `damped_condition_number` is that
  of the matrix plus `damping`, as a damped preconditioner sees it.
  """
  values = np.asarray(values, np.float64)
  top = np.sort(values)[::-1] if top is None else np.asarray(top)
  top = top[np.isfinite(top)]
  zero = floor(cfg, values)
  damping = cfg.damping
  lowest = float(values.min())
  kept = np.abs(values)[np.abs(values) > zero]
  at_floor = kept.size and kept.min() < 10 * zero
  condition = "condition_number_at_least" if at_floor else "condition_number"
  return {
    "max_eigenvalue": float(top[0]),
    "min_eigenvalue": lowest,
    condition: metrics.condition_number(values, zero),
    # What a damped preconditioner sees; undefined when indefinite.
    "damped_condition_number": (top[0] + damping) / (lowest + damping)
    if lowest + damping > 0
    else np.nan,
    "num_outliers": metrics.num_outliers(top, cfg.top_k),
    "negative_mass": metrics.negative_mass(values, weights, zero),
    "negative_ratio": metrics.negative_ratio(values, top[0]),
  }
