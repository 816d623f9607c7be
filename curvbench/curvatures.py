"""One interface over every curvature estimator the harness compares.

`make(cfg.curvature, loss_fn)` gives a `Curvature` with pure functions
(`init`, `update`, `refresh`, `precondition`, `multiply`, `eigenvalues`,
`to_dense`), so measurements never special-case an estimator class.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.flatten_util
import jax.numpy as jnp
import numpy as np

import estimators as kfac

BLOCK_TYPES = {
    "kfac": {},  # the library's defaults: Kronecker factors where possible
    "diagonal": {"dense_tag": kfac.DenseDiagonal,
                 "conv2d_tag": kfac.Conv2DDiagonal,
                 "scale_and_shift_tag": kfac.ScaleAndShiftDiagonal},
    "full": {"dense_tag": kfac.DenseFull, "conv2d_tag": kfac.Conv2DFull,
             "scale_and_shift_tag": kfac.ScaleAndShiftFull},
    "identity": {t: kfac.ScaledIdentity for t in
                 ("dense_tag", "conv2d_tag", "scale_and_shift_tag",
                  "repeated_dense_tag", "generic_tag")},
}
ESTIMATORS = ("block_diagonal", "explicit_exact", "implicit_exact")
IMPLICIT_MATRICES = ("ggn", "fisher", "hessian")


def mat_type(mode: str) -> str:
  """'ggn', 'fisher' or 'empirical_fisher': what an estimation mode estimates."""
  return kfac.estimation_modes.matrix_type(mode)


def check_dense_fits(num_params: int, itemsize: int, max_gib: float,
                     what: str, hint: str = "use curvature=implicit_exact "
                     "(matrix-free)") -> None:
  """Raises a clear error when a dense P x P matrix would be too large."""
  gib = num_params ** 2 * itemsize / 2 ** 30
  if gib > max_gib:
    raise MemoryError(
        f"{what} needs a dense {num_params} x {num_params} matrix ({gib:.2f} "
        f"GiB), over the limit of {max_gib} GiB: {hint}, or raise "
        "max_dense_gib if the memory is there.")


def _unravel_like(tree):
  return jax.flatten_util.ravel_pytree(tree)[1]


@dataclasses.dataclass
class Curvature:
  """A configured estimator; all methods are pure and jittable.

  `update` replaces (ema_old=0) or averages (ema_old > 0) the estimate with
  one batch; `refresh` recomputes the cached damped inverse; `precondition`
  applies it. Implicit estimators keep `(params, batch)` as their state.
  """

  name: str
  estimator: str
  block_type: str | None
  mode: str
  matrix: str  # the exact matrix this estimates
  impl: object
  cg_iters: int = 50
  max_dense_gib: float = 2.0

  @property
  def label(self) -> str:
    return f"{self.name}/{self.mode}"

  @property
  def explicit(self) -> bool:
    return self.estimator != "implicit_exact"

  def init(self, rng, params, batch):
    if self.estimator == "implicit_exact":
      return (params, batch)
    if self.estimator == "explicit_exact":
      num = int(sum(np.size(x) for x in jax.tree.leaves(params)))
      itemsize = jnp.result_type(*jax.tree.leaves(params)).itemsize
      check_dense_fits(num, itemsize, self.max_dense_gib, "explicit_exact")
    return self.impl.init(rng, (params, batch), exact_powers_to_cache=-1,
                          approx_powers_to_cache=None, cache_eigenvalues=False)

  def update(self, state, params, batch, rng, ema_old=0.0, ema_new=1.0):
    if self.estimator == "implicit_exact":
      return (params, batch)
    size = jax.tree.leaves(batch)[0].shape[0]
    return self.impl.update_curvature_matrix_estimate(
        state, ema_old, ema_new, size, rng, (params, batch),
        estimation_mode=self.mode)

  def refresh(self, state, damping):
    if self.estimator == "implicit_exact":
      return state
    return self.impl.update_cache(state, damping, exact_powers=-1,
                                  approx_powers=None, eigenvalues=False)

  def multiply(self, state, vector):
    """The undamped estimate times a params-shaped vector."""
    if self.estimator == "implicit_exact":
      product = getattr(self.impl, f"multiply_{self.matrix}")
      return product(state, vector)
    return self.impl.multiply(state, vector, 0.0, True, False)

  def precondition(self, state, vector, damping):
    """`(C + damping I)^-1 v`, from the cache (CG for implicit estimators)."""
    if self.estimator != "implicit_exact":
      return self.impl.multiply_inverse(state, vector, damping, True, True)
    flat, unravel = jax.flatten_util.ravel_pytree(vector)

    def matvec(x):
      y = jax.flatten_util.ravel_pytree(self.multiply(state, unravel(x)))[0]
      return y + damping * x

    solution, _ = jax.scipy.sparse.linalg.cg(matvec, flat,
                                             maxiter=self.cg_iters)
    return unravel(solution)

  def eigenvalues(self, state):
    if self.estimator == "implicit_exact":
      return jnp.linalg.eigvalsh(self.to_dense(state))
    return self.impl.eigenvalues(state)

  def to_dense(self, state):
    if self.estimator == "implicit_exact":
      params = state[0]
      num = int(sum(np.size(x) for x in jax.tree.leaves(params)))
      itemsize = jnp.result_type(*jax.tree.leaves(params)).itemsize
      check_dense_fits(num, itemsize, self.max_dense_gib,
                       "A dense export of implicit_exact",
                       "use measure.spectra.method=lanczos (matrix-free)")
      return self.impl.to_dense_matrix(state, self.matrix)
    return self.impl.to_dense_matrix(state)

  def registration(self) -> list[dict]:
    """One row per curvature block (after `init`): name, class and size."""
    if self.estimator != "block_diagonal" or self.impl.blocks is None:
      return [dict(block=self.estimator, block_class=type(self.impl).__name__,
                   dim=None)]
    return [dict(block=b.name, block_class=type(b).__name__, dim=int(b.dim))
            for b in self.impl.blocks]


def make(cfg, loss_fn: Callable) -> Curvature:
  """A `Curvature` from the `curvature` config group (a mapping)."""
  get = cfg.get
  name, estimator = get("name"), get("estimator", "block_diagonal")
  if estimator not in ESTIMATORS:
    raise ValueError(f"Unknown estimator {estimator!r} in curvature {name!r}; "
                     f"choose one of {', '.join(ESTIMATORS)}.")
  mode = get("mode", "ggn_exact")
  if mode not in kfac.ESTIMATION_MODES:
    raise ValueError(f"Unknown estimation mode {mode!r}; choose one of "
                     f"{', '.join(kfac.ESTIMATION_MODES)}.")
  common = dict(cg_iters=int(get("cg_iters", 50)),
                max_dense_gib=float(get("max_dense_gib", 2.0)))
  if estimator == "block_diagonal":
    block_type = get("block_type", "kfac")
    if block_type not in BLOCK_TYPES:
      raise ValueError(f"Unknown block type {block_type!r}; choose one of "
                       f"{', '.join(BLOCK_TYPES)}.")
    impl = kfac.BlockDiagonalCurvature(
        loss_fn, default_estimation_mode=mode,
        layer_tag_to_block_ctor=BLOCK_TYPES[block_type] or None)
    return Curvature(name or block_type, estimator, block_type, mode,
                     mat_type(mode), impl, **common)
  if estimator == "explicit_exact":
    impl = kfac.ExplicitExactCurvature(loss_fn, default_estimation_mode=mode)
    return Curvature(name or estimator, estimator, None, mode, mat_type(mode),
                     impl, **common)
  matrix = get("matrix", "ggn")
  if matrix not in IMPLICIT_MATRICES:
    raise ValueError(f"implicit_exact multiplies by one of "
                     f"{', '.join(IMPLICIT_MATRICES)}, not {matrix!r}.")
  impl = kfac.ImplicitExactCurvature(loss_fn)
  mode = {"ggn": "ggn_exact", "fisher": "fisher_exact"}.get(matrix, "hessian")
  return Curvature(name or estimator, estimator, None, mode, matrix, impl,
                   **common)
