"""estimators.losses against brute-force float64 ground truth.

Dense matrices are assembled from the matrix-vector products on basis vectors
and compared with Fishers built by enumeration (categorical, Bernoulli) or in
closed form (normal), with `jax.hessian` for the GGN, and with Monte Carlo
averages for the sampled gradients.
"""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend import core as jex_core
from jax.flatten_util import ravel_pytree

from estimators import losses
from estimators.tags import LossTag

BATCH, DIM = 3, 4
BERNOULLI_DIM = 3  # Small enough to enumerate all 2^d outcomes.
WEIGHTS = (1.0, 0.3, 2.5)
MASK = jnp.array([1.0, 0.0, 1.0])


def _normal(seed, shape):
  # NumPy draws: jax.random would compile a program per shape.
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape))


def _logits(d):
  return 1.5 * _normal(1, (BATCH, d))


def _class_targets():
  return jnp.array([0, 3, 2])


def make_loss(case, weight, targets=True):
  """A loss of kind `case` on fixed random inputs."""
  if case == "normal":
    return losses.NormalMeanNegativeLogProbLoss(
      _normal(1, (BATCH, DIM)),
      _normal(2, (BATCH, DIM)) if targets else None,
      variance=0.7,
      weight=weight,
    )
  if case == "normal_mean_variance":
    return losses.NormalMeanVarianceNegativeLogProbLoss(
      _normal(1, (BATCH, DIM)),
      jnp.exp(0.5 * _normal(3, (BATCH, DIM))),
      _normal(2, (BATCH, DIM)) if targets else None,
      weight=weight,
    )
  if case == "bernoulli":
    t = jnp.asarray(
      np.random.default_rng(2).uniform(size=(BATCH, BERNOULLI_DIM))
    )
    return losses.MultiBernoulliNegativeLogProbLoss(
      _logits(BERNOULLI_DIM), t if targets else None, weight=weight
    )
  mask = MASK if case.endswith("masked") else None
  if case.startswith("categorical"):
    return losses.CategoricalLogitsNegativeLogProbLoss(
      _logits(DIM),
      _class_targets() if targets else None,
      mask=mask,
      weight=weight,
    )
  assert case.startswith("one_hot")
  t = jax.nn.one_hot(_class_targets(), DIM)
  return losses.OneHotCategoricalLogitsNegativeLogProbLoss(
    _logits(DIM), t if targets else None, mask=mask, weight=weight
  )


CASES = (
  "normal",
  "normal_mean_variance",
  "bernoulli",
  "categorical",
  "categorical_masked",
  "one_hot",
  "one_hot_masked",
)
# Losses in natural parameters, whose GGN is the Hessian of the loss.
NATURAL_CASES = tuple(c for c in CASES if c != "normal_mean_variance")


def reference_nll(case, loss, targets):
  """Per-example unweighted loss, written out by hand."""
  if case == "normal":
    v = loss.variance
    return jnp.sum((targets - loss.mean) ** 2, -1) / (
      2 * v
    ) + 0.5 * DIM * jnp.log(2 * jnp.pi * v)
  if case == "normal_mean_variance":
    v = loss.variance
    return jnp.sum(
      (targets - loss.mean) ** 2 / (2 * v) + 0.5 * jnp.log(2 * jnp.pi * v), -1
    )
  if case == "bernoulli":
    p = jax.nn.sigmoid(loss.logits)
    return -jnp.sum(targets * jnp.log(p) + (1 - targets) * jnp.log(1 - p), -1)
  log_p = jax.nn.log_softmax(loss.logits)
  if case.startswith("one_hot"):
    nll = -jnp.sum(targets * log_p, -1)
  else:
    nll = -log_p[jnp.arange(BATCH), targets]
  return nll * (MASK if case.endswith("masked") else 1.0)


