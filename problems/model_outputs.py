"""Which part of what a model's `apply` returns is the loss's input.

Models as frameworks write them often return more than the logits: a
tuple `(logits, aux)`, a dict, or a dataclass holding them (Flax's
`struct.dataclass`, an Equinox module). A model's `output` setting
(`problems.Network.output`, which `curvbench.Model` passes on) names the
part that the loss reads:

- `None` (the default): apply returns that array itself;
- an `int`: the item at that index of a tuple or list;
- a `str`: the value at that key of a dict, or else the attribute of that
  name (a dataclass's field, a named tuple's);
- a tuple of these: a path, one step after the other, e.g. `(0, "logits")`
  for a model returning `({"logits": ..., ...}, state)`.

Where apply returns anything but an array and no `output` says which part
to read, the model is refused rather than a part guessed: the first item is
the logits in Flax's `(outputs, state)` but not in `(loss, logits)` or
`(features, logits)`, and a wrong guess would measure the curvature of
another function without a word. `pick` runs inside the traced forward
pass, so the parts need not be JAX types, only the array picked;
`problems.checks.output_shape` runs it abstractly on one example before
anything else, so a model is refused before any loss is registered.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any

import jax
import numpy as np

Step = int | str
Output = Step | tuple[Step, ...] | None

# How to name the part the loss reads, for messages.
HOW = (
  "name the part that holds the loss's input (the logits, or the "
  "predictions) with the model's `output` setting: "
  "curvbench.Model(apply, ..., output=...), or "
  "problems.Network(init, apply, output=...) in a problem of your own"
)


class OutputError(ValueError):
  """A model whose outputs its `output` setting picks no array from."""


def check_setting(output: Any) -> None:
  """Refuses an `output` setting of the wrong type, saying which to give."""
  if output is None:
    return
  steps = output if isinstance(output, tuple) else (output,)
  if steps and all(_is_step(s) for s in steps):
    return
  raise OutputError(
    f"output={output!r} names no part of the model's outputs: give None "
    "(apply returns the array itself), an index (int) into a tuple or "
    "list, a key of a dict or an attribute name (str), or a tuple of these "
    "as a path, e.g. output=(0, 'logits')."
  )


def _is_step(step) -> bool:
  return isinstance(step, (int, str)) and not isinstance(step, bool)


def _is_array(x) -> bool:
  return isinstance(x, (jax.Array, np.ndarray))


def pick(out, output: Output):
  """The array of `out` (what apply returned) that `output` names.

  Raises:
    OutputError: where `out` is not an array and `output` is None, where
      a step of `output` is not in `out` (an index out of range, a key or
      attribute it lacks), or where the part it names is not an array;
      each names what apply returned and the settings that would pick
      one of its arrays.
  """
  check_setting(output)
  if output is None:
    if _is_array(out):
      return out
    raise OutputError(
      f"apply returned {describe(out)}, not one array: {HOW}; {_choices(out)}."
    )
  steps = output if isinstance(output, tuple) else (output,)
  part = out
  done: tuple[Step, ...] = ()
  for step in steps:
    part = _step(part, step, output, done)
    done += (step,)
  if not _is_array(part):
    raise OutputError(
      f"output={output!r} picks {describe(part)} from what apply "
      f"returned, not an array; {_choices(out)}."
    )
  return part


def _step(part, step: Step, output: Output, done: tuple):
  """`part[step]`, or its attribute `step`; an `OutputError` where neither
  is there."""
  where = f"output={output!r}: apply's outputs{_path_text(done)} are"
  if isinstance(part, Mapping):
    if step in part:
      return part[step]
    keys = ", ".join(repr(k) for k in part)
    raise OutputError(
      f"{where} {_a(type(part).__name__)} without key {step!r}; give one of "
      f"its keys ({keys})."
    )
  fields = _fields(part)
  if isinstance(step, str):
    # An object's attribute; a named tuple's field (not a tuple's method).
    if step in fields or (
      not isinstance(part, (tuple, list)) and hasattr(part, step)
    ):
      return getattr(part, step)
    fix = (
      f"give one of its fields ({', '.join(map(repr, fields))})"
      if fields
      else f"give an index, 0..{len(part) - 1}"
      if isinstance(part, (tuple, list)) and part
      else "it has no named parts"
    )
    raise OutputError(
      f"{where} {describe(part)}, with no attribute {step!r}: {fix}."
    )
  if isinstance(part, (tuple, list)):
    if -len(part) <= step < len(part):
      return part[step]
    raise OutputError(
      f"{where} {_a(type(part).__name__)} of {len(part)}, which has no index "
      f"{step}: give one of 0..{len(part) - 1}."
    )
  fix = f": give a name, one of {', '.join(map(repr, fields))}" * bool(fields)
  raise OutputError(
    f"{where} {describe(part)}, which an index does not pick from{fix}."
  )


def _fields(x) -> tuple[str, ...]:
  """The names of `x`'s parts: a named tuple's or a dataclass's fields."""
  if isinstance(x, tuple) and hasattr(x, "_fields"):
    return tuple(x._fields)
  if dataclasses.is_dataclass(x) and not isinstance(x, type):
    return tuple(f.name for f in dataclasses.fields(x))
  return ()


