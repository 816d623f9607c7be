"""Inverse p-th roots of positive definite matrices by matrix products only.

The coupled Newton iteration of Guo & Higham ("A Schur-Newton method for the
matrix p-th root and its inverse", SIAM J. Matrix Anal. Appl. 28(3), 2006),
the inverse-root solver of distributed Shampoo (Anil et al., "Scalable second
order optimization for deep learning", 2020). It needs no eigendecomposition
or Cholesky factor, only products of stacked matrices, which accelerators run
well where LAPACK-style factorizations of many mid-size matrices do not.

`by_products(fn)` makes every damped power that `fn` asks of
`utils.psd_matrix_power` (and every inverse Cholesky root it asks of
`utils.psd_inverse_root`) come from this iteration, with matrices of one
size and dtype stacked into one batched iteration.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, cast

import jax
import jax.numpy as jnp
import numpy as np

from estimators.utils.pytree import is_tracer

DEFAULT_MAX_ITERATIONS = 100


def root_order(power: float) -> int:
  """The integer `p` with `power == -1/p`.

  Raises:
    ValueError: for any other power.
  """
  p = -1 / power if power < 0 else 0
  if p < 1 or abs(p - round(p)) > 1e-9:
    raise ValueError(
      f"The Newton iteration computes inverse p-th roots, powers -1/p for "
      f"an integer p >= 1 (-1, -0.5, -0.25, ...), not {power}; use "
      "matrix_power_method='decomposition' for other powers."
    )
  return round(p)


def _tolerance(dtype, n: int) -> float:
  # Where the residual `M - I` stops shrinking in this precision: the
  # round-off of n-term inner products, with a margin.
  return 8 * n * float(jnp.finfo(dtype).eps)


def _int_power(matrix, p: int):
  """`matrix ** p` by repeated squaring (p >= 1)."""
  result, square = None, matrix
  while p:
    if p & 1:
      result = square if result is None else result @ square
    p >>= 1
    if p:
      square = square @ square
  return result


class Roots(NamedTuple):
  """What `inverse_root` returns.

  Attributes:
    roots: the roots, NaN where the iteration did not converge.
    residuals: each matrix's largest entry of `|M - I|` at the end.
    converged: whether it converged (residual below 1e-3).
    steps: the Newton steps taken (the stack's slowest matrix's).
  """

  roots: jax.Array
  residuals: jax.Array
  converged: jax.Array
  steps: jax.Array


def inverse_root(
  matrices: jax.Array, p: int, max_iterations: int = DEFAULT_MAX_ITERATIONS
) -> Roots:
  """`matrix^(-1/p)` of each positive definite matrix of a stack.

  With `z = (1 + p) / (2 c)` for an upper bound `c` on the largest
  eigenvalue (the smaller of the Frobenius norm and the largest absolute row
  sum), it starts from `X = z^(1/p) I` and `M = z A` and repeats
  `T = ((p + 1) I - M) / p`, `X <- X T`, `M <- T^p M`. `M = X^p A` holds
  throughout, so `X` tends to `A^(-1/p)` as `M` tends to `I`: each small
  eigenvalue of `M` roughly doubles per step until it nears one, then the
  convergence is quadratic. The steps needed grow with log2 of the
  condition number, about 30 for 1e6. A singular (or indefinite) matrix
  never converges.

  The loop stops once every matrix's largest entry of `|M - I|` is below
  the round-off floor of the dtype, once it stopped shrinking near that
  floor, or after `max_iterations`.

  Args:
    matrices: `(..., n, n)` symmetric positive definite matrices.
    p: the root, an integer >= 1 (1: the inverse).
    max_iterations: the most steps taken.

  Returns:
    The roots, NaN where the iteration did not converge, with the
    residuals, convergence and step count (`Roots`).
  """
  return inverse_roots([(matrices, p)], max_iterations)[0]


def inverse_roots(
  stacks: Sequence[tuple[jax.Array, int]],
  max_iterations: int = DEFAULT_MAX_ITERATIONS,
) -> list[Roots]:
  """`inverse_root` of several stacks (each with its own size, dtype and
  root) in one loop, which stops when all are done: on an accelerator each
  step's test of the loop condition waits for the device, so one loop waits
  once per step instead of once per stack and step."""
  starts = [_start(matrices, p) for matrices, p in stacks]
  floors = [
    _tolerance(matrices.dtype, matrices.shape[-1]) for matrices, _ in stacks
  ]

  def more(carry):
    i, states = carry
    # Go on while some matrix is above the floor and still improving (or
    # still far from converged: the small eigenvalues' doubling phase can
    # leave the largest entry flat for a while).
    going = [
      jnp.any((err > floor) & ((err < last) | (err > 1e-2)))
      for (_, _, err, last), floor in zip(states, floors)
    ]
    return (i < max_iterations) & jnp.any(jnp.stack(going))

  def step(carry):
    i, states = carry
    return i + 1, [_step(state, p) for state, (_, p) in zip(states, stacks)]

  steps, states = jax.lax.while_loop(more, step, (0, starts))
  out = []
  for x, _, err, _ in states:
    converged = err < 1e-3
    out.append(
      Roots(
        jnp.where(converged[..., None, None], x, jnp.nan),
        err,
        converged,
        cast(jax.Array, steps),  # the loop's carry comes back as arrays
      )
    )
  return out


def _residual(m):
  return jnp.max(
    jnp.abs(m - jnp.eye(m.shape[-1], dtype=m.dtype)), axis=(-2, -1)
  )


def _start(matrices, p):
  """`(X, M, residual, last residual)` before the first step."""
  a = (matrices + jnp.swapaxes(matrices, -1, -2)) / 2
  frobenius = jnp.sqrt(jnp.sum(a * a, axis=(-2, -1)))
  row_sum = jnp.max(jnp.sum(jnp.abs(a), axis=-1), axis=-1)
  bound = jnp.minimum(frobenius, row_sum)
  # A zero matrix gets a bound of one, so it fails by not converging
  # instead of dividing by zero.
  z = (1 + p) / (2 * jnp.where(bound > 0, bound, 1))[..., None, None]
  eye = jnp.eye(a.shape[-1], dtype=a.dtype)
  m = z * a
  err = _residual(m)
  return (
    jnp.broadcast_to(z ** (1 / p) * eye, a.shape),
    m,
    err,
    jnp.full_like(err, jnp.inf),
  )


def _step(state, p):
  x, m, err, _ = state
  t = ((p + 1) * jnp.eye(m.shape[-1], dtype=m.dtype) - m) / p
  m = _int_power(t, p) @ m
  return x @ t, m, _residual(m), err


def _check(converged, shape, max_iterations) -> None:
  """Raises for a concrete non-converged result (nothing to do under jit,
  where the root is NaN instead)."""
  if is_tracer(converged):
    return
  if not bool(np.all(converged)):
    raise ValueError(
      f"The Newton iteration for an inverse root of a {shape[-2]}x"
      f"{shape[-1]} matrix did not converge in {max_iterations} steps: the "
      "matrix is singular, indefinite or too badly conditioned. Add damping "
      "(identity weight) to it, raise max_iterations, or use "
      "matrix_power_method='decomposition'."
    )


def psd_power(
  matrix: jax.Array, power: float, max_iterations: int = DEFAULT_MAX_ITERATIONS
) -> jax.Array:
  """`matrix ** power` for a power -1/p, by the Newton iteration.

  Raises:
    ValueError: for another power, or (outside `jax.jit`) when the
      iteration does not converge. Under `jax.jit` the result is NaN then.
  """
  result = inverse_root(matrix, root_order(power), max_iterations)
  _check(result.converged, matrix.shape, max_iterations)
  return result.roots


@dataclasses.dataclass
class _Request:
  matrix: jax.Array
  p: int
  result: jax.Array | None = None


class _Products(threading.local):
  """The active `by_products` call of this thread: how requests are met."""

  def __init__(self):
    self.mode = None  # None, "direct", "record" or "replay"
    self.requests: list[_Request] = []
    self.position = 0
    self.max_iterations = DEFAULT_MAX_ITERATIONS


_ACTIVE = _Products()


def active() -> bool:
  """Whether a `by_products` call is computing powers now."""
  return _ACTIVE.mode is not None


def requested_power(matrix: jax.Array, p: int) -> jax.Array:
  """`matrix^(-1/p)` inside `by_products` (see there)."""
  state = _ACTIVE
  if state.mode == "direct":
    result = inverse_root(matrix, p, state.max_iterations)
    _check(result.converged, matrix.shape, state.max_iterations)
    return result.roots
  if state.mode == "record":
    state.requests.append(_Request(matrix, p))
    return jnp.zeros_like(matrix)  # unused: the replay gives the root
  request = state.requests[state.position]
  state.position += 1
  if request.p != p or request.matrix.shape != matrix.shape:
    raise RuntimeError(
      "by_products: the function asked for different "
      "powers on its second call; it must be deterministic."
    )
  # `_solve_batched` filled every request before the replay.
  return cast(jax.Array, request.result)


@contextlib.contextmanager
def _mode(mode, requests=(), max_iterations=DEFAULT_MAX_ITERATIONS):
  if active():
    raise RuntimeError("by_products calls cannot be nested.")
  state = _ACTIVE
  state.mode, state.requests, state.position = mode, list(requests), 0
  state.max_iterations = max_iterations
  try:
    yield state
  finally:
    state.mode, state.requests = None, []


def _solve_batched(requests: Sequence[_Request], max_iterations: int) -> None:
  """Fills each request's result: the matrices of one (size, dtype, p)
  stacked, all stacks in one loop."""
  groups: dict[Any, list[_Request]] = {}
  for r in requests:
    groups.setdefault((r.matrix.shape, r.matrix.dtype, r.p), []).append(r)
  results = inverse_roots(
    [
      (jnp.stack([r.matrix for r in members]), p)
      for (_, _, p), members in groups.items()
    ],
    max_iterations,
  )
  for (shape, _, _), members, result in zip(groups, groups.values(), results):
    _check(result.converged, shape, max_iterations)
    for r, root in zip(members, result.roots):
      r.result = root


def by_products(
  fn: Callable[[], Any],
  batched: bool = True,
  max_iterations: int = DEFAULT_MAX_ITERATIONS,
) -> Any:
  """Calls `fn()` with its damped powers computed by the Newton iteration.

  Every `utils.psd_matrix_power(matrix, -1/p)` that `fn` makes returns
  `matrix^(-1/p)` from `inverse_root`, and every `utils.psd_inverse_root`
  returns the symmetric inverse square root, which serves as `L⁻¹` does
  (`Rᵀ R = matrix⁻¹`). With `batched`, `fn` is called twice: the first call
  collects the matrices (its results are dropped, and under `jax.jit` XLA
  removes the work they alone needed), the matrices of one shape, dtype and
  root are stacked and all stacks run in one loop (`inverse_roots`), and
  the second call receives the roots in the order it asks for them. `fn` must therefore ask for the
  same powers in the same order each time, and its matrices must be
  reachable outside it (not traced inside a `lax.cond` or `lax.switch`
  branch: use `batched=False` there).

  Args:
    fn: the function to call, with no arguments.
    batched: stack equal-size matrices and run them all in one loop.
    max_iterations: the most Newton steps per iteration.

  Returns:
    `fn()`'s result.

  Raises:
    ValueError: for a power that is not -1/p, or (outside `jax.jit`) when the
      iteration does not converge. Under `jax.jit` the power is NaN then.
  """
  if not batched:
    with _mode("direct", max_iterations=max_iterations):
      return fn()
  with _mode("record") as state:
    fn()
    requests = state.requests
  if not requests:
    return fn()
  _solve_batched(requests, max_iterations)
  with _mode("replay", requests, max_iterations):
    return fn()