def brute_force_fisher_blocks(case, loss):
  """Unweighted per-example Fisher, (batch, n, n), inputs concatenated."""
  if case == "normal":
    return jnp.broadcast_to(jnp.eye(DIM) / loss.variance, (BATCH, DIM, DIM))
  if case == "normal_mean_variance":
    v = loss.variance
    return jax.vmap(jnp.diag)(jnp.concatenate([1 / v, 1 / (2 * v**2)], -1))
  blocks = _enumerated_fisher(
    "bernoulli" if case == "bernoulli" else "categorical", loss.logits
  )
  if case.endswith("masked"):
    blocks = blocks * MASK[:, None, None]
  return blocks


@functools.partial(jax.jit, static_argnums=0)
def _enumerated_fisher(kind, logits):
  """sum over all outcomes t of p(t) g(t) g(t)^T, g = grad log p(t), per row."""
  if kind == "bernoulli":
    outcomes = jnp.array(
      list(itertools.product([0.0, 1.0], repeat=BERNOULLI_DIM))
    )

    def log_prob(z, t):
      return jnp.sum(
        t * jax.nn.log_sigmoid(z) + (1 - t) * jax.nn.log_sigmoid(-z)
      )
  else:
    outcomes = jnp.arange(DIM)

    def log_prob(z, t):
      return jax.nn.log_softmax(z)[t]

  def fisher(z):
    g = jax.vmap(jax.grad(log_prob), (None, 0))(z, outcomes)
    p = jnp.exp(jax.vmap(log_prob, (None, 0))(z, outcomes))
    return jnp.einsum("t,ti,tj->ij", p, g, g)

  return jax.vmap(fisher)(logits)


