"""Block-wise work shared among devices (`distributed_cache_updates`,
`distributed_multiplies`, the optimizer's `distributed_inverses` and
`distributed_precon_apply`): each device computes only its share, counted
by callbacks that run where the work runs, and the results equal the
undistributed ones (2 host devices, float64)."""

import collections

import jax
import jax.extend
import jax.flatten_util
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec

import estimators as kfac
from estimators.utils import distributed
from tests import groundtruth as gt

pytestmark = pytest.mark.skipif(
  jax.device_count() < 2,
  reason="needs 2 devices (tests/conftest.py asks XLA for 2 on CPU)",
)

AXIS = "i"
ravel = lambda t: jax.flatten_util.ravel_pytree(t)[0]


def test_balance_spreads_costs_evenly_and_is_deterministic():
  rng = np.random.default_rng(0)
  for num_devices in (1, 2, 3, 8):
    costs = rng.exponential(size=17) ** 3
    owners = distributed.balance(costs, num_devices)
    assert set(owners) <= set(range(num_devices))
    loads = np.bincount(owners, weights=costs, minlength=num_devices)
    assert loads.max() <= loads.min() + costs.max() + 1e-12
    assert owners == distributed.balance(costs, num_devices)
  # The one costly block gets a device to itself.
  assert distributed.balance([1, 1, 10, 1, 1], 2) == (1, 1, 0, 1, 1)


def test_costs_follow_the_blocks_matrices():
  state = dict(a=jnp.zeros((30, 30)), g=jnp.zeros((4, 4)), b=jnp.zeros(7))
  assert distributed.refresh_cost(state) == 30**3 + 4**3 + 916 + 7
  assert distributed.product_cost(state, dim=120) == 120 * 34
  assert distributed.product_cost(dict(d=jnp.zeros(9)), dim=9) == 9


class _Log:
  """Which device ran which block's refresh and product."""

  def __init__(self):
    self.calls = collections.Counter()

  def record(self, what, name):
    try:  # outside a mapped axis (init's shape tracing) nothing is logged
      device = jax.lax.axis_index(AXIS)
    except NameError:
      return
    jax.debug.callback(
      lambda d: self.calls.update([(what, name, int(d))]), device
    )

  def block(self):
    log = self

    class Logged(kfac.DenseTwoKroneckerFactored):
      """K-FAC, reporting each refresh and product from its device."""

      def _update_cache(self, state, *args, **kwargs):
        log.record("refresh", self.name)
        return super()._update_cache(state, *args, **kwargs)

      def _multiply_matpower_unscaled(self, state, *args, **kwargs):
        log.record("product", self.name)
        return super()._multiply_matpower_unscaled(state, *args, **kwargs)

    return Logged


def _estimator(problem, log=None, distribute=True):
  blocks = {"dense_tag": log.block()} if log else None
  return kfac.BlockDiagonalCurvature(
    problem.tagged,
    default_estimation_mode="ggn_exact",
    layer_tag_to_block_ctor=blocks,
    distributed_multiplies=distribute,
    distributed_cache_updates=distribute,
  )


def _refresh_and_precondition(estimator, problem, state, vector, axis):
  state = estimator.update_curvature_matrix_estimate(
    state, 0.0, 1.0, 7, jax.random.PRNGKey(1), (problem.params, problem.batch)
  )
  state = estimator.update_cache(
    state,
    0.1,
    exact_powers=-1,
    approx_powers=None,
    eigenvalues=False,
    pmap_axis_name=axis,
  )
  return state, estimator.multiply_inverse(
    state, vector, 0.1, exact_power=True, use_cached=True, pmap_axis_name=axis
  )


def _mapped(fn, how):
  """`fn` run on 2 devices with its inputs replicated, by pmap or shard_map;
  device 0's outputs."""
  if how == "pmap":
    mapped = jax.pmap(fn, axis_name=AXIS)
    twice = lambda t: jax.tree.map(lambda x: jnp.stack([x, x]), t)
    return lambda *args: jax.tree.map(lambda x: x[0], mapped(*twice(args)))
  mesh = Mesh(np.array(jax.devices()[:2]), (AXIS,))
  return jax.jit(
    jax.shard_map(
      fn, mesh=mesh, in_specs=PartitionSpec(), out_specs=PartitionSpec()
    )
  )


