"""Checks of `estimators.Optimizer`'s constructor arguments: each conflict
or invalid value gets an error naming the arguments and the fix."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from estimators import estimation_modes

# The matrices the exact quadratic model can use.
QUAD_MODEL_MATRICES = ("fisher", "ggn")


def check(settings: Mapping[str, Any]) -> None:
  """Raises ValueError for conflicting or invalid optimizer settings.

  Args:
    settings: the constructor's arguments by name.
  """
  s = settings
  for name in ("learning_rate", "momentum", "damping"):
    if s[f"use_adaptive_{name}"] and s[f"{name}_schedule"] is not None:
      raise ValueError(
        f"Pass either use_adaptive_{name}=True or a {name}_schedule, not both."
      )
  if s["use_adaptive_damping"] and s["initial_damping"] is None:
    raise ValueError("use_adaptive_damping=True needs initial_damping.")
  if s["use_initial_damping_calibration"] and s["num_burnin_steps"] <= 0:
    raise ValueError(
      "use_initial_damping_calibration=True needs num_burnin_steps > 0: "
      "the calibration uses the burnt-in curvature estimate."
    )
  if s["norm_constraint"] is not None and s["use_adaptive_learning_rate"]:
    raise ValueError(
      "norm_constraint cannot be combined with "
      "use_adaptive_learning_rate=True: the adaptive rule "
      "already sets the step length."
    )
  if not 0 < s["damping_lower_threshold"] < s["damping_upper_threshold"]:
    raise ValueError(
      "Need 0 < damping_lower_threshold < damping_upper_threshold."
    )
  _check_periods(s)
  norm = s["norm_to_scale_identity_weight_per_block"]
  adaptive = (
    s["use_adaptive_learning_rate"]
    or s["use_adaptive_momentum"]
    or s["use_adaptive_damping"]
  )
  if norm not in (None, "none") and adaptive:
    raise ValueError(
      "norm_to_scale_identity_weight_per_block cannot be combined with "
      "adaptive learning rate, momentum or damping: the exact quadratic "
      "model they use does not scale the damping per block."
    )
  matrix = s["exact_quad_model_matrix_type"]
  if matrix is not None and matrix not in QUAD_MODEL_MATRICES:
    raise ValueError(
      f"exact_quad_model_matrix_type={matrix!r}: choose 'fisher', 'ggn' or "
      "None (the estimation mode's matrix)."
    )
  if s["custom_estimator_ctor"] is not None and s["estimator_ctor"] is not None:
    raise ValueError(
      "Pass custom_estimator_ctor or its older name estimator_ctor, not both."
    )
  if s["num_estimator_samples"] < 0:
    raise ValueError(
      f"num_estimator_samples={s['num_estimator_samples']}: give an int >= 0."
    )
  if s["estimation_mode"] is not None:
    estimation_modes.check_estimation_mode(s["estimation_mode"])


def _check_periods(s: Mapping[str, Any]) -> None:
  for name in (
    "curvature_update_period",
    "inverse_update_period",
    "damping_adaptation_interval",
  ):
    period = s[name]
    if not isinstance(period, (int, np.integer)) or period < 1:
      raise ValueError(f"{name} must be an integer >= 1, got {period!r}.")
  if s["curvature_update_period"] > s["inverse_update_period"]:
    raise ValueError(
      f"curvature_update_period={s['curvature_update_period']} is larger "
      f"than inverse_update_period={s['inverse_update_period']}: the same "
      "estimate would be inverted again. Raise inverse_update_period instead."
    )


def check_step_hyperparameters(
  given: Mapping[str, tuple[bool, Any, Any]],
) -> None:
  """Checks that `step` gets each hyperparameter exactly when needed.

  Args:
    given: by name ("learning_rate", ...), whether the optimizer adapts
      it, its schedule (or None) and the value passed to `step` (or None).

  Raises:
    ValueError: for a missing or superfluous value.
  """
  for name, (adaptive, schedule, value) in given.items():
    if adaptive and value is not None:
      raise ValueError(
        f"{name} was passed to step() but the optimizer "
        f"adapts it (use_adaptive_{name}=True); drop it."
      )
    if schedule is not None and value is not None:
      raise ValueError(
        f"{name} was passed to step() but a {name}_schedule "
        "was given to the constructor; use one of them."
      )
    if not adaptive and schedule is None and value is None:
      raise ValueError(
        f"step() needs {name}=...: the optimizer was built "
        f"without use_adaptive_{name} or a {name}_schedule."
      )
