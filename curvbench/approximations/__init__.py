"""The curvature approximations a run can choose (the `curvature` config
group), one module each: its settings and the `Curvature` it builds.

A block-diagonal approximation only names its blocks (`BlockDiagonal.blocks`,
layer tag -> `estimators` block class); facts about a block type (e.g. that
its statistics live in a basis the refresh recomputes) are attributes of the
library's block classes, not of the config.
"""

import abc
import dataclasses
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, ClassVar

import estimators
from curvbench.components import (
  Component,
  Flag,
  Number,
  OneOf,
  Registry,
  Whole,
  setting,
)
from curvbench.core import curvatures
from estimators import estimation_modes

GIB = Number(0, low_in=False, finite=False)
MATRIX_POWER_METHODS = estimators.curvature.block_diagonal.MATRIX_POWER_METHODS


@dataclasses.dataclass(frozen=True)
class Nearer:
  """A published claim about the approximation that declares it: it is
  nearer the exact matrix, in relative Frobenius error, than the
  approximation `than`. The report checks it wherever a sweep measured
  both alike (per block type and over the whole network), quoting each
  one's gap over `floor`, an approximation neither can beat, where that
  was measured too."""

  than: str
  source: str
  floor: str | None = None


@dataclasses.dataclass
class CurvatureSettings(Component, abc.ABC):
  """What every curvature approximation has."""

  mode: str | None = setting(
    None,
    OneOf(estimators.ESTIMATION_MODES, null=True),
    "estimation mode (matrix-free families ignore it); null: the "
    "measurement's (ggn_curvature_prop, KFAC-JAX 0.0.8's optimizer's, "
    "where it trains or times; ggn_exact for spectra)",
  )
  cg_iters: int = setting(
    50, Whole(1), "conjugate-gradient steps where an inverse is matrix-free"
  )
  max_dense_gib: float = setting(
    2.0, GIB, "refuse to form a dense P x P matrix larger than this"
  )
  max_state_gib: float = setting(
    4.0,
    GIB,
    "refuse, before allocating it, a block-diagonal (or "
    "-tridiagonal) state larger than this; the error names the largest "
    "block",
  )
  distributed: bool = setting(
    True,
    Flag(),
    "with devices > 1, in the curvature phases of timing: "
    "each device refreshes and applies its share of the blocks (false: "
    "every device does every block)",
  )

  # Whether `mode` changes the estimate (sweeps run other modes only once).
  uses_estimation_mode: ClassVar[bool] = True
  # Whether estimators.Optimizer (optimizer=kfac) can use it.
  is_block_diagonal: ClassVar[bool] = False
  # Whether it forms each example's gradient from that example alone, which
  # a model normalising over the batch (batch norm) does not allow.
  per_example_alone: ClassVar[bool] = False
  # Published claims about it that the report checks (`Nearer`).
  claims: ClassVar[tuple[Nearer, ...]] = ()

  @abc.abstractmethod
  def make(self, loss_fn: Callable) -> curvatures.Curvature:
    """The curvature of `loss_fn` with these settings."""

  def common(self) -> dict:
    """The `Curvature` fields every family takes from these settings."""
    return dict(
      name=self.name,
      cg_iters=self.cg_iters,
      max_dense_gib=self.max_dense_gib,
      max_state_gib=self.max_state_gib,
    )

  def distribution(self) -> dict:
    """The estimator's arguments that share the work of its blocks among
    the devices of an axis (`distributed`)."""
    return dict(
      distributed_multiplies=self.distributed,
      distributed_cache_updates=self.distributed,
    )


@dataclasses.dataclass
class BlockDiagonal(CurvatureSettings):
  """One block per tagged layer, each of the class `blocks` names for its
  tag (the library's default for tags it does not name)."""

  # A class constant, or a property where the blocks take settings;
  # read-only either way.
  if TYPE_CHECKING:

    @property
    def blocks(self) -> Mapping[str, Any]:
      """`{tag name: block class}`: the block each tag gets (a class or a
      partial of one that takes the settings)."""

  else:
    blocks: ClassVar[Mapping[str, Any]] = {}
  # A cheaper choice, for the message that refuses a state too large.
  smaller: ClassVar[str] = "curvature=diagonal"
  is_block_diagonal: ClassVar[bool] = True

  matrix_power_method: str = setting(
    "decomposition",
    OneOf(MATRIX_POWER_METHODS),
    "how a refresh raises damped factors to powers: decomposition "
    "(Cholesky, eigh) or newton (the coupled Newton iteration: matrix "
    "products only, batched over equal-size factors; suits accelerators). "
    "Block-diagonal families; eigenbases and exact powers always use eigh",
  )
  newton_max_iterations: int = setting(
    100,
    Whole(1),
    "matrix_power_method=newton: the most Newton steps; a "
    "factor that needs more (too little damping) stops the run with an "
    "error",
  )

  def ignored(self):
    if self.matrix_power_method == "newton":
      return {}
    return {
      "newton_max_iterations": "matrix_power_method=decomposition "
      "takes no Newton steps"
    }

  def estimator_options(self) -> dict:
    """The block-diagonal estimator's arguments from these settings, past
    its function, mode, blocks and `distribution`. The harness's
    `fisher_empirical` estimates are the mean of per-example outer
    products, as its `empirical_fisher` reference and the exact estimators
    are (the library's default follows KFAC-JAX: that mean divided by the
    batch size)."""
    return dict(
      fisher_empirical_normalization="batch",
      matrix_power_method=self.matrix_power_method,
      newton_max_iterations=self.newton_max_iterations,
    )

  def make(self, loss_fn):
    options = self.estimator_options()
    estimator = estimators.BlockDiagonalCurvature(
      loss_fn,
      default_estimation_mode=self.mode,
      layer_tag_to_block_ctor=dict(self.blocks) or None,
      **self.distribution(),
      **options,
    )
    mode = estimator.default_estimation_mode  # the library's, where null
    return curvatures.BlockDiagonal(
      mode=mode,
      matrix=estimation_modes.matrix_type(mode),
      estimator=estimator,
      estimator_options=options,
      block_type=self.name,
      block_ctors=dict(self.blocks),
      smaller=self.smaller,
      **self.common(),
    )


CURVATURES = Registry(
  "curvature",
  # The components' base class: abstract, and never instantiated.
  CurvatureSettings,  # type: ignore[type-abstract]
  package=__name__,
)


def make(settings, loss_fn: Callable) -> curvatures.Curvature:
  """The curvature of `settings` (a mapping with `name`, or the settings)
  for `loss_fn`."""
  if not isinstance(settings, CurvatureSettings):
    settings = CURVATURES.load(settings, "curvature")
  return settings.make(loss_fn)


__all__ = [
  "BlockDiagonal",
  "CURVATURES",
  "CurvatureSettings",
  "MATRIX_POWER_METHODS",
  "Nearer",
  "make",
]
