"""The `Problem` type (a model, its registered loss, data and batch order),
the settings every problem has, and the registry of problems.

A problem is one module of `problems.models`: a `ProblemSettings` dataclass
registered with `PROBLEMS.register`, whose `build(data)` returns the
`Problem` on the chosen dataset.
"""

from __future__ import annotations

import abc
import dataclasses
import functools
import itertools
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np

import estimators as kfac
from curvbench.components import (
  Choice,
  Component,
  OneOf,
  Registry,
  Text,
  Whole,
  dotted,
  setting,
)
from problems import model_outputs
from problems.data import Dataset
from problems.datasets import DATASETS, DatasetSettings

# What the targets are: class labels (`classification`, per position for
# sequence models), arrays the outputs should equal (`regression`), or the
# inputs themselves (`reconstruction`).
TASKS = ("classification", "regression", "reconstruction")


def softmax_cross_entropy(logits, labels):
  """Mean over the batch of `-log softmax(logits)[label]`, registered."""
  logits = kfac.register_softmax_cross_entropy_loss(logits, labels)
  log_p = jax.nn.log_softmax(logits)
  return -jnp.mean(jnp.take_along_axis(log_p, labels[:, None], axis=1))


def sequence_softmax_cross_entropy(logits, labels):
  """Mean over the batch and the positions of `-log softmax(logits)[label]`
  for logits `(batch, positions, classes)`: registered as one categorical
  loss per example summed over its positions, weighted by 1 / positions."""
  logits = kfac.register_softmax_cross_entropy_loss(
    logits, labels, weight=1.0 / logits.shape[1]
  )
  log_p = jax.nn.log_softmax(logits)
  return -jnp.mean(jnp.take_along_axis(log_p, labels[..., None], axis=-1))


def sigmoid_cross_entropy(logits, targets):
  """Mean over the batch of the summed Bernoulli NLL of `targets`, registered."""
  logits = kfac.register_sigmoid_cross_entropy_loss(logits, targets)
  per_pixel = (
    jnp.maximum(logits, 0)
    - logits * targets
    + jnp.log1p(jnp.exp(-jnp.abs(logits)))
  )
  return jnp.mean(jnp.sum(per_pixel, axis=-1))


def squared_error(prediction, targets):
  """Mean over the batch of `0.5 * ||targets - prediction||^2`, registered."""
  prediction = kfac.register_squared_error_loss(prediction, targets, weight=0.5)
  return jnp.mean(0.5 * jnp.sum((targets - prediction) ** 2, axis=-1))


def one_hot_squared_error(outputs, labels):
  """Mean over the batch of `0.5 * ||outputs - onehot(label)||^2` summed over
  the classes, registered as `squared_error` of the one-hot targets: the
  squared loss Cohen et al. (2021) train most of their classifiers with
  (their code's convention; PyTorch's MSELoss would also average over the
  classes)."""
  targets = jax.nn.one_hot(labels, outputs.shape[-1], dtype=outputs.dtype)
  return squared_error(outputs, targets)


LOSSES = {
  "softmax_cross_entropy": softmax_cross_entropy,
  "sequence_softmax_cross_entropy": sequence_softmax_cross_entropy,
  "sigmoid_cross_entropy": sigmoid_cross_entropy,
  "squared_error": squared_error,
  "one_hot_squared_error": one_hot_squared_error,
}

# The losses whose targets are class labels (indices into the outputs' last
# axis); the others compare the outputs with targets of their own shape.
LABEL_LOSSES = (
  "softmax_cross_entropy",
  "sequence_softmax_cross_entropy",
  "one_hot_squared_error",
)

# A classifier's `loss` setting: its choices, and the loss each one names.
CLASSIFIER_LOSSES = {
  "softmax_cross_entropy": "softmax_cross_entropy",
  "squared_error": "one_hot_squared_error",
}


def classifier_loss_setting() -> Any:
  """The `loss` setting of a classifier: a key of `CLASSIFIER_LOSSES`."""
  return setting(
    "softmax_cross_entropy",
    OneOf(tuple(CLASSIFIER_LOSSES)),
    "the training loss: softmax_cross_entropy, or squared_error, half the "
    "squared distance to the one-hot label summed over the classes (as "
    "Cohen et al. 2021 train most runs)",
  )


def loss(name: str) -> Callable:
  """The loss function `LOSSES[name]`, `(outputs, targets) -> scalar`; an
  unknown name raises a ValueError listing the known ones."""
  if name not in LOSSES:
    raise ValueError(
      f"Unknown loss {name!r}; choose one of {', '.join(LOSSES)}."
    )
  return LOSSES[name]


