"""The Frobenius-nearest Kronecker product to each layer's exact block (Van
Loan & Pitsianis, 1993), by power iteration on the per-example weight
gradients, started from Shampoo²'s factors."""

import dataclasses

import estimators as kfac
from curvbench.approximations import CURVATURES, BlockDiagonal
from curvbench.approximations.shampoo import (
  max_full_vocab_setting,
  shampoo_family_blocks,
)
from curvbench.components import Number, Whole, setting
from curvbench.core import palette


def tolerance_setting():
  """When the fixed-point iterations of the nearest Kronecker product and
  of KL-Shampoo stop (each of them declares it)."""
  return setting(
    None,
    Number(0, null=True),
    "stop once a step moves the unit-norm "
    "input factor by at most this (Frobenius); null: the square root of "
    "the parameters' machine epsilon",
  )


@CURVATURES.register
@dataclasses.dataclass
class OptimalKronecker(BlockDiagonal):
  """Nearest-Kronecker blocks for dense (shared over positions too), conv
  and embedding layers; other tags keep the library's default block."""

  name: str = "optimal_kronecker"
  colour = palette.BLUE
  marker = "p"
  max_iterations: int = setting(
    100,
    Whole(0),
    "the most power-iteration steps per update (0: "
    "Shampoo²'s factors, optimally scaled)",
  )
  tolerance: float | None = tolerance_setting()
  max_full_vocab: int = max_full_vocab_setting()

  @property
  def blocks(self):
    # A property, not the usual class constant: the blocks take settings.
    return shampoo_family_blocks(
      kfac.DenseOptimalKronecker,
      kfac.Conv2DOptimalKronecker,
      kfac.EmbeddingOptimalKronecker,
      self.max_full_vocab,
      max_iterations=self.max_iterations,
      tolerance=self.tolerance,
    )
