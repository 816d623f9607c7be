"""Block-tridiagonal K-FAC (Martens & Grosse, ICML 2015, Section 4.3):
consecutive dense layers coupled (a Gaussian chain whose inverse is
block-tridiagonal), with the paper's factored damping; other layers keep
their K-FAC blocks."""

import dataclasses
from typing import ClassVar

import estimators as kfac
from curvbench.approximations import CURVATURES, BlockDiagonal
from curvbench.core import curvatures, palette
from estimators import estimation_modes


@dataclasses.dataclass(frozen=True)
class BlockTridiagonal(curvatures.BlockDiagonal):
  """`estimators.BlockTridiagonalCurvature` behind the `Curvature`
  interface; its inverse is the approximate (factored-damping) one."""

  damped_inverse_is_exact = False

  def empty_state(self, rng, params, batch):
    return self.estimator.init(rng, (params, batch), approx_powers_to_cache=-1)

  def refresh(self, state, damping, axis_name=None):
    return self.estimator.update_cache(
      state, damping, approx_powers=-1, pmap_axis_name=axis_name
    )

  def precondition(self, state, vector, damping, axis_name=None):
    return self.estimator.multiply_inverse(
      state,
      vector,
      identity_weight=damping,
      exact_power=False,
      use_cached=True,
      pmap_axis_name=axis_name,
    )


@CURVATURES.register
@dataclasses.dataclass
class KFACTridiagonal(BlockDiagonal):
  """K-FAC blocks, consecutive dense ones coupled."""

  name: str = "kfac_tridiagonal"
  colour = palette.WINE
  marker = "v"
  smaller: ClassVar = (
    "curvature=kfac, without the coupling, or curvature=diagonal"
  )

  def make(self, loss_fn):
    options = self.estimator_options()
    estimator = kfac.BlockTridiagonalCurvature(
      loss_fn,
      default_estimation_mode=self.mode,
      **self.distribution(),
      **options,
    )
    mode = estimator.default_estimation_mode  # the library's, where null
    return BlockTridiagonal(
      mode=mode,
      matrix=estimation_modes.matrix_type(mode),
      estimator=estimator,
      estimator_options=options,
      block_type=self.name,
      smaller=self.smaller,
      **self.common(),
    )
