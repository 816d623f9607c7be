"""KFAC-JAX's module name `curvature_blocks`: the blocks of `estimators.blocks`.

`kfac_jax.curvature_blocks.X` and `from kfac_jax import curvature_blocks`
keep working with `import estimators as kfac_jax`.
"""

from estimators.blocks import *  # noqa: F401,F403  (the public blocks)
from estimators.blocks import __all__ as _block_names
from estimators.blocks.base import ScalarOrSequence

__all__ = list(_block_names) + ["ScalarOrSequence"]
