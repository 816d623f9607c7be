"""KFAC-JAX's module name `patches_second_moment`: the convolution-patch
moments of `estimators.patches`."""

from estimators.patches import patches_moments, patches_moments_explicit

__all__ = ["patches_moments", "patches_moments_explicit"]
