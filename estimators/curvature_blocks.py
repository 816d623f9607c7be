"""KFAC-JAX's module name `curvature_blocks`: the blocks of `estimators.blocks`.

`kfac_jax.curvature_blocks.X` and `from kfac_jax import curvature_blocks`
keep working with `import estimators as kfac_jax`.
"""

from estimators.blocks import *  # noqa: F403  (the public blocks)
from estimators.blocks import __all__ as _block_names

# KFAC-JAX's submodule names, each the module of ours that holds its blocks
# (its `utils` holds the module-wide settings, as our base module does).
from estimators.blocks import base as curvature_block
from estimators.blocks import base as utils
from estimators.blocks import diagonal, full, tnt
from estimators.blocks import kronecker as kronecker_factored
from estimators.blocks.base import ScalarOrSequence

__all__ = list(_block_names) + [
  "ScalarOrSequence",
  "curvature_block",
  "diagonal",
  "full",
  "kronecker_factored",
  "tnt",
  "utils",
]