def per_example_order(loss):
  """Permutation from the flat input order to example-major order."""
  offsets = np.cumsum([0] + [x.size for x in loss.parameter_dependants])
  return np.concatenate(
    [
      offsets[j] + b * (x.size // BATCH) + np.arange(x.size // BATCH)
      for b in range(BATCH)
      for j, x in enumerate(loss.parameter_dependants)
    ]
  )


def block_diag(blocks):
  n = blocks.shape[-1]
  out = jnp.zeros((BATCH * n, BATCH * n))
  for b in range(BATCH):
    out = out.at[b * n : (b + 1) * n, b * n : (b + 1) * n].set(blocks[b])
  return out


def dense(product, in_example, out_example):
  """Dense matrix of a linear map, from its action on basis vectors."""
  flat_in, unravel_in = ravel_pytree(in_example)
  cols = jax.vmap(lambda e: ravel_pytree(product(unravel_in(e)))[0])(
    jnp.eye(flat_in.size)
  )
  assert cols.shape[1] == ravel_pytree(out_example)[0].size
  return cols.T


@functools.partial(jax.jit, static_argnums=0)
def _all_matrices(case, weight):
  """{kind: (M, B, B^T)} for the Fisher and the GGN, dense, flat input order.

  Jitted per case: one compilation instead of one per eager operation.
  """
  loss = make_loss(case, weight)
  inputs = tuple(loss.parameter_dependants)
  out = {}
  for kind in ("fisher", "ggn"):
    inner = jnp.zeros(getattr(loss, f"{kind}_factor_inner_shape"))
    out[kind] = (
      dense(getattr(loss, f"multiply_{kind}"), inputs, inputs),
      dense(getattr(loss, f"multiply_{kind}_factor"), inner, inputs),
      dense(getattr(loss, f"multiply_{kind}_factor_transpose"), inputs, inner),
    )
  return out


def matrices(case, weight, kind="fisher"):
  return _all_matrices(case, weight)[kind]


def expected_fisher(case, loss, weight):
  perm = per_example_order(loss)
  inverse = np.argsort(perm)
  full = block_diag(brute_force_fisher_blocks(case, loss))
  return weight * full[inverse][:, inverse]


# Evaluation and gradients.


@pytest.mark.parametrize("weight", WEIGHTS)
@pytest.mark.parametrize("case", CASES)
def test_evaluate_matches_formula_in_every_mode(case, weight):
  loss = make_loss(case, weight)
  nll = reference_nll(case, loss, loss.targets)
  assert loss.evaluate().shape == (BATCH,)
  np.testing.assert_allclose(loss.evaluate(), weight * nll, rtol=1e-12)
  np.testing.assert_allclose(
    loss.evaluate(coefficient_mode="sqrt"), np.sqrt(weight) * nll, rtol=1e-12
  )
  np.testing.assert_allclose(
    loss.evaluate(coefficient_mode="off"), nll, rtol=1e-12
  )
  other = make_loss(case, weight, targets=False).evaluate(loss.targets)
  np.testing.assert_allclose(other, weight * nll, rtol=1e-12)


@pytest.mark.parametrize("mode", losses.COEFFICIENT_MODES)
@pytest.mark.parametrize("case", CASES)
def test_grad_of_evaluate_matches_jax_grad(case, mode):
  loss = make_loss(case, 2.5)

  def total(*inputs):
    c = {"regular": 2.5, "sqrt": np.sqrt(2.5), "off": 1.0}[mode]
    return c * jnp.sum(
      reference_nll(case, loss.copy_with_different_inputs(inputs), loss.targets)
    )

  argnums = tuple(range(loss.num_parameter_dependants))
  expected = jax.grad(total, argnums)(*loss.parameter_dependants)
  got = loss.grad_of_evaluate(None, mode)
  assert isinstance(got, tuple) and len(got) == loss.num_parameter_dependants
  for g, e in zip(got, expected):
    np.testing.assert_allclose(g, e, rtol=1e-10, atol=1e-12)


# Curvature products against dense ground truth.


@pytest.mark.parametrize("weight", (0.3, 2.5))
@pytest.mark.parametrize("case", CASES)
def test_fisher_and_its_factor_match_brute_force(case, weight):
  loss = make_loss(case, weight)
  fisher, factor, factor_t = matrices(case, weight, "fisher")
  expected = expected_fisher(case, loss, weight)
  np.testing.assert_allclose(fisher, expected, atol=1e-12)
  np.testing.assert_allclose(factor @ factor.T, expected, atol=1e-12)
  np.testing.assert_allclose(factor_t, factor.T, atol=1e-12)
  # And directly: <B u, v> == <u, B^T v> for random u and v.
  u = _normal(7, loss.fisher_factor_inner_shape)
  v = tuple(
    _normal(8 + i, x.shape) for i, x in enumerate(loss.parameter_dependants)
  )
  lhs = sum(jnp.vdot(a, b) for a, b in zip(loss.multiply_fisher_factor(u), v))
  rhs = jnp.vdot(u, loss.multiply_fisher_factor_transpose(v))
  np.testing.assert_allclose(lhs, rhs, rtol=1e-12)


@pytest.mark.parametrize("case", CASES)
def test_ggn_equals_fisher(case):
  loss = make_loss(case, 0.3)
  for ggn_matrix, fisher_matrix in zip(
    matrices(case, 0.3, "ggn"), matrices(case, 0.3, "fisher")
  ):
    np.testing.assert_allclose(ggn_matrix, fisher_matrix, atol=1e-14)
  assert loss.ggn_factor_inner_shape == loss.fisher_factor_inner_shape


@pytest.mark.parametrize("case", NATURAL_CASES)
def test_ggn_is_the_hessian_for_natural_parameters(case):
  loss = make_loss(case, 2.5)
  flat, unravel = ravel_pytree(tuple(loss.parameter_dependants))

  def total(x):
    copy = loss.copy_with_different_inputs(unravel(x))
    return jnp.sum(copy.evaluate())

  ggn, _, _ = matrices(case, 2.5, "ggn")
  np.testing.assert_allclose(ggn, jax.jit(jax.hessian(total))(flat), atol=1e-12)


def test_normal_mean_variance_ggn_is_the_expected_hessian():
  # Averaging the Hessian over the model's targets, E[(t - m)^2] = variance.
  loss = make_loss("normal_mean_variance", 1.0)
  m, v = loss.mean, loss.variance

  def nll(m, v, t):
    return (t - m) ** 2 / (2 * v) + 0.5 * jnp.log(2 * jnp.pi * v)

  nodes, node_weights = np.polynomial.hermite_e.hermegauss(20)
  hessians = jax.vmap(jax.hessian(nll, argnums=(0, 1)), (None, None, 0))(
    m[0, 0], v[0, 0], m[0, 0] + jnp.sqrt(v[0, 0]) * nodes
  )
  expected = np.einsum(
    "n,ijn->ij", node_weights / node_weights.sum(), np.array(hessians)
  )
  basis = [
    (jnp.zeros_like(m).at[0, 0].set(1), jnp.zeros_like(v)),
    (jnp.zeros_like(m), jnp.zeros_like(v).at[0, 0].set(1)),
  ]
  ggn = np.array([[p[0, 0] for p in loss.multiply_ggn(e)] for e in basis]).T
  np.testing.assert_allclose(ggn, expected, atol=1e-10)


@pytest.mark.parametrize("kind", ("fisher", "ggn"))
@pytest.mark.parametrize("case", CASES)
def test_replicated_one_hot_is_factor_times_one_hot(case, kind):
  loss = make_loss(case, 2.5)
  inner_shape = getattr(loss, f"{kind}_factor_inner_shape")
  _, factor, _ = matrices(case, 2.5, kind)
  product = getattr(loss, f"multiply_{kind}_factor_replicated_one_hot")
  for index in np.ndindex(*inner_shape[1:]):
    e = jnp.zeros(inner_shape).at[(slice(None),) + index].set(1.0)
    got = ravel_pytree(product(index))[0]
    np.testing.assert_allclose(got, factor @ e.ravel(), atol=1e-12)


def test_normal_mean_variance_factor_layout():
  loss = make_loss("normal_mean_variance", 1.0)
  assert loss.fisher_factor_inner_shape == (BATCH, 2 * DIM)
  mean_part, var_part = loss.multiply_fisher_factor_replicated_one_hot((1,))
  np.testing.assert_allclose(mean_part[:, 1], 1 / jnp.sqrt(loss.variance[:, 1]))
  np.testing.assert_allclose(var_part, 0.0)
  mean_part, var_part = loss.multiply_fisher_factor_replicated_one_hot((DIM,))
  np.testing.assert_allclose(mean_part, 0.0)
  np.testing.assert_allclose(
    var_part[:, 0], 1 / (np.sqrt(2) * loss.variance[:, 0])
  )


@pytest.mark.parametrize(
  "case", ("normal", "bernoulli", "categorical_masked", "one_hot")
)
def test_extra_axes_act_as_independent_slices(case):
  # Inputs (batch, 2, d): the loss sums the slices, products act per slice and
  # replicated one-hot indices address (slice, entry).
  losses_2d = [make_loss(case, 2.5), make_loss(case, 2.5)]
  losses_2d[1] = losses_2d[1].copy_with_different_inputs(
    tuple(-x for x in losses_2d[1].parameter_dependants)
  )
  stack = lambda xs: None if xs[0] is None else jnp.stack(xs, 1)
  kwargs = {
    n: stack([getattr(part, n) for part in losses_2d])
    for n in ("targets", "mask") + losses_2d[0].dependant_names
    if hasattr(losses_2d[0], n)
  }
  if case == "normal":
    kwargs["variance"] = losses_2d[0].variance
  loss = type(losses_2d[0])(**kwargs, weight=2.5)
  np.testing.assert_allclose(
    loss.evaluate(), sum(part.evaluate() for part in losses_2d)
  )
  v = (_normal(5, jnp.shape(loss.parameter_dependants[0])),)
  np.testing.assert_allclose(
    loss.multiply_fisher(v)[0],
    stack(
      [
        part.multiply_fisher((v[0][:, i],))[0]
        for i, part in enumerate(losses_2d)
      ]
    ),
  )
  got = loss.multiply_fisher_factor_replicated_one_hot((1, 2))[0]
  np.testing.assert_allclose(got[:, 0], 0.0)
  np.testing.assert_allclose(
    got[:, 1], losses_2d[1].multiply_fisher_factor_replicated_one_hot((2,))[0]
  )


@pytest.mark.parametrize("case", ("normal", "categorical_masked", "one_hot"))
def test_vmap_over_examples_matches_the_batch(case):
  # A loss built inside `vmap` on one-example batches gives the batch's rows.
  loss = make_loss(case, 2.5)
  per_example = {
    n: getattr(loss, n)
    for n in ("targets", "mask")
    if getattr(loss, n, None) is not None
  }
  fixed = {"variance": loss.variance} if case == "normal" else {}

  def single(x, rows):
    one = type(loss)(
      x[None], weight=2.5, **fixed, **{k: a[None] for k, a in rows.items()}
    )
    return one.evaluate()[0], one.multiply_fisher((x[None],))[0][0]

  values, products = jax.vmap(single)(loss.parameter_dependants[0], per_example)
  np.testing.assert_allclose(values, loss.evaluate(), rtol=1e-12)
  np.testing.assert_allclose(
    products, loss.multiply_fisher(loss.parameter_dependants)[0], rtol=1e-12
  )


# Sampling.

NUM_SAMPLES = 20_000
SIGMAS = 5.0  # Allowed deviation of a Monte Carlo mean, in standard errors.


def assert_close_to_monte_carlo_mean(samples, expected):
  """|mean - expected| <= SIGMAS standard errors (per entry, fixed seed)."""
  mean = samples.mean(0)
  stderr = samples.std(0) / np.sqrt(samples.shape[0])
  excess = np.abs(mean - expected) - (SIGMAS * stderr + 1e-12)
  assert np.all(excess <= 0), (np.max(excess), mean, expected)


@pytest.mark.parametrize("case", CASES)
def test_sampled_gradients_have_mean_zero_and_fisher_covariance(case):
  weight = 2.5
  loss = make_loss(case, weight)

  @jax.jit
  def sampled_statistics(rngs):
    grads = jax.vmap(lambda r: loss.grad_of_evaluate_on_sample(r, "sqrt"))(rngs)
    # Per-example gradient vectors (samples, batch, n), inputs concatenated.
    g = jnp.concatenate([x.reshape(NUM_SAMPLES, BATCH, -1) for x in grads], -1)
    return g, jnp.einsum("sbi,sbj->sbij", g, g)

  g, outer = sampled_statistics(
    jax.random.split(jax.random.PRNGKey(42), NUM_SAMPLES)
  )
  assert_close_to_monte_carlo_mean(np.asarray(g), 0.0)
  expected = weight * brute_force_fisher_blocks(case, loss)
  assert_close_to_monte_carlo_mean(np.asarray(outer), np.asarray(expected))


@pytest.mark.parametrize("case", CASES)
def test_samples_have_the_targets_layout(case):
  loss = make_loss(case, 1.0)
  sample = loss.sample(jax.random.PRNGKey(0))
  assert sample.shape == jnp.shape(loss.targets)
  assert loss.evaluate(sample).shape == (BATCH,)


@pytest.mark.parametrize("case", ("categorical", "one_hot"))
def test_class_samples_follow_the_softmax(case):
  # A sure class, a near-impossible one and the last class are the edges of
  # inverting the CDF.
  logits = jnp.array(
    [
      [0.3, -1.2, 2.0, 0.0, 0.7],
      [30.0, 0.0, 0.0, 0.0, 0.0],
      [0.0, 0.0, 0.0, 0.0, 30.0],
      [-30.0, 1.0, 1.0, 1.0, 1.0],
    ],
    jnp.float32,
  )
  loss = {
    "categorical": losses.CategoricalLogitsNegativeLogProbLoss,
    "one_hot": losses.OneHotCategoricalLogitsNegativeLogProbLoss,
  }[case](logits)
  samples = jax.jit(jax.vmap(loss.sample))(
    jax.random.split(jax.random.PRNGKey(3), NUM_SAMPLES)
  )
  if case == "one_hot":
    np.testing.assert_array_equal(np.asarray(samples).sum(-1), 1)
    samples = np.argmax(samples, -1)
  counts = np.asarray(jax.nn.one_hot(samples, 5), np.float64)
  assert_close_to_monte_carlo_mean(counts, np.asarray(jax.nn.softmax(logits)))
  np.testing.assert_array_equal(np.asarray(samples)[:, 1], 0)
  np.testing.assert_array_equal(np.asarray(samples)[:, 2], 4)
  assert not np.any(np.asarray(samples)[:, 3] == 0)


# Masks, copies, jit.


@pytest.mark.parametrize("case", ("categorical_masked", "one_hot_masked"))
def test_mask_zeroes_masked_examples(case):
  masked = make_loss(case, 2.5)
  plain = make_loss(case.removesuffix("_masked"), 2.5)
  keep = np.asarray(MASK, bool)
  np.testing.assert_allclose(masked.evaluate()[~keep], 0.0)
  np.testing.assert_allclose(masked.evaluate()[keep], plain.evaluate()[keep])
  v = (_normal(5, (BATCH, DIM)),)
  u = _normal(6, (BATCH, DIM))
  results = [
    (
      masked.grad_of_evaluate(None, "regular")[0],
      plain.grad_of_evaluate(None, "regular")[0],
    ),
    (
      masked.grad_of_evaluate_on_sample(jax.random.PRNGKey(1), "regular")[0],
      plain.grad_of_evaluate_on_sample(jax.random.PRNGKey(1), "regular")[0],
    ),
    (masked.multiply_fisher(v)[0], plain.multiply_fisher(v)[0]),
    (masked.multiply_ggn(v)[0], plain.multiply_ggn(v)[0]),
    (masked.multiply_fisher_factor(u)[0], plain.multiply_fisher_factor(u)[0]),
    (
      masked.multiply_fisher_factor_transpose(v),
      plain.multiply_fisher_factor_transpose(v),
    ),
    (
      masked.multiply_fisher_factor_replicated_one_hot((2,))[0],
      plain.multiply_fisher_factor_replicated_one_hot((2,))[0],
    ),
  ]
  for got, unmasked in results:
    np.testing.assert_allclose(got[~keep], 0.0)
    np.testing.assert_allclose(got[keep], unmasked[keep], rtol=1e-12)


@pytest.mark.parametrize("case", CASES)
def test_copy_with_different_inputs_keeps_the_rest(case):
  loss = make_loss(case, 2.5)
  new_inputs = tuple(x + 0.25 for x in loss.parameter_dependants)
  copy = loss.copy_with_different_inputs(new_inputs)
  assert type(copy) is type(loss)
  for a, b in zip(copy.parameter_dependants, new_inputs):
    assert a is b
  for a, b in zip(copy.parameter_independants, loss.parameter_independants):
    assert a is b
  assert copy.num_parameter_independants == len(copy.parameter_independants)
  assert copy.num_parameter_dependants == len(new_inputs)
  assert copy.weight == 2.5 and copy.dtype == jnp.float64
  np.testing.assert_allclose(
    copy.evaluate(), 2.5 * reference_nll(case, copy, loss.targets)
  )
  assert all(a is b for a, b in zip(copy.params, copy.parameter_dependants))


@pytest.mark.parametrize(
  "case",
  (
    "normal",
    "normal_mean_variance",
    "bernoulli",
    "categorical_masked",
    "one_hot_masked",
  ),
)
def test_methods_work_under_jit(case):
  loss = make_loss(case, 0.3)
  inner = _normal(4, loss.fisher_factor_inner_shape)

  def everything(dependants, independants, vector, inner, rng):
    rebuilt = type(loss)(
      **dict(zip(loss.dependant_names, dependants)),
      **dict(zip(loss.independant_names, independants)),
    )
    return (
      rebuilt.evaluate(),
      rebuilt.grad_of_evaluate(None, "sqrt"),
      rebuilt.multiply_fisher(vector),
      rebuilt.multiply_ggn_factor(inner),
      rebuilt.multiply_fisher_factor_transpose(vector),
      rebuilt.multiply_ggn_factor_replicated_one_hot((1,)),
      rebuilt.grad_of_evaluate_on_sample(rng, "regular"),
    )

  args = (
    loss.parameter_dependants,
    loss.parameter_independants,
    loss.parameter_dependants,
    inner,
    jax.random.PRNGKey(3),
  )
  for a, b in zip(
    jax.tree.leaves(jax.jit(everything)(*args)),
    jax.tree.leaves(everything(*args)),
  ):
    np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-14)