def _parts(x) -> list[tuple[Step | Any, Any]]:
  """`(step, part)` for each part of a container `x`; [] for anything else."""
  if isinstance(x, Mapping):
    return list(x.items())
  fields = _fields(x)
  if fields:
    return [(f, getattr(x, f)) for f in fields]
  if isinstance(x, (tuple, list)):
    return list(enumerate(x))
  return []


def describe(x, depth: int = 0) -> str:
  """A short account of `x`'s structure: arrays as `dtype[shape]`,
  containers with their parts (two levels deep, six parts at most)."""
  if hasattr(x, "shape") and hasattr(x, "dtype"):
    return f"{x.dtype}[{', '.join(map(str, x.shape))}]"
  name = type(x).__name__
  parts = _parts(x)
  if not parts:
    if isinstance(x, (Mapping, tuple, list)):
      return f"an empty {name}"
    return "None" if x is None else _a(name)
  if depth >= 2:
    return f"{_a(name)} of {len(parts)}"
  shown = parts[:6]
  more = ", ..." if len(parts) > len(shown) else ""
  if isinstance(x, Mapping):
    inner = ", ".join(f"{k!r}: {describe(v, depth + 1)}" for k, v in shown)
    return f"{_a(name)} {{{inner}{more}}}"
  if _fields(x):
    inner = ", ".join(f"{k}={describe(v, depth + 1)}" for k, v in shown)
    return f"{_a(name)}({inner}{more})"
  inner = ", ".join(describe(v, depth + 1) for _, v in shown)
  return f"{_a(name)} of {len(parts)} ({inner}{more})"


def _a(name: str) -> str:
  return f"{'an' if name[:1].lower() in 'aeiou' else 'a'} {name}"


def _arrays(x, path: tuple, depth: int = 0) -> Iterator[tuple[tuple, Any]]:
  """`(path, array)` for the arrays inside `x`, three levels deep."""
  if _is_array(x):
    yield path, x
    return
  if depth < 3:
    for step, part in _parts(x):
      if _is_step(step):
        yield from _arrays(part, path + (step,), depth + 1)


def _choices(out) -> str:
  """The `output` settings that pick each array of `out` (six at most)."""
  found = list(_arrays(out, ()))
  if not found:
    return "it holds no array"
  shown = ", ".join(
    f"output={_setting_text(p)} ({describe(a)})" for p, a in found[:6]
  )
  more = f" and {len(found) - 6} more" if len(found) > 6 else ""
  return f"its arrays are picked by {shown}{more}"


def _setting_text(path: tuple) -> str:
  return repr(path[0]) if len(path) == 1 else repr(path)


def _path_text(path: tuple) -> str:
  return "".join(f"[{s!r}]" for s in path)
