"""Jaxpr machinery shared by the tracer and the graph matcher.

Both walk a model's jaxpr equation by equation: they look inside call-like
equations (jit, remat, custom_jvp/vjp), take a `scan` equation's operands
apart and run a scan again with a body of their own. These helpers hold that
common part, so that neither module reaches into the other.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend import core as jex_core

# Call-like primitives whose one body can be evaluated in place of the call,
# so that tags inside it show up as if written at the top level.
INLINABLE_PRIMITIVES: frozenset[str] = frozenset(
  {
    "jit",
    "pjit",
    "closed_call",
    "core_call",
    "remat",
    "remat2",
    "checkpoint",
    "custom_jvp_call",
    "custom_vjp_call",
    "custom_vjp_call_jaxpr",
  }
)


class TracingError(ValueError):
  """The model function cannot be used by the curvature code as written."""


def sub_jaxprs(eqn: Any) -> Iterator[tuple[jex_core.Jaxpr, Sequence[Any]]]:
  """The jaxprs an equation carries in its parameters (call or loop bodies).

  Args:
    eqn: a jaxpr equation.

  Returns:
    An iterator of `(jaxpr, consts)` pairs, one per jaxpr-valued parameter;
    `consts` is empty for an open jaxpr.
  """
  for value in eqn.params.values():
    if isinstance(value, jex_core.ClosedJaxpr):
      yield value.jaxpr, value.consts
    elif isinstance(value, jex_core.Jaxpr):
      yield value, ()


def scan_parts(eqn: Any, values: Sequence[Any]) -> tuple[Sequence[Any], ...]:
  """Splits a scan's operands (or its body's inputs) by their role.

  Args:
    eqn: a `scan` equation.
    values: one item per operand of `eqn`, in order (values, variables or
      keys), or one per input of its body, which come in the same order.

  Returns:
    `(consts, initial carry, scanned inputs)`, three slices of `values`.
  """
  n_consts, n_carry = eqn.params["num_consts"], eqn.params["num_carry"]
  return (
    values[:n_consts],
    values[n_consts : n_consts + n_carry],
    values[n_consts + n_carry :],
  )


def rebind_scan(
  eqn: Any,
  invals: Sequence[Any],
  body_fn: Callable[..., Any],
  extra: Any = None,
) -> tuple[list[Any], Any]:
  """Runs a scan equation again, with a body given as a Python function.

  Length, direction and unrolling are those of `eqn`.

  Args:
    eqn: the `scan` equation to run.
    invals: values of its operands.
    body_fn: `body_fn(consts, carry, xs, extra_i) -> (new_carry, ys,
      extra_ys)`, called with lists of values for one iteration.
    extra: a pytree scanned along with the scan's own inputs (its leaves have
      a leading axis of the scan's length), or None.

  Returns:
    `(outputs, stacked extra_ys)`: the scan's outputs (final carry, then
    stacked `ys`) as a list, and `extra_ys` stacked over iterations.
  """
  consts, init, xs = scan_parts(eqn, invals)

  def step(carry, scanned):
    xs_i, extra_i = scanned
    new_carry, ys, extra_ys = body_fn(consts, list(carry), list(xs_i), extra_i)
    return new_carry, (ys, extra_ys)

  carry, (ys, extra_ys) = jax.lax.scan(
    step,
    init,
    (xs, extra),
    length=eqn.params["length"],
    reverse=eqn.params["reverse"],
    unroll=eqn.params["unroll"],
  )
  return list(carry) + list(ys), extra_ys


def bind_equation(eqn: Any, invals: Sequence[Any]) -> list[Any]:
  """Applies one equation's primitive to values, as `eval_jaxpr` would.

  Args:
    eqn: a jaxpr equation.
    invals: values of its operands.

  Returns:
    The list of its results (a one-item list for single-result primitives).
  """
  with eqn.ctx.manager:
    out = eqn.primitive.bind(
      *invals, **eqn.primitive.get_bind_params(eqn.params)
    )
  return list(out) if eqn.primitive.multiple_results else [out]


def shape_dtype_structs(tree: Any) -> Any:
  """The shapes and dtypes of a pytree of arrays, to trace a function on.

  Args:
    tree: a pytree of arrays, scalars or `jax.ShapeDtypeStruct`s.

  Returns:
    The same tree with each leaf replaced by a `jax.ShapeDtypeStruct`.
  """
  return jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)), tree
  )