@pytest.mark.slow
@pytest.mark.parametrize("how", ["pmap", "shard_map"])
def test_each_device_refreshes_and_applies_only_its_share(how):
  problem = gt.deep_linear()
  vector = jax.tree.map(lambda x: jnp.cos(x + 1.0), problem.params)
  reference = _estimator(problem)
  rng = jax.random.PRNGKey(0)
  args = (problem.params, problem.batch)
  state0 = reference.init(rng, args, exact_powers_to_cache=-1)
  want_state, want = _refresh_and_precondition(
    reference, problem, state0, vector, None
  )

  for distribute in (True, False):
    log = _Log()
    estimator = _estimator(problem, log, distribute)
    state = estimator.init(rng, args, exact_powers_to_cache=-1)
    got_state, got = _mapped(
      lambda s, v, e=estimator: _refresh_and_precondition(
        e, problem, s, v, AXIS
      ),
      how,
    )(state, vector)
    jax.effects_barrier()
    np.testing.assert_allclose(ravel(got), ravel(want), rtol=1e-10)
    for a, b in zip(jax.tree.leaves(got_state), jax.tree.leaves(want_state)):
      np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-14)

    names = [b.name for b in estimator.blocks]
    for what in ("refresh", "product"):
      devices = {
        name: sorted(
          d
          for (w, n, d), count in log.calls.items()
          if w == what and n == name
          for _ in range(count)
        )
        for name in names
      }
      if distribute:  # once per block, on one device; both devices work
        assert all(len(d) == 1 for d in devices.values()), (what, devices)
        assert {d[0] for d in devices.values()} == {0, 1}, (what, devices)
      else:
        assert all(d == [0, 1] for d in devices.values()), (what, devices)


def test_distributed_optimizer_steps_equal_undistributed_and_one_device():
  problem = gt.deep_linear(batch=8)
  kwargs = dict(learning_rate=0.2, momentum=0.5, damping=0.1)
  rng = jax.random.PRNGKey(0)

  def run(multi_device, **flags):
    opt = kfac.Optimizer(
      jax.value_and_grad(problem.tagged),
      l2_reg=0.0,
      use_adaptive_learning_rate=False,
      use_adaptive_momentum=False,
      use_adaptive_damping=False,
      num_burnin_steps=1,
      estimation_mode="ggn_exact",
      inverse_update_period=1,
      multi_device=multi_device,
      **flags,
    )
    params, keys, batch = problem.params, rng, problem.batch
    if multi_device:
      twice = lambda t: jax.tree.map(lambda x: jnp.stack([x, x]), t)
      params, keys = twice(params), twice(rng)
      batch = jax.tree.map(lambda x: x.reshape((2, 4) + x.shape[1:]), batch)
    state = opt.init(params, keys, batch)
    for step in range(3):
      params, state, _ = opt.step(
        params, state, keys, batch=batch, global_step_int=step, **kwargs
      )
    return ravel(
      jax.tree.map(lambda x: x[0], params) if multi_device else params
    )

  want = run(False)
  for flags in (
    dict(),
    dict(distributed_inverses=False, distributed_precon_apply=False),
  ):
    np.testing.assert_allclose(run(True, **flags), want, rtol=1e-9, atol=1e-12)


