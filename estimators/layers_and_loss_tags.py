"""KFAC-JAX's module name `layers_and_loss_tags`: the tag primitives and
registration functions of `estimators.tags`."""

from estimators.tags import (
  LayerTag,
  LossTag,
  conv2d,
  dense,
  embedding,
  generic,
  register_embedding,
  register_conv2d,
  register_dense,
  register_generic,
  register_repeated_dense,
  register_scale_and_shift,
  repeated_dense,
  scale_and_shift,
)

__all__ = [
  "LayerTag",
  "LossTag",
  "conv2d",
  "dense",
  "embedding",
  "generic",
  "register_embedding",
  "register_conv2d",
  "register_dense",
  "register_generic",
  "register_repeated_dense",
  "register_scale_and_shift",
  "repeated_dense",
  "scale_and_shift",
]
