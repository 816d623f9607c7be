"""Checks of a problem's examples, run before anything trains on them.

The Python API (`curvbench.Data`) and every problem `problems.make` builds
(curvbench's own and plugins') go through the same checks: the model
returns one array, or its `output` setting names one in what it returns
(`problems.model_outputs`; else `OutputError`); each split's inputs and
targets are numbers, agree in length and are not empty; the inputs are
finite and have the same shape per example in both splits; the targets fit
the loss and the model's outputs (class labels whole numbers in
0..outputs-1, one per prediction; regression and reconstruction targets
finite, of the outputs' shape, in [0, 1] for the sigmoid cross-entropy).
A failure raises `ExamplesError` naming the split's array and the fix.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np

from problems.base import LABEL_LOSSES
from problems.model_outputs import OutputError

SPLITS = ("train", "test")


class ExamplesError(ValueError):
  """Examples a problem cannot be measured on (found before any run)."""


def _fail(where: str, message: str, fix: str) -> ExamplesError:
  return ExamplesError(f"{where}: {message} {fix}".rstrip())


def _first(mask: np.ndarray) -> int:
  """The index of the first example with a True entry in `mask`."""
  per_example = mask.reshape(len(mask), -1).any(axis=1)
  return int(np.argmax(per_example))


def _nonfinite(a: np.ndarray) -> np.ndarray | None:
  """The mask of `a`'s NaN and infinite entries, None where all are finite
  (told first from the extremes, which NaN and infinities reach)."""
  if not np.issubdtype(a.dtype, np.floating) or a.size == 0:
    return None
  if np.isfinite(a.min()) and np.isfinite(a.max()):
    return None
  return ~np.isfinite(a)


def _numeric(a: np.ndarray) -> bool:
  return bool(
    np.issubdtype(a.dtype, np.integer) or np.issubdtype(a.dtype, np.floating)
  )


def check_arrays(
  arrays: Mapping[str, Any], *, where: str, fix: str = ""
) -> None:
  """Checks what holds whatever the model: each split's `x_*` and `y_*`
  (`y_*` None where there are no targets; a split whose `x_*` is None is
  left out) are numeric arrays, one target per input, at least one example
  each; inputs have a per-example shape, the same in both splits, and are
  finite. `where` names the data in messages, `fix` ends them."""
  shapes = {}
  for split in SPLITS:
    x, y = arrays.get(f"x_{split}"), arrays.get(f"y_{split}")
    if x is None:
      continue
    x = np.asarray(x)
    if not _numeric(x):
      raise _fail(
        where,
        f"x_{split} has dtype {x.dtype}; inputs must be numbers (floats, or "
        f"integer token ids): convert them, e.g. x_{split}.astype(np.float32).",
        fix,
      )
    if x.ndim < 2:
      raise _fail(
        where,
        f"x_{split} has shape {x.shape}; inputs need an axis of examples "
        "and at least one more for each example's values: give shape "
        f"(examples, features), e.g. x_{split}.reshape(len(x_{split}), -1)"
        if x.ndim
        else f"x_{split} is a single number; give an array of examples.",
        fix,
      )
    if len(x) == 0:
      raise _fail(
        where,
        f"x_{split} holds no examples (shape {x.shape}); give at least one "
        f"in each split.",
        fix,
      )
    if y is not None:
      y = np.asarray(y)
      if y.ndim == 0 or len(y) != len(x):
        count = "a single number" if y.ndim == 0 else f"{len(y)} targets"
        raise _fail(
          where,
          f"x_{split} has {len(x)} examples but y_{split} holds {count}; "
          "give one target per example.",
          fix,
        )
      if not (_numeric(y) or y.dtype == np.bool_):
        raise _fail(
          where,
          f"y_{split} has dtype {y.dtype}; targets must be numbers (integer "
          "class labels, or floats for regression).",
          fix,
        )
    shapes[split] = x.shape[1:]
    bad = _nonfinite(x)
    if bad is not None:
      raise _fail(
        where,
        f"x_{split} holds {int(bad.sum())} NaN or infinite value(s), the "
        f"first in example {_first(bad)}; drop or repair those examples "
        "(every input must be finite).",
        fix,
      )
  if len(shapes) == 2 and shapes["train"] != shapes["test"]:
    raise _fail(
      where,
      f"each example of x_train has shape {shapes['train']} but each of "
      f"x_test {shapes['test']}; give both splits inputs of one shape.",
      fix,
    )


def output_shape(
  outputs: Callable, x: np.ndarray, *, where: str, fix: str = ""
) -> tuple[int, ...]:
  """The shape of `outputs(rng, inputs)` (initialisation and forward pass)
  on the first example of `x`, evaluated abstractly: nothing is computed.

  Raises:
    problems.model_outputs.OutputError: where the model returns no array
      or its `output` setting names none, before any loss is registered.
    ExamplesError: where the model cannot be applied to the example, or
      its outputs lack an axis of examples.
  """
  try:
    out = jax.eval_shape(outputs, jax.random.PRNGKey(0), x[:1])
  except OutputError as e:  # what apply returned is no array, or not named
    raise OutputError(f"{where}: {e}") from None
  except Exception as e:
    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    raise _fail(
      where,
      f"the model cannot be applied to one example of x_train (shape "
      f"{tuple(x.shape[1:])}, dtype {x.dtype}): {type(e).__name__}: {first}. "
      "Give inputs of the shape the model reads, or fix the model.",
      fix,
    ) from e
  if not hasattr(out, "shape") or len(out.shape) < 2:
    raise _fail(
      where,
      f"the model's outputs on a batch of one example are {out}; apply "
      "must return one array with an axis of examples and the outputs "
      "(logits or predictions) after it.",
      fix,
    )
  return tuple(out.shape)


def _check_labels(y, split, outputs, where, fix) -> None:
  """Class labels `y` of one split against the outputs' shape."""
  classes = outputs[-1]
  per_example = tuple(outputs[1:-1])
  if y.dtype == np.bool_:
    raise _fail(
      where,
      f"y_{split} holds booleans; class labels are integers "
      f"0..{classes - 1}: give y_{split}.astype(np.int32).",
      fix,
    )
  fractional = y != np.round(y)  # NaN too
  if fractional.any():
    raise _fail(
      where,
      f"y_{split} has dtype {y.dtype} and {int(fractional.sum())} values "
      f"that are not class labels (the first at example {_first(fractional)}"
      f"); give whole numbers 0..{classes - 1} (integers, e.g. np.int32), "
      "or choose task='regression' for real-valued targets.",
      fix,
    )
  if tuple(y.shape[1:]) != per_example:
    one_hot = tuple(y.shape[1:]) == tuple(outputs[1:])
    raise _fail(
      where,
      f"y_{split} has shape {y.shape}; the model's outputs are "
      f"{tuple(outputs[1:])} per example, so the loss wants "
      + (
        f"a class label for each of the {per_example} positions"
        if per_example
        else "one class label per example"
      )
      + f", shape {(len(y),) + per_example}"
      + (
        f": give the labels, not one-hot rows (y_{split}.argmax(-1))."
        if one_hot
        else "."
      ),
      fix,
    )
  lo, hi = y.min(), y.max()
  if lo < 0 or hi >= classes:
    bad = (y < 0) | (y >= classes)
    raise _fail(
      where,
      f"y_{split} holds labels in [{lo:g}, {hi:g}] ({int(bad.sum())} outside "
      f"0..{classes - 1}, the first at example {_first(bad)}), but the "
      f"model has {classes} outputs: number the classes 0..{classes - 1}, "
      "or give the model one output per class.",
      fix,
    )


