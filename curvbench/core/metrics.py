"""Approximation-quality metrics, in float64 numpy.

Spectra may be weighted samples `(values, weights)`: weights are 1/P for a
full eigendecomposition and the quadrature weights for stochastic Lanczos.
"""

from __future__ import annotations

import dataclasses

import numpy as np
from scipy.stats import wasserstein_distance


def relative_frobenius(approx: np.ndarray, exact: np.ndarray) -> float:
  """`||A - E||_F / ||E||_F` (0 for an exact estimate)."""
  approx, exact = np.asarray(approx, np.float64), np.asarray(exact, np.float64)
  return float(np.linalg.norm(approx - exact) / np.linalg.norm(exact))


def cosine_similarity(approx: np.ndarray, exact: np.ndarray) -> float:
  """`<A, E>_F / (||A||_F ||E||_F)` (1 for an estimate proportional to the
  exact matrix): Morwani et al. (ICLR 2025, Fig. 1) compare Kronecker-
  factored approximations of the Gauss-Newton matrix by it.

  Unlike `relative_frobenius` it ignores the scale: the best rescaling's
  error is `min_c ||E - c A||_F / ||E||_F = sqrt(1 - cos^2)`.
  """
  return cosine(approx, exact)


def jackknife_stderr(statistic, num: int) -> float:
  """The jackknife standard error of a statistic of `num` independent
  samples (probes, say).

  Args:
    statistic: `statistic(keep)`, its value over the samples where the
      boolean array `keep` (length `num`) is True.
    num: the number of samples.

  Returns:
    `sqrt((num - 1) / num * sum_i (t_i - mean t)^2)` over the `num`
    leave-one-out values `t_i`; nan for one sample.
  """
  if num < 2:
    return float("nan")
  left_out = np.array(
    [statistic(np.arange(num) != i) for i in range(num)], np.float64
  )
  return float(
    np.sqrt((num - 1) / num * np.sum((left_out - left_out.mean()) ** 2))
  )


def log_spectrum(values, floor: float) -> np.ndarray:
  """`log10(max(value, floor))`: zero and negative eigenvalues sit at the floor."""
  return np.log10(np.maximum(np.asarray(values, np.float64), floor))


def log_wasserstein(
  approx, exact, floor: float, approx_weights=None, exact_weights=None
) -> float:
  """1-Wasserstein distance between the log10-spectra (in decades)."""
  return float(
    wasserstein_distance(
      log_spectrum(approx, floor),
      log_spectrum(exact, floor),
      approx_weights,
      exact_weights,
    )
  )


def cosine(u, v) -> float:
  """The cosine of the angle between `u` and `v`, flattened."""
  u, v = np.ravel(u).astype(np.float64), np.ravel(v).astype(np.float64)
  return float(u @ v / (np.linalg.norm(u) * np.linalg.norm(v)))


def top_eigenvectors(matrix, k: int) -> np.ndarray:
  """The `k` eigenvectors of largest eigenvalue, as columns."""
  _, vecs = np.linalg.eigh(np.asarray(matrix, np.float64))
  return vecs[:, ::-1][:, :k]


def subspace_overlap(u: np.ndarray, v: np.ndarray) -> float:
  """`||Uᵀ V||_F^2 / k` for orthonormal columns: 1 when the spans agree."""
  k = min(u.shape[1], v.shape[1])
  return float(np.linalg.norm(u[:, :k].T @ v[:, :k]) ** 2 / k)


def share_in_span(vectors: np.ndarray, g: np.ndarray) -> float:
  """The share of `g`'s squared norm in the span of the orthonormal
  columns of `vectors`: `||Vᵀ g||^2 / ||g||^2` (Gur-Ari, Roberts & Dyer
  2018 measure the gradient's in the top Hessian eigenvectors')."""
  g = np.asarray(g, np.float64)
  projected = np.asarray(vectors, np.float64).T @ g
  return float(projected @ projected / (g @ g))


def gradient_curvature_alignment(g, mg) -> float:
  """`gᵀ M g / (||g|| ||M g||)` given `g` and the product `M g`: 1 when `g`
  is an eigenvector of `M` of positive eigenvalue, near 1 when it lies in
  a top eigenspace that stands apart (Gur-Ari, Roberts & Dyer 2018, eq. 2,
  for the Hessian)."""
  return cosine(g, mg)


def density(values, weights, grid, bandwidth: float) -> np.ndarray:
  """A Gaussian-smoothed density of weighted samples on `grid`."""
  values, weights = np.asarray(values, np.float64), np.asarray(weights)
  z = (np.asarray(grid)[:, None] - values[None, :]) / bandwidth
  kernel = np.exp(-0.5 * z**2) / (bandwidth * np.sqrt(2 * np.pi))
  return kernel @ (weights / weights.sum())


# --- signed spectra (a Hessian's eigenvalues may be negative) ---------------


def _weights(values: np.ndarray, weights) -> np.ndarray:
  if weights is None:
    return np.full(values.shape, 1.0 / values.size)
  weights = np.asarray(weights, np.float64)
  return weights / weights.sum()