def _two_chains():
  """Dense, dense, a convolution, dense, dense: block-tridiagonal K-FAC
  couples the two pairs of dense layers (two chains) around the conv."""

  def model(params, batch):
    x, t = batch
    h = jnp.tanh(x @ params[0][0] + params[0][1])
    h = jnp.tanh(h @ params[1][0] + params[1][1])
    h = jax.lax.conv_general_dilated(
      h.reshape(-1, 2, 2, 1),
      params[2],
      (1, 1),
      "SAME",
      dimension_numbers=("NHWC", "HWIO", "NHWC"),
    ).reshape(-1, 4)
    h = jnp.tanh(h @ params[3][0] + params[3][1])
    y = h @ params[4][0] + params[4][1]
    kfac.register_squared_error_loss(y, t, weight=0.5)
    return 0.5 * jnp.mean(jnp.sum((y - t) ** 2, axis=1))

  shapes = [(3, 4), (4, 4), None, (4, 3), (3, 2)]
  params = [
    gt.random_normal(3, 2, 2, 1, 1)
    if s is None
    else (gt.random_normal(k, *s) / 2, gt.random_normal(10 + k, s[1]))
    for k, s in enumerate(shapes)
  ]
  batch = (gt.random_normal(20, 16, 3), gt.random_normal(21, 16, 2))
  return model, params, batch


LINALG = ("eigh", "lu", "cholesky", "triangular_solve")


def _linalg_count(jaxpr) -> int:
  """Factorisations and solves in a jaxpr, sub-jaxprs included."""
  total = 0
  for eqn in jaxpr.eqns:
    total += eqn.primitive.name in LINALG
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      total += _linalg_count(sub)
  return total


def _per_branch(jaxpr) -> list[int]:
  """Per device, the factorisations and solves of the branches it takes in
  the device-indexed switches of `jaxpr` (sub-jaxprs searched)."""
  counts = [0, 0]
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "cond" and len(eqn.params["branches"]) == 2:
      for d, branch in enumerate(eqn.params["branches"]):
        counts[d] += _linalg_count(branch.jaxpr)
    else:
      for sub in jax.extend.core.jaxprs_in_params(eqn.params):
        counts = [a + b for a, b in zip(counts, _per_branch(sub))]
  return counts


@pytest.mark.slow
def test_block_tridiagonal_shares_blocks_and_chains_among_devices():
  """Each device's program does part of the factorisations and solves, and
  the parts add up to the undistributed work; results are unchanged."""
  model, params, batch = _two_chains()
  vector = jax.tree.map(lambda x: jnp.sin(x + 1.0), params)

  def make(distribute=True):
    return kfac.BlockTridiagonalCurvature(
      model,
      default_estimation_mode="ggn_exact",
      distributed_multiplies=distribute,
      distributed_cache_updates=distribute,
    )

  def work(estimator, state, axis):
    state = estimator.update_curvature_matrix_estimate(
      state, 0.0, 1.0, 16, jax.random.PRNGKey(1), (params, batch)
    )
    state = estimator.update_cache(
      state, 0.1, approx_powers=-1, pmap_axis_name=axis
    )
    return (
      state,
      estimator.multiply(
        state, vector, 0.1, exact_power=False, pmap_axis_name=axis
      ),
      estimator.multiply_inverse(
        state,
        vector,
        0.1,
        exact_power=False,
        use_cached=True,
        pmap_axis_name=axis,
      ),
    )

  init = lambda e: e.init(
    jax.random.PRNGKey(0), (params, batch), approx_powers_to_cache=-1
  )
  reference = make()
  state = init(reference)
  want = work(reference, state, None)
  assert len(reference.chains) == 2
  for how in ("pmap", "shard_map"):
    got = _mapped(lambda s: work(reference, s, AXIS), how)(state)
    # The products, not the cached bases: eigenvectors of one compiled
    # program may differ from another's by rounding the products don't see.
    for a, b in zip(jax.tree.leaves(got[1:]), jax.tree.leaves(want[1:])):
      np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-12)

  mesh = Mesh(np.array(jax.devices()[:2]), (AXIS,))
  program = lambda e: jax.make_jaxpr(
    jax.shard_map(
      lambda s: work(e, s, AXIS),
      mesh=mesh,
      in_specs=PartitionSpec(),
      out_specs=PartitionSpec(),
    )
  )(state).jaxpr
  everything = _linalg_count(program(make(distribute=False)))
  shares = _per_branch(program(reference))
  assert everything > 0 and sum(shares) == everything, (shares, everything)
  assert 0 < min(shares) <= max(shares) < everything, shares