# Registration.


def tag_operands(fn, *args):
  """Runs `fn`'s jaxpr up to its loss tag: (tag, operand values, params)."""
  closed = jax.make_jaxpr(fn)(*args)
  env = dict(zip(closed.jaxpr.constvars, closed.consts))
  env.update(zip(closed.jaxpr.invars, args))
  read = lambda v: v.val if isinstance(v, jex_core.Literal) else env[v]
  for eqn in closed.jaxpr.eqns:
    values = [read(v) for v in eqn.invars]
    if isinstance(eqn.primitive, LossTag):
      return eqn.primitive, values, eqn.params
    out = eqn.primitive.bind(*values, **eqn.params)
    env.update(
      zip(eqn.outvars, out if eqn.primitive.multiple_results else [out])
    )
  raise AssertionError("no loss tag in the traced function")


X = _normal(11, (BATCH, DIM))
Y = _normal(12, (BATCH, DIM))
CLASSES = _class_targets()
# (register function, its arguments, class, constructor arguments it stands for)
REGISTRATIONS = [
  (
    losses.register_sigmoid_cross_entropy_loss,
    dict(logits=X, targets=(Y > 0) * 1.0, weight=0.5),
    losses.MultiBernoulliNegativeLogProbLoss,
    dict(logits=X, targets=(Y > 0) * 1.0, weight=0.5),
  ),
  (
    losses.register_multi_bernoulli_predictive_distribution,
    dict(logits=X),
    losses.MultiBernoulliNegativeLogProbLoss,
    dict(logits=X, weight=1.0),
  ),
  (
    losses.register_softmax_cross_entropy_loss,
    dict(logits=X, targets=CLASSES, mask=MASK, weight=2.0),
    losses.CategoricalLogitsNegativeLogProbLoss,
    dict(logits=X, targets=CLASSES, mask=MASK, weight=2.0),
  ),
  (
    losses.register_categorical_predictive_distribution,
    dict(logits=X, targets=CLASSES),
    losses.CategoricalLogitsNegativeLogProbLoss,
    dict(logits=X, targets=CLASSES, weight=1.0),
  ),
  (
    losses.register_squared_error_loss,
    dict(prediction=X, targets=Y, weight=3.0),
    losses.NormalMeanNegativeLogProbLoss,
    dict(mean=X, targets=Y, variance=0.5, weight=3.0, normalize_log_prob=False),
  ),
  (
    losses.register_normal_predictive_distribution,
    dict(mean=X, targets=Y, variance=2.0),
    losses.NormalMeanNegativeLogProbLoss,
    dict(mean=X, targets=Y, variance=2.0, weight=1.0),
  ),
]


