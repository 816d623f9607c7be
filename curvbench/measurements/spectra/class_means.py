"""Papyan's class-mean test of a classifier's GGN outliers.

Papyan ("Measurements of Three-Level Hierarchical Structure in the Outliers
in the Spectrum of Deepnet Hessians", ICML 2019; "Traces of Class/Cross-Class
Structure Pervade Deep Learning Spectra", JMLR 2020) writes the GGN of a
softmax cross-entropy loss as a second moment. For example i (logits
Jacobian `J_i`, softmax `p_i`) and class c', let
`δ_{i,c'} = sqrt(p_{i,c'}) J_iᵀ (e_{c'} - p_i)`; since
`Σ_{c'} p_{c'} (e_{c'} - p)(e_{c'} - p)ᵀ = diag(p) - p pᵀ`, the GGN is
`(1/N) Σ_i Σ_{c'} δ_{i,c'} δ_{i,c'}ᵀ`. With `δ_{c,c'}` the mean of
`δ_{i,c'}` over the examples of class c and
`δ_c = (1/(C-1)) Σ_{c'≠c} δ_{c,c'}`, the class-mean matrix is
`G₁ = (C-1) Σ_c π_c δ_c δ_cᵀ` (`π_c` the share of class c). He finds its
at most C eigenvalues close to the GGN's C outliers, and the outliers'
eigenspace the span of the `δ_c`. They cannot exceed them: averaging over
a class's examples and over the `c' ≠ c` only lowers a second moment, so
`G₁ ≼ GGN`, and by Weyl each eigenvalue of `G₁` is at most the GGN's of
the same rank.

Each `δ_c` summed over the examples is one vector-Jacobian product of the
batch's logits, with a cotangent that is zero outside class c and sums the
`c' ≠ c` rows there (the sum over c' taken before the product, as it is
linear): C products per chunk of the data.
"""

from __future__ import annotations

import jax
import jax.flatten_util
import jax.numpy as jnp
import numpy as np

# The spectra rows of G₁'s eigenvalues, and the statistic of the overlap.
SOURCE = "class_means"
OVERLAP = "class_mean_overlap"


def check_applies(problem) -> None:
  """Refuses a problem the class-mean test does not apply to.

  Raises:
    ValueError: naming why and what to do, unless `problem` is a classifier
      with a per-example softmax cross-entropy loss and no batch statistics.
  """
  off = "or set measure.spectra.class_means=false"
  if problem.task != "classification" or (
    problem.loss_name != "softmax_cross_entropy"
  ):
    raise ValueError(
      "measure.spectra.class_means=true needs a classifier with a softmax "
      f"cross-entropy loss (Papyan's setting), but problem {problem.name!r} "
      f"has task {problem.task!r} and loss {problem.loss_name!r}: measure a "
      f"classification problem (problem=mlp, convnet, resnet) {off}."
    )
  if problem.has_state:
    raise ValueError(
      f"measure.spectra.class_means=true: problem {problem.name!r} "
      "normalises over its batch (batch norm), so its GGN is no mean of "
      "per-example terms and the class means do not decompose it: measure "
      f"a model without batch statistics {off}."
    )


def cotangents(logits):
  """`(N, C, C)`: row `[i, c']` is `sqrt(p_{i,c'}) (e_{c'} - p_i)`, so that
  `δ_{i,c'} = J_iᵀ` of it."""
  p = jax.nn.softmax(logits)
  eye = jnp.eye(p.shape[-1], dtype=p.dtype)
  return jnp.sqrt(p)[..., None] * (eye - p[:, None, :])


def _class_sums(outputs, params, batch):
  """`((C, P), (C,))`: per class c, `Σ_{i in c} Σ_{c'≠c} δ_{i,c'}` over the
  batch divided by its size, and the classes' shares of the batch."""
  inputs, labels = batch
  logits, vjp = jax.vjp(lambda w: outputs(w, inputs), params)
  rows = cotangents(logits)
  onehot = jax.nn.one_hot(labels, logits.shape[-1], dtype=logits.dtype)
  others = rows.sum(1) - jnp.einsum("nc,ncd->nd", onehot, rows)
  per_class = onehot.T[:, :, None] * others[None]
  flat = lambda u: jax.flatten_util.ravel_pytree(vjp(u)[0])[0]
  return jax.vmap(flat)(per_class) / len(labels), onehot.mean(0)


def sums(outputs, params, data):
  """`_class_sums` averaged over every example of `data` (a `Data`): the
  chunks one at a time. Jit it, with the network's `outputs(params,
  inputs)` fixed."""
  return data.mean(lambda batch: _class_sums(outputs, params, batch))


def class_means(found) -> tuple[np.ndarray, np.ndarray, int]:
  """`(δ, π, C)` from `sums`' output: the `δ_c` as rows and the shares
  `π_c` of the classes present in the data, and the number of classes C
  (a class absent from the data has no mean and no share in `G₁`)."""
  total, shares = (np.asarray(x, np.float64) for x in found)
  num_classes = len(shares)
  present = shares > 0
  deltas = total[present] / (shares[present, None] * (num_classes - 1))
  return deltas, shares[present], num_classes


def _scaled(deltas, shares, num_classes):
  """The rows `sqrt((C-1) π_c) δ_c`, so that `G₁ = Dᵀ D`."""
  return deltas * np.sqrt((num_classes - 1) * shares)[:, None]


def dense(deltas, shares, num_classes) -> np.ndarray:
  """`G₁ = (C-1) Σ_c π_c δ_c δ_cᵀ`, P x P (for small models and tests)."""
  d = _scaled(deltas, shares, num_classes)
  return d.T @ d


def eigenvalues(deltas, shares, num_classes) -> np.ndarray:
  """`G₁`'s eigenvalues that may be nonzero, descending: those of the
  class-by-class `M_cd = (C-1) sqrt(π_c π_d) <δ_c, δ_d>` (`D Dᵀ` where
  `G₁ = Dᵀ D`)."""
  d = _scaled(deltas, shares, num_classes)
  return np.linalg.eigvalsh(d @ d.T)[::-1]


def overlap(vectors, deltas) -> float:
  """`||Uᵀ Q||_F^2 / k` for the k orthonormal columns `vectors` (U: the
  GGN's top k eigenvectors, k the classes) and an orthonormal basis Q of
  the span of the rows of `deltas`: 1 where U spans the class means, about
  k/P for a random U."""
  u, s, _ = np.linalg.svd(np.asarray(deltas, np.float64).T, full_matrices=False)
  basis = u[:, s > s[0] * len(s) * np.finfo(np.float64).eps]
  vectors = np.asarray(vectors, np.float64)
  return float(np.linalg.norm(vectors.T @ basis) ** 2 / vectors.shape[1])


def rows(deltas, shares, num_classes, ggn_top) -> tuple[list, list]:
  """`(spectra rows, statistics rows)`: `G₁`'s eigenvalues (source
  `class_means`, matrix `ggn`, no weight: a top of the spectrum) and the
  overlap of `ggn_top`, the GGN's top eigenvectors (as many as the
  classes present), with the class means (`class_mean_overlap`)."""
  values = eigenvalues(deltas, shares, num_classes)
  spectra = [
    dict(
      source=SOURCE,
      matrix="ggn",
      reference="ggn",
      index=i,
      eigenvalue=float(v),
      weight=np.nan,
    )
    for i, v in enumerate(values)
  ]
  statistics = [
    dict(
      source="exact",
      matrix="ggn",
      statistic=OVERLAP,
      value=overlap(ggn_top, deltas),
      stderr=0.0,
    )
  ]
  return spectra, statistics
