"""Losses that know their curvature with respect to their inputs.

A loss object holds the arrays the model feeds into it: the *parameter
dependants* (e.g. logits) and the *parameter independants* (targets, mask,
variance, weight). Besides its per-example values it multiplies vectors by its
GGN `G` and, for negative log-likelihoods, its Fisher `F`, directly or through
a factor `B` with `B B^T = G` (or `F`).

Conventions: the first axis of every input is the batch, and `evaluate` returns
one value per example (shape `(batch,)`), so every curvature matrix is
block-diagonal over examples. Vectors shaped like the inputs are tuples (one
array per parameter dependant), and so are the results; vectors of a factor's
inner shape are single arrays. Products with `G` or `F` are scaled by the
weight, products with `B` or `B^T` by its square root.

The `register_*` functions mark a loss in a model function with a `LossTag`;
the tracer rebuilds the loss object from the tag's operands.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import distrax
import jax
import jax.numpy as jnp

from estimators.tags import LossTag
from estimators.utils.types import Array, Numeric, Shape

COEFFICIENT_MODES = ("regular", "sqrt", "off")


def _coefficient(weight, coefficient_mode: str):
  """The factor that `coefficient_mode` puts in front of the unweighted loss."""
  if coefficient_mode == "regular":
    return weight
  if coefficient_mode == "sqrt":
    return jnp.sqrt(weight)
  if coefficient_mode == "off":
    return 1.0
  raise ValueError(
    f"Unknown coefficient_mode {coefficient_mode!r}; use one of "
    f"{COEFFICIENT_MODES}."
  )


def _sum_over_non_batch_axes(x: Array) -> Array:
  return jnp.sum(x, axis=tuple(range(1, jnp.ndim(x))))


def _replicated_one_hot(index: Sequence[int], inner_shape: Shape, dtype):
  """An array of `inner_shape` that is one-hot at `index` for every example."""
  one_hot = jnp.zeros(inner_shape[1:], dtype).at[tuple(index)].set(1)
  return jnp.broadcast_to(one_hot, inner_shape)


def _input(name: str, doc: str) -> property:
  """A read-only property returning the constructor argument `name`."""
  return property(lambda self: self._inputs.get(name), doc=doc)


def _check_shape(owner: str, name: str, value, expected: Shape, fix: str):
  if value is not None and jnp.shape(value) != tuple(expected):
    raise ValueError(
      f"{owner}: {name} has shape {jnp.shape(value)} but "
      f"{tuple(expected)} is needed; {fix}."
    )


def _as_flag(value) -> Any:
  """`value` as a Python bool when it is concrete; a traced array stays."""
  try:
    return bool(value)
  except jax.errors.ConcretizationTypeError:
    return value


LossFunctionInputs = tuple[Array, ...]
"""The parameter-dependent inputs of one loss, e.g. `(logits,)`."""


def filter_none(
  **kwargs: Numeric | None,
) -> tuple[tuple[Numeric, ...], tuple[str, ...]]:
  """Drops the arguments that are None, as a loss tag binds only the others.

  Args:
    **kwargs: named loss arguments, None where absent.

  Returns:
    `(values, names)`: the present values and their names, in call order.
  """
  kept = [(k, v) for k, v in kwargs.items() if v is not None]
  return tuple(v for _, v in kept), tuple(k for k, _ in kept)


def insert_slice_in_zeros(
  slice_to_insert: Array, zeros_shape: Sequence[int], position: Sequence[int]
) -> Array:
  """An array of zeros of `zeros_shape` holding `slice_to_insert` at `position`.

  Along each axis the slice either spans the whole axis (then the position
  there must be 0) or has length 1 and sits at `position[axis]`.

  Args:
    slice_to_insert: the values to place, with as many axes as `zeros_shape`.
    zeros_shape: the shape of the result.
    position: the slice's offset along each axis.

  Returns:
    The zero-padded slice.

  Raises:
    ValueError: if the ranks differ or the slice does not fit.
  """
  shape, zeros_shape = jnp.shape(slice_to_insert), tuple(zeros_shape)
  if not len(shape) == len(zeros_shape) == len(position):
    raise ValueError(
      f"insert_slice_in_zeros: the slice {shape}, the shape {zeros_shape} "
      f"and the position {tuple(position)} need the same number of axes."
    )
  pad_width = []
  for size, full, at in zip(shape, zeros_shape, position):
    if size == full and at == 0:
      pad_width.append((0, 0))
    elif size == 1 and 0 <= at < full:
      pad_width.append((at, full - at - 1))
    else:
      raise ValueError(
        f"insert_slice_in_zeros: a slice of shape {shape} does not fit in "
        f"{zeros_shape} at {tuple(position)}; along each axis it must span "
        "the axis (at 0) or have length 1."
      )
  return jnp.pad(slice_to_insert, pad_width)


class LossFunction:
  """A loss with per-example values and a GGN w.r.t. its inputs.

  Subclasses name their constructor arguments in `dependant_names` (inputs
  that depend on the model parameters) and `independant_names` (the rest), in
  the order their `LossTag` uses, and expose each as a property. They
  implement `_evaluate` and the `*_unweighted` hooks; this class checks
  arguments, applies the weight and differentiates.
  """

  dependant_names: tuple[str, ...] = ()
  independant_names: tuple[str, ...] = ("targets", "weight")

  def __init__(self, weight: Numeric):
    """Stores the weight; subclasses store their other arguments.

    Args:
      weight: a scalar multiplying the loss (and so its curvature).
    """
    # Subclasses add their arguments (None for an absent one).
    self._inputs: dict[str, Numeric | None] = {"weight": weight}

  weight = _input("weight", "The loss's relative weight (a scalar).")
  targets = _input("targets", "Default targets for `evaluate`, or None.")

  @property
  def parameter_dependants(self) -> tuple[Array, ...]:
    """The parameter-dependent inputs, in `dependant_names` order."""
    return tuple(getattr(self, n) for n in self.dependant_names)

  @property
  def num_parameter_dependants(self) -> int:
    """How many parameter-dependent inputs the loss has."""
    return len(self.dependant_names)

  @property
  def parameter_independants(self) -> tuple[Any, ...]:
    """The other arguments in `independant_names` order (None where absent)."""
    return tuple(getattr(self, n) for n in self.independant_names)

  @property
  def num_parameter_independants(self) -> int:
    """How many other arguments the loss has (targets, weight, ...)."""
    return len(self.independant_names)

  @property
  def dtype(self) -> jnp.dtype:
    """The dtype of the first parameter-dependent input."""
    return jnp.result_type(self.parameter_dependants[0])

  def copy_with_different_inputs(
    self, parameter_dependants: Sequence[Array]
  ) -> LossFunction:
    """The same loss (targets, weight, ...) on other parameter dependants.

    Args:
      parameter_dependants: new values for the inputs named in
        `dependant_names`, in that order.

    Returns:
      A new loss of the same class.

    Raises:
      ValueError: if the number of inputs is wrong.
    """
    if len(parameter_dependants) != self.num_parameter_dependants:
      raise ValueError(
        f"{type(self).__name__} takes {self.num_parameter_dependants} "
        f"parameter-dependent input(s) {self.dependant_names}, got "
        f"{len(parameter_dependants)}."
      )
    kwargs = {n: getattr(self, n) for n in self.independant_names}
    kwargs.update(zip(self.dependant_names, parameter_dependants))
    return type(self)(**kwargs)

  def tree_flatten(self) -> tuple[tuple[Any, ...], dict[str, Any] | None]:
    """The loss as a pytree: its inputs as children, nothing static.

    Returns:
      `(children, aux)`: the parameter dependants then the other inputs
      (None where absent, which JAX treats as an empty subtree), and None.
    """
    return self.parameter_dependants + self.parameter_independants, None

  @classmethod
  def tree_unflatten(
    cls, aux: dict[str, Any] | None, children: Sequence[Any]
  ) -> LossFunction:
    """Rebuilds a loss from `tree_flatten`'s output.

    Args:
      aux: more inputs by name (`tree_flatten` gives None), or None.
      children: the inputs, in `tree_flatten` order.

    Returns:
      A loss of class `cls`.
    """
    # Skips the constructor: JAX unflattens with placeholder leaves (tracers,
    # `object()`, None) that its argument checks would reject.
    loss = cls.__new__(cls)
    names = cls.dependant_names + cls.independant_names
    loss._inputs = dict(zip(names, children), **(aux or {}))
    return loss

  def evaluate(
    self, targets: Array | None = None, coefficient_mode: str = "regular"
  ) -> Array:
    """Per-example loss values, neither summed nor averaged over the batch.

    Args:
      targets: the targets to evaluate at; None uses `self.targets`.
      coefficient_mode: 'regular' multiplies the values by the weight,
        'sqrt' by its square root and 'off' not at all.

    Returns:
      A `(batch,)` array.

    Raises:
      ValueError: if there are no targets, or for an unknown mode.
    """
    coefficient = _coefficient(self.weight, coefficient_mode)
    if targets is None:
      targets = self.targets
    if targets is None:
      raise ValueError(
        f"{type(self).__name__}.evaluate needs targets: pass them to "
        "evaluate() or to the loss (e.g. the register_* function's targets)."
      )
    return coefficient * self._evaluate(targets)

  def _evaluate(self, targets: Array) -> Array:
    """Unweighted per-example loss values."""
    raise NotImplementedError

  def grad_of_evaluate(
    self, targets: Array | None, coefficient_mode: str
  ) -> tuple[Array, ...]:
    """The gradient of the summed loss w.r.t. the parameter dependants.

    Args:
      targets: as for `evaluate`.
      coefficient_mode: as for `evaluate`.

    Returns:
      The gradient of `sum(evaluate(targets, coefficient_mode))`, one array
      per parameter dependant, shaped like it.
    """

    def total(inputs):
      loss = self.copy_with_different_inputs(inputs)
      return jnp.sum(loss.evaluate(targets, coefficient_mode))

    return tuple(jax.grad(total)(tuple(self.parameter_dependants)))

  # The public products check their argument, call an unweighted hook and
  # scale by the weight (matrix) or by its square root (factor).

  def _name(self, hook) -> str:
    return f"{type(self).__name__}.{hook.__name__.removesuffix('_unweighted')}"

  def _check_vector(self, vector, hook) -> tuple[Array, ...]:
    if not isinstance(vector, (tuple, list)):
      raise ValueError(
        f"{self._name(hook)}: pass a tuple with one array per "
        f"parameter dependant {self.dependant_names}, got "
        f"{type(vector).__name__}."
      )
    if len(vector) != self.num_parameter_dependants:
      raise ValueError(
        f"{self._name(hook)}: got {len(vector)} arrays for the "
        f"parameter dependants {self.dependant_names}."
      )
    for n, v, x in zip(self.dependant_names, vector, self.parameter_dependants):
      _check_shape(
        self._name(hook),
        f"the vector for {n!r}",
        v,
        jnp.shape(x),
        "vectors must have the shapes of the loss inputs",
      )
    return tuple(vector)

  def _matrix_product(self, hook, vector) -> tuple[Array, ...]:
    vector = self._check_vector(vector, hook)
    return tuple(self.weight * r for r in hook(vector))

  def _factor_product(self, hook, vector, inner_shape) -> tuple[Array, ...]:
    _check_shape(
      self._name(hook),
      "the vector",
      vector,
      inner_shape,
      "use the factor's inner shape",
    )
    return tuple(jnp.sqrt(self.weight) * r for r in hook(vector))

  def _factor_transpose_product(self, hook, vector) -> Array:
    return jnp.sqrt(self.weight) * hook(self._check_vector(vector, hook))

  def _one_hot_product(self, hook, index, inner_shape) -> tuple[Array, ...]:
    index = tuple(index)
    if len(index) != len(inner_shape) - 1:
      raise ValueError(
        f"{self._name(hook)}: the index {index} needs {len(inner_shape) - 1} "
        "entries, one per non-batch axis of the factor's inner shape "
        f"{tuple(inner_shape)}."
      )
    return tuple(jnp.sqrt(self.weight) * r for r in hook(index))

  def multiply_ggn(self, vector: Sequence[Array]) -> tuple[Array, ...]:
    """`weight * G @ vector`, `G` the GGN w.r.t. the parameter dependants.

    Args:
      vector: one array per parameter dependant, shaped like it.

    Returns:
      The product, shaped like `vector`.
    """
    return self._matrix_product(self.multiply_ggn_unweighted, vector)

  def multiply_ggn_factor(self, vector: Array) -> tuple[Array, ...]:
    """`sqrt(weight) * B @ vector`, `B` this class's factor with `B Bᵀ = G`.

    Args:
      vector: an array of shape `ggn_factor_inner_shape`.

    Returns:
      The product, one array per parameter dependant, shaped like it.
    """
    return self._factor_product(
      self.multiply_ggn_factor_unweighted, vector, self.ggn_factor_inner_shape
    )

  def multiply_ggn_factor_transpose(self, vector: Sequence[Array]) -> Array:
    """`sqrt(weight) * Bᵀ @ vector`, with the `B` of `multiply_ggn_factor`.

    Args:
      vector: one array per parameter dependant, shaped like it.

    Returns:
      An array of shape `ggn_factor_inner_shape`.
    """
    return self._factor_transpose_product(
      self.multiply_ggn_factor_transpose_unweighted, vector
    )

  def multiply_ggn_factor_replicated_one_hot(
    self, index: Sequence[int]
  ) -> tuple[Array, ...]:
    """`sqrt(weight) * B @ e`, `e` one-hot at `index` in every example.

    Args:
      index: a position in `ggn_factor_inner_shape[1:]` (all axes but the
        batch).

    Returns:
      The product, one array per parameter dependant, shaped like it.
    """
    return self._one_hot_product(
      self.multiply_ggn_factor_replicated_one_hot_unweighted,
      index,
      self.ggn_factor_inner_shape,
    )

  def multiply_ggn_unweighted(
    self, vector: Sequence[Array]
  ) -> tuple[Array, ...]:
    """`multiply_ggn` without the weight and the argument checks."""
    raise NotImplementedError

  def multiply_ggn_factor_unweighted(self, vector: Array) -> tuple[Array, ...]:
    """`multiply_ggn_factor` without the weight and the argument checks."""
    raise NotImplementedError

  def multiply_ggn_factor_transpose_unweighted(
    self, vector: Sequence[Array]
  ) -> Array:
    """`multiply_ggn_factor_transpose` without the weight and the checks."""
    raise NotImplementedError

  def multiply_ggn_factor_replicated_one_hot_unweighted(
    self, index: Sequence[int]
  ) -> tuple[Array, ...]:
    """`multiply_ggn_factor_replicated_one_hot` without the weight."""
    e = _replicated_one_hot(index, self.ggn_factor_inner_shape, self.dtype)
    return self.multiply_ggn_factor_unweighted(e)

  @property
  def ggn_factor_inner_shape(self) -> Shape:
    """Shape of the vectors that `multiply_ggn_factor` takes."""
    raise NotImplementedError


class NegativeLogProbLoss(LossFunction):
  """A loss `-log p(targets | params)` for a distribution `p` of the targets.

  Adds the Fisher of `p` w.r.t. its parameters, `F = E_y[g g^T]` with `g` the
  gradient of `log p(y)` and `y` drawn from `p`, and sampling from `p`. The
  losses here use natural parameters of exponential families: their Hessian
  does not depend on the targets and equals `F`, so the GGN hooks default to
  the Fisher ones.
  """

  @property
  def params(self) -> tuple[Array, ...]:
    """The distribution's parameters (the parameter dependants)."""
    return tuple(getattr(self, n) for n in self.dependant_names)

  @property
  def parameter_dependants(self) -> tuple[Array, ...]:
    return self.params

  def multiply_fisher(self, vector: Sequence[Array]) -> tuple[Array, ...]:
    """`weight * F @ vector`, `F` the Fisher w.r.t. the distribution's params.

    Args:
      vector: one array per parameter, shaped like it.

    Returns:
      The product, shaped like `vector`.
    """
    return self._matrix_product(self.multiply_fisher_unweighted, vector)

  def multiply_fisher_factor(self, vector: Array) -> tuple[Array, ...]:
    """`sqrt(weight) * B @ vector`, `B` this class's factor with `B Bᵀ = F`.

    Args:
      vector: an array of shape `fisher_factor_inner_shape`.

    Returns:
      The product, one array per parameter, shaped like it.
    """
    return self._factor_product(
      self.multiply_fisher_factor_unweighted,
      vector,
      self.fisher_factor_inner_shape,
    )

  def multiply_fisher_factor_transpose(self, vector: Sequence[Array]) -> Array:
    """`sqrt(weight) * Bᵀ @ vector`, with the `B` of `multiply_fisher_factor`.

    Args:
      vector: one array per parameter, shaped like it.

    Returns:
      An array of shape `fisher_factor_inner_shape`.
    """
    return self._factor_transpose_product(
      self.multiply_fisher_factor_transpose_unweighted, vector
    )

  def multiply_fisher_factor_replicated_one_hot(
    self, index: Sequence[int]
  ) -> tuple[Array, ...]:
    """`sqrt(weight) * B @ e`, `e` one-hot at `index` in every example.

    Args:
      index: a position in `fisher_factor_inner_shape[1:]` (all axes but the
        batch).

    Returns:
      The product, one array per parameter, shaped like it.
    """
    return self._one_hot_product(
      self.multiply_fisher_factor_replicated_one_hot_unweighted,
      index,
      self.fisher_factor_inner_shape,
    )

  def multiply_fisher_unweighted(
    self, vector: Sequence[Array]
  ) -> tuple[Array, ...]:
    """`multiply_fisher` without the weight and the argument checks."""
    raise NotImplementedError

  def multiply_fisher_factor_unweighted(
    self, vector: Array
  ) -> tuple[Array, ...]:
    """`multiply_fisher_factor` without the weight and the argument checks."""
    raise NotImplementedError

  def multiply_fisher_factor_transpose_unweighted(
    self, vector: Sequence[Array]
  ) -> Array:
    """`multiply_fisher_factor_transpose` without the weight and the checks."""
    raise NotImplementedError

  def multiply_fisher_factor_replicated_one_hot_unweighted(
    self, index: Sequence[int]
  ) -> tuple[Array, ...]:
    """`multiply_fisher_factor_replicated_one_hot` without the weight."""
    e = _replicated_one_hot(index, self.fisher_factor_inner_shape, self.dtype)
    return self.multiply_fisher_factor_unweighted(e)

  @property
  def fisher_factor_inner_shape(self) -> Shape:
    """Shape of the vectors that `multiply_fisher_factor` takes."""
    raise NotImplementedError

  def multiply_ggn_unweighted(self, vector):
    return self.multiply_fisher_unweighted(vector)

  def multiply_ggn_factor_unweighted(self, vector):
    return self.multiply_fisher_factor_unweighted(vector)

  def multiply_ggn_factor_transpose_unweighted(self, vector):
    return self.multiply_fisher_factor_transpose_unweighted(vector)

  def multiply_ggn_factor_replicated_one_hot_unweighted(self, index):
    return self.multiply_fisher_factor_replicated_one_hot_unweighted(index)

  @property
  def ggn_factor_inner_shape(self) -> Shape:
    return self.fisher_factor_inner_shape

  def sample(self, rng: Array) -> Array:
    """Targets drawn from the model's distribution.

    Args:
      rng: a PRNG key.

    Returns:
      One draw per example, shaped like the targets.
    """
    raise NotImplementedError

  def grad_of_evaluate_on_sample(
    self, rng: Array, coefficient_mode: str
  ) -> tuple[Array, ...]:
    """`grad_of_evaluate` at targets sampled from the model (held constant).

    Args:
      rng: a PRNG key for the sample.
      coefficient_mode: as for `evaluate`.

    Returns:
      One array per parameter, shaped like it. Per example, the outer
      product of the result has expectation `c² F`, `c` the mode's
      coefficient: `weight * F` for `coefficient_mode='sqrt'`.
    """
    targets = jax.lax.stop_gradient(self.sample(rng))
    return self.grad_of_evaluate(targets, coefficient_mode)


