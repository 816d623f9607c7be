"""Shampoo² (Morwani et al., ICLR 2025): `L ⊗ R / tr L` from Shampoo's
factors `L = E[G Gᵀ]`, `R = E[Gᵀ G]` of the per-example weight gradients;
for a weight matrix it is the same matrix as two-factor TNT."""

import dataclasses
from typing import ClassVar

import estimators as kfac
from curvbench.approximations import CURVATURES, BlockDiagonal, Nearer
from curvbench.approximations.shampoo import (
  max_full_vocab_setting,
  shampoo_family_blocks,
)
from curvbench.core import palette


@CURVATURES.register
@dataclasses.dataclass
class Shampoo2(BlockDiagonal):
  """Shampoo² blocks for dense (shared over positions too), conv and
  embedding layers; other tags keep the library's default block."""

  name: str = "shampoo2"
  colour = palette.VERMILLION
  marker = "X"
  max_full_vocab: int = max_full_vocab_setting()
  # Morwani et al.'s finding: Shampoo² is one power-iteration step toward
  # the nearest Kronecker product, and close to it; Shampoo is not.
  claims: ClassVar = (
    Nearer(
      than="shampoo",
      floor="optimal_kronecker",
      source="Morwani et al., ICLR 2025",
    ),
  )

  @property
  def blocks(self):
    # A property, not the usual class constant: the embedding block takes
    # a setting.
    return shampoo_family_blocks(
      kfac.DenseShampoo2,
      kfac.Conv2DShampoo2,
      kfac.EmbeddingShampoo2,
      self.max_full_vocab,
    )
