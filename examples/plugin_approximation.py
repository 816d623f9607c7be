"""Your own curvature approximation, beside the built-in ones.

K-FAC's Kronecker factors for the dense layers, the diagonal for every
other layer: a hybrid that keeps K-FAC where its factors are cheapest.

    curvbench plugins=[examples/plugin_approximation.py] problem=convnet \
        curvature=kfac_dense measure=spectra
    python examples/plugin_approximation.py      # the same from Python

A plugin is any module that registers components when imported; a name
that a built-in component holds is refused, naming both.
"""

import dataclasses
from typing import ClassVar

import estimators
from curvbench.approximations import CURVATURES, BlockDiagonal


@CURVATURES.register
@dataclasses.dataclass
class KFACDense(BlockDiagonal):
  """K-FAC blocks for dense layers, diagonal blocks for the rest."""

  name: str = "kfac_dense"
  blocks: ClassVar = {
    "dense_tag": estimators.DenseTwoKroneckerFactored,
    "conv2d_tag": estimators.Conv2DDiagonal,
    "scale_and_shift_tag": estimators.ScaleAndShiftDiagonal,
  }


if __name__ == "__main__":
  import sys

  import curvbench

  results = curvbench.measure(
    "convnet",
    approximations=["kfac", "kfac_dense", "diagonal"],
    measurements=["spectra"],
    name="kfac_dense",
    settings=["measure.spectra.references=[ggn]", *sys.argv[1:]],
  )
  quality = results.tables["quality"]
  print(
    quality[
      quality.metric.eq("relative_frobenius") & quality.level.eq("network")
    ]
    .groupby("method")
    .value.median()
  )
  print("report:", results.report()["tables"][-1])