class NaturalParamsNegativeLogProbLoss(NegativeLogProbLoss):
  """A negative log-likelihood whose inputs are an exponential family's
  natural parameters.

  For such losses the Hessian w.r.t. the inputs does not depend on the
  targets and equals the Fisher, so the GGN products are the Fisher ones
  (which `NegativeLogProbLoss` already uses by default; this class names
  that property, as KFAC-JAX does).
  """


class DistributionNegativeLogProbLoss(NegativeLogProbLoss):
  """A negative log-likelihood given by a distrax distribution, `dist`.

  The per-example loss sums `-dist.log_prob` over the non-batch axes.
  """

  @property
  def dist(self) -> distrax.Distribution:
    """The distrax distribution of the targets."""
    raise NotImplementedError

  def _evaluate(self, targets):
    return _sum_over_non_batch_axes(-self.dist.log_prob(targets))

  def sample(self, rng):
    return self.dist.sample(seed=rng)

  @property
  def fisher_factor_inner_shape(self) -> Shape:
    """By default, the shape of the first parameter."""
    return tuple(jnp.shape(self.params[0]))


@jax.tree_util.register_pytree_node_class
class NormalMeanNegativeLogProbLoss(
  DistributionNegativeLogProbLoss, NaturalParamsNegativeLogProbLoss
):
  """`-log N(targets; mean, variance * I)` with a fixed (scalar) variance.

  The last axis is the event axis. W.r.t. the mean, `F = G = I / variance` and
  `B = I / sqrt(variance)`. The default variance 0.5 makes the loss
  `weight * ||targets - mean||^2` plus a constant; with
  `normalize_log_prob=False` the constant (`0.5 log(2 pi variance)` per
  entry) is left out, which changes values but no derivative.
  """

  dependant_names = ("mean",)
  independant_names = ("targets", "variance", "weight", "normalize_log_prob")

  def __init__(
    self,
    mean: Array,
    targets: Array | None = None,
    variance: Numeric = 0.5,
    weight: Numeric = 1.0,
    normalize_log_prob: bool | Array = True,
  ):
    """Builds the loss.

    Args:
      mean: the mean, `(batch, ..., d)`.
      targets: optional targets, shaped like `mean`.
      variance: the variance, a scalar (or an array shaped like `mean`).
      weight: a scalar multiplying the loss.
      normalize_log_prob: whether the values include the normal
        distribution's normalising constant, so that they are true negative
        log-densities rather than scaled squared errors.
    """
    super().__init__(weight)
    owner = type(self).__name__
    _check_shape(
      owner,
      "targets",
      targets,
      jnp.shape(mean),
      "targets must have the mean's shape",
    )
    if jnp.ndim(variance) and jnp.shape(variance) != jnp.shape(mean):
      raise ValueError(
        f"{owner}: the variance must be a scalar (or have the "
        f"mean's shape {jnp.shape(mean)}), got shape "
        f"{jnp.shape(variance)}."
      )
    self._inputs.update(
      mean=mean,
      targets=targets,
      variance=variance,
      normalize_log_prob=_as_flag(normalize_log_prob),
    )

  mean = _input("mean", "The mean of the normal distribution.")
  variance = _input("variance", "The fixed variance.")
  normalize_log_prob = _input(
    "normalize_log_prob",
    "Whether `evaluate` includes the normalising constant (a bool, or a "
    "traced boolean array when the loss is rebuilt inside a trace).",
  )

  @property
  def dist(self) -> distrax.MultivariateNormalDiag:
    """`N(mean, variance * I)` over the last axis."""
    scale = jnp.sqrt(self.variance) * jnp.ones_like(self.mean)
    return distrax.MultivariateNormalDiag(loc=self.mean, scale_diag=scale)

  def _evaluate(self, targets):
    flag = self.normalize_log_prob
    if flag is True:
      return super()._evaluate(targets)
    half_chi2 = 0.5 * jnp.square(targets - self.mean) / self.variance
    squared = _sum_over_non_batch_axes(half_chi2)
    if flag is False:
      return squared
    # A flag bound as a loss tag operand may be traced: add the constant
    # without branching on it.
    per_entry = 0.5 * jnp.log(2 * jnp.pi * self.variance)
    constant = _sum_over_non_batch_axes(
      jnp.broadcast_to(per_entry, jnp.shape(self.mean))
    )
    return squared + jnp.where(flag, constant, 0.0)

  def multiply_fisher_unweighted(self, vector):
    return (vector[0] / self.variance,)

  def multiply_fisher_factor_unweighted(self, vector):
    return (vector / jnp.sqrt(self.variance),)

  def multiply_fisher_factor_transpose_unweighted(self, vector):
    return vector[0] / jnp.sqrt(self.variance)


