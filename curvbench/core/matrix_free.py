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
Every probe estimate (traces, diagonals, Frobenius and diagonal errors) comes
with its standard error, so that a reader can tell an approximation's error
from the estimator's noise, and `probes_needed` says how many probes a stated
precision takes. Memory is O(k * dim), never `dim x dim`: Lanczos keeps its
`iters` basis vectors (full reorthogonalisation), and the probe estimators
evaluate `batch_size` probes at a time (all of them by default), each a few
vectors like `like` (SLQ: a Lanczos basis per probe; the diagonal error
keeps two vectors per probe).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.flatten_util
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


def _one_probe(
  make_sampler: Callable, like: PyTree
) -> Callable[[jax.Array], PyTree]:
  """matfree's `make_sampler(like, num=1)` without its leading axis."""
  one = make_sampler(like, num=1)
  return lambda k: jax.tree.map(lambda x: x[0], one(k))


def _one_key_per_probe(
  make_sampler: Callable, like: PyTree, num: int
) -> Callable[[jax.Array], PyTree]:
  """matfree's `make_sampler(like, num=1)`, drawn once per key of
  `jax.random.split(key, num)`, stacked on a leading axis."""
  one = _one_probe(make_sampler, like)
  return lambda key: jax.vmap(one)(jax.random.split(key, num))


def _per_probe(
  fn: Callable, key: jax.Array, num: int, batch_size: int | None
) -> PyTree:
  """`fn(k)` for each key `k` of `jax.random.split(key, num)`, stacked:
  all at once (`batch_size` None) or `batch_size` at a time
  (`jax.lax.map`), which bounds the memory of `fn`'s intermediates."""
  keys = jax.random.split(key, num)
  if batch_size is None or batch_size >= num:
    return jax.vmap(fn)(keys)
  _check_positive(batch_size=batch_size)
  return jax.lax.map(fn, keys, batch_size=batch_size)


def _sq_norm(tree: PyTree) -> jax.Array | int:
  return sum(jnp.vdot(x, x) for x in jax.tree.leaves(tree))


def probes_needed(estimate, stderr, num_probes: int, precision: float) -> float:
  """The probes that would bring a probe estimate's standard error to
  `precision` times its magnitude.

  A mean over `m` independent probes has variance `sigma^2 / m`; so do, to
  first order, smooth functions of such means (the ratios here) and
  jackknife estimates. `m` probes gave `stderr`; `n` probes give about
  `stderr * sqrt(m / n)`, which is `precision * |estimate|` at
  `n = m * (stderr / (precision * |estimate|))^2`.

  Args:
    estimate: the estimate from `num_probes` probes.
    stderr: its standard error.
    num_probes: the probes it took.
    precision: the relative standard error wanted (0.05: 5 % of it).

  Returns:
    That `n` rounded up, at least 1 (1 where `stderr` is 0: the estimate
    is exact); inf where the estimate is 0 but its error is not; nan where
    either is nan.
  """
  estimate, stderr = abs(float(estimate)), float(stderr)
  if math.isnan(estimate) or math.isnan(stderr):
    return float("nan")
  if stderr == 0:
    return 1.0
  if estimate == 0:
    return float("inf")
  return float(
    max(1, math.ceil(num_probes * (stderr / (precision * estimate)) ** 2))
  )


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
  lowest = jnp.min(
    jnp.where(
      valid, 2 * jnp.diagonal(kept) - jnp.sum(jnp.abs(kept), axis=1), jnp.inf
    )
  )
  kept = kept + jnp.diag(jnp.where(valid, 0, lowest - scale - 1))
  values, vectors = jnp.linalg.eigh(kept)
  found = jnp.sum(jnp.where(valid[:, None], vectors**2, 0), axis=0) > 0.5
  return values, vectors, basis, found


