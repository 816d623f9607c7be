"""Matrix-free spectral estimates of symmetric operators, built on matfree.

An operator is a matvec `matvec(v, *params) -> A v` over pytrees shaped like
`like` (the model parameters, say; a flat array works too), as in matfree.
Passing the operator's data as `*params` rather than closing over it lets one
compiled program serve every call with the same `matvec`. Lanczos
(`decomp.tridiag_sym` with full reorthogonalisation), probe samplers and the
Monte-Carlo and leave-one-out estimators (`stochtrace`) are matfree's; the
Ritz pairs are cut where Lanczos breaks down (see `_ritz`), which matfree's
`eig.eigh_partial` does not do. Probes use one key per probe, split from `key`
exactly as the harness always has, so estimates reproduce across versions.
Trace and diagonal estimates come with a standard error, so that a reader can
tell an approximation's error from the estimator's noise.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
from matfree import decomp, stochtrace

PyTree = Any
Matvec = Callable[..., PyTree]


def _dim(like: PyTree) -> int:
  return sum(int(jnp.size(x)) for x in jax.tree.leaves(like))


def _check_positive(**counts: int) -> None:
  for name, value in counts.items():
    if int(value) < 1:
      raise ValueError(f"{name} must be a positive integer, got {value!r}.")


def _one_key_per_probe(make_sampler: Callable, like: PyTree, num: int
                       ) -> Callable[[jax.Array], PyTree]:
  """matfree's `make_sampler(like, num=1)`, drawn once per key of
  `jax.random.split(key, num)`, stacked on a leading axis."""
  one = make_sampler(like, num=1)
  return lambda key: jax.vmap(lambda k: jax.tree.map(lambda x: x[0], one(k)))(
      jax.random.split(key, num))


def rademacher_sampler(like: PyTree, num: int) -> Callable[[jax.Array], PyTree]:
  """A sampler of `num` Rademacher probes shaped like `like`.

  Args:
    like: a pytree (or array) whose structure, shapes and dtype the probes take.
    num: number of probes.

  Returns:
    `sample(key)`: a pytree like `like` with a leading axis of size `num`;
    probe `i` is drawn from `jax.random.split(key, num)[i]`.
  """
  # matfree's sampler_signs draws all probes from one key; we keep the
  # harness's one-key-per-probe stream so results match earlier runs.
  return _one_key_per_probe(stochtrace.sampler_signs, like, num)


def _ritz(matvec: Matvec, v: PyTree, iters: int, *params: PyTree):
  """Ritz pairs from `iters` Lanczos steps (matfree's) on `v`.

  Lanczos can stop early: once the Krylov space holds an invariant subspace
  (a rank-deficient GGN reaches one after about its rank), the next off-
  diagonal entry vanishes and every later basis vector is round-off, whose
  Ritz values are no eigenvalues of the operator. matfree runs on regardless,
  so the rows past that point are decoupled here and marked not found.

  Returns:
    `(values, vectors, basis, found)`: the Ritz values (ascending), their
    eigenvectors in the Krylov basis (columns), the basis (a pytree with a
    leading axis) and which Ritz pairs belong to the Krylov space.
  """
  basis, t, *_ = decomp.tridiag_sym(iters)(matvec, v, *params)
  scale = jnp.max(jnp.abs(t))
  off = jnp.abs(jnp.diagonal(t, 1)) > jnp.sqrt(jnp.finfo(t.dtype).eps) * scale
  valid = jnp.concatenate([jnp.ones(1, bool), jnp.cumprod(off).astype(bool)])
  kept = jnp.where(valid[:, None] & valid[None, :], t, 0)
  # Below every kept Ritz value (Gershgorin), so the cut rows sort first.
  lowest = jnp.min(jnp.where(valid, 2 * jnp.diagonal(kept)
                             - jnp.sum(jnp.abs(kept), axis=1), jnp.inf))
  kept = kept + jnp.diag(jnp.where(valid, 0, lowest - scale - 1))
  values, vectors = jnp.linalg.eigh(kept)
  found = jnp.sum(jnp.where(valid[:, None], vectors ** 2, 0), axis=0) > 0.5
  return values, vectors, basis, found


@functools.partial(jax.jit, static_argnames=("matvec", "k", "iters"))
def top_k_eigenpairs(matvec: Matvec, like: PyTree, k: int, iters: int,
                     key: jax.Array, *params: PyTree
                     ) -> tuple[jax.Array, PyTree]:
  """Largest `k` Ritz pairs of a symmetric operator by Lanczos.

  Args:
    matvec: `matvec(v, *params)`, symmetric, over pytrees like `like`.
    like: a pytree (or array) with the operator's input structure and dtype.
    k: number of eigenpairs.
    iters: Krylov depth; clipped to `[k, dim]`.
    key: PRNG key of the Gaussian start vector.
    *params: the operator's data, passed on to `matvec`.

  Returns:
    `(values, vectors)`: the `min(k, dim)` largest Ritz values, descending,
    and their unit Ritz vectors as a pytree like `like` with a leading axis.
  """
  _check_positive(k=k, iters=iters)
  iters = min(max(iters, k), _dim(like))
  v0 = jax.tree.map(lambda x: x[0],
                    stochtrace.sampler_normal(like, num=1)(key))
  values, vectors, basis, found = _ritz(matvec, v0, iters, *params)
  top = vectors[:, ::-1][:, :k]
  ritz = jax.tree.map(lambda q: jnp.tensordot(top.T, q, axes=1), basis)
  return jnp.where(found[::-1][:k], values[::-1][:k], jnp.nan), ritz


@functools.partial(jax.jit, static_argnames=("matvec", "iters", "num_probes"))
def slq_density(matvec: Matvec, like: PyTree, iters: int, num_probes: int,
                key: jax.Array, *params: PyTree
                ) -> tuple[jax.Array, jax.Array]:
  """A spectral density by stochastic Lanczos quadrature (SLQ).

  Args:
    matvec: `matvec(v, *params)`, symmetric, over pytrees like `like`.
    like: a pytree (or array) with the operator's input structure and dtype.
    iters: Krylov depth per probe; clipped to `dim`.
    num_probes: number of Rademacher probes (see `rademacher_sampler`).
    key: PRNG key of the probes.
    *params: the operator's data, passed on to `matvec`.

  Returns:
    `(nodes, weights)`, each of length `num_probes * iters'`: probe by probe,
    the Ritz values (ascending) and the squared first components of their
    eigenvectors over `num_probes`. The weights sum to one and
    `dim * sum(weights * f(nodes))` estimates `trace(f(A))`.
  """
  _check_positive(iters=iters, num_probes=num_probes)
  iters = min(iters, _dim(like))

  # matfree 0.6's SLQ integrands return v^T f(A) v only, not the Gauss rule.
  def gauss_rule(v):
    nodes, vecs, _, found = _ritz(matvec, v, iters, *params)
    # Ritz values past a breakdown get no weight (and a found node's value).
    nodes = jnp.where(found, nodes, jnp.max(nodes))
    return nodes, jnp.where(found, vecs[0] ** 2, 0)

  probes = rademacher_sampler(like, num_probes)(key)
  nodes, weights = jax.vmap(gauss_rule)(probes)
  return nodes.ravel(), weights.ravel() / num_probes


@functools.partial(jax.jit,
                   static_argnames=("approx", "exact", "num_probes"))
def relative_frobenius(approx: Matvec, exact: Matvec, like: PyTree,
                       num_probes: int, key: jax.Array, *params: PyTree
                       ) -> jax.Array:
  """Hutchinson estimate of `||A - E||_F / ||E||_F` from matvecs.

  Args:
    approx: `approx(v, *params) = A v`, over pytrees like `like`.
    exact: `exact(v, *params) = E v`, over pytrees like `like`.
    like: a pytree (or array) with the operators' input structure and dtype.
    num_probes: number of Rademacher probes (see `rademacher_sampler`).
    key: PRNG key of the probes.
    *params: the data of both operators, passed on to each matvec.

  Returns:
    `sqrt(mean ||(A - E) v||^2 / mean ||E v||^2)` over the probes: a scalar,
    exactly 0 when the two operators agree.
  """
  _check_positive(num_probes=num_probes)

  # matfree's Frobenius integrand takes one operator; this one shares E v
  # between the numerator and the denominator.
  def squared_norms(_, v):
    ev = exact(v, *params)
    diff = jax.tree.map(jnp.subtract, approx(v, *params), ev)
    sq = lambda t: sum(jnp.vdot(x, x) for x in jax.tree.leaves(t))
    return sq(diff), sq(ev)

  estimate = stochtrace.estimator_monte_carlo(
      squared_norms, sampler=rademacher_sampler(like, num_probes))
  num, den = estimate(None, key)
  return jnp.sqrt(num / den)


def _unbiased_sem(sem: PyTree, num: int) -> PyTree:
  """matfree's `std / sqrt(num)` with the sample variance's `num - 1`."""
  # ddof=0 understates the error at a few probes; one probe gives nan.
  factor = (num / (num - 1)) ** 0.5 if num > 1 else float("nan")
  return jax.tree.map(lambda x: x * factor, sem)


@functools.partial(jax.jit, static_argnames=("matvec", "num_probes"))
def hutchinson_trace(matvec: Matvec, like: PyTree, num_probes: int,
                     key: jax.Array, *params: PyTree
                     ) -> tuple[jax.Array, jax.Array]:
  """Hutchinson's estimate of `trace(A)`: the mean of `vᵀ A v` over probes.

  Args:
    matvec: `matvec(v, *params) = A v`, over pytrees like `like`.
    like: a pytree (or array) with the operator's input structure and dtype.
    num_probes: number of Rademacher probes (see `rademacher_sampler`), one
      matvec each.
    key: PRNG key of the probes.
    *params: the operator's data, passed on to `matvec`.

  Returns:
    `(estimate, standard_error)`: scalars; the standard error is the sample
    standard deviation of the `vᵀ A v` over `sqrt(num_probes)` (nan for one
    probe). For Rademacher probes the variance of one `vᵀ A v` is
    `2 (||A||_F^2 - sum_i A_ii^2)`.
  """
  _check_positive(num_probes=num_probes)
  estimate = stochtrace.estimator_monte_carlo_mean_and_sem(
      stochtrace.monte_carlo_trace(),
      sampler=rademacher_sampler(like, num_probes))
  mean, sem = estimate(matvec, key, *params)
  return mean, _unbiased_sem(sem, num_probes)


@functools.partial(jax.jit, static_argnames=("matvec", "num_probes"))
def xtrace(matvec: Matvec, like: PyTree, num_probes: int, key: jax.Array,
           *params: PyTree) -> tuple[jax.Array, jax.Array]:
  """The XTrace estimate of `trace(A)` (matfree's leave-one-out integrand).

  XTrace (Epperly, Tropp & Webber 2024, "XTrace: making the most of every
  sample in stochastic trace estimation", SIAM J. Matrix Anal. Appl. 45(1))
  spends the probes twice: on a low-rank approximation of `A` from their
  range (traced exactly), and as Hutchinson probes of the residual. Each
  probe's estimate leaves that probe out of the low-rank part, so it stays
  unbiased; the result is their mean. It is exact for an operator of rank
  below `num_probes` and far better than Hutchinson where the spectrum
  decays.

  Args:
    matvec: `matvec(v, *params) = A v`, over pytrees like `like`.
    like: a pytree (or array) with the operator's input structure and dtype.
    num_probes: number of probes, at most the operator's dimension; costs
      `2 * num_probes` matvecs. From half the dimension on, matfree builds
      the dense operator (dimension-many matvecs) and traces it exactly.
    key: PRNG key of the probes: uniform on the sphere of radius
      `sqrt(dim)` (what XTrace's resphering assumes), probe `i` from
      `jax.random.split(key, num_probes)[i]`.
    *params: the operator's data, passed on to `matvec`.

  Returns:
    `(estimate, standard_error)`: scalars. The standard error is the
    paper's error estimate: the sample standard deviation of the
    `num_probes` leave-one-out estimates over `sqrt(num_probes)`. Those
    estimates share all but one probe, so it is a heuristic, not an exact
    standard error; it is 0 where the estimate is exact.
  """
  _check_positive(num_probes=num_probes)
  if num_probes > _dim(like):
    raise ValueError(f"xtrace needs num_probes <= the operator's dimension "
                     f"{_dim(like)}, got {num_probes}; use fewer probes.")
  estimate = stochtrace.estimator_leave_one_out_mean_and_sem(
      stochtrace.leave_one_out_xtrace(),
      sampler=_one_key_per_probe(stochtrace.sampler_sphere, like, num_probes))
  mean, sem = estimate(matvec, key, *params)
  return mean, _unbiased_sem(sem, num_probes)


@functools.partial(jax.jit, static_argnames=("matvec", "num_probes"))
def stochastic_diagonal(matvec: Matvec, like: PyTree, num_probes: int,
                        key: jax.Array, *params: PyTree
                        ) -> tuple[PyTree, PyTree]:
  """The diagonal of `A` as the mean of `v ⊙ (A v)` over Rademacher probes.

  The estimator of Bekas, Kokiopoulou & Saad (2007, "An estimator for the
  diagonal of a matrix", Appl. Numer. Math. 57): unbiased, and exact for a
  diagonal `A`; entry `i` has variance `sum_{j != i} A_ij^2` per probe.

  Args:
    matvec: `matvec(v, *params) = A v`, over pytrees like `like`.
    like: a pytree (or array) with the operator's input structure and dtype.
    num_probes: number of Rademacher probes (see `rademacher_sampler`), one
      matvec each.
    key: PRNG key of the probes.
    *params: the operator's data, passed on to `matvec`.

  Returns:
    `(diagonal, standard_error)`: two pytrees like `like`; entry by entry,
    the estimate and the sample standard deviation of `v ⊙ (A v)` over
    `sqrt(num_probes)` (nan for one probe).
  """
  _check_positive(num_probes=num_probes)
  estimate = stochtrace.estimator_monte_carlo_mean_and_sem(
      stochtrace.monte_carlo_diagonal(),
      sampler=rademacher_sampler(like, num_probes))
  mean, sem = estimate(matvec, key, *params)
  return mean, _unbiased_sem(sem, num_probes)