@jax.tree_util.register_pytree_node_class
class NormalMeanVarianceNegativeLogProbLoss(DistributionNegativeLogProbLoss):
  """`-log N(targets; mean, diag(variance))`, with mean and variance as inputs.

  Per dimension, the Fisher w.r.t. `(mean, variance)` is
  `diag(1 / variance, 1 / (2 variance^2))`. Factor vectors hold a mean part
  and then a variance part along the last axis (inner shape `(batch, 2 d)`).

  The Hessian w.r.t. the variance depends on the targets and can be
  indefinite, so this class takes the Fisher, which is that Hessian's
  expectation under the model, as its GGN.
  """

  dependant_names = ("mean", "variance")
  independant_names = ("targets", "weight")

  def __init__(
    self,
    mean: Array,
    variance: Array,
    targets: Array | None = None,
    weight: Numeric = 1.0,
  ):
    """Builds the loss.

    Args:
      mean: the mean, `(batch, ..., d)`.
      variance: the positive variance, shaped like `mean`.
      targets: optional targets, shaped like `mean`.
      weight: a scalar multiplying the loss.
    """
    super().__init__(weight)
    owner = type(self).__name__
    _check_shape(
      owner,
      "variance",
      variance,
      jnp.shape(mean),
      "give one variance per mean entry",
    )
    _check_shape(
      owner,
      "targets",
      targets,
      jnp.shape(mean),
      "targets must have the mean's shape",
    )
    self._inputs.update(mean=mean, variance=variance, targets=targets)

  mean = _input("mean", "The mean of the normal distribution.")
  variance = _input("variance", "The per-entry variance.")

  @property
  def dist(self) -> distrax.MultivariateNormalDiag:
    """`N(mean, diag(variance))` over the last axis."""
    return distrax.MultivariateNormalDiag(
      loc=self.mean, scale_diag=jnp.sqrt(self.variance)
    )

  @property
  def fisher_factor_inner_shape(self) -> Shape:
    shape = tuple(jnp.shape(self.mean))
    return shape[:-1] + (2 * shape[-1],)

  def multiply_fisher_unweighted(self, vector):
    v_mean, v_var = vector
    return v_mean / self.variance, v_var / (2 * jnp.square(self.variance))

  def multiply_fisher_factor_unweighted(self, vector):
    u_mean, u_var = jnp.split(vector, 2, axis=-1)
    return (
      u_mean / jnp.sqrt(self.variance),
      u_var / (jnp.sqrt(2.0) * self.variance),
    )

  def multiply_fisher_factor_transpose_unweighted(self, vector):
    v_mean, v_var = vector
    return jnp.concatenate(
      [
        v_mean / jnp.sqrt(self.variance),
        v_var / (jnp.sqrt(2.0) * self.variance),
      ],
      axis=-1,
    )


