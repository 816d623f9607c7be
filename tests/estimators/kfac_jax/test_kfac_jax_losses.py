"""The KFAC-JAX 0.0.8 `loss_functions` names of `estimators.losses`.

Checks, in float64, against hand computations or brute force: the
`normalize_log_prob` switch of the normal loss, losses as pytrees,
`insert_slice_in_zeros`, `filter_none` and the natural-parameter losses'
Fisher factors.
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from estimators import loss_functions, losses, tracer

BATCH, DIM = 3, 4


def _normal(seed, shape):
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape))


MEAN, TARGETS = _normal(0, (BATCH, DIM)), _normal(1, (BATCH, DIM))


def test_module_exports_the_new_names():
  for name in (
    "LossFunctionInputs",
    "NaturalParamsNegativeLogProbLoss",
    "filter_none",
    "insert_slice_in_zeros",
  ):
    assert getattr(loss_functions, name) is getattr(losses, name)


# normalize_log_prob.


@pytest.mark.parametrize("variance", [0.5, 1.7])
def test_normalize_log_prob_adds_exactly_the_normaliser(variance):
  def loss(flag):
    return losses.NormalMeanNegativeLogProbLoss(
      MEAN, TARGETS, variance=variance, weight=2.5, normalize_log_prob=flag
    )

  squared = 0.5 * np.sum((np.asarray(TARGETS) - np.asarray(MEAN)) ** 2, -1)
  normaliser = 0.5 * DIM * np.log(2 * np.pi * variance)
  bare, full = loss(False).evaluate(), loss(True).evaluate()
  np.testing.assert_allclose(bare, 2.5 * squared / variance, rtol=1e-12)
  np.testing.assert_allclose(full - bare, 2.5 * normaliser, rtol=1e-12)
  # True is the default, and a traced flag gives the same values.
  np.testing.assert_allclose(
    losses.NormalMeanNegativeLogProbLoss(
      MEAN, TARGETS, variance=variance, weight=2.5
    ).evaluate(),
    full,
    rtol=1e-12,
  )
  traced = jax.jit(lambda f: loss(f).evaluate())
  np.testing.assert_allclose(traced(True), full, rtol=1e-12)
  np.testing.assert_allclose(traced(False), bare, rtol=1e-12)
  assert loss(False).normalize_log_prob is False
  assert loss(True).normalize_log_prob is True


def test_normalize_log_prob_changes_no_derivative():
  bare = losses.NormalMeanNegativeLogProbLoss(
    MEAN, TARGETS, variance=0.8, normalize_log_prob=False
  )
  full = bare.copy_with_different_inputs((MEAN,))
  assert full.normalize_log_prob is False
  full = losses.NormalMeanNegativeLogProbLoss(MEAN, TARGETS, variance=0.8)
  for mode in ("regular", "sqrt"):
    np.testing.assert_allclose(
      bare.grad_of_evaluate(None, mode)[0],
      full.grad_of_evaluate(None, mode)[0],
      rtol=1e-12,
    )
  v = (TARGETS,)
  np.testing.assert_allclose(bare.multiply_ggn(v)[0], full.multiply_ggn(v)[0])


@pytest.mark.parametrize("flag", [True, False])
def test_register_normal_passes_normalize_log_prob_to_the_tracer(flag):
  def model(params, x):
    mean = x * params
    losses.register_normal_predictive_distribution(
      mean, TARGETS, variance=1.3, weight=0.5, normalize_log_prob=flag
    )
    return mean

  params = jnp.float64(1.5)
  (loss,), _ = tracer.loss_tags_vjp(model)((params, MEAN))
  expected = losses.NormalMeanNegativeLogProbLoss(
    MEAN * params, TARGETS, 1.3, 0.5, normalize_log_prob=flag
  )
  np.testing.assert_allclose(loss.evaluate(), expected.evaluate(), rtol=1e-12)


def test_registered_squared_error_is_the_squared_error():
  def model(params, x):
    prediction = x * params
    losses.register_squared_error_loss(prediction, TARGETS, weight=0.5)
    return prediction

  params = jnp.float64(1.5)
  (loss,), _ = tracer.loss_tags_vjp(model)((params, MEAN))
  squared = np.sum((np.asarray(TARGETS) - 1.5 * np.asarray(MEAN)) ** 2, -1)
  np.testing.assert_allclose(loss.evaluate(), 0.5 * squared, rtol=1e-12)


# Pytrees.


def _all_losses():
  logits = _normal(2, (BATCH, DIM))
  probs = jax.nn.sigmoid(_normal(3, (BATCH, DIM)))
  return [
    losses.NormalMeanNegativeLogProbLoss(MEAN, TARGETS, 0.7, 2.0, False),
    losses.NormalMeanVarianceNegativeLogProbLoss(
      MEAN, jnp.exp(_normal(4, (BATCH, DIM))), TARGETS, 1.5
    ),
    losses.MultiBernoulliNegativeLogProbLoss(logits, probs, 0.5),
    losses.CategoricalLogitsNegativeLogProbLoss(
      logits, jnp.array([0, 3, 1]), jnp.array([1.0, 0.0, 1.0]), 3.0
    ),
    losses.OneHotCategoricalLogitsNegativeLogProbLoss(
      logits, jax.nn.one_hot(jnp.array([2, 0, 1]), DIM)
    ),
    losses.CategoricalLogitsNegativeLogProbLoss(logits),  # None leaves.
  ]


@pytest.mark.parametrize("loss", _all_losses(), ids=lambda x: type(x).__name__)
def test_losses_round_trip_as_pytrees(loss):
  children, aux = loss.tree_flatten()
  assert len(children) == (
    loss.num_parameter_dependants + loss.num_parameter_independants
  )
  rebuilt = type(loss).tree_unflatten(aux, children)
  assert type(rebuilt) is type(loss)

  leaves, treedef = jax.tree_util.tree_flatten(loss)
  again = jax.tree_util.tree_unflatten(treedef, leaves)
  doubled = jax.tree_util.tree_map(lambda x: 2 * x, loss)
  through_jit = jax.jit(lambda x: x)(loss)
  for copy in (rebuilt, again, through_jit):
    assert type(copy) is type(loss)
    for a, b in zip(
      jax.tree_util.tree_leaves(copy), jax.tree_util.tree_leaves(loss)
    ):
      np.testing.assert_array_equal(a, b)
  np.testing.assert_array_equal(
    doubled.parameter_dependants[0], 2 * loss.parameter_dependants[0]
  )

  vector = tuple(
    _normal(8 + k, jnp.shape(x))
    for k, x in enumerate(loss.parameter_dependants)
  )
  np.testing.assert_allclose(
    jax.jit(lambda x: x.multiply_ggn(vector))(loss)[0],
    loss.multiply_ggn(vector)[0],
    rtol=1e-10,
    atol=1e-14,
  )
  if loss.targets is not None:
    np.testing.assert_allclose(
      jax.jit(lambda x: x.evaluate())(loss), loss.evaluate(), rtol=1e-12
    )


def test_pytree_keeps_normalize_log_prob():
  loss = losses.NormalMeanNegativeLogProbLoss(MEAN, TARGETS, 0.7, 2.0, False)
  assert loss.tree_flatten()[0][-1] is False
  values = jax.jit(lambda x: x.evaluate())(loss)
  np.testing.assert_allclose(values, loss.evaluate(), rtol=1e-12)


# insert_slice_in_zeros and filter_none.


@pytest.mark.parametrize(
  "slice_shape, zeros_shape, position",
  [
    ((3, 1), (3, 5), (0, 2)),
    ((1, 4), (6, 4), (5, 0)),
    ((2, 1, 1), (2, 3, 4), (0, 1, 3)),
    ((2, 3), (2, 3), (0, 0)),
  ],
)
def test_insert_slice_in_zeros_against_numpy(
  slice_shape, zeros_shape, position
):
  piece = np.random.default_rng(5).standard_normal(slice_shape)
  expected = np.zeros(zeros_shape)
  where = tuple(
    slice(p, p + 1) if s == 1 else slice(None)
    for s, p in zip(slice_shape, position)
  )
  expected[where] = piece
  np.testing.assert_array_equal(
    losses.insert_slice_in_zeros(jnp.asarray(piece), zeros_shape, position),
    expected,
  )


@pytest.mark.parametrize(
  "slice_shape, zeros_shape, position",
  [((3, 1), (3, 5), (1, 2)), ((2, 1), (3, 5), (0, 0)), ((3,), (3, 5), (0,))],
)
def test_insert_slice_in_zeros_rejects_a_misfit(
  slice_shape, zeros_shape, position
):
  with pytest.raises(ValueError, match="insert_slice_in_zeros"):
    losses.insert_slice_in_zeros(jnp.ones(slice_shape), zeros_shape, position)


def test_filter_none():
  x = jnp.ones(2)
  values, names = losses.filter_none(mean=x, targets=None, weight=1.0)
  assert names == ("mean", "weight")
  assert values[0] is x and values[1] == 1.0
  assert losses.filter_none(a=None) == ((), ())


# Natural parameters: the Fisher factors against the brute-force Fisher.


def _per_example_fisher(loss, outcomes):
  """sum_y p(y) g g^T per example, `g` the gradient of log p(y) w.r.t. the
  inputs and `outcomes` every value y can take (with its probability)."""
  x = loss.parameter_dependants[0]

  def log_prob(x_b, y_b):
    one = loss.copy_with_different_inputs((x_b[None],))
    return -one.evaluate(y_b[None], coefficient_mode="off")[0]

  fishers = []
  for b in range(x.shape[0]):
    total = 0.0
    for y in outcomes(b):
      g = jax.grad(log_prob)(x[b], y).reshape(-1)
      total = total + jnp.exp(log_prob(x[b], y)) * jnp.outer(g, g)
    fishers.append(total)
  return fishers


def _hessian_fisher(loss):
  """Per-example Hessian of -log N w.r.t. the mean: the Fisher, for natural
  parameters (it does not depend on the targets)."""
  x = loss.parameter_dependants[0]

  def nll(x_b, b):
    one = losses.NormalMeanNegativeLogProbLoss(
      x_b[None], variance=loss.variance, normalize_log_prob=False
    )
    return one.evaluate(loss.targets[b : b + 1])[0]

  size = int(np.prod(x.shape[1:]))
  return [
    jax.hessian(nll)(x[b], b).reshape(size, size) for b in range(x.shape[0])
  ]


def _natural_cases():
  logits = _normal(6, (BATCH, DIM))
  categorical = losses.CategoricalLogitsNegativeLogProbLoss(logits, weight=1.7)
  bernoulli = losses.MultiBernoulliNegativeLogProbLoss(logits, weight=0.6)
  normal = losses.NormalMeanNegativeLogProbLoss(
    MEAN, TARGETS, variance=0.4, weight=2.2, normalize_log_prob=False
  )
  classes = lambda b: [jnp.asarray(k) for k in range(DIM)]
  bits = lambda b: [
    jnp.asarray(y, jnp.float64) for y in itertools.product([0, 1], repeat=DIM)
  ]
  return [
    (
      "categorical",
      categorical,
      lambda: _per_example_fisher(categorical, classes),
    ),
    ("bernoulli", bernoulli, lambda: _per_example_fisher(bernoulli, bits)),
    ("normal", normal, lambda: _hessian_fisher(normal)),
  ]


@pytest.mark.parametrize(
  "loss, brute_force", [c[1:] for c in _natural_cases()], ids=lambda x: ""
)
def test_natural_params_fisher_factors_match_brute_force(loss, brute_force):
  assert isinstance(loss, losses.NaturalParamsNegativeLogProbLoss)
  fishers = brute_force()
  x = loss.parameter_dependants[0]
  inner = loss.fisher_factor_inner_shape
  assert loss.ggn_factor_inner_shape == inner
  size_in, size_out = int(np.prod(inner[1:])), int(np.prod(x.shape[1:]))
  # B column by column: B e_j for one-hot e_j in every example.
  columns = [
    loss.multiply_fisher_factor_replicated_one_hot(index)[0].reshape(
      BATCH, size_out
    )
    for index in np.ndindex(*inner[1:])
  ]
  factor = jnp.stack(columns, axis=-1)  # (batch, size_out, size_in)
  assert factor.shape[-1] == size_in
  rng = np.random.default_rng(7)
  u = jnp.asarray(rng.standard_normal(inner))
  v = jnp.asarray(rng.standard_normal(x.shape))
  for b in range(BATCH):
    # B B^T = weight * F, and the GGN factor is the Fisher one.
    np.testing.assert_allclose(
      factor[b] @ factor[b].T, loss.weight * fishers[b], atol=1e-12
    )
  np.testing.assert_allclose(
    loss.multiply_fisher_factor(u)[0].reshape(BATCH, -1),
    jnp.einsum("bij,bj->bi", factor, u.reshape(BATCH, -1)),
    atol=1e-12,
  )
  np.testing.assert_allclose(
    loss.multiply_ggn_factor(u)[0], loss.multiply_fisher_factor(u)[0]
  )
  np.testing.assert_allclose(
    loss.multiply_fisher_factor_transpose((v,)).reshape(BATCH, -1),
    jnp.einsum("bij,bi->bj", factor, v.reshape(BATCH, -1)),
    atol=1e-12,
  )
  np.testing.assert_allclose(
    loss.multiply_ggn_factor_transpose((v,)),
    loss.multiply_fisher_factor_transpose((v,)),
  )
  fisher_v = jnp.stack(
    [fishers[b] @ v[b].reshape(-1) for b in range(BATCH)]
  ).reshape(x.shape)
  np.testing.assert_allclose(
    loss.multiply_ggn((v,))[0], loss.weight * fisher_v, atol=1e-12
  )
