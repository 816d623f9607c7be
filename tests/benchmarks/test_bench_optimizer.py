"""K-FAC optimizer step time against Adam on the same problem (float32).

Settings follow the reference measurements: adaptive learning rate, momentum
and damping, inverses refreshed every 5 steps, batch 128. Each round runs one
full refresh period (5 steps) and ends with `block_until_ready`; the
per-step time is a fifth of that; an Adam round, timed the same way, runs
before each K-FAC round. The first two K-FAC steps (trace + compile +
run of the refresh step, then of the plain step) are recorded apart, as
`first_step_s` and `second_step_s`, and the ratio to Adam measured in
the same run as `ratio_to_adam`: the median of each K-FAC round over the
Adam round before it, with the quartiles of the same ratios
(`ratio_q25`, `ratio_q75`). Next to it, `flop_ratio_to_adam` is the
ratio of the arithmetic XLA counts in the compiled steps (averaged over a
refresh period; LAPACK calls are not counted): a time ratio near it means the
step is bound by arithmetic, not overhead. The `distributed-refresh` group
times the inverse refresh on 2 devices with and without the blocks shared
among them. `make bench` runs them all; `make test` skips the large problems.
"""

import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax

import estimators as kfac

F32 = jnp.float32
BATCH = 128
PERIOD = 5


def _dense_params(rng, sizes):
  params = {}
  for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
    params[f"w{i}"] = jax.random.normal(
      jax.random.fold_in(rng, i), (a, b), F32
    ) / jnp.sqrt(a)
    params[f"b{i}"] = jnp.zeros((b,), F32)
  return params


def _dense_net(params, x, n_layers, activation, final=None):
  for i in range(n_layers):
    x = x @ params[f"w{i}"] + params[f"b{i}"]
    if i < n_layers - 1 and (final is None or i != final):
      x = activation(x)
  return x


def mlp():
  sizes = (100, 50, 50, 50, 10)
  rng = jax.random.PRNGKey(0)
  x = jax.random.normal(rng, (BATCH, 100), F32)
  y = jax.random.randint(jax.random.fold_in(rng, 1), (BATCH,), 0, 10)

  def loss_fn(params, batch):
    x, y = batch
    logits = _dense_net(params, x, 4, jnp.tanh)
    kfac.register_softmax_cross_entropy_loss(logits, y)
    return -jnp.mean(
      jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], 1)
    )

  return loss_fn, _dense_params(rng, sizes), (x, y)


def autoencoder():
  sizes = (784, 1000, 500, 250, 30, 250, 500, 1000, 784)
  rng = jax.random.PRNGKey(0)
  x = jax.random.uniform(rng, (BATCH, 784), F32)

  def loss_fn(params, batch):
    (x,) = batch
    # The 30-unit code layer (layer 3) is linear, as in the K-FAC paper.
    logits = _dense_net(params, x, 8, jnp.tanh, final=3)
    kfac.register_sigmoid_cross_entropy_loss(logits, x)
    return jnp.mean(jnp.sum(optax.sigmoid_binary_cross_entropy(logits, x), -1))

  return loss_fn, _dense_params(rng, sizes), (x,)


def convnet():
  rng = jax.random.PRNGKey(0)
  shapes = {
    "k0": (3, 3, 1, 32),
    "c0": (32,),
    "k1": (3, 3, 32, 64),
    "c1": (64,),
    "w": (7 * 7 * 64, 10),
    "b": (10,),
  }
  params = {
    n: 0.1 * jax.random.normal(jax.random.fold_in(rng, i), s, F32)
    for i, (n, s) in enumerate(shapes.items())
  }
  x = jax.random.normal(rng, (BATCH, 28, 28, 1), F32)
  y = jax.random.randint(jax.random.fold_in(rng, 1), (BATCH,), 0, 10)

  def loss_fn(params, batch):
    h, y = batch
    for i in range(2):
      h = lax.conv_general_dilated(
        h,
        params[f"k{i}"],
        (2, 2),
        "SAME",
        dimension_numbers=("NHWC", "HWIO", "NHWC"),
      )
      h = jax.nn.relu(h + params[f"c{i}"])
    logits = h.reshape(BATCH, -1) @ params["w"] + params["b"]
    kfac.register_softmax_cross_entropy_loss(logits, y)
    return -jnp.mean(
      jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], 1)
    )

  return loss_fn, params, (x, y)


PROBLEMS = {"mlp": mlp, "autoencoder": autoencoder, "convnet": convnet}
LARGE = {"autoencoder", "convnet"}


def _timed(fn):
  start = time.perf_counter()
  jax.block_until_ready(fn())
  return time.perf_counter() - start


def _flops(fn, *args):
  return jax.jit(fn).lower(*args).compile().cost_analysis()["flops"]


def _adam_runner(loss_fn, params, batch):
  adam = optax.adam(1e-3)

  @jax.jit
  def step(p, s):
    grads = jax.grad(loss_fn)(p, batch)
    updates, s = adam.update(grads, s, p)
    return optax.apply_updates(p, updates), s

  carry = [params, adam.init(params)]
  compile_s = _timed(lambda: step(*carry))

  def run():
    for _ in range(PERIOD):
      carry[:] = step(*carry)
    return jax.block_until_ready(carry[0])

  return run, compile_s, lambda: _flops(step, params, adam.init(params))