@jax.tree_util.register_pytree_node_class
class MultiBernoulliNegativeLogProbLoss(
  DistributionNegativeLogProbLoss, NaturalParamsNegativeLogProbLoss
):
  """Independent Bernoulli variables with log-odds `logits`.

  This is the sigmoid cross-entropy; targets may be soft (values in [0, 1]).
  With `p = sigmoid(logits)`, `F = G = diag(p (1 - p))` and `B = sqrt(F)`.
  """

  dependant_names = ("logits",)
  independant_names = ("targets", "weight")

  def __init__(
    self, logits: Array, targets: Array | None = None, weight: Numeric = 1.0
  ):
    """Builds the loss.

    Args:
      logits: the log-odds, `(batch, ...)`.
      targets: optional targets in [0, 1], shaped like `logits`.
      weight: a scalar multiplying the loss.
    """
    super().__init__(weight)
    _check_shape(
      type(self).__name__,
      "targets",
      targets,
      jnp.shape(logits),
      "targets must have the logits' shape",
    )
    self._inputs.update(logits=logits, targets=targets)

  logits = _input("logits", "The log-odds of the Bernoulli variables.")

  @property
  def dist(self) -> distrax.Bernoulli:
    """Independent Bernoulli variables with log-odds `logits`."""
    return distrax.Bernoulli(logits=self.logits)

  def _fisher_diagonal(self):
    p = jax.nn.sigmoid(self.logits)
    return p * (1 - p)

  def multiply_fisher_unweighted(self, vector):
    return (self._fisher_diagonal() * vector[0],)

  def multiply_fisher_factor_unweighted(self, vector):
    return (jnp.sqrt(self._fisher_diagonal()) * vector,)

  def multiply_fisher_factor_transpose_unweighted(self, vector):
    return jnp.sqrt(self._fisher_diagonal()) * vector[0]


