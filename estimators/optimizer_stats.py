"""Statistics an optimizer step reports besides the loss and coefficients:
norms of its vectors and the loss of the registered losses."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from estimators import utils
from estimators.utils.types import Array, Numeric, Params


def norms(
  named: Mapping[str, Params], whole: bool, per_param: bool
) -> dict[str, Any]:
  """Euclidean norms of parameter-shaped trees.

  Args:
    named: the trees by name (e.g. "grad").
    whole: add "<name>_norm", the norm of the whole tree.
    per_param: add the norm of each array, both as a tree under
      "per_param_<name>_norm" and flat under KFAC-JAX's keys
      "<name>_norm(<path>)", path as "a/b/0".

  Returns:
    The statistics.
  """
  stats: dict[str, Any] = {}
  for name, tree in named.items():
    if whole:
      stats[f"{name}_norm"] = jnp.sqrt(utils.inner_product(tree, tree))
    if per_param:
      each = jax.tree.map(jnp.linalg.norm, tree)
      stats[f"per_param_{name}_norm"] = each
      for path, value in jax.tree_util.tree_flatten_with_path(each)[0]:
        stats[f"{name}_norm({path_string(path)})"] = value
  return stats


def path_string(path: Sequence[Any]) -> str:
  """A tree path as "a/b/0": dict keys, attribute names and indices."""
  parts = []
  for key in path:
    for attr in ("key", "name", "idx"):
      if hasattr(key, attr):
        parts.append(str(getattr(key, attr)))
        break
  return "/".join(parts)


def registered_loss(
  losses: Sequence[Any], batch_size: Numeric, l2_reg: Numeric, params: Params
) -> Array:
  """The loss the registrations describe: the registered losses' summed
  values over the batch size, plus `l2_reg / 2 ||params||²`. The
  registrations need their targets."""
  total = sum(
    jnp.sum(loss.evaluate(None, coefficient_mode="regular")) for loss in losses
  )
  value = total / batch_size
  return value + l2_reg / 2 * utils.inner_product(params, params)