def _kfac_runner(loss_fn, params, batch):
  opt = kfac.Optimizer(
    jax.value_and_grad(loss_fn),
    l2_reg=0.0,
    use_adaptive_learning_rate=True,
    use_adaptive_momentum=True,
    use_adaptive_damping=True,
    initial_damping=1.0,
    num_burnin_steps=0,
    inverse_update_period=PERIOD,
  )
  rng = jax.random.PRNGKey(0)
  state = opt.init(params, rng, batch)
  carry = [params, state, 0]

  def one_step():
    p, s, i = carry
    p, s, _ = opt.step(p, s, rng, batch=batch, global_step_int=i)
    carry[:] = [p, s, i + 1]
    return p

  # Refresh steps and the others are separate programs: the first two steps
  # compile one each.
  compile_s = [_timed(one_step), _timed(one_step)]
  for _ in range(PERIOD - 2):  # align rounds with the refresh period
    one_step()

  def run():
    for _ in range(PERIOD):
      one_step()
    return jax.block_until_ready(carry[0])

  def flops_per_step():
    # The first step of each period refreshes the inverses and adapts the
    # damping (both intervals are PERIOD); the others do neither. The
    # unstaged step differs from `step()`'s program only by copies.
    def step(refresh):
      return lambda p, s: opt.uncompiled_step(
        p, s, rng, batch, refresh_cache=refresh, update_damping=refresh
      )

    plain, first = (_flops(step(r), params, state) for r in (False, True))
    return (first + (PERIOD - 1) * plain) / PERIOD

  return run, compile_s, flops_per_step


@pytest.mark.benchmark(group="optimizer-step")
@pytest.mark.parametrize("name", list(PROBLEMS))
def test_kfac_step_against_adam(benchmark, name):
  if benchmark.disabled and name in LARGE:
    pytest.skip("timing run on a large problem: use `make bench`")
  loss_fn, params, batch = PROBLEMS[name]()
  adam_run, adam_compile_s, adam_flops = _adam_runner(loss_fn, params, batch)
  kfac_run, (first_step_s, second_step_s), kfac_flops = _kfac_runner(
    loss_fn, params, batch
  )
  rounds = 7 if name in LARGE else 30
  adam_times = []
  # An Adam round before every K-FAC round, so that both see the same load.
  benchmark.pedantic(
    kfac_run,
    setup=lambda: adam_times.append(_timed(adam_run) / PERIOD),
    rounds=rounds,
    warmup_rounds=1,
  )
  adam_median = sorted(adam_times)[len(adam_times) // 2]
  if not benchmark.disabled:
    kfac_median = benchmark.stats.stats.median / PERIOD
    kfac_times = np.asarray(benchmark.stats.stats.data) / PERIOD
    # The timed rounds, each over the Adam round just before it.
    ratios = kfac_times / np.asarray(adam_times[-len(kfac_times) :])
    q25, ratio, q75 = np.quantile(ratios, [0.25, 0.5, 0.75])
    kfac_gflop, adam_gflop = kfac_flops() / 1e9, adam_flops() / 1e9
    benchmark.extra_info.update(
      kfac_step_ms=1e3 * kfac_median,
      adam_step_ms=1e3 * adam_median,
      ratio_to_adam=ratio,
      ratio_q25=q25,
      ratio_q75=q75,
      kfac_gflop=kfac_gflop,
      adam_gflop=adam_gflop,
      flop_ratio_to_adam=kfac_gflop / adam_gflop,
      first_step_s=first_step_s,
      second_step_s=second_step_s,
      adam_first_step_s=adam_compile_s,
      device=jax.devices()[0].device_kind,
    )


@pytest.mark.benchmark(group="distributed-refresh")
@pytest.mark.parametrize(
  "distributed", [False, True], ids=["replicated", "distributed"]
)
@pytest.mark.parametrize("name", list(PROBLEMS))
def test_refresh_on_two_devices(benchmark, name, distributed):
  """The optimizer's inverse refresh (approximate inverses, factored
  damping) under `shard_map` on 2 devices: every device refreshing every
  block, or each its share (`distributed_cache_updates`)."""
  if len(jax.devices()) < 2:
    pytest.skip("needs 2 devices (tests/conftest.py asks XLA for 2 on CPU)")
  if benchmark.disabled and name in LARGE:
    pytest.skip("timing run on a large problem: use `make bench`")
  loss_fn, params, batch = PROBLEMS[name]()
  est = kfac.BlockDiagonalCurvature(
    loss_fn, distributed_cache_updates=distributed
  )
  state = est.init(
    jax.random.PRNGKey(0), (params, batch), approx_powers_to_cache=-1
  )
  state = jax.jit(
    lambda s, args: est.update_curvature_matrix_estimate(
      s, 0.0, 1.0, BATCH, jax.random.PRNGKey(1), args
    )
  )(state, (params, batch))
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("devices",))
  refresh = jax.jit(
    jax.shard_map(
      lambda s: est.update_cache(
        s, 1e-3, None, -1, False, pmap_axis_name="devices"
      ),
      mesh=mesh,
      in_specs=jax.P(),
      out_specs=jax.P(),
    )
  )
  jax.block_until_ready(refresh(state))  # compile outside the rounds
  benchmark.pedantic(
    lambda: jax.block_until_ready(refresh(state)), rounds=10, warmup_rounds=1
  )
  benchmark.extra_info.update(device=jax.devices()[0].device_kind, devices=2)