def _sample_classes(rng, logits):
  """Class indices by inverting the CDF: one uniform number per example.

  The Gumbel-max trick of `distrax` would draw one number per class and take
  an argmax, which costs noticeably more in a K-FAC step.
  """
  probs = jax.nn.softmax(logits)
  uniform = jax.random.uniform(rng, probs.shape[:-1] + (1,), probs.dtype)
  # The class is the number of CDF values below the draw; the last CDF value
  # is 1, so leaving it out keeps the index in range under rounding.
  cdf = jnp.cumsum(probs[..., :-1], axis=-1)
  return jnp.sum(cdf < uniform, axis=-1)


@jax.tree_util.register_pytree_node_class
class CategoricalLogitsNegativeLogProbLoss(
  DistributionNegativeLogProbLoss, NaturalParamsNegativeLogProbLoss
):
  """Softmax cross-entropy with integer targets, `-log softmax(logits)[t]`.

  The last axis of `logits` holds the classes; `targets` has the other axes.
  With `p = softmax(logits)` and `q = sqrt(p)`: `F = G = diag(p) - p p^T` and
  `B = diag(q) - p q^T` (`B B^T = F` because `q^T q = 1`). An optional 0/1
  `mask` over the examples multiplies the values, gradients and all products.
  """

  dependant_names = ("logits",)
  independant_names = ("targets", "mask", "weight")

  def __init__(
    self,
    logits: Array,
    targets: Array | None = None,
    mask: Array | None = None,
    weight: Numeric = 1.0,
  ):
    """Builds the loss.

    Args:
      logits: `(batch, ..., num_classes)`.
      targets: optional integer classes of shape `logits.shape[:-1]` (for
        the one-hot class: one-hot vectors shaped like `logits`).
      mask: an optional 0/1 array of shape `logits.shape[:-1]`.
      weight: a scalar multiplying the loss.
    """
    super().__init__(weight)
    owner = type(self).__name__
    if jnp.ndim(logits) < 1:
      raise ValueError(f"{owner}: logits need a class axis (the last one).")
    self._check_targets(owner, logits, targets)
    _check_shape(
      owner,
      "mask",
      mask,
      jnp.shape(logits)[:-1],
      "give one 0/1 value per example, shape logits.shape[:-1]",
    )
    self._inputs.update(logits=logits, targets=targets, mask=mask)

  logits = _input("logits", "Unnormalised log-probabilities of the classes.")
  mask = _input("mask", "Optional 0/1 mask over the examples.")

  def _check_targets(self, owner, logits, targets):
    if targets is None:
      return
    if not jnp.issubdtype(jnp.result_type(targets), jnp.integer):
      raise ValueError(
        f"{owner}: targets must be integer class indices, got "
        f"dtype {jnp.result_type(targets)}; for one-hot targets "
        "use OneHotCategoricalLogitsNegativeLogProbLoss."
      )
    _check_shape(
      owner,
      "targets",
      targets,
      jnp.shape(logits)[:-1],
      "give one class index per example, shape logits.shape[:-1]",
    )

  @property
  def dist(self) -> distrax.Categorical:
    """The categorical distribution over the last axis of `logits`."""
    return distrax.Categorical(logits=self.logits)

  def sample(self, rng):
    return _sample_classes(rng, self.logits)

  def _masked(self, x, per_class=True):
    if self.mask is None:
      return x
    mask = jnp.asarray(self.mask, jnp.result_type(x))
    return x * (mask[..., None] if per_class else mask)

  def _evaluate(self, targets):
    nll = -self.dist.log_prob(targets)
    return _sum_over_non_batch_axes(self._masked(nll, per_class=False))

  def multiply_fisher_unweighted(self, vector):
    p, v = jax.nn.softmax(self.logits), vector[0]
    return (self._masked(p * v - p * jnp.sum(p * v, -1, keepdims=True)),)

  def multiply_fisher_factor_unweighted(self, vector):
    p = jax.nn.softmax(self.logits)
    qu = jnp.sqrt(p) * vector
    return (self._masked(qu - p * jnp.sum(qu, -1, keepdims=True)),)

  def multiply_fisher_factor_transpose_unweighted(self, vector):
    p, v = jax.nn.softmax(self.logits), vector[0]
    q = jnp.sqrt(p)
    return self._masked(q * v - q * jnp.sum(p * v, -1, keepdims=True))


