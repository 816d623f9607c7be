"""Parameter checkpoints that load without curvbench.

Checkpoints are safetensors files (a JSON header, then raw little-endian
tensors): a plain documented format with no pickle and a metadata slot, read
by numpy alone or by any framework; orbax needs orbax, npz has no metadata.
Nested dict keys are joined with "/": haiku's `{module: {name: array}}` is
stored as "module/name".

Loading one without curvbench::

  from safetensors.numpy import load_file
  params = {}
  for key, array in load_file("params_step0000100.safetensors").items():
    *modules, name = key.split("/")
    node = params
    for m in modules:
      node = node.setdefault(m, {})
    node[name] = array  # numpy; jnp.asarray(array) for a JAX array

A model with state (batch norm's running averages) stores it beside the
parameters under the top-level key "~model_state" (haiku gives no module a
name starting with "~"), e.g. "~model_state/norm_in/mean".
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import safetensors
import safetensors.numpy

from curvbench.core.records import atomic_write

FORMAT = "curvbench-params-v1"
SEP = "/"
MODEL_STATE = "~model_state"
_NAME = re.compile(r"params_step(\d+)\.safetensors")


def path_for(directory, step: int) -> Path:
  """The conventional file name of the checkpoint at `step` in `directory`."""
  return Path(directory) / f"params_step{step:07d}.safetensors"


def _leaves(params) -> dict:
  """Nested dicts -> `{"a/b/c": leaf}`, with clear errors for bad keys."""
  flat = {}

  def visit(node, prefix):
    for key, value in node.items():
      if not isinstance(key, str) or not key or SEP in key:
        raise ValueError(
          f"parameter key {key!r} under {SEP.join(prefix) or 'the root'!r} "
          f"cannot be stored: keys must be non-empty strings without "
          f"{SEP!r}, which separates nesting levels in the file (haiku "
          f"names nested modules 'outer/~/inner'; give the layers their "
          f"own top-level names, as problems/ does)"
        )
      if isinstance(value, Mapping):
        visit(value, prefix + [key])
      elif hasattr(value, "shape") and hasattr(value, "dtype"):
        flat[SEP.join(prefix + [key])] = value
      else:
        raise ValueError(
          f"parameter {SEP.join(prefix + [key])!r} is a "
          f"{type(value).__name__}, not an array or a dict of arrays"
        )

  if not isinstance(params, Mapping):
    raise ValueError(
      f"params must be a (nested) dict of arrays, got a {type(params).__name__}"
    )
  visit(params, [])
  return flat


def flatten(params) -> dict[str, np.ndarray]:
  """Nested dicts of arrays -> `{"a/b/c": numpy array}`, dtypes kept.

  Args:
    params: nested mappings with string keys and array leaves.

  Returns:
    A flat dict from "/"-joined key paths to contiguous numpy arrays.
  """
  # np.asarray pulls jax arrays to the host; safetensors needs C order.
  return {
    k: np.ascontiguousarray(np.asarray(v)) for k, v in _leaves(params).items()
  }


def unflatten(flat: Mapping[str, np.ndarray]) -> dict:
  """`{"a/b/c": array}` -> `{"a": {"b": {"c": array}}}`."""
  params: dict[str, Any] = {}
  for key, array in flat.items():
    *modules, name = key.split(SEP)
    node = params
    for m in modules:
      node = node.setdefault(m, {})
    node[name] = array
  return params


def save(
  path,
  params,
  *,
  step: int,
  problem: str,
  metadata: dict | None = None,
  model_state=None,
) -> Path:
  """Writes `params` to a safetensors file atomically.

  Args:
    path: the file to write (see `path_for` for the usual name).
    params: nested dict of arrays, e.g. haiku's `{module: {name: array}}`.
    step: the training step the parameters belong to.
    problem: the label of the problem they were trained on.
    metadata: extra JSON-serialisable information (e.g. the config).
    model_state: the model's state at that step, a nested dict like
      `params` (none or `{}`: a model without state).

  Returns:
    The path written.
  """
  if MODEL_STATE in params:
    raise ValueError(
      f"parameter key {MODEL_STATE!r} is where checkpoints "
      "keep the model state; rename that module."
    )
  flat = flatten(
    {**params, MODEL_STATE: model_state} if model_state else params
  )
  # safetensors metadata is str -> str, so anything richer goes in as JSON.
  header = {
    "format": FORMAT,
    "step": str(int(step)),
    "problem": str(problem),
    "curvbench": json.dumps(metadata or {}, sort_keys=True, default=str),
  }
  return atomic_write(
    Path(path),
    lambda tmp: safetensors.numpy.save_file(flat, tmp, metadata=header),
  )


def load(path) -> tuple[dict, dict]:
  """Reads a checkpoint written by `save`.

  Args:
    path: a safetensors file written by `save`.

  Returns:
    `(params, info)`: params as a nested dict of numpy arrays, and info with
    `step` (int), `problem` (str), `metadata` (the extra dict given to
    `save`) and `model_state` (`{}` where none was saved).
  """
  path = Path(path)
  if not path.is_file():
    raise FileNotFoundError(f"no checkpoint file at {path}")
  try:
    with safetensors.safe_open(path, framework="numpy") as f:
      header = f.metadata() or {}
      flat = {key: f.get_tensor(key) for key in f.keys()}
  except safetensors.SafetensorError as e:
    raise ValueError(
      f"{path} is not a safetensors file (expected an 8-byte header length, "
      f"a JSON header and raw tensors, as curvbench.core.checkpoints.save "
      f"writes): {e}"
    ) from e
  if header.get("format") != FORMAT:
    raise ValueError(
      f"{path} is a safetensors file without curvbench metadata (expected "
      f"format={FORMAT!r}, got {header.get('format')!r}); save parameters "
      f"with curvbench.core.checkpoints.save"
    )
  try:
    info = {
      "step": int(header["step"]),
      "problem": header["problem"],
      "metadata": json.loads(header.get("curvbench", "{}")),
    }
  except (KeyError, ValueError) as e:
    raise ValueError(f"{path} has damaged curvbench metadata: {e!r}") from e
  params = unflatten(flat)
  info["model_state"] = params.pop(MODEL_STATE, {})
  return params, info


def check_matches(
  params, reference_params, *, path, problem=None, expected_problem=None
) -> None:
  """Raises ValueError unless loaded params fit the problem being measured.

  Args:
    params: parameters loaded from `path`.
    reference_params: the problem's own (e.g. freshly initialised) params.
    path: the checkpoint file, named in the error.
    problem: the problem label stored in the checkpoint, if known.
    expected_problem: the label of the problem being measured, if known.

  Dtypes may differ; the caller casts. Tree structure and shapes may not.
  """
  if (
    problem is not None
    and expected_problem is not None
    and problem != expected_problem
  ):
    raise ValueError(
      f"checkpoint {path} was saved for problem {problem!r}, but the "
      f"measurement is on problem {expected_problem!r}"
    )
  # Shapes only: no need to copy the reference arrays off the device.
  got = {k: tuple(v.shape) for k, v in _leaves(params).items()}
  want = {k: tuple(v.shape) for k, v in _leaves(reference_params).items()}
  missing = sorted(set(want) - set(got))
  extra = sorted(set(got) - set(want))
  if missing or extra:
    raise ValueError(
      f"checkpoint {path} has a different parameter tree than the problem: "
      f"missing {missing or 'nothing'}, unexpected {extra or 'nothing'}"
    )
  bad = [
    f"{k}: checkpoint {got[k]} vs problem {want[k]}"
    for k in want
    if got[k] != want[k]
  ]
  if bad:
    raise ValueError(
      f"checkpoint {path} has parameters of the wrong shape: " + "; ".join(bad)
    )
  nonfinite = [
    k
    for k, v in _leaves(params).items()
    if not np.all(np.isfinite(np.asarray(v)))
  ]
  if nonfinite:
    raise ValueError(
      f"checkpoint {path} holds non-finite values (NaN or inf) in "
      f"{', '.join(nonfinite)}: there is no curvature to measure there "
      "(its training diverged, or the file was damaged)."
    )


def steps_in(directory) -> dict[int, Path]:
  """The checkpoints in a run directory, by training step (ascending)."""
  directory = Path(directory)
  if not directory.is_dir():
    raise FileNotFoundError(f"no run directory at {directory}")
  found = {}
  for p in directory.iterdir():
    m = _NAME.fullmatch(p.name)
    if m and p.is_file():
      found[int(m.group(1))] = p
  return dict(sorted(found.items()))