@dataclasses.dataclass(frozen=True)
class Network:
  """A model as two pure functions, `init(rng, inputs) -> params` and
  `apply(params, inputs) -> outputs`: the form of a Haiku transform, which
  any JAX model takes (a Flax module's `init` and `apply`, an Equinox or
  Flax NNX model split into its arrays and the rest, a plain function).

  `output` names the part of what apply returns that the loss reads, where
  apply returns more than that array: an index into a tuple, a key of a
  dict, an attribute name, or a tuple of these as a path
  (`problems.model_outputs`). None, the default, takes apply's return value
  as the array itself and refuses anything else, naming what it was."""

  init: Callable
  apply: Callable
  output: model_outputs.Output = None

  def __post_init__(self):
    model_outputs.check_setting(self.output)

  def outputs(self, params, inputs):
    """The loss's input: the part of `apply(params, inputs)` that `output`
    names."""
    return model_outputs.pick(self.apply(params, inputs), self.output)


@dataclasses.dataclass(frozen=True)
class Problem:
  """What is optimized: `loss_fn(params, (inputs, targets))` and its data.

  The loss is averaged over the batch, registered with `estimators`, and the
  model's layers are tagged. Batches come in a fixed order given by the seed.
  """

  name: str
  task: str
  net: Network | hk.Transformed | hk.TransformedWithState
  loss_name: str
  data: Dataset
  batch_size: int
  seed: int = 0
  # Roles of layers that their tag alone does not tell (is a dense layer
  # part of attention or of an MLP?): `(part of the layer's name, role)`,
  # the first match wins (`ProblemSettings.layer_roles`).
  layer_roles: tuple[tuple[str, str], ...] = ()

  def __post_init__(self):
    if self.task not in TASKS:
      raise ValueError(f"Unknown task {self.task!r}; choose one of {TASKS}.")
    count = len(self.data.x_train)
    if count == 0:  # the loaders refuse this; a hand-made Dataset may not
      raise ValueError(
        f"The {self.data.name} data has no training examples: give "
        "problem.data sizes (num_train, num_test, ...) that leave some."
      )
    if self.batch_size < 1 or self.batch_size > count:
      raise ValueError(
        f"batch_size={self.batch_size} must be between 1 and the {count} "
        f"training examples of {self.data.name}: lower problem.batch_size "
        "or train on more examples (problem.data)."
      )

  @classmethod
  def from_model(
    cls,
    model: Callable,
    data: Dataset,
    settings: ProblemSettings,
    *,
    task: str,
    loss_name: str,
    with_state: bool = False,
  ) -> Problem:
    """A problem around the Haiku forward function `model(inputs)`, or with
    `with_state` `model(inputs, is_training)` keeping model state (batch
    norm's running averages, `hk.get_state`); its name and batch size come
    from its `settings`."""
    transform = hk.transform_with_state if with_state else hk.transform
    return cls(
      name=settings.label or settings.name,
      task=task,
      net=hk.without_apply_rng(transform(model)),
      loss_name=loss_name,
      data=data,
      batch_size=settings.batch_size,
      layer_roles=settings.layer_roles,
    )

  @classmethod
  def from_functions(
    cls,
    network: Network,
    data: Dataset,
    settings: ProblemSettings,
    *,
    task: str,
    loss_name: str,
  ) -> Problem:
    """A problem around any JAX model, given as a `Network`; its name and
    batch size come from its `settings`."""
    return cls(
      name=settings.label or settings.name,
      task=task,
      net=network,
      loss_name=loss_name,
      data=data,
      batch_size=settings.batch_size,
      layer_roles=settings.layer_roles,
    )

  @property
  def has_state(self) -> bool:
    """Whether the model keeps state (batch norm's running averages).

    Such a model couples the examples of a batch in training mode: each
    example's output depends on the batch's statistics. Its loss, and so
    every curvature of it, is that of training mode on the batch given, as
    in the papers that study batch-norm networks' curvature; evaluation uses
    the running averages (`outputs` with a `model_state`).
    """
    return isinstance(self.net, hk.TransformedWithState)

  @functools.cached_property
  def _state_structure(self):
    """A model state of the right structure, for training-mode calls, whose
    outputs do not read it (numpy arrays: it may first be asked for while
    a function is traced, and must outlive the trace)."""
    shapes = jax.eval_shape(self._init, jax.random.PRNGKey(0), None)[1]
    return jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), shapes)

  def _init(self, rng, dtype):
    """`(params, model_state)` of the model (state `{}` without)."""
    x = jnp.asarray(self.data.x_train[:1], dtype)
    if self.has_state:
      return self.net.init(rng, x, True)
    return self.net.init(rng, x), {}

  def outputs(self, params, inputs, model_state=None):
    """The network's outputs on `inputs`: in training mode, or, for a model
    with state and given its `model_state`, in evaluation mode (batch norm
    normalising by its running averages)."""
    if isinstance(self.net, Network):
      return self.net.outputs(params, inputs)
    if not self.has_state:
      # A Haiku model (`from_model`): refused by name if it returns no array.
      return model_outputs.pick(self.net.apply(params, inputs), None)
    if model_state is None:
      return self.net.apply(params, self._state_structure, inputs, True)[0]
    return self.net.apply(params, model_state, inputs, False)[0]

  def loss_fn(self, params, batch):
    """The registered training loss, in training mode."""
    inputs, targets = batch
    return loss(self.loss_name)(self.outputs(params, inputs), targets)

  def evaluation_loss(self, params, batch, model_state=None):
    """The loss of `outputs(params, inputs, model_state)`."""
    inputs, targets = batch
    return loss(self.loss_name)(
      self.outputs(params, inputs, model_state), targets
    )

  def error(self, params, batch, model_state=None):
    """The error the papers report, averaged over the batch, of
    `outputs(params, inputs, model_state)`.

    Classification: the fraction of misclassified examples. Regression:
    the squared error summed over outputs. Reconstruction (autoencoders):
    the squared reconstruction error summed over pixels (the K-FAC paper's
    "training error"), the reconstruction being the sigmoid of the logits
    under the cross-entropy loss and the output itself under squared error.
    """
    inputs, targets = batch
    out = self.outputs(params, inputs, model_state)
    if self.task == "classification":
      return jnp.mean(jnp.argmax(out, axis=-1) != targets)
    if self.loss_name == "sigmoid_cross_entropy":
      out = jax.nn.sigmoid(out)
    return jnp.mean(jnp.sum((out - targets) ** 2, axis=-1))

  def init_model_state(self, dtype=None):
    """The model state before training (`{}` for a model without)."""
    if not self.has_state:
      return {}
    return jax.jit(self._init, static_argnums=1)(jax.random.PRNGKey(0), dtype)[
      1
    ]

  def next_model_state(self, params, model_state, inputs):
    """The model state after a training step on `inputs` from `params`:
    the running averages moved towards the batch's statistics, which the
    step's forward pass computes (here a forward pass of its own)."""
    if not self.has_state:
      return model_state
    return self.net.apply(params, model_state, inputs, True)[1]

  def init_params(self, rng, dtype=None):
    """The initial parameters; floating ones in `dtype` where given (a
    model may fix its parameters' precision whatever its inputs')."""
    params = jax.jit(self._init, static_argnums=1)(rng, dtype)[0]
    if dtype is None:
      return params
    return jax.tree.map(
      lambda p: p.astype(dtype) if jnp.issubdtype(p.dtype, jnp.floating) else p,
      params,
    )

  @property
  def num_params(self) -> int:
    """The number of scalar parameters (found from shapes alone, without
    initialising the model)."""
    shapes = jax.eval_shape(self.init_params, jax.random.PRNGKey(0))
    return int(sum(np.prod(s.shape) for s in jax.tree.leaves(shapes)))

  def targets(self, inputs, labels):
    """The loss targets of `inputs`: the labels, or the flattened inputs
    where the task is their reconstruction."""
    if self.task == "reconstruction":
      return inputs.reshape(len(inputs), -1)
    return labels

  def _split(self, split: str):
    """The `(inputs, labels)` arrays of the 'train' or 'test' split."""
    if split not in ("train", "test"):
      raise ValueError(f"split must be 'train' or 'test', got {split!r}.")
    return getattr(self.data, f"x_{split}"), getattr(self.data, f"y_{split}")

  def batches(
    self,
    split: str = "train",
    batch_size: int | None = None,
    seed: int | None = None,
    epochs: int | None = None,
    dtype=np.float32,
    sizes: Iterator[int] | None = None,
  ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Batches `(inputs, targets)`, reshuffled each epoch; the last partial
    batch of an epoch is dropped. Endless when `epochs` is None.

    With `sizes`, each batch takes its size from that iterator in turn (a
    batch schedule), drawn from the epoch's order where the last one ended;
    a batch that no longer fits the epoch starts the next.
    """
    x, y = self._split(split)
    fixed = batch_size or self.batch_size
    sizes = itertools.repeat(fixed) if sizes is None else sizes
    seed = self.seed if seed is None else seed
    if epochs == 0:
      return
    epoch, start = 0, 0
    order = np.random.default_rng([seed, epoch]).permutation(len(x))
    for size in sizes:
      if size > len(x):
        raise ValueError(
          f"A batch of {size} does not fit the {len(x)} "
          f"{split} examples; lower the batch size or raise "
          "the data size."
        )
      if start + size > len(x):
        epoch, start = epoch + 1, 0
        if epochs is not None and epoch >= epochs:
          return
        order = np.random.default_rng([seed, epoch]).permutation(len(x))
      idx = order[start : start + size]
      start += size
      xb = x[idx].astype(dtype)
      yield xb, self.targets(xb, y[idx])

  def fixed_batch(
    self,
    size: int | None = None,
    split: str = "train",
    dtype=np.float32,
    seed: int | None = None,
  ):
    """The first batch of the seed's order (for curvature measurements)."""
    return next(self.batches(split, size, seed=seed, dtype=dtype))

  def evaluation_batch(
    self, size: int | None = None, dtype=np.float32, split: str = "test"
  ):
    """The first `size` examples of `split` (all of them when None), in the
    split's stored order, so every run evaluates the same examples."""
    x, y = self._split(split)
    x = x[:size].astype(dtype)
    return x, self.targets(x, y[:size])

  def metadata(self) -> dict:
    """What describes the problem in a run's record: its name, task, loss,
    dataset, parameter count, batch size, split sizes and input shape."""
    return dict(
      problem=self.name,
      task=self.task,
      loss=self.loss_name,
      dataset=self.data.name,
      num_params=self.num_params,
      batch_size=self.batch_size,
      num_train=len(self.data.x_train),
      num_test=len(self.data.x_test),
      input_shape=list(self.data.input_shape),
    )


@dataclasses.dataclass
class ProblemSettings(Component, abc.ABC):
  """What every problem has: a label, a batch size and a dataset.

  A subclass names its dataset when none is chosen (`default_data`), adds
  its model's settings and builds the problem (`build`); where a model
  cannot use some data (e.g. a convnet on signals) it says so in
  `disagreements_with`, which is asked before anything is loaded.
  """

  label: str | None = setting(
    None,
    Text(null=True),
    "the problem's name in records and reports (null: its name)",
  )
  batch_size: int = setting(64, Whole(1), "training batch size")
  data: Any = setting(
    None, Choice(DATASETS), "the dataset: choose with problem/data=NAME"
  )
  default_data: ClassVar[str] = "digits"
  # Whether the model reads token sequences (datasets with `tokens`) and
  # predicts a token at every position; the others read arrays of numbers.
  sequence_model: ClassVar[bool] = False
  # `(part of a layer's name, role)` for layers whose tag does not say
  # their role, e.g. `("attention", "attention")` (see `Problem`).
  layer_roles: ClassVar[tuple[tuple[str, str], ...]] = ()
  # Whether the defaults are sized for an accelerator (paper-size models):
  # the CPU benchmark of record leaves such a problem out.
  accelerator_sized: ClassVar[bool] = False

  def not_images(self, data: DatasetSettings, prefix: str) -> str | None:
    """Why `data` does not fit a model of images (H, W, C), or None."""
    shape = data.input_shape()
    if len(shape) == 3:
      return None
    images = [
      n for n in DATASETS if len(DATASETS.defaults(n).input_shape()) == 3
    ]
    return (
      f"{dotted(prefix, 'data')}: the {self.name} needs images (H, W, "
      f"C) but dataset {data.name!r} has inputs of shape {shape}; "
      f"choose an image dataset (problem/data={', '.join(images)})."
    )

  @property
  def couples_examples(self) -> bool:
    """Whether an example's output depends on the rest of its batch in
    training (batch norm); the model then keeps state (`Problem.has_state`)."""
    return False

  @abc.abstractmethod
  def build(self, data: Dataset) -> Problem:
    """The problem on `data`."""

  def disagreements_with(
    self, data: DatasetSettings, prefix: str
  ) -> Iterator[str]:
    """Why this model cannot use `data` (nothing where it can)."""
    return iter(())

  def disagreements(self, prefix):
    yield from super().disagreements(prefix)
    if self.data.tokens != self.sequence_model:
      wanted = "token sequences" if self.sequence_model else "numeric arrays"
      fits = [
        n
        for n in DATASETS
        if DATASETS.defaults(n).tokens == self.sequence_model
      ]
      yield (
        f"{prefix}.data: problem {self.name!r} reads {wanted} but "
        f"dataset {self.data.name!r} does not hold them; choose "
        f"problem/data={' or '.join(fits)}."
      )
      return
    yield from self.disagreements_with(self.data, prefix)
    sizes = self.data.sizes()
    if sizes is not None and self.batch_size > sizes[0]:
      yield (
        f"{prefix}.batch_size={self.batch_size} is more than the "
        f"{sizes[0]} training examples of dataset {self.data.name!r}: "
        f"lower {prefix}.batch_size or train on more examples "
        f"({prefix}.data)."
      )

  @classmethod
  def completed(cls, values):
    if values.get("data") is None:  # the model's own dataset
      values = dict(
        values, data=dataclasses.asdict(DATASETS.defaults(cls.default_data))
      )
    return values


PROBLEMS = Registry(
  "problem",
  # The components' base class: abstract, and never instantiated.
  ProblemSettings,  # type: ignore[type-abstract]
  package="problems.models",
)