@jax.tree_util.register_pytree_node_class
class OneHotCategoricalLogitsNegativeLogProbLoss(
  CategoricalLogitsNegativeLogProbLoss
):
  """As `CategoricalLogitsNegativeLogProbLoss`, with one-hot targets/samples."""

  def _check_targets(self, owner, logits, targets):
    _check_shape(
      owner,
      "targets",
      targets,
      jnp.shape(logits),
      "one-hot targets must have the logits' shape",
    )

  @property
  def dist(self) -> distrax.OneHotCategorical:
    """As `Categorical`, over one-hot vectors."""
    return distrax.OneHotCategorical(logits=self.logits)

  def sample(self, rng):
    classes = _sample_classes(rng, self.logits)
    return jax.nn.one_hot(
      classes, self.logits.shape[-1], dtype=self.logits.dtype
    )


def _tag_for(cls) -> LossTag:
  return LossTag(
    cls,
    parameter_dependants=cls.dependant_names,
    parameter_independants=cls.independant_names,
  )


# pylint: disable=invalid-name
NormalMeanNegativeLogProbLoss_tag = _tag_for(NormalMeanNegativeLogProbLoss)
NormalMeanVarianceNegativeLogProbLoss_tag = _tag_for(
  NormalMeanVarianceNegativeLogProbLoss
)
MultiBernoulliNegativeLogProbLoss_tag = _tag_for(
  MultiBernoulliNegativeLogProbLoss
)
CategoricalLogitsNegativeLogProbLoss_tag = _tag_for(
  CategoricalLogitsNegativeLogProbLoss
)
OneHotCategoricalLogitsNegativeLogProbLoss_tag = _tag_for(
  OneHotCategoricalLogitsNegativeLogProbLoss
)
# pylint: enable=invalid-name

