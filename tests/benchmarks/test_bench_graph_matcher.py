"""pytest-benchmark timing of automatic layer registration.

Each benchmark times `auto_register_tags` (tracing the model, matching the
default patterns, building the report) on an untagged Haiku model, and
records next to it the time XLA takes to compile the model's loss
(`jax.jit(...).lower(...).compile()`), which registration should stay well
under. Parameters are abstract (`jax.eval_shape`): neither step needs values.
"""

import time

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import estimators as kfac
from estimators import graph_matcher

F32 = jnp.float32


def _mlp(x):
  for _ in range(19):
    x = jax.nn.relu(hk.Linear(128)(x))
  return hk.Linear(10)(x)


def _mlp_layer_stack(x):
  x = jax.nn.relu(hk.Linear(128)(x))
  x = hk.experimental.layer_stack(18)(lambda h: jax.nn.relu(hk.Linear(128)(h)))(
    x
  )
  return hk.Linear(10)(x)


def _convnet(x):
  for i in range(10):
    x = jax.nn.relu(hk.Conv2D(32, 3, stride=2 if i in (3, 6) else 1)(x))
  return hk.Linear(10)(hk.Flatten()(x))


def _resnet(x):
  def bn(h):
    return hk.BatchNorm(True, True, 0.9)(h, is_training=True)

  x = jax.nn.relu(bn(hk.Conv2D(16, 3, with_bias=False)(x)))
  for width, stride in [(16, 1), (16, 1), (32, 2), (32, 1), (64, 2), (64, 1)]:
    h = jax.nn.relu(bn(hk.Conv2D(width, 3, stride=stride, with_bias=False)(x)))
    h = bn(hk.Conv2D(width, 3, with_bias=False)(h))
    if stride != 1 or x.shape[-1] != width:
      x = bn(hk.Conv2D(width, 1, stride=stride, with_bias=False)(x))
    x = jax.nn.relu(x + h)
  x = hk.LayerNorm(-1, True, True)(jnp.mean(x, axis=(1, 2)))
  return hk.Linear(10)(x)


MODELS = {
  "mlp_20_layers": (_mlp, (128, 256)),
  "mlp_20_layers_layer_stack": (_mlp_layer_stack, (128, 256)),
  "convnet_10_layers": (_convnet, (32, 32, 32, 3)),
  "resnet_batchnorm_layernorm": (_resnet, (32, 32, 32, 3)),
}


def _problem(name):
  forward, x_shape = MODELS[name]
  model = hk.transform_with_state(forward)
  x = jax.ShapeDtypeStruct(x_shape, F32)
  labels = jax.ShapeDtypeStruct(x_shape[:1], jnp.int32)
  params, state = jax.eval_shape(model.init, jax.random.PRNGKey(0), x)

  def loss_fn(p, s, x, labels):
    logits, _ = model.apply(p, s, None, x)
    logits = kfac.register_softmax_cross_entropy_loss(logits, labels)
    return -jnp.mean(
      jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], 1)
    )

  return loss_fn, (params, state, x, labels)


def _compile_seconds(loss_fn, args, repeats=2):
  times = []
  for _ in range(repeats):  # a fresh function each time: no cache hits
    fn = jax.jit(lambda *a: jax.value_and_grad(loss_fn)(*a))
    start = time.perf_counter()
    fn.lower(*args).compile()
    times.append(time.perf_counter() - start)
  return min(times)


@pytest.mark.benchmark(group="auto-register-tags")
@pytest.mark.parametrize("name", list(MODELS))
def test_auto_register_tags(benchmark, name):
  loss_fn, args = _problem(name)
  tagged = benchmark.pedantic(
    lambda: graph_matcher.auto_register_tags(loss_fn, args),
    rounds=5,
    iterations=1,
    warmup_rounds=1,
  )
  report = tagged.registrations(*args)
  assert not [r for r in report if r["tag"] == "generic_tag"]
  compile_s = _compile_seconds(loss_fn, args)
  register_s = (
    float(np.median(benchmark.stats.stats.data))
    if (benchmark.stats is not None)
    else float("nan")
  )
  benchmark.extra_info.update(
    num_params=len(report),
    num_layers=len({r["layer"] for r in report}),
    compile_seconds=compile_s,
    register_seconds=register_s,
    register_over_compile=register_s / compile_s,
  )