def _check_values(t, name, outputs, loss_name, where, fix) -> None:
  """Regression or reconstruction targets `t` of one split."""
  if tuple(t.shape[1:]) != tuple(outputs[1:]):
    raise _fail(
      where,
      f"{name} has shape {t.shape[1:]} per example but the model's outputs "
      f"{tuple(outputs[1:])}; the {loss_name} loss compares them entry by "
      "entry: give targets of the outputs' shape (a column per output), or "
      "a model with as many outputs.",
      fix,
    )
  if not (_numeric(t) or t.dtype == np.bool_):
    raise _fail(
      where, f"{name} has dtype {t.dtype}; give numbers (floats).", fix
    )
  bad = _nonfinite(t)
  if bad is not None:
    raise _fail(
      where,
      f"{name} holds {int(bad.sum())} NaN or infinite value(s), the first "
      f"in example {_first(bad)}; drop or repair those examples (every "
      "target must be finite).",
      fix,
    )
  if loss_name == "sigmoid_cross_entropy":
    lo, hi = float(t.min()), float(t.max())
    if lo < 0 or hi > 1:
      outside = (t < 0) | (t > 1)
      raise _fail(
        where,
        f"{name} holds values in [{lo:g}, {hi:g}] (the first outside [0, 1] "
        f"in example {_first(outside)}); the sigmoid cross-entropy wants "
        "targets in [0, 1] (probabilities): scale them (pixels: / 255), "
        "or choose loss='squared_error'.",
        fix,
      )


def check_targets(
  arrays: Mapping[str, Any],
  *,
  task: str,
  loss_name: str,
  outputs: tuple[int, ...],
  where: str,
  fix: str = "",
) -> None:
  """Checks each split's targets against the loss and the model's
  `outputs` shape (from `output_shape`): class labels for the losses of
  `LABEL_LOSSES`; the inputs, flattened, for a reconstruction; `y_*`
  otherwise. Run `check_arrays` first."""
  for split in SPLITS:
    x = np.asarray(arrays[f"x_{split}"])
    if task == "reconstruction":
      targets = x.reshape(len(x), -1)
      name = f"x_{split} (the targets of a reconstruction, flattened)"
    else:
      targets = np.asarray(arrays[f"y_{split}"])
      name = f"y_{split}"
    if loss_name in LABEL_LOSSES and task != "reconstruction":
      _check_labels(targets, split, outputs, where, fix)
    else:
      _check_values(targets, name, outputs, loss_name, where, fix)


def _one_input(x: np.ndarray) -> np.ndarray:
  """The first example of `x`: floats as float32, as `Problem.batches`
  gives them; integer token ids as stored, as the model is initialised."""
  one = x[:1]
  return one if np.issubdtype(x.dtype, np.integer) else one.astype(np.float32)


def check_problem(problem) -> None:
  """Checks a built `problems.Problem`'s data against its task, loss and
  model (`problems.make` calls it before returning the problem)."""
  data = problem.data
  where = f"dataset {data.name!r} of problem {problem.name!r}"
  fix = (
    "Fix the arrays the dataset's load() returns, or choose a dataset "
    "(problem/data=NAME) or loss that fits the problem."
  )
  arrays = {f"{k}_{s}": getattr(data, f"{k}_{s}") for s in SPLITS for k in "xy"}
  check_arrays(arrays, where=where, fix=fix)
  outputs = output_shape(
    lambda rng, x: problem.outputs(problem.init_params(rng), x),
    _one_input(np.asarray(data.x_train)),
    where=where,
    fix=fix,
  )
  check_targets(
    arrays,
    task=problem.task,
    loss_name=problem.loss_name,
    outputs=outputs,
    where=where,
    fix=fix,
  )