_BERNOULLI_RANK = (1, "logits need a leading batch axis")
_CATEGORICAL_RANK = (
  2,
  "logits need a batch axis and a class axis, e.g. shape (batch, num_classes)",
)
_NORMAL_RANK = (
  2,
  "it needs a batch axis and a feature axis; reshape a "
  "(batch,) array with x[:, None]",
)


def _register(fn: str, tag: LossTag, rank_rule, **kwargs):
  """Checks the arguments, binds `tag` on them and returns the first input."""
  name = tag.parameter_dependants_names[0]
  first, (min_ndim, hint) = kwargs[name], rank_rule
  if jnp.ndim(first) < min_ndim:
    raise ValueError(
      f"{fn}: {name} of shape {jnp.shape(first)} is not supported; {hint}."
    )
  if jnp.ndim(kwargs["weight"]) != 0:
    raise ValueError(
      f"{fn}: the weight must be a scalar, got shape "
      f"{jnp.shape(kwargs['weight'])}."
    )
  for key in ("weight", "variance"):  # Python numbers take the input's dtype.
    if isinstance(kwargs.get(key), (int, float)):
      kwargs[key] = jnp.asarray(kwargs[key], jnp.result_type(first))
  tag.loss(*kwargs.values(), args_names=tuple(kwargs))  # Checks the rest.
  return tag.bind_loss(**kwargs)[0]


def register_sigmoid_cross_entropy_loss(
  logits: Array, targets: Array | None = None, weight: Numeric = 1.0
) -> Array:
  """Marks a sigmoid cross-entropy loss on `logits` in a model function.

  It behaves as `register_multi_bernoulli_predictive_distribution`.

  Args:
    logits: the log-odds, `(batch, ...)`.
    targets: targets in [0, 1] shaped like `logits`; needed only for the
      empirical Fisher.
    weight: a scalar multiplying the loss.

  Returns:
    `logits`, unchanged (the tag's output).

  Raises:
    ValueError: for logits without a batch axis, a non-scalar weight or
      targets of another shape.
  """
  return _register(
    "register_sigmoid_cross_entropy_loss",
    MultiBernoulliNegativeLogProbLoss_tag,
    _BERNOULLI_RANK,
    logits=logits,
    targets=targets,
    weight=weight,
  )