def spectral_distance(
  approx, exact, approx_weights=None, exact_weights=None
) -> float:
  """1-Wasserstein distance between signed spectra, over the exact width.

  Unlike `log_wasserstein`, negative eigenvalues keep their place. Dividing
  by the width (max - min) of the exact spectrum makes the number
  scale-free: multiplying both spectra by a constant does not change it.

  Args:
    approx: eigenvalues (or SLQ nodes) of the approximation.
    exact: eigenvalues (or SLQ nodes) of the reference.
    approx_weights: weights of `approx`; uniform when None.
    exact_weights: weights of `exact`; uniform when None.

  Returns:
    The distance over the width of `exact`'s support; over its largest
    `|value|` when the width is 0, and the raw distance if that is 0 too.
  """
  approx = np.asarray(approx, np.float64)
  exact = np.asarray(exact, np.float64)
  distance = wasserstein_distance(approx, exact, approx_weights, exact_weights)
  # Nodes without weight (e.g. SLQ past a breakdown) are not in the support.
  support = exact[_weights(exact, exact_weights) > 0]
  scale = support.max() - support.min()
  if scale == 0:
    scale = np.abs(support).max()
  return float(distance / scale if scale > 0 else distance)


def condition_number(values, floor: float) -> float:
  """`max |λ| / min |λ|` over the eigenvalues with `|λ| > floor`.

  Eigenvalues at or below the floor in magnitude count as the null space
  (a GGN of rank below its size has one) rather than as tiny eigenvalues
  that would make the ratio infinite.

  Args:
    values: eigenvalues, of any sign.
    floor: magnitude at or below which an eigenvalue is taken for zero.

  Returns:
    The ratio, or nan when no eigenvalue is above the floor.
  """
  kept = np.abs(np.asarray(values, np.float64))
  kept = kept[kept > floor]
  return float(kept.max() / kept.min()) if kept.size else float("nan")


def num_outliers(values, k: int, min_gap: float = 2.0) -> int:
  """The number of top eigenvalues that stand apart from the bulk.

  The outliers of a network's Hessian (Ghorbani et al. 2019, Papyan 2019)
  sit above a gap from the bulk. Here the gap is the largest ratio
  `λ_i / λ_{i+1}` between consecutive ones of the `k + 1` largest positive
  eigenvalues (sorted descending); when it is at least `min_gap`, the
  outliers are `λ_1 .. λ_i`.

  Args:
    values: eigenvalues, of any sign; only positive ones are considered.
    k: most outliers to look for.
    min_gap: smallest ratio that counts as a gap.

  Returns:
    The number of outliers, between 0 and `k`.
  """
  values = np.asarray(values, np.float64)
  top = np.sort(values[values > 0])[::-1][: k + 1]
  if top.size < 2:
    return 0
  ratios = top[:-1] / top[1:]
  i = int(np.argmax(ratios))
  return i + 1 if ratios[i] >= min_gap else 0


def negative_mass(values, weights=None, floor: float = 0.0) -> float:
  """The weighted fraction of eigenvalues below `-floor`.

  Args:
    values: eigenvalues (or SLQ nodes).
    weights: their weights; uniform when None.
    floor: eigenvalues within `floor` of zero count as zero (a null space
      has round-off of either sign).

  Returns:
    A number in [0, 1].
  """
  values = np.asarray(values, np.float64)
  return float(np.sum(_weights(values, weights)[values < -floor]))


def negative_ratio(values, largest: float | None = None) -> float:
  """`|λ_min| / λ_max`, the ratio Ghorbani et al. (2019) track.

  Args:
    values: eigenvalues, of any sign.
    largest: `λ_max` where it is known better than from `values` (Lanczos).

  Returns:
    The most negative eigenvalue's magnitude over the largest eigenvalue;
    0 when none is negative, nan when `λ_max <= 0`.
  """
  values = np.asarray(values, np.float64)
  top = values.max() if largest is None else largest
  if top <= 0:
    return float("nan")
  return float(max(0.0, -values.min()) / top)  # never -0.0


# --- what each measured quantity is, in words --------------------------------


@dataclasses.dataclass(frozen=True)
class Described:
  """A measured quantity as a reader is told it: `words` (plain text: a
  table's column header), its `formula` or gloss where short (read after
  the words in a title), `unit` ("" where it has none) and which way is
  `better` ("lower", "higher", "1": nearest 1; "" where neither is)."""

  words: str
  formula: str = ""
  unit: str = ""
  better: str = ""

  def direction(self) -> str:
    """E.g. "lower is better", "1 is best"; "" where neither is."""
    if self.better == "1":
      return "1 is best"
    return f"{self.better} is better" if self.better else ""

  def axis(self) -> str:
    """The value axis's label: the unit, or that there is none."""
    return self.unit or "dimensionless"

  def title(self, detail: str = "") -> str:
    """E.g. "Time per step (ms, lower is better)"; `detail` follows the
    words ("at ρ = 0.001")."""
    words = self.words + (
      self.formula if self.formula.startswith(",") else f" {self.formula}"
    )
    words = words.rstrip()
    words = f"{words}, {detail}" if detail else words
    said = ", ".join(x for x in (self.unit, self.direction()) if x)
    return f"{words} ({said})" if said else words