@pytest.mark.parametrize(
  "register, kwargs, cls, expected",
  REGISTRATIONS,
  ids=lambda r: getattr(r, "__name__", ""),
)
def test_register_returns_input_and_tag_rebuilds_loss(
  register, kwargs, cls, expected
):
  first, *rest = kwargs

  def model(x):
    return register(**{first: x}, **{k: kwargs[k] for k in rest})

  x = kwargs[first]
  np.testing.assert_array_equal(model(x), x)
  np.testing.assert_array_equal(jax.jit(model)(x), x)
  grad = jax.grad(lambda x: jnp.sum(model(x) ** 2))(x)
  np.testing.assert_allclose(grad, 2 * x)

  tag, values, params = tag_operands(model, x)
  rebuilt = tag.loss(*values, **params)
  reference = cls(**expected)
  assert type(rebuilt) is cls
  np.testing.assert_array_equal(rebuilt.parameter_dependants[0], x)
  for a, b in zip(
    rebuilt.parameter_independants, reference.parameter_independants
  ):
    assert (a is None) == (b is None)
    if a is not None:
      np.testing.assert_array_equal(a, b)
  if reference.targets is not None:
    np.testing.assert_allclose(
      rebuilt.evaluate(), reference.evaluate(), rtol=1e-12
    )
  v = (Y,)
  np.testing.assert_allclose(
    rebuilt.multiply_fisher(v)[0], reference.multiply_fisher(v)[0], rtol=1e-12
  )


