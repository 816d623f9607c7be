"""One interface over every curvature the harness compares.

A `Curvature` has pure, jittable methods (`init`, `update`, `refresh`,
`multiply`, `precondition`, `eigenvalues`, `to_dense`); measurements use only
these and never ask which estimator sits behind them. Each estimator family
is one subclass, registered in `FAMILIES` under the name its config file
gives as `estimator`; `make` builds the configured one and `exact` the exact
reference matrices, so no other module branches on an estimator or a matrix.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable, Mapping

import jax
import jax.flatten_util
import jax.numpy as jnp
import numpy as np

import estimators as kfac
from estimators import estimation_modes

# Block constructors of each block type; {} keeps the library's defaults
# (Kronecker factors where a layer allows them).
BLOCK_TYPES = {
    "kfac": {},
    "diagonal": {"dense_tag": kfac.DenseDiagonal,
                 "conv2d_tag": kfac.Conv2DDiagonal,
                 "scale_and_shift_tag": kfac.ScaleAndShiftDiagonal},
    "full": {"dense_tag": kfac.DenseFull, "conv2d_tag": kfac.Conv2DFull,
             "scale_and_shift_tag": kfac.ScaleAndShiftFull},
    "identity": {t: kfac.ScaledIdentity for t in
                 ("dense_tag", "conv2d_tag", "scale_and_shift_tag",
                  "repeated_dense_tag", "generic_tag")},
}
# Matrices that have an exact reference: the estimation-mode matrices and the
# Hessian, which only matrix-vector products give.
EXACT_MATRICES = (*estimation_modes.EXACT_MODE_OF_MATRIX, "hessian")
# The products of the matrix-free exact curvature, by matrix name.
IMPLICIT_PRODUCTS = {"ggn": kfac.ImplicitExactCurvature.multiply_ggn,
                     "fisher": kfac.ImplicitExactCurvature.multiply_fisher,
                     "hessian": kfac.ImplicitExactCurvature.multiply_hessian}


def num_params(params) -> int:
  return int(sum(np.size(x) for x in jax.tree.leaves(params)))


def check_dense_fits(num: int, itemsize: int, max_gib: float, what: str,
                     hint: str = "use curvature=implicit_exact "
                     "(matrix-free)") -> None:
  """Raises a clear error when a dense `num` x `num` matrix is too large."""
  gib = num ** 2 * itemsize / 2 ** 30
  if gib > max_gib:
    raise MemoryError(
        f"{what} needs a dense {num} x {num} matrix ({gib:.2f} GiB), over the "
        f"limit of {max_gib} GiB: {hint}, or raise max_dense_gib if the "
        "memory is there.")


@dataclasses.dataclass(frozen=True)
class Curvature(abc.ABC):
  """A configured curvature estimate; every method is pure and jittable.

  `update` replaces (`ema_old=0`) or averages (`ema_old > 0`) the estimate
  with one batch; `refresh` recomputes the cached damped inverse;
  `precondition` applies it. Vectors are shaped like the parameters.

  Attributes:
    name: the config's name (`kfac`, `explicit_exact`, ...).
    mode: the estimation mode (for matrix-free families, the exact mode of
      their matrix, or 'hessian').
    matrix: the exact matrix this estimates ('ggn', 'fisher',
      'empirical_fisher' or 'hessian').
    cg_iters: conjugate-gradient steps where an inverse is matrix-free.
    max_dense_gib: the largest dense matrix this may form.
  """

  name: str
  mode: str
  matrix: str
  cg_iters: int
  max_dense_gib: float
  block_type = None  # the block type, for block-diagonal families
  uses_estimation_mode = True  # whether `curvature.mode` changes the estimate
  is_block_diagonal = False  # whether estimators.Optimizer can use it

  @property
  def label(self) -> str:
    return f"{self.name}/{self.mode}"

  @abc.abstractmethod
  def init(self, rng, params, batch):
    """An empty estimate; traces the model on `batch`."""

  @abc.abstractmethod
  def update(self, state, params, batch, rng, ema_old=0.0, ema_new=1.0):
    """`ema_old * state + ema_new * (the estimate on batch)`."""

  @abc.abstractmethod
  def refresh(self, state, damping):
    """The state with its cached `(C + damping I)^-1` recomputed."""

  @abc.abstractmethod
  def multiply(self, state, vector):
    """The undamped estimate times `vector`."""

  @abc.abstractmethod
  def precondition(self, state, vector, damping):
    """`(C + damping I)^-1 vector`."""

  @abc.abstractmethod
  def eigenvalues(self, state) -> jax.Array:
    """Every eigenvalue of the estimate (any order)."""

  @abc.abstractmethod
  def to_dense(self, state) -> jax.Array:
    """The estimate as a dense P x P matrix."""

  def registration(self) -> list[dict]:
    """One row per curvature block (after `init`): name, class and size."""
    return [dict(block=self.name, block_class=type(self).__name__, dim=None)]


@dataclasses.dataclass(frozen=True)
class _Estimator(Curvature):
  """A curvature held by an `estimators.CurvatureEstimator`."""

  estimator: kfac.CurvatureEstimator = None

  def init(self, rng, params, batch):
    return self.estimator.init(rng, (params, batch), exact_powers_to_cache=-1,
                               approx_powers_to_cache=None,
                               cache_eigenvalues=False)

  def update(self, state, params, batch, rng, ema_old=0.0, ema_new=1.0):
    size = jax.tree.leaves(batch)[0].shape[0]
    return self.estimator.update_curvature_matrix_estimate(
        state, ema_old, ema_new, size, rng, (params, batch),
        estimation_mode=self.mode)

  def refresh(self, state, damping):
    return self.estimator.update_cache(state, damping, exact_powers=-1,
                                       approx_powers=None, eigenvalues=False)

  def multiply(self, state, vector):
    return self.estimator.multiply(state, vector, identity_weight=0.0,
                                   exact_power=True, use_cached=False)

  def precondition(self, state, vector, damping):
    return self.estimator.multiply_inverse(state, vector,
                                           identity_weight=damping,
                                           exact_power=True, use_cached=True)

  def eigenvalues(self, state):
    return self.estimator.eigenvalues(state)

  def to_dense(self, state):
    return self.estimator.to_dense_matrix(state)


@dataclasses.dataclass(frozen=True)
class BlockDiagonal(_Estimator):
  """One block per tagged layer, of the configured block type."""

  block_type: str = "kfac"
  is_block_diagonal = True

  @classmethod
  def from_config(cls, cfg: Mapping, loss_fn: Callable, **common):
    block_type = cfg["block_type"]
    if block_type not in BLOCK_TYPES:
      raise ValueError(f"Unknown curvature.block_type {block_type!r}; choose "
                       f"one of {', '.join(BLOCK_TYPES)}.")
    estimator = kfac.BlockDiagonalCurvature(
        loss_fn, default_estimation_mode=cfg["mode"],
        layer_tag_to_block_ctor=BLOCK_TYPES[block_type] or None)
    return cls(mode=cfg["mode"], matrix=estimation_modes.matrix_type(
        cfg["mode"]), estimator=estimator, block_type=block_type, **common)

  @property
  def block_ctors(self) -> dict:
    """The layer-tag to block-constructor map (empty: library defaults)."""
    return BLOCK_TYPES[self.block_type]

  def registration(self):
    return [dict(block=b.name, block_class=type(b).__name__, dim=int(b.dim))
            for b in self.estimator.blocks]


@dataclasses.dataclass(frozen=True)
class ExplicitExact(_Estimator):
  """The whole matrix of the estimation mode, dense (small models)."""

  @classmethod
  def from_config(cls, cfg: Mapping, loss_fn: Callable, **common):
    estimator = kfac.ExplicitExactCurvature(
        loss_fn, default_estimation_mode=cfg["mode"])
    return cls(mode=cfg["mode"], matrix=estimation_modes.matrix_type(
        cfg["mode"]), estimator=estimator, **common)

  def init(self, rng, params, batch):
    itemsize = jnp.result_type(*jax.tree.leaves(params)).itemsize
    check_dense_fits(num_params(params), itemsize, self.max_dense_gib,
                     "explicit_exact")
    return super().init(rng, params, batch)


@dataclasses.dataclass(frozen=True)
class ImplicitExact(Curvature):
  """The exact GGN, Fisher or Hessian through matrix-vector products only.

  The state is the point `(params, batch)`; `update` moves it (no average),
  the inverse is conjugate gradients on the damped products, and eigenvalues
  come from a dense export.
  """

  implicit: kfac.ImplicitExactCurvature = None
  uses_estimation_mode = False

  @classmethod
  def from_config(cls, cfg: Mapping, loss_fn: Callable, **common):
    return cls.of_matrix(cfg["matrix"], loss_fn, **common)

  @classmethod
  def of_matrix(cls, matrix: str, loss_fn: Callable, **common):
    if matrix not in IMPLICIT_PRODUCTS:
      raise ValueError(
          f"The matrix-free exact curvature multiplies by one of "
          f"{', '.join(IMPLICIT_PRODUCTS)}, not {matrix!r}"
          + ("; the empirical Fisher needs a dense method (curvature="
             "explicit_exact, measure.spectra.method=dense)."
             if matrix == "empirical_fisher" else "."))
    mode = estimation_modes.EXACT_MODE_OF_MATRIX.get(matrix, matrix)
    return cls(mode=mode, matrix=matrix,
               implicit=kfac.ImplicitExactCurvature(loss_fn), **common)

  def init(self, rng, params, batch):
    del rng
    return (params, batch)

  def update(self, state, params, batch, rng, ema_old=0.0, ema_new=1.0):
    del state, rng, ema_old, ema_new
    return (params, batch)

  def refresh(self, state, damping):
    del damping
    return state

  def multiply(self, state, vector):
    return IMPLICIT_PRODUCTS[self.matrix](self.implicit, state, vector)

  def precondition(self, state, vector, damping):
    flat, unravel = jax.flatten_util.ravel_pytree(vector)

    def matvec(x):
      y = jax.flatten_util.ravel_pytree(self.multiply(state, unravel(x)))[0]
      return y + damping * x

    solution, _ = jax.scipy.sparse.linalg.cg(matvec, flat,
                                             maxiter=self.cg_iters)
    return unravel(solution)

  def eigenvalues(self, state):
    return jnp.linalg.eigvalsh(self.to_dense(state))

  def to_dense(self, state):
    params = state[0]
    itemsize = jnp.result_type(*jax.tree.leaves(params)).itemsize
    check_dense_fits(num_params(params), itemsize, self.max_dense_gib,
                     f"A dense export of the exact {self.matrix}",
                     "use measure.spectra.method=lanczos (matrix-free)")
    return self.implicit.to_dense_matrix(state, self.matrix)


# Estimator families by the name a config gives as `curvature.estimator`.
FAMILIES = {"block_diagonal": BlockDiagonal, "explicit_exact": ExplicitExact,
            "implicit_exact": ImplicitExact}


def family(cfg: Mapping) -> type[Curvature]:
  """The class of the curvature config `cfg` (a mapping)."""
  estimator = cfg["estimator"]
  if estimator not in FAMILIES:
    raise ValueError(f"Unknown curvature.estimator {estimator!r}; choose one "
                     f"of {', '.join(FAMILIES)}.")
  return FAMILIES[estimator]


def make(cfg: Mapping, loss_fn: Callable) -> Curvature:
  """The curvature of the `curvature` config group (a mapping) for `loss_fn`."""
  estimation_modes.check_estimation_mode(cfg["mode"])
  return family(cfg).from_config(
      cfg, loss_fn, name=cfg["name"], cg_iters=int(cfg["cg_iters"]),
      max_dense_gib=float(cfg["max_dense_gib"]))


def exact(matrix: str, loss_fn: Callable, *, matrix_free: bool,
          max_dense_gib: float = np.inf, cg_iters: int = 100) -> Curvature:
  """The exact `matrix` (one of `EXACT_MATRICES`) as a `Curvature`.

  Dense (`matrix_free=False`) where an estimation mode gives the matrix, else
  through matrix-vector products.
  """
  if matrix not in EXACT_MATRICES:
    raise ValueError(f"Unknown exact matrix {matrix!r}; choose from "
                     f"{', '.join(EXACT_MATRICES)}.")
  common = dict(name="exact", cg_iters=cg_iters, max_dense_gib=max_dense_gib)
  if matrix_free or matrix not in estimation_modes.EXACT_MODE_OF_MATRIX:
    return ImplicitExact.of_matrix(matrix, loss_fn, **common)
  mode = estimation_modes.exact_mode(matrix)
  return ExplicitExact(mode=mode, matrix=matrix, estimator=
                       kfac.ExplicitExactCurvature(
                           loss_fn, default_estimation_mode=mode), **common)


def estimate(curvature: Curvature, rng, params, batch, num_samples: int = 1):
  """The curvature's state averaged over `num_samples` draws on one batch."""
  state = curvature.init(rng, params, batch)
  update = jax.jit(curvature.update)
  for i, key in enumerate(jax.random.split(rng, num_samples)):
    state = update(state, params, batch, key, i / (i + 1), 1 / (i + 1))
  return state
