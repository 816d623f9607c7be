"""KFAC-JAX's module name `tag_graph_matcher`: automatic layer registration
from `estimators.graph_matcher`."""

from estimators.graph_matcher import (
  DEFAULT_GRAPH_PATTERNS,
  GraphMatcherComparator,
  GraphPattern,
  TaggedFunction,
  auto_register_tags,
  check_patterns_to_skip,
  conv2d_layer,
  dense_layer,
  normalization_layer,
  registration_report,
  scale_and_shift_layer,
)

__all__ = [
  "DEFAULT_GRAPH_PATTERNS",
  "GraphMatcherComparator",
  "GraphPattern",
  "TaggedFunction",
  "auto_register_tags",
  "check_patterns_to_skip",
  "conv2d_layer",
  "dense_layer",
  "normalization_layer",
  "registration_report",
  "scale_and_shift_layer",
]
