"""KL-Shampoo (Lin et al., 2025): the Kronecker product `S_a ⊗ S_b` nearest
each layer's (damped) exact block in KL divergence, by the paper's
fixed-point iteration on the per-example weight gradients."""

import dataclasses

import estimators as kfac
from curvbench.approximations import CURVATURES, BlockDiagonal
from curvbench.approximations.optimal_kronecker import tolerance_setting
from curvbench.approximations.shampoo import (
  max_full_vocab_setting,
  shampoo_family_blocks,
)
from curvbench.components import Number, Whole, setting
from curvbench.core import palette


@CURVATURES.register
@dataclasses.dataclass
class KLShampoo(BlockDiagonal):
  """KL-Shampoo blocks for dense (shared over positions too), conv and
  embedding layers; other tags keep the library's default block."""

  name: str = "kl_shampoo"
  colour = palette.PURPLE
  marker = "h"
  max_iterations: int = setting(
    100,
    Whole(1),
    "the most fixed-point steps per update (1 from the "
    "previous factors: the paper's moving-average step)",
  )
  tolerance: float | None = tolerance_setting()
  damping: float = setting(
    1e-3,
    Number(0),
    "the paper's damping κ, as a fraction of the batch "
    "block's mean eigenvalue (0: undamped, which needs enough examples)",
  )
  max_full_vocab: int = max_full_vocab_setting()

  @property
  def blocks(self):
    # A property, not the usual class constant: the blocks take settings.
    return shampoo_family_blocks(
      kfac.DenseKLShampoo,
      kfac.Conv2DKLShampoo,
      kfac.EmbeddingKLShampoo,
      self.max_full_vocab,
      max_iterations=self.max_iterations,
      tolerance=self.tolerance,
      damping=self.damping,
    )
