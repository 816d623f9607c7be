"""KFAC-JAX 0.0.8's own example code, unmodified, trains on `estimators`.

Loaded from the release's source tree (not a dependency: see
benchmarks/kfac_jax/README.md; set KFAC_JAX_SOURCE to its checkout, e.g.
../kfac-jax-0.0.8), with `kfac_jax` an alias of `estimators`:

- `examples/optimizers.py`: `create_optimizer` builds the K-FAC optimizer
  from the `kfac` options of `classifier_mnist/pipeline.py`'s config;
- `examples/classifier_mnist/experiment.py`: the classifier network and its
  loss (`examples/losses.py`);
- `examples/optax_wrapper.py`: `OptaxWrapper` drives an
  `OptaxPreconditioner` chained with SGD.

The steps are called as `examples/training.py` calls them. Two imports
are stood in for, as they are not installed here: `jaxline` (only the
experiment base class `training.MnistExperiment` comes from it, and the
experiment module subclasses it at import) and `ml_collections` (imported
by `optimizers.py` for a type annotation). The data are synthetic 8x8
images instead of MNIST.
"""

import functools
import importlib
import itertools
import os
import pathlib
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import estimators
from curvbench.optimizers.kfac import MNIST_EXAMPLES
from tests.conftest import ROOT

CANDIDATES = [
  os.environ.get("KFAC_JAX_SOURCE"),
  str(ROOT.parent / "kfac-jax-0.0.8"),
  "/tmp/kfac008/repo",
]
# The `kfac` options of classifier_mnist/pipeline.py's config, and its l2_reg.
CLASSIFIER_MNIST_KFAC = {
  k: v for k, v in MNIST_EXAMPLES.items() if k != "l2_reg"
}
L2_REG = MNIST_EXAMPLES["l2_reg"]


def _source() -> pathlib.Path | None:
  for candidate in CANDIDATES:
    if (
      candidate
      and (pathlib.Path(candidate) / "examples/optimizers.py").exists()
    ):
      return pathlib.Path(candidate)
  return None


@pytest.fixture
def examples(monkeypatch):
  """The example modules, imported with `kfac_jax` -> `estimators`."""
  source = _source()
  if source is None:
    pytest.skip(
      "KFAC-JAX 0.0.8's source tree is not here: set KFAC_JAX_SOURCE to a "
      "checkout of its v0.0.8 tag (see benchmarks/kfac_jax/README.md)."
    )
  before = set(sys.modules)
  monkeypatch.setitem(sys.modules, "kfac_jax", estimators)
  for name in ("utils", "optimizer", "curvature_estimator", "curvature_blocks"):
    monkeypatch.setitem(
      sys.modules, f"kfac_jax.{name}", getattr(estimators, name)
    )
  ml_collections = types.ModuleType("ml_collections")
  ml_collections.config_dict = types.SimpleNamespace(ConfigDict=dict)
  monkeypatch.setitem(sys.modules, "ml_collections", ml_collections)
  package = types.ModuleType("examples")
  package.__path__ = [str(source / "examples")]
  monkeypatch.setitem(sys.modules, "examples", package)
  training = types.ModuleType("examples.training")
  training.MnistExperiment = type("MnistExperiment", (), {})
  monkeypatch.setitem(sys.modules, "examples.training", training)
  yield types.SimpleNamespace(
    optimizers=importlib.import_module("examples.optimizers"),
    optax_wrapper=importlib.import_module("examples.optax_wrapper"),
    experiment=importlib.import_module("examples.classifier_mnist.experiment"),
  )
  for name in set(sys.modules) - before:
    if name.split(".")[0] == "examples":
      del sys.modules[name]


def _setup(experiment):
  """Per-device params, a batch iterator and device keys, as training.py
  makes them, for the classifier on synthetic 8x8 images."""
  kfac_jax = estimators
  devices = jax.local_device_count()
  rng = np.random.default_rng(0)
  images = rng.uniform(size=(devices, 8, 8, 8)).astype(np.float32)
  labels = rng.integers(0, 10, size=(devices, 8))
  batch = dict(images=jnp.asarray(images), labels=jnp.asarray(labels))
  params = experiment.convolutional_classifier().init(
    jax.random.PRNGKey(0), batch["images"][0]
  )
  params = kfac_jax.utils.replicate_all_local_devices(params)
  rng = kfac_jax.utils.make_different_rng_key_on_all_devices(
    jax.random.PRNGKey(1)
  )
  return params, batch, rng


def _loss(train_loss, params, batch):
  first = lambda tree: jax.tree.map(lambda x: x[0], tree)
  return float(train_loss(first(params), first(batch))[0])


@pytest.mark.slow
def test_classifier_mnist_kfac_trains_with_the_example_optimizer(examples):
  kfac_jax = estimators
  train_loss = functools.partial(
    examples.experiment.classifier_loss, l2_reg=L2_REG, is_training=True
  )
  optimizer = examples.optimizers.create_optimizer(
    name="kfac",
    config=dict(kfac=CLASSIFIER_MNIST_KFAC),
    train_model_func=train_loss,
    l2_reg=L2_REG,
    has_aux=True,
    has_func_state=False,
    has_rng=False,
    model_func_for_estimator=None,
    dataset_size=64,
    train_total_batch_size=16,
    total_steps=10,
    total_epochs=None,
    schedule_free_config=types.SimpleNamespace(enabled=False),
  )
  assert isinstance(optimizer, kfac_jax.Optimizer)
  params, batch, rng = _setup(examples.experiment)
  data = itertools.repeat(batch)
  init_rng = kfac_jax.utils.replicate_all_local_devices(jax.random.PRNGKey(2))
  state = optimizer.init(params, init_rng, batch, None)
  start = _loss(train_loss, params, batch)
  for step in range(2):  # a refresh step, then one without
    rng, step_rng = kfac_jax.utils.p_split(rng)
    params, state, stats = optimizer.step(
      params=params,
      state=state,
      rng=step_rng,
      data_iterator=data,
      func_state=None,
      global_step_int=step,
    )
  assert int(stats["step"][0]) == 2
  assert np.isfinite(np.asarray(stats["loss"])).all()
  assert "top_1_accuracy" in stats["aux"]
  assert _loss(train_loss, params, batch) < start


@pytest.mark.slow
def test_optax_wrapper_drives_the_optax_preconditioner(examples):
  kfac_jax = estimators
  train_loss = functools.partial(
    examples.experiment.classifier_loss, l2_reg=L2_REG, is_training=True
  )
  preconditioner = kfac_jax.OptaxPreconditioner(
    train_loss, l2_reg=L2_REG, damping=1.0, inverse_update_period=1
  )
  wrapper = examples.optax_wrapper.OptaxWrapper(
    value_and_grad_func=jax.value_and_grad(train_loss, has_aux=True),
    value_func_has_aux=True,
    value_func_has_state=False,
    value_func_has_rng=False,
    learning_rate=0.5,
    optax_optimizer_ctor=lambda lr: optax.chain(
      preconditioner.as_gradient_transform(), optax.sgd(lr)
    ),
    preconditioner=preconditioner,
  )
  params, batch, rng = _setup(examples.experiment)
  data = itertools.repeat(batch)
  state = wrapper.init(params, rng, batch, None)
  start = _loss(train_loss, params, batch)
  for step in range(2):
    rng, step_rng = kfac_jax.utils.p_split(rng)
    params, state, stats = wrapper.step(
      params, state, step_rng, data, None, global_step_int=step
    )
  assert np.isfinite(np.asarray(stats["loss"])).all()
  assert int(state.precond_state.count[0]) == 2
  assert _loss(train_loss, params, batch) < start
