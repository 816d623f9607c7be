"""The Frobenius-nearest Kronecker product to each layer's exact block (Van
Loan & Pitsianis, 1993), by power iteration on the per-example weight
gradients, started from Shampoo²'s factors."""

import dataclasses
import functools
from typing import Any

import estimators as kfac
from curvbench.approximations import CURVATURES, BlockDiagonal
from curvbench.approximations.shampoo import max_full_vocab_setting
from curvbench.components import Number, Whole, setting
from curvbench.core import palette


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
  tolerance: float | None = setting(
    None,
    Number(0, null=True),
    "stop once a step moves the unit-norm "
    "input factor by at most this (Frobenius); null: the square root of "
    "the parameters' machine epsilon",
  )
  max_full_vocab: int = max_full_vocab_setting()

  @property
  def blocks(self):
    # A property, not the usual class constant: the blocks take settings.
    ctor = functools.partial
    options: dict[str, Any] = dict(
      max_iterations=self.max_iterations, tolerance=self.tolerance
    )
    return {
      "dense_tag": ctor(kfac.DenseOptimalKronecker, **options),
      "repeated_dense_tag": ctor(kfac.DenseOptimalKronecker, **options),
      "conv2d_tag": ctor(kfac.Conv2DOptimalKronecker, **options),
      "embedding_tag": ctor(
        kfac.EmbeddingOptimalKronecker,
        max_full_vocab=self.max_full_vocab,
        **options,
      ),
    }