@functools.partial(jax.jit, static_argnames=("matvec", "k", "iters"))
def top_k_eigenpairs(
  matvec: Matvec,
  like: PyTree,
  k: int,
  iters: int,
  key: jax.Array,
  *params: PyTree,
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
  v0 = jax.tree.map(lambda x: x[0], stochtrace.sampler_normal(like, num=1)(key))
  values, vectors, basis, found = _ritz(matvec, v0, iters, *params)
  top = vectors[:, ::-1][:, :k]
  ritz = jax.tree.map(lambda q: jnp.tensordot(top.T, q, axes=1), basis)
  return jnp.where(found[::-1][:k], values[::-1][:k], jnp.nan), ritz


@functools.partial(
  jax.jit, static_argnames=("matvec", "iters", "num_probes", "batch_size")
)
def slq_density(
  matvec: Matvec,
  like: PyTree,
  iters: int,
  num_probes: int,
  key: jax.Array,
  *params: PyTree,
  batch_size: int | None = None,
) -> tuple[jax.Array, jax.Array]:
  """A spectral density by stochastic Lanczos quadrature (SLQ).

  Args:
    matvec: `matvec(v, *params)`, symmetric, over pytrees like `like`.
    like: a pytree (or array) with the operator's input structure and dtype.
    iters: Krylov depth per probe; clipped to `dim`.
    num_probes: number of Rademacher probes (see `rademacher_sampler`).
    key: PRNG key of the probes.
    *params: the operator's data, passed on to `matvec`.
    batch_size: probes run at once (None: all); each holds a Lanczos
      basis, so the memory is `min(batch_size, num_probes) * iters`
      vectors like `like`.

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

  probe = _one_probe(stochtrace.sampler_signs, like)
  nodes, weights = _per_probe(
    lambda k: gauss_rule(probe(k)), key, num_probes, batch_size
  )
  return nodes.ravel(), weights.ravel() / num_probes


def _standard_error(samples: jax.Array) -> jax.Array:
  """The sample standard deviation (ddof=1) of `samples` over the leading
  axis, over the square root of their number; nan for one sample."""
  num = samples.shape[0]
  if num < 2:
    return jnp.full(samples.shape[1:], jnp.nan, samples.dtype)
  return jnp.std(samples, axis=0, ddof=1) / num**0.5


def sqrt_ratio_of_means(
  num: jax.Array, den: jax.Array
) -> tuple[jax.Array, jax.Array]:
  """`R = sqrt(mean(num) / mean(den))` over `m` paired samples (the leading
  axis) and its standard error by the delta method.

  With `N`, `D` the means, `g(N, D) = sqrt(N / D)` has the partial
  derivatives `dg/dN = R / (2 N)` and `dg/dD = -R / (2 D)`; to first order

    Var(R) = (R / 2)^2 (Var(N) / N^2 + Var(D) / D^2 - 2 Cov(N, D) / (N D)),

  where `Var(N) = s_n^2 / m`, `Var(D) = s_d^2 / m`, `Cov(N, D) = s_nd / m`
  from the samples' variances and covariance (ddof=1). That is the sample
  variance of `z_i = (R / 2) (num_i / N - den_i / D)` over `m`, which is
  how it is computed. The covariance matters: both terms of a relative
  error share their probes. `R` itself has a bias of order `1 / m`, below
  the standard error's `1 / sqrt(m)`.

  Returns:
    `(R, standard_error)` over the trailing axes; the error is 0 where
    every `num_i` is 0 (`R = 0` exactly) and nan for one sample.
  """
  n_mean, d_mean = jnp.mean(num, axis=0), jnp.mean(den, axis=0)
  ratio = jnp.sqrt(n_mean / d_mean)
  n_rel = jnp.where(n_mean > 0, num / jnp.where(n_mean > 0, n_mean, 1), 0)
  z = ratio / 2 * (n_rel - den / d_mean)
  return ratio, _standard_error(z)


@functools.partial(
  jax.jit, static_argnames=("approx", "exact", "num_probes", "batch_size")
)
def relative_frobenius(
  approx: Matvec,
  exact: Matvec,
  like: PyTree,
  num_probes: int,
  key: jax.Array,
  *params: PyTree,
  batch_size: int | None = None,
) -> tuple[jax.Array, jax.Array]:
  """Hutchinson estimate of `||A - E||_F / ||E||_F` from matvecs.

  Each Rademacher probe `v` gives `n = ||(A - E) v||^2` and
  `d = ||E v||^2`, unbiased for `||A - E||_F^2` and `||E||_F^2`; the
  estimate is `sqrt(mean n / mean d)` (see `sqrt_ratio_of_means` for its
  standard error).

  Args:
    approx: `approx(v, *params) = A v`, over pytrees like `like`.
    exact: `exact(v, *params) = E v`, over pytrees like `like`.
    like: a pytree (or array) with the operators' input structure and dtype.
    num_probes: number of Rademacher probes (see `rademacher_sampler`), one
      matvec of each operator each.
    key: PRNG key of the probes.
    *params: the data of both operators, passed on to each matvec.
    batch_size: probes evaluated at once (None: all). Memory: that many
      probes' vectors like `like` and matvec intermediates.

  Returns:
    `(estimate, standard_error)`: scalars; the estimate is exactly 0 (its
    error too) when the two operators agree, the error nan for one probe.
  """
  _check_positive(num_probes=num_probes)
  probe = _one_probe(stochtrace.sampler_signs, like)

  # matfree's Frobenius integrand takes one operator; this one shares E v
  # between the numerator and the denominator, probe by probe.
  def squared_norms(k):
    v = probe(k)
    ev = exact(v, *params)
    return _sq_norm(
      jax.tree.map(jnp.subtract, approx(v, *params), ev)
    ), _sq_norm(ev)

  num, den = _per_probe(squared_norms, key, num_probes, batch_size)
  return sqrt_ratio_of_means(num, den)


@functools.partial(
  jax.jit, static_argnames=("approx", "exact", "num_probes", "batch_size")
)
def relative_diagonal_error(
  approx: Matvec,
  exact: Matvec,
  like: PyTree,
  num_probes: int,
  key: jax.Array,
  *params: PyTree,
  cells: jax.Array | None = None,
  groups: jax.Array | None = None,
  batch_size: int | None = None,
) -> tuple[jax.Array, jax.Array]:
  """`||diag(A - E)||_2 / ||diag(E)||_2` from stochastic diagonals, over
  groups of parameters.

  Probe `v_i` gives `x_i = v_i * ((A - E) v_i)` and `y_i = v_i * (E v_i)`,
  unbiased for the two diagonals (as `stochastic_diagonal`). The squared
  norm of a mean of `m` of them is biased by the sum of its entries'
  variances over `m`, which off-diagonal mass makes large (30 probes of a
  K-FAC error can read three times the true value); so each squared norm
  is taken unbiased, `|x̄|^2 - sum_j s_j^2 / m` (`s_j^2` entry j's sample
  variance, ddof=1: the pairwise mean of `x_i . x_k`, i != k), and
  `R = sqrt(max(N, 0) / D)` over their ratio `N / D`.

  Standard error: to first order `N` moves by the mean of `2 x̄ . x_i`
  and `D` by that of `2 ȳ . y_i`, so the delta method gives `SE(R^2)` as
  the standard error of the mean of `(2 / D) (x̄ . x_i - (N / D) ȳ . y_i)`.
  It is reported on the scale of `R` as `sqrt(R^2 + SE(R^2)) - R`: the
  delta method's `SE(R^2) / (2 R)` where `R` is well resolved, and
  `sqrt(SE(R^2))` rather than infinity where the estimate is near 0.

  Args:
    approx: `approx(v, *params) = A v`, over pytrees like `like`.
    exact: `exact(v, *params) = E v`, over pytrees like `like`.
    like: a pytree (or array) with the operators' input structure and dtype.
    num_probes: number of Rademacher probes (see `rademacher_sampler`), one
      matvec of each operator each. One probe gives the plain (biased)
      estimate, and a nan error.
    key: PRNG key of the probes.
    *params: the data of both operators, passed on to each matvec.
    cells: an integer per entry of `like` (in `ravel_pytree` order), which
      of `C` cells it is in; None (or `groups` None): every entry in one.
    groups: a `(G, C)` 0/1 matrix: group g is the union of the cells where
      row g is 1; None: one group, every cell (the whole operator).
    batch_size: probes evaluated at once (None: all).

  Returns:
    `(estimate, standard_error)`, arrays of length G (scalars where
    `groups` is None). Memory: `2 * num_probes` vectors like `like` (the
    samples of both diagonals), plus `batch_size` probes' matvec
    intermediates.
  """
  _check_positive(num_probes=num_probes)
  probe = _one_probe(stochtrace.sampler_signs, like)
  flat = lambda t: jax.flatten_util.ravel_pytree(t)[0]

  def samples(k):
    v = probe(k)
    ev = exact(v, *params)
    diff = jax.tree.map(jnp.subtract, approx(v, *params), ev)
    return flat(v) * flat(diff), flat(v) * flat(ev)

  x, y = _per_probe(samples, key, num_probes, batch_size)
  single = groups is None
  if single or cells is None:
    cells = jnp.zeros(x.shape[1], int)
  groups = (
    jnp.ones((1, 1), x.dtype) if groups is None else groups.astype(x.dtype)
  )
  num_cells, m = groups.shape[1], num_probes
  by_cell = lambda t: jax.ops.segment_sum(t.T, cells, num_cells).T

  def squared_norm(s):
    """The unbiased squared norm over each group, and each probe's first-
    order term `s̄ . s_i` over each group."""
    mean = jnp.mean(s, axis=0)
    noise = (
      jnp.sum((s - mean) ** 2, axis=0) / (m * (m - 1))
      if m > 1
      else jnp.zeros_like(mean)
    )
    norm = groups @ by_cell(mean**2 - noise)
    return norm, by_cell(s * mean) @ groups.T

  num, num_terms = squared_norm(x)
  den, den_terms = squared_norm(y)
  ratio2 = num / den
  se2 = _standard_error(2 / den * (num_terms - ratio2 * den_terms))
  estimate = jnp.sqrt(jnp.maximum(ratio2, 0))
  stderr = jnp.sqrt(estimate**2 + se2) - estimate
  return (estimate[0], stderr[0]) if single else (estimate, stderr)


def _unbiased_sem(sem: PyTree, num: int) -> PyTree:
  """matfree's `std / sqrt(num)` with the sample variance's `num - 1`."""
  # ddof=0 understates the error at a few probes; one probe gives nan.
  factor = (num / (num - 1)) ** 0.5 if num > 1 else float("nan")
  return jax.tree.map(lambda x: x * factor, sem)


@functools.partial(jax.jit, static_argnames=("matvec", "num_probes"))
def hutchinson_trace(
  matvec: Matvec, like: PyTree, num_probes: int, key: jax.Array, *params: PyTree
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
    `2 (||A||_F^2 - sum_i A_ii^2)`. matfree runs every probe at once:
    memory `num_probes` vectors like `like` and matvec intermediates.
  """
  _check_positive(num_probes=num_probes)
  estimate = stochtrace.estimator_monte_carlo_mean_and_sem(
    stochtrace.monte_carlo_trace(), sampler=rademacher_sampler(like, num_probes)
  )
  mean, sem = estimate(matvec, key, *params)
  return mean, _unbiased_sem(sem, num_probes)


@functools.partial(jax.jit, static_argnames=("matvec", "num_probes"))
def xtrace(
  matvec: Matvec, like: PyTree, num_probes: int, key: jax.Array, *params: PyTree
) -> tuple[jax.Array, jax.Array]:
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
    standard error; it is 0 where the estimate is exact. Memory: about
    `2 * num_probes` vectors like `like` (the probes and their products,
    which the low-rank part needs together).
  """
  _check_positive(num_probes=num_probes)
  if num_probes > _dim(like):
    raise ValueError(
      f"xtrace needs num_probes <= the operator's dimension "
      f"{_dim(like)}, got {num_probes}; use fewer probes."
    )
  estimate = stochtrace.estimator_leave_one_out_mean_and_sem(
    stochtrace.leave_one_out_xtrace(),
    sampler=_one_key_per_probe(stochtrace.sampler_sphere, like, num_probes),
  )
  mean, sem = estimate(matvec, key, *params)
  return mean, _unbiased_sem(sem, num_probes)


@functools.partial(jax.jit, static_argnames=("matvec", "num_probes"))
def stochastic_diagonal(
  matvec: Matvec, like: PyTree, num_probes: int, key: jax.Array, *params: PyTree
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
    `sqrt(num_probes)` (nan for one probe). matfree runs every probe at
    once: memory `num_probes` vectors like `like` and matvec intermediates.
  """
  _check_positive(num_probes=num_probes)
  estimate = stochtrace.estimator_monte_carlo_mean_and_sem(
    stochtrace.monte_carlo_diagonal(),
    sampler=rademacher_sampler(like, num_probes),
  )
  mean, sem = estimate(matvec, key, *params)
  return mean, _unbiased_sem(sem, num_probes)
