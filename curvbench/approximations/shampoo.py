"""Shampoo (Gupta et al., ICML 2018) as a curvature: `(L ⊗ R)^(1/2)` from
the per-example weight gradients' factors, scaled to the exact block's
trace."""

import dataclasses
import functools

import estimators as kfac
from curvbench.approximations import CURVATURES, BlockDiagonal
from curvbench.components import Whole, setting
from curvbench.core import palette


def max_full_vocab_setting():
  """The Shampoo family's embedding setting (each of its approximations
  declares it)."""
  return setting(
    kfac.blocks.MAX_FULL_VOCAB,
    Whole(0),
    "embeddings: the largest "
    "vocabulary whose input-side factor is a full V x V matrix; a larger "
    "one keeps its diagonal, as Distributed Shampoo does above a size",
  )


def shampoo_family_blocks(
  dense, conv, embedding, max_full_vocab: int, **options
) -> dict:
  """The blocks of a Shampoo-family approximation: the library's `dense`,
  `conv` and `embedding` block classes for dense (shared over positions
  too), conv and embedding layers, each given `options`, the embedding's
  `max_full_vocab` too."""
  if options:
    dense = functools.partial(dense, **options)
    conv = functools.partial(conv, **options)
  return {
    "dense_tag": dense,
    "repeated_dense_tag": dense,
    "conv2d_tag": conv,
    "embedding_tag": functools.partial(
      embedding, max_full_vocab=max_full_vocab, **options
    ),
  }


@CURVATURES.register
@dataclasses.dataclass
class Shampoo(BlockDiagonal):
  """Shampoo blocks for dense (shared over positions too), conv and
  embedding layers; other tags keep the library's default block."""

  name: str = "shampoo"
  colour = palette.TEAL
  marker = "P"
  max_full_vocab: int = max_full_vocab_setting()

  @property
  def blocks(self):
    # A property, not the usual class constant: the embedding block takes
    # a setting.
    return shampoo_family_blocks(
      kfac.DenseShampoo,
      kfac.Conv2DShampoo,
      kfac.EmbeddingShampoo,
      self.max_full_vocab,
    )