def register_multi_bernoulli_predictive_distribution(
  logits: Array, targets: Array | None = None, weight: Numeric = 1.0
) -> Array:
  """Marks independent Bernoulli outputs with log-odds `logits`.

  Args:
    logits: the log-odds, `(batch, ...)`.
    targets: values in [0, 1] shaped like `logits`; needed only for the
      empirical Fisher.
    weight: a scalar multiplying the negative log-likelihood and hence the
      Fisher; it is not a temperature.

  Returns:
    `logits`, unchanged.

  Raises:
    ValueError: as for `register_sigmoid_cross_entropy_loss`.
  """
  return _register(
    "register_multi_bernoulli_predictive_distribution",
    MultiBernoulliNegativeLogProbLoss_tag,
    _BERNOULLI_RANK,
    logits=logits,
    targets=targets,
    weight=weight,
  )


def register_softmax_cross_entropy_loss(
  logits: Array,
  targets: Array | None = None,
  mask: Array | None = None,
  weight: Numeric = 1.0,
) -> Array:
  """Marks a softmax cross-entropy loss on `logits` in a model function.

  Args:
    logits: `(batch, num_classes)`; the softmax is over the last axis.
    targets: integer classes of shape `(batch,)`; needed only for the
      empirical Fisher.
    mask: an optional 0/1 array of shape `(batch,)`; where it is 0 the loss
      is the constant 0 (no gradient, no curvature).
    weight: a scalar multiplying the loss.

  Returns:
    `logits`, unchanged (the tag's output).

  Raises:
    ValueError: for logits without batch and class axes, a non-scalar
      weight, or targets or a mask of the wrong shape or dtype.
  """
  return _register(
    "register_softmax_cross_entropy_loss",
    CategoricalLogitsNegativeLogProbLoss_tag,
    _CATEGORICAL_RANK,
    logits=logits,
    targets=targets,
    mask=mask,
    weight=weight,
  )


def register_categorical_predictive_distribution(
  logits: Array,
  targets: Array | None = None,
  mask: Array | None = None,
  weight: Numeric = 1.0,
) -> Array:
  """Marks a categorical output distribution with `logits`.

  Args:
    logits: `(batch, num_classes)`.
    targets: integer classes of shape `(batch,)`; needed only for the
      empirical Fisher.
    mask: an optional 0/1 array of shape `(batch,)`; where it is 0 the
      log-likelihood is the constant 0.
    weight: a scalar multiplying the negative log-likelihood and hence the
      Fisher; it is not a temperature.

  Returns:
    `logits`, unchanged.

  Raises:
    ValueError: as for `register_softmax_cross_entropy_loss`.
  """
  return _register(
    "register_categorical_predictive_distribution",
    CategoricalLogitsNegativeLogProbLoss_tag,
    _CATEGORICAL_RANK,
    logits=logits,
    targets=targets,
    mask=mask,
    weight=weight,
  )


def register_squared_error_loss(
  prediction: Array, targets: Array | None = None, weight: Numeric = 1.0
) -> Array:
  """Marks the loss `weight * ||targets - prediction||^2` per example.

  It is a normal distribution around `prediction` with variance 0.5, so its
  GGN w.r.t. `prediction` is `2 * weight * I`. For a loss
  `0.5 * c * ||targets - prediction||^2`, pass `weight=0.5 * c`.

  Args:
    prediction: the network output, `(batch, d)` or `(batch, ..., d)`.
    targets: targets shaped like `prediction`; needed only for the
      empirical Fisher.
    weight: a scalar multiplying the loss.

  Returns:
    `prediction`, unchanged (the tag's output).

  Raises:
    ValueError: for a prediction without batch and feature axes, a
      non-scalar weight or targets of another shape.
  """
  return _register(
    "register_squared_error_loss",
    NormalMeanNegativeLogProbLoss_tag,
    _NORMAL_RANK,
    mean=prediction,
    targets=targets,
    variance=0.5,
    weight=weight,
    # The value is the squared error itself, without the normal's constant.
    normalize_log_prob=False,
  )


def register_normal_predictive_distribution(
  mean: Array,
  targets: Array | None = None,
  variance: Numeric = 0.5,
  weight: Numeric = 1.0,
  normalize_log_prob: bool = True,
) -> Array:
  """Marks a normal output distribution `N(mean, variance * I)`.

  The loss is `weight / (2 variance) * ||targets - mean||^2` up to a constant
  and its Fisher w.r.t. `mean` is `weight / variance * I`, so `variance=1.0`
  gives `0.5 * weight * ||targets - mean||^2`.

  Args:
    mean: the network output, `(batch, d)` or `(batch, ..., d)`.
    targets: targets shaped like `mean`; needed only for the empirical
      Fisher.
    variance: the fixed variance, a scalar.
    weight: a scalar multiplying the negative log-likelihood.
    normalize_log_prob: whether the loss values include the normalising
      constant `0.5 log(2 pi variance)` per entry. It only matters where the
      registered loss is evaluated (e.g. for statistics); the curvature is
      the same either way.

  Returns:
    `mean`, unchanged.

  Raises:
    ValueError: as for `register_squared_error_loss`.
  """
  return _register(
    "register_normal_predictive_distribution",
    NormalMeanNegativeLogProbLoss_tag,
    _NORMAL_RANK,
    mean=mean,
    targets=targets,
    variance=variance,
    weight=weight,
    normalize_log_prob=normalize_log_prob,
  )