def test_squared_error_loss_is_weighted_squared_distance():
  loss = losses.NormalMeanNegativeLogProbLoss(X, Y, weight=3.0)
  constant = 0.5 * DIM * np.log(np.pi)  # -log N at zero error, variance 0.5.
  np.testing.assert_allclose(
    loss.evaluate(), 3.0 * (jnp.sum((Y - X) ** 2, -1) + constant)
  )


# Errors.


def _categorical(**kwargs):
  return losses.CategoricalLogitsNegativeLogProbLoss(X, **kwargs)


ERRORS = [
  (lambda: _categorical().evaluate(), "needs targets"),
  (
    lambda: _categorical(targets=CLASSES).evaluate(coefficient_mode="half"),
    "Unknown coefficient_mode",
  ),
  (lambda: _categorical(targets=CLASSES * 1.0), "integer class indices"),
  (lambda: _categorical(targets=CLASSES[:2]), r"shape \(2,\) but \(3,\)"),
  (lambda: _categorical(mask=MASK[:, None]), "mask has shape"),
  (
    lambda: losses.OneHotCategoricalLogitsNegativeLogProbLoss(X, CLASSES),
    "one-hot targets must have the logits' shape",
  ),
  (
    lambda: losses.MultiBernoulliNegativeLogProbLoss(X, Y[:, :2]),
    "targets must have the logits' shape",
  ),
  (lambda: losses.NormalMeanNegativeLogProbLoss(X, Y.T), "targets has shape"),
  (
    lambda: losses.NormalMeanNegativeLogProbLoss(X, variance=jnp.ones(DIM)),
    "variance must be a scalar",
  ),
  (
    lambda: losses.NormalMeanVarianceNegativeLogProbLoss(X, jnp.ones(DIM)),
    "one variance per mean entry",
  ),
  (
    lambda: _categorical().copy_with_different_inputs((X, X)),
    "takes 1 parameter-dependent input",
  ),
  (lambda: _categorical().multiply_fisher(X), "pass a tuple"),
  (lambda: _categorical().multiply_ggn((X, X)), "got 2 arrays"),
  (lambda: _categorical().multiply_fisher((X[:2],)), "vector for 'logits'"),
  (
    lambda: _categorical().multiply_fisher_factor(X[:2]),
    "factor's inner shape",
  ),
  (
    lambda: _categorical().multiply_ggn_factor_replicated_one_hot((1, 2)),
    "needs 1 entries",
  ),
  (
    lambda: losses.register_softmax_cross_entropy_loss(X, CLASSES[:, None]),
    r"logits.shape\[:-1\]",
  ),
  (
    lambda: losses.register_softmax_cross_entropy_loss(X[0]),
    "batch axis and a class axis",
  ),
  (lambda: losses.register_squared_error_loss(X[:, 0]), r"x\[:, None\]"),
  (
    lambda: losses.register_sigmoid_cross_entropy_loss(X, weight=jnp.ones(3)),
    "weight must be a scalar",
  ),
  (
    lambda: losses.register_categorical_predictive_distribution(
      X, mask=jnp.ones(4)
    ),
    "mask has shape",
  ),
]


@pytest.mark.parametrize("make, message", ERRORS)
def test_bad_input_raises_a_clear_value_error(make, message):
  with pytest.raises(ValueError, match=message):
    make()