# The approximation-quality metrics of the spectra measurement, C the
# exact matrix and Ĉ its approximation; the tables show them in this
# order, the headline ones first.
QUALITY = {
  "relative_frobenius": Described(
    "Relative Frobenius error", "‖Ĉ − C‖ / ‖C‖", better="lower"
  ),
  "cosine_similarity": Described(
    "Cosine similarity", "⟨Ĉ, C⟩ / (‖Ĉ‖ ‖C‖)", better="higher"
  ),
  "natural_gradient_cosine": Described(
    "Natural-gradient cosine", ", damped Ĉ⁻¹g against C⁻¹g", better="higher"
  ),
  "spectral_distance": Described(
    "Spectral Wasserstein distance",
    ", relative to the exact spectrum's width",
    better="lower",
  ),
  "top_k_overlap": Described(
    "Top-k eigenspace overlap", "‖UᵀÛ‖² / k", better="higher"
  ),
  "top_eigenvalue_ratio": Described(
    "Largest eigenvalue ratio", "λ₁(Ĉ) / λ₁(C)", better="1"
  ),
  "trace_ratio": Described("Trace ratio", "tr Ĉ / tr C", better="1"),
  "diagonal_relative_error": Described(
    "Relative error of the diagonal",
    "‖diag Ĉ − diag C‖ / ‖diag C‖",
    better="lower",
  ),
  "log_wasserstein": Described(
    "Log-spectral Wasserstein distance",
    unit="decades",
    better="lower",
  ),
}

# The spectral statistics of each exact matrix and approximation: not
# better or worse, only compared with the exact matrix's.
STATISTICS = {
  "trace": Described("Trace (Hutchinson estimate where matrix-free)"),
  "trace_xtrace": Described("Trace (XTrace estimate)"),
  "max_eigenvalue": Described("Largest eigenvalue", "λ₁"),
  "min_eigenvalue": Described("Smallest eigenvalue", "λₙ"),
  "condition_number": Described(
    "Condition number", ", largest over smallest |λ| above the floor"
  ),
  "condition_number_at_least": Described(
    "Condition number", ", a lower bound (the spectrum reaches the floor)"
  ),
  "damped_condition_number": Described(
    "Damped condition number", "(λ₁ + δ) / (λₙ + δ)"
  ),
  "num_outliers": Described("Outliers above the bulk", unit="eigenvalues"),
  "negative_mass": Described(
    "Share of negative eigenvalues", unit="fraction of the spectrum"
  ),
  "negative_ratio": Described("Negative ratio", "|λₙ| / λ₁"),
  "gradient_in_top_k": Described(
    "Share of the gradient in the top-k eigenspace",
    unit="fraction of ‖g‖²",
  ),
  "gradient_curvature_alignment": Described(
    "Gradient-curvature alignment", "gᵀCg / (‖g‖ ‖Cg‖)"
  ),
  "class_mean_overlap": Described(
    "Overlap of the top-C eigenspace with the class means' span"
  ),
}


# The training measurement's curves (columns of its table); a tuning score
# is one of them, its last ("final_") or least ("best_") value.
TRAINING = {
  "train_error": Described(
    "Training error", unit="fraction misclassified", better="lower"
  ),
  "test_error": Described(
    "Test error", unit="fraction misclassified", better="lower"
  ),
  "train_loss": Described("Training loss", better="lower"),
  "test_loss": Described("Test loss", better="lower"),
  "batch_loss": Described("Minibatch loss", better="lower"),
}


def described(name: str) -> Described:
  """What the quantity `name` is (`QUALITY`, `STATISTICS`, `TRAINING`; a
  damping in parentheses after the name, "natural_gradient_cosine
  (rho=0.001)", read apart): its declared words, else the name in words."""
  base = name.split(" (")[0]
  found = QUALITY.get(base) or STATISTICS.get(base) or TRAINING.get(base)
  if found is not None:
    return found
  when, _, column = base.partition("_")
  if when in ("final", "best") and column in TRAINING:
    of = TRAINING[column]
    first = "Final" if when == "final" else "Best"
    return dataclasses.replace(
      of, words=f"{first} {of.words[0].lower()}{of.words[1:]}"
    )
  return Described(base.replace("_", " ").capitalize())


def title(name: str) -> str:
  """The quantity `name` in words with its unit and which way is better,
  e.g. "Relative Frobenius error ‖Ĉ − C‖ / ‖C‖ (lower is better)"; a
  relative damping after the name is said as "at ρ = 0.001"."""
  _, _, extra = name.partition(" (")
  detail = extra.rstrip(")").replace("rho=", "at ρ = ") if extra else ""
  return described(name).title(detail)
