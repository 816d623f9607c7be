"""The calling convention of the optimizer's value-and-grad function.

`Optimizer` calls `value_and_grad_func(params, [func_state,] [rng,] batch)`
and gets `(out, grads)`, where `out` is the loss, `(loss, func_state)`,
`(loss, aux)` or `(loss, (func_state, aux))`, per the function's
`has_state` / `has_aux` flags. These helpers build the arguments and take
the outputs apart; `estimators.optimizer` re-exports them under KFAC-JAX's
names.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from estimators.utils.types import Array, Batch, FuncAux, Params, PRNGKey

FuncState = Any

# The positional arguments of the value function, by which of state and rng
# it takes.
FuncArgsVariants = (
  tuple[Params, Batch]
  | tuple[Params, FuncState, Batch]
  | tuple[Params, PRNGKey, Batch]
  | tuple[Params, FuncState, PRNGKey, Batch]
)
# The value function's first output, by which of state and aux it returns.
FuncOutputs = (
  Array
  | tuple[Array, FuncState]
  | tuple[Array, FuncAux]
  | tuple[Array, tuple[FuncState, FuncAux]]
)
ValueFunc = Callable[..., FuncOutputs]
ValueAndGradFunc = Callable[..., tuple[FuncOutputs, Params]]


def make_func_args(
  params: Params,
  func_state: FuncState | None,
  rng: PRNGKey | None,
  batch: Batch,
  has_state: bool,
  has_rng: bool,
) -> FuncArgsVariants:
  """`(params, [func_state,] [rng,] batch)`, with only the flagged extras.

  Args:
    params: the model parameters.
    func_state: the function's state; needed when `has_state`.
    rng: a PRNG key; needed when `has_rng`.
    batch: the data.
    has_state: whether the function takes a state.
    has_rng: whether the function takes a PRNG key.

  Returns:
    The positional arguments of the value function.

  Raises:
    ValueError: for a flagged argument given as None.
  """
  if has_state and func_state is None:
    raise ValueError(
      "has_state=True but func_state is None: pass the function's state."
    )
  if has_rng and rng is None:
    raise ValueError("has_rng=True but rng is None: pass a PRNG key.")
  extras = ((func_state,) if has_state else ()) + ((rng,) if has_rng else ())
  return (params, *extras, batch)


def extract_func_outputs(
  raw_outputs: FuncOutputs, has_aux: bool, has_state: bool
) -> tuple[Array, FuncState | None, FuncAux | None]:
  """`(loss, func_state, aux)` from the value function's first output.

  Args:
    raw_outputs: what the value function returned (without the gradient).
    has_aux: whether it returns auxiliary data.
    has_state: whether it returns a state.

  Returns:
    The loss, the state (None without one) and the aux (None without it).

  Raises:
    TypeError: when the output does not have the flagged structure.
  """
  if not (has_aux or has_state):
    if isinstance(raw_outputs, (tuple, list)):
      raise TypeError(
        "The value function returned a tuple, but neither has_aux nor "
        "has_state is set: set the flag that describes its output."
      )
    return raw_outputs, None, None
  if not (isinstance(raw_outputs, (tuple, list)) and len(raw_outputs) == 2):
    raise TypeError(
      "With has_aux or has_state the value function must return "
      f"(loss, extra); got {type(raw_outputs).__name__}."
    )
  loss, extra = raw_outputs
  if has_aux and has_state:
    func_state, aux = extra
    return loss, func_state, aux
  if has_state:
    return loss, extra, None
  return loss, None, extra


def convert_value_and_grad_to_value_func(
  value_and_grad_func: ValueAndGradFunc, has_aux: bool = False
) -> ValueFunc:
  """The loss alone from a value-and-grad function.

  Args:
    value_and_grad_func: returns `(out, grads)`.
    has_aux: whether `out` is `(loss, extra)` rather than the loss (as for
      `jax.value_and_grad`'s `has_aux`; a state counts as extra too).

  Returns:
    A function of the same arguments returning only the loss.
  """

  def value_func(*args: Any, **kwargs: Any) -> Array:
    out: Any
    out, _ = value_and_grad_func(*args, **kwargs)
    return out[0] if has_aux else out

  return value_func


def convert_value_and_grad_to_clean_value_and_grad(
  value_and_grad_func: ValueAndGradFunc, has_aux: bool = False
) -> Callable[..., tuple[Array, Params]]:
  """`(loss, grads)` from a value-and-grad function, dropping any extras.

  Args:
    value_and_grad_func: returns `(out, grads)`.
    has_aux: whether `out` is `(loss, extra)` rather than the loss.

  Returns:
    A function of the same arguments returning `(loss, grads)`.
  """

  def clean_value_and_grad(*args: Any, **kwargs: Any) -> tuple[Array, Params]:
    out: Any
    out, grads = value_and_grad_func(*args, **kwargs)
    return (out[0] if has_aux else out), grads

  return clean_value_and_grad
