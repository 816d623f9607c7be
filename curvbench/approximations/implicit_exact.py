"""An exact matrix through matrix-vector products only (its inverse by
conjugate gradients): the GGN, Fisher, empirical Fisher or Hessian. It is
registered twice: `implicit_exact` (the GGN) and `implicit_hessian`."""

import dataclasses
from typing import ClassVar

from curvbench.approximations import CURVATURES, CurvatureSettings
from curvbench.components import OneOf, setting
from curvbench.core import curvatures, palette


@dataclasses.dataclass
class ImplicitExact(CurvatureSettings):
  """The `matrix` it multiplies by is set here, so `mode` is ignored."""

  name: str = "implicit_exact"
  colour = palette.GREY
  marker = "8"
  matrix: str = setting(
    "ggn", OneOf(tuple(curvatures.IMPLICIT_PRODUCTS)), "the exact matrix"
  )

  uses_estimation_mode: ClassVar[bool] = False

  def make(self, loss_fn):
    return curvatures.ImplicitExact.of_matrix(
      self.matrix, loss_fn, **self.common()
    )


CURVATURES.register(ImplicitExact)
CURVATURES.register(ImplicitExact, name="implicit_hessian", matrix="hessian")
