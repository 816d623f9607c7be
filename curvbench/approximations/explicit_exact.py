"""The whole curvature of the estimation mode as one dense P x P matrix,
cross-layer terms included (small models)."""

import dataclasses

import estimators as kfac
from curvbench.approximations import CURVATURES, CurvatureSettings
from curvbench.core import curvatures, palette
from estimators import estimation_modes


@CURVATURES.register
@dataclasses.dataclass
class ExplicitExact(CurvatureSettings):
  """`estimators.ExplicitExactCurvature`: exact in the `*_exact` modes."""

  name: str = "explicit_exact"
  colour = palette.BLACK
  marker = "H"
  per_example_alone = True  # its rows: one example's gradient at a time

  def make(self, loss_fn):
    estimator = kfac.ExplicitExactCurvature(
      loss_fn, default_estimation_mode=self.mode
    )
    mode = estimator.default_estimation_mode  # the library's, where null
    return curvatures.ExplicitExact(
      mode=mode,
      matrix=estimation_modes.matrix_type(mode),
      estimator=estimator,
      **self.common(),
    )
