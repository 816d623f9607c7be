"""KFAC-JAX 0.0.8's `kfac_jax.utils` names on `estimators.utils` (issue 47).

Each function is checked against a dense NumPy computation or a hand
computation; the device helpers run on the two host CPU devices conftest.py
sets up.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.linalg

from estimators import utils

TOL = dict(rtol=1e-9, atol=1e-10)
NDEV = jax.local_device_count()

# The public names of kfac_jax.utils in KFAC-JAX 0.0.8.
KFAC_JAX_008_NAMES = """
Array PRNGKey Scalar Numeric Shape DType PyTree ArrayTree TArrayTree Params
Batch FuncState FuncAux PyTreeDef FuncArgs FuncOuts Func ValueFunc
ValueAndGradFunc AssumedFuncOutput ScheduleType tree_is_empty
abstract_objects_equal get_float_dtype_and_check_consistency
deserialize_state_tree serialize_state_tree to_tuple_or_repeat
filter_sequence first_dim_is_size fake_element_from_iterator
default_batch_size_extractor auto_scope_function auto_scope_method
register_state_class replace_char call_func_with_conditional_kwargs
Finalizable State rearrange in_pmap wrap_if_pmap pmean_if_pmap psum_if_pmap
pmap_mean pmap_sum using_legacy_pmap get_first get_mean get_sum
broadcast_all_local_devices pmap_zeros_like jit_zeros_like
replicate_all_local_devices make_different_rng_key_on_all_devices p_split
p_split_num host_sync host_all_gather host_mean pmap_sync_and_divide_value
jit_sync_and_divide_value copy_array copy_obj pmap_copy_obj distribute_thunks
set_special_case_zero_inv get_special_case_zero_inv set_use_cholesky_inversion
get_use_cholesky_inversion product outer_product scalar_mul scalar_div
weighted_sum_of_objects sum_of_objects pytree_size inner_product
symmetric_matrix_inner_products asymmetric_matrix_inner_products
matrix_of_inner_products vector_of_inner_products block_permuted norm
squared_norm per_parameter_norm psd_inv psd_solve
psd_solve_maybe_zero_last_idx pi_adjusted_kronecker_factors
pi_adjusted_kronecker_inverse kronecker_product_axis_mul_v
kronecker_eigen_basis_axis_mul_v kronecker_product_mul_v
kronecker_eigen_basis_mul_v safe_psd_eigh tnt_scale
loop_and_parallelize_average psd_matrix_norm invert_psd_matrices
inverse_sqrt_psd_matrices stable_sqrt cosine_similarity default_add_function
WeightedMovingAverage MultiChunkAccumulator staged WithStagedMethods
""".split()


def rand(seed, *shape):
  return np.random.default_rng(seed).standard_normal(shape)


def spd(seed, n):
  x = rand(seed, n, n + 2)
  return x @ x.T / n + 0.1 * np.eye(n)


def test_every_0_0_8_name_is_exported():
  assert len(KFAC_JAX_008_NAMES) == 107
  missing = [n for n in KFAC_JAX_008_NAMES if not hasattr(utils, n)]
  assert not missing
  assert set(KFAC_JAX_008_NAMES) <= set(utils.__all__)


# --- pytrees --------------------------------------------------------------


def test_pytree_predicates_and_sizes():
  tree = {"a": jnp.zeros((2, 3)), "b": [jnp.zeros(4, jnp.float32)]}
  assert utils.tree_is_empty({"a": [], "b": None})
  assert not utils.tree_is_empty(tree)
  assert utils.pytree_size(tree) == 10
  same = jax.tree.map(jnp.ones_like, tree)
  assert utils.abstract_objects_equal(tree, same)
  other_dtype = {"a": tree["a"], "b": [jnp.zeros(4, jnp.float64)]}
  assert not utils.abstract_objects_equal(tree, other_dtype)
  assert utils.abstract_objects_equal(tree, other_dtype, check_dtype=False)
  assert not utils.abstract_objects_equal(tree, {"a": tree["a"]})
  one_dtype = {"a": jnp.zeros(2, jnp.float32), "b": jnp.ones(1, jnp.float32)}
  assert utils.get_float_dtype_and_check_consistency(one_dtype) == jnp.float32
  assert utils.get_float_dtype_and_check_consistency({}) is None
  with pytest.raises(ValueError, match="different float dtypes"):
    utils.get_float_dtype_and_check_consistency(tree)
  with pytest.raises(ValueError, match="floating-point"):
    utils.get_float_dtype_and_check_consistency(jnp.zeros(2, jnp.int32))


def test_product():
  assert utils.product([2, np.int64(3), 4]) == 24
  assert type(utils.product((2, 3))) is int
  assert utils.product([]) == 1
  np.testing.assert_allclose(
    utils.product([jnp.array([1.0, 2.0]), 3.0, jnp.array(0.5)]), [1.5, 3.0]
  )


def test_inner_product_and_norms():
  a = {"w": jnp.asarray(rand(0, 3, 2)), "b": jnp.asarray(rand(1, 4))}
  b = {"w": jnp.asarray(rand(2, 3, 2)), "b": jnp.asarray(rand(3, 4))}
  flat = lambda t: np.concatenate([np.ravel(x) for x in jax.tree.leaves(t)])
  np.testing.assert_allclose(utils.inner_product(a, b), flat(a) @ flat(b))
  np.testing.assert_allclose(
    utils.cosine_similarity(a, b),
    flat(a) @ flat(b) / np.linalg.norm(flat(a)) / np.linalg.norm(flat(b)),
  )
  low = jax.tree.map(lambda x: x.astype(jnp.float32), (a, b))
  got = utils.inner_product(*low, in_float64=True)
  assert got.dtype == jnp.float32
  exact = flat(low[0]).astype(np.float64) @ flat(low[1]).astype(np.float64)
  np.testing.assert_allclose(got, exact, rtol=1e-7)
  with pytest.raises(ValueError, match="same leaf shapes"):
    utils.inner_product(a, {"w": a["w"]})
  norms = utils.per_parameter_norm({"mlp": a, "out": [b["b"]]}, "norm")
  assert set(norms) == {"norm(mlp/b)", "norm(mlp/w)", "norm(out/0)"}
  np.testing.assert_allclose(norms["norm(mlp/w)"], np.linalg.norm(a["w"]))
  np.testing.assert_allclose(norms["norm(out/0)"], np.linalg.norm(b["b"]))
  trees = [a, b, jax.tree.map(lambda x: 2 * x, a)]
  np.testing.assert_allclose(
    flat(utils.sum_of_objects(trees)), 3 * flat(a) + flat(b)
  )
  assert utils.scalar_mul(a, 1) is a and utils.scalar_div(a, 1.0) is a
  np.testing.assert_allclose(flat(utils.scalar_div(a, 4.0)), flat(a) / 4)


def test_inner_product_matrices():
  trees = [
    {"x": jnp.asarray(rand(i, 5)), "y": jnp.asarray(rand(i + 9, 2, 2))}
    for i in range(3)
  ]
  others = [jax.tree.map(lambda x: x + 1.0, t) for t in trees]
  flat = lambda t: np.concatenate([np.ravel(x) for x in jax.tree.leaves(t)])
  rows = np.stack([flat(t) for t in trees])
  cols = np.stack([flat(t) for t in others])
  np.testing.assert_allclose(
    utils.matrix_of_inner_products(trees), rows @ rows.T
  )
  np.testing.assert_allclose(
    utils.asymmetric_matrix_inner_products(trees, others), rows @ cols.T
  )
  np.testing.assert_allclose(
    utils.vector_of_inner_products(others[0], trees), rows @ cols[0]
  )
  # The symmetric form computes the upper triangle and mirrors it.
  upper = np.triu(rows @ cols.T)
  np.testing.assert_allclose(
    utils.symmetric_matrix_inner_products(trees, others),
    upper + np.triu(upper, 1).T,
  )
  diff = lambda u, v: jnp.sum(u["x"]) - jnp.sum(v["x"])
  m = utils.asymmetric_matrix_inner_products(trees, trees, ip_function=diff)
  s = [np.sum(t["x"]) for t in trees]
  np.testing.assert_allclose(m, np.subtract.outer(s, s))
  with pytest.raises(ValueError, match="same length"):
    utils.symmetric_matrix_inner_products(trees, others[:2])


# --- arrays ---------------------------------------------------------------


def test_outer_product_and_block_permuted():
  a, b, c = rand(0, 2), rand(1, 3), rand(2, 4)
  np.testing.assert_allclose(
    utils.outer_product(a, b, c), np.multiply.outer(np.multiply.outer(a, b), c)
  )
  with pytest.raises(ValueError, match="vectors"):
    utils.outer_product(a, np.eye(2))
  m = rand(3, 6, 6)
  sizes, order = [1, 2, 3], [2, 0, 1]
  cuts = np.cumsum(sizes)[:-1]
  blocks = [np.split(r, cuts, axis=1) for r in np.split(m, cuts, axis=0)]
  expected = np.block([[blocks[i][j] for j in order] for i in order])
  np.testing.assert_array_equal(utils.block_permuted(m, sizes, order), expected)
  assert utils.block_permuted(m, sizes, [0, 1, 2]) is m
  with pytest.raises(ValueError, match="same length"):
    utils.block_permuted(m, sizes, [1, 0])


@pytest.mark.parametrize(
  "shape, spec, order, out",
  [
    ([4], "b->b1", [0], [4, 1]),
    ([2, 3, 4, 5], "b h w c -> (b h) w c", [0, 1, 2, 3], [6, 4, 5]),
    ([2, 3, 4, 5], "b h w c -> h (b w) c", [1, 0, 2, 3], [3, 8, 5]),
    ([2, 3, 4, 5], "b h w c -> b (c h w) 1", [0, 3, 1, 2], [2, 60, 1]),
  ],
)
def test_rearrange(shape, spec, order, out):
  x = rand(0, *shape)
  expected = np.transpose(x, order).reshape(out)
  np.testing.assert_array_equal(utils.rearrange(jnp.asarray(x), spec), expected)


@pytest.mark.parametrize(
  "shape, spec",
  [([4], "b->b1"), ([2, 3, 4], "abc -> (cb)1a"), ([2, 3], "ab -> ba")],
)
def test_unrearrange_inverts_rearrange(shape, spec):
  x = jnp.asarray(rand(1, *shape))
  np.testing.assert_array_equal(
    utils.unrearrange(utils.rearrange(x, spec), spec, shape), x
  )


def test_rearrange_refuses_bad_specs():
  for spec in ("a b -> a", "a b c -> a b c", "a b", "a b -> a z"):
    with pytest.raises(ValueError, match="rearrange"):
      utils.rearrange(jnp.zeros((2, 3)), spec)


@pytest.mark.parametrize("cap", [None, 10.0])
def test_stable_sqrt(cap):
  x = jnp.asarray([1.0, 1e-2, 1e-5, 1e-8, 0.0])
  kwargs = {} if cap is None else {"max_gradient": cap}
  limit = 1000.0 if cap is None else cap
  f = functools.partial(utils.stable_sqrt, **kwargs)
  with np.errstate(divide="ignore"):
    expected = np.minimum(1 / (2 * np.sqrt(np.asarray(x))), limit)
  y, dx = jax.jvp(f, [x], [jnp.ones_like(x)])
  np.testing.assert_allclose(y, np.sqrt(x))
  np.testing.assert_allclose(dx, expected)
  np.testing.assert_allclose(jax.grad(lambda v: f(v).sum())(x), expected)


# --- PSD linear algebra ---------------------------------------------------


@pytest.fixture
def cholesky_flag():
  before = utils.get_use_cholesky_inversion()
  yield
  utils.set_use_cholesky_inversion(before)


@pytest.mark.parametrize("cholesky", [False, True])
def test_psd_inv_and_solve(cholesky, cholesky_flag):
  utils.set_use_cholesky_inversion(cholesky)
  assert utils.get_use_cholesky_inversion() is cholesky
  a, v = spd(0, 4), rand(1, 4)
  np.testing.assert_allclose(utils.psd_inv(a), np.linalg.inv(a), **TOL)
  np.testing.assert_allclose(
    utils.psd_solve(a, v), np.linalg.solve(a, v), **TOL
  )
  padded = np.zeros((5, 5))
  padded[:4, :4] = a
  got = utils.psd_solve_maybe_zero_last_idx(padded, np.append(v, 7.0))
  np.testing.assert_allclose(got, np.append(np.linalg.solve(a, v), 0), **TOL)
  np.testing.assert_allclose(
    utils.psd_solve_maybe_zero_last_idx(a, v), np.linalg.solve(a, v), **TOL
  )
  with pytest.raises(ValueError, match="square"):
    utils.psd_inv(jnp.zeros((2, 3)))


def test_psd_inv_of_non_finite_matrix_is_nan(cholesky_flag):
  utils.set_use_cholesky_inversion(False)
  a = spd(0, 3)
  a[0, 1] = np.nan
  assert np.isnan(utils.psd_inv(a)).all()
  assert np.isnan(utils.psd_solve(a, np.ones(3))).all()


def test_invert_and_inverse_sqrt_psd_matrices():
  tree = {"m": spd(0, 3), "d": np.array([4.0, 0.25]), "s": np.array(9.0)}
  inv = utils.invert_psd_matrices(tree)
  np.testing.assert_allclose(inv["m"], np.linalg.inv(tree["m"]), **TOL)
  np.testing.assert_allclose(inv["d"], [0.25, 4.0])
  np.testing.assert_allclose(inv["s"], 1 / 9)
  root = utils.inverse_sqrt_psd_matrices(tree)
  expected = np.linalg.inv(scipy.linalg.sqrtm(tree["m"]).real)
  np.testing.assert_allclose(root["m"], expected, rtol=1e-8, atol=1e-10)
  np.testing.assert_allclose(root["d"], [0.5, 2.0])
  np.testing.assert_allclose(root["s"], 1 / 3)


@pytest.mark.parametrize("force_on_host", [False, True])
def test_safe_psd_eigh(force_on_host):
  a = spd(0, 4) - 0.5 * np.eye(4) * 0  # PSD
  values, vectors = jax.jit(utils.safe_psd_eigh, static_argnums=1)(
    a, force_on_host
  )
  np.testing.assert_allclose(values, np.linalg.eigvalsh(a), **TOL)
  np.testing.assert_allclose((vectors * values) @ vectors.T, a, **TOL)
  clipped, _ = utils.safe_psd_eigh(np.diag([-1e-12, 1.0]), force_on_host)
  np.testing.assert_array_equal(clipped, [0.0, 1.0])


def test_psd_matrix_norm():
  m = spd(0, 7)
  d, s = np.array([1.0, 4.0, 2.0]), np.array(3.0)
  eig = np.linalg.eigvalsh(m)
  expected = {
    "avg_diag": (np.trace(m) / 7, d.mean()),
    "median_diag": (np.median(np.diag(m)), np.median(d)),
    "trace": (np.trace(m), d.sum()),
    "median_eig": (np.median(eig), np.median(d)),
    "one_over_dim": (1 / 7, 1 / 3),
    "1_norm": (np.abs(m).sum(0).max(), d.max()),
    "avg_fro": (np.linalg.norm(m) / np.sqrt(7), np.linalg.norm(d) / np.sqrt(3)),
    "fro": (np.linalg.norm(m), np.linalg.norm(d)),
    "2_norm": (eig[-1], d.max()),
  }
  for name, (of_matrix, of_diagonal) in expected.items():
    np.testing.assert_allclose(
      utils.psd_matrix_norm(m, norm_type=name), of_matrix, rtol=1e-7
    )
    np.testing.assert_allclose(
      utils.psd_matrix_norm(d, norm_type=name), of_diagonal, rtol=1e-12
    )
    scalar = 1.0 if name == "one_over_dim" else 3.0
    np.testing.assert_allclose(utils.psd_matrix_norm(s, norm_type=name), scalar)
  small = spd(1, 3)
  np.testing.assert_allclose(
    utils.psd_matrix_norm(small, "2_norm"), np.linalg.eigvalsh(small)[-1]
  )
  np.testing.assert_allclose(
    utils.psd_matrix_norm(m, "2_norm", method_2norm="power_iteration"),
    eig[-1],
    rtol=1e-5,
  )
  with pytest.raises(ValueError, match="norm_type"):
    utils.psd_matrix_norm(m, "spectral")
  with pytest.raises(ValueError, match="method_2norm"):
    utils.psd_matrix_norm(m, "2_norm", method_2norm="qr")
  with pytest.raises(ValueError, match="square"):
    utils.psd_matrix_norm(np.zeros((2, 3)))


# --- Kronecker products ---------------------------------------------------


def test_kronecker_products_against_dense():
  f1, f2, f3 = rand(0, 2, 2), rand(1, 3, 3), rand(2, 4, 4)
  v = rand(3, 2, 3, 4)
  kron = np.kron(np.kron(f1, f2), f3)
  got = utils.kronecker_product_axis_mul_v([f1, f2, f3], v)
  np.testing.assert_allclose(got.ravel(), kron @ v.ravel(), **TOL)
  got = utils.kronecker_product_axis_mul_v([f1, f2, f3], v, transpose=True)
  np.testing.assert_allclose(got.ravel(), kron.T @ v.ravel(), **TOL)
  mixed = utils.kronecker_product_axis_mul_v(
    [f1, None, f3], v, transpose=[True, False, False]
  )
  dense = np.kron(np.kron(f1.T, np.eye(3)), f3)
  np.testing.assert_allclose(mixed.ravel(), dense @ v.ravel(), **TOL)
  f23 = rand(4, 12, 12)
  grouped = utils.kronecker_product_axis_mul_v([f1, f23], v, [[0], [1, 2]])
  np.testing.assert_allclose(
    grouped.ravel(), np.kron(f1, f23) @ v.ravel(), **TOL
  )
  q = [np.linalg.qr(rand(i, n, n))[0] for i, n in enumerate((2, 3, 4))]
  lam = rand(5, 2, 3, 4)
  basis = np.kron(np.kron(q[0], q[1]), q[2])
  got = utils.kronecker_eigen_basis_axis_mul_v(q, lam, v)
  np.testing.assert_allclose(
    got.ravel(), basis @ (lam.ravel() * (basis.T @ v.ravel())), **TOL
  )
  with pytest.raises(ValueError, match="axis_groups"):
    utils.kronecker_product_axis_mul_v([f1, f23], v, [[1], [0, 2]])
  with pytest.raises(ValueError, match="factors"):
    utils.kronecker_product_axis_mul_v([f1], v)
  with pytest.raises(ValueError, match="same shape"):
    utils.kronecker_eigen_basis_axis_mul_v(q, lam[0], v)


def test_two_factor_kronecker_products_use_column_vec():
  a, b, m = rand(0, 3, 3), rand(1, 2, 2), rand(2, 2, 3)
  vec = lambda x: x.T.ravel()  # column-stacking vec
  np.testing.assert_allclose(
    vec(utils.kronecker_product_mul_v(a, b, m, False)),
    np.kron(a, b) @ vec(m),
    **TOL,
  )
  qa, qb = np.linalg.qr(rand(3, 3, 3))[0], np.linalg.qr(rand(4, 2, 2))[0]
  lam = rand(5, 2, 3)
  q = np.kron(qa, qb)
  np.testing.assert_allclose(
    vec(utils.kronecker_eigen_basis_mul_v(qa, qb, lam, m)),
    q @ (vec(lam) * (q.T @ vec(m))),
    **TOL,
  )


def test_pi_adjusted_kronecker_factors_two_factors_match_martens_grosse():
  a, g, damping = spd(0, 3), spd(1, 4), 0.3
  got = utils.pi_adjusted_kronecker_factors(a, g, damping=damping)
  ours = utils.pi_adjusted_kronecker_damping(a, g, damping)
  np.testing.assert_allclose(np.kron(*got), np.kron(*ours), **TOL)
  inverses = utils.pi_adjusted_kronecker_inverse(a, g, damping=damping)
  for inverse, factor in zip(inverses, got):
    np.testing.assert_allclose(inverse, np.linalg.inv(factor), **TOL)


def test_pi_adjusted_kronecker_factors_by_hand():
  a, d, s, damping = spd(0, 3), np.array([1.0, 3.0]), np.array(4.0), 0.2
  norms = [np.trace(a) / 3, d.mean(), 4.0]
  c = np.prod(norms) ** (1 / 3)
  # The scalar factor takes no damping; the other two share it.
  share = damping ** (1 / 2) / c ** (3 / 2)
  got = utils.pi_adjusted_kronecker_factors(a, d, s, damping=damping)
  np.testing.assert_allclose(got[0], c * (a / norms[0] + share * np.eye(3)))
  np.testing.assert_allclose(got[1], c * (d / norms[1] + share))
  np.testing.assert_allclose(got[2], c)
  # All scalars: each is the k-th root of the damped product.
  got = utils.pi_adjusted_kronecker_factors(s, s, damping=damping)
  np.testing.assert_allclose(got, [np.sqrt(16.2)] * 2)


@pytest.fixture
def zero_inv_flag():
  before = utils.get_special_case_zero_inv()
  yield
  utils.set_special_case_zero_inv(before)


def test_pi_adjusted_kronecker_factors_zero_factor(zero_inv_flag):
  a, damping = spd(0, 3), 0.25
  got = utils.pi_adjusted_kronecker_factors(a, np.zeros(2), damping=damping)
  np.testing.assert_allclose(got[0], 0.5 * np.eye(3))
  np.testing.assert_allclose(got[1], [0.5, 0.5])
  utils.set_special_case_zero_inv(False)
  assert utils.get_special_case_zero_inv() is False
  got = utils.pi_adjusted_kronecker_factors(a, np.zeros(2), damping=damping)
  assert not np.isfinite(np.asarray(got[1])).all()


def test_tnt_scale():
  factors = [spd(i, n) for i, n in enumerate((2, 3, 4))]
  traces = [np.trace(f) for f in factors]
  np.testing.assert_allclose(
    utils.tnt_scale(factors), np.prod(traces) ** (-2 / 3), **TOL
  )
  assert utils.tnt_scale(factors[:1]) == 1.0
  np.testing.assert_allclose(utils.tnt_scale([factors[0], np.zeros((2, 2))]), 1)


# --- moving averages, accumulators, state classes -------------------------


def test_weighted_moving_average_in_kfac_jax_form():
  avg = utils.WeightedMovingAverage.zeros_array((2,))
  assert avg.shape == (2,) and avg.ndim == 1 and avg.dtype == jnp.float64
  assert avg.update(jnp.array([1.0, 2.0]), 0.9, 0.1) is avg  # in place
  np.testing.assert_allclose(avg.value, [1.0, 2.0])
  np.testing.assert_allclose(avg.weight, 0.1)
  kept = avg.updated(jnp.array([3.0, 4.0]), 0.5, 1.0)
  np.testing.assert_allclose(avg.value, [1.0, 2.0])  # `updated` copies
  np.testing.assert_allclose(
    kept.value, ([0.05, 0.1] + np.array([3, 4])) / 1.05
  )
  # A negative weight adds the term without counting its weight.
  avg.update(jnp.array([1.0, 1.0]), 1.0, -0.1)
  np.testing.assert_allclose(avg.weight, 0.1)
  np.testing.assert_allclose(avg.value, [2.0, 3.0])
  halves = lambda x, y, c1, c2: jax.tree.map(lambda u, v: (u + v) / 2, x, y)
  avg.update(jnp.array([0.0, 1.0]), 1.0, 1.0, add_function=halves)
  np.testing.assert_allclose(avg.value, [1.0, 2.0])
  np.testing.assert_allclose(avg.weight, 1.1)
  avg.sync(None)
  np.testing.assert_allclose(avg.value, [1.0, 2.0])
  np.testing.assert_allclose(avg.value_and_clear(), [1.0, 2.0])
  np.testing.assert_array_equal(avg.value, [0.0, 0.0])
  assert float(avg.weight) == 0.0
  avg.clear(value_to_none=True)
  assert avg.value is None
  with pytest.raises(ValueError, match="cleared"):
    avg.update(jnp.zeros(2), 0.5, 0.5)
  with pytest.raises(ValueError, match="does not match"):
    utils.WeightedMovingAverage.zeros((2,)).update(jnp.zeros(3), 0.5, 0.5)


def test_weighted_moving_average_of_a_pytree_and_its_value_field():
  params = {"w": jnp.ones((2, 2), jnp.float32), "b": jnp.zeros(2, jnp.float32)}
  avg = utils.WeightedMovingAverage.zeros_like(params)
  assert avg.weight.dtype == jnp.float32
  avg.update(params, 0.5, 1.0)
  avg.update(jax.tree.map(lambda x: x + 3, params), 0.5, 1.0)
  # weights 0.5 and 1: (0.5 * x + 1 * (x + 3)) / 1.5 = x + 2
  np.testing.assert_allclose(avg.value["w"], 3.0)
  np.testing.assert_allclose(avg.value["b"], 2.0)
  copy = avg.copy()
  copy.update(params, 0.0, 1.0)
  np.testing.assert_allclose(avg.value["b"], 2.0)
  given = utils.WeightedMovingAverage(weight=jnp.array(2.0), value=jnp.ones(3))
  np.testing.assert_allclose(given.raw_value, 2.0)
  np.testing.assert_allclose(given.value, 1.0)
  fresh = utils.WeightedMovingAverage(jnp.array(0.0), jnp.full(3, 5.0))
  np.testing.assert_allclose(fresh.value, 5.0)
  raw = utils.WeightedMovingAverage.from_raw(jnp.array(4.0), jnp.full(3, 2.0))
  np.testing.assert_allclose(raw.value, 0.5)
  # A pytree of (weight, raw_value), serialised with the average.
  leaves = jax.tree.leaves(given)
  assert len(leaves) == 2
  doubled = jax.jit(lambda a: a.updated(3 * jnp.ones(3), 1.0, 2.0))(given)
  np.testing.assert_allclose(doubled.value, 2.0)
  rep = utils.serialize_state_tree({"avg": given})
  assert set(rep["avg"]) == {"weight", "value", "__class__"}
  back = utils.deserialize_state_tree(rep)["avg"]
  np.testing.assert_allclose(back.value, 1.0)
  np.testing.assert_allclose(back.weight, 2.0)
  np.testing.assert_allclose(
    utils.default_add_function({"a": 1.0}, {"a": 3.0}, 0.5, 2.0)["a"], 6.5
  )


def test_weighted_moving_average_sync_over_devices():
  values = jnp.arange(NDEV * 2, dtype=jnp.float64).reshape(NDEV, 2)

  def step(v):
    avg = utils.WeightedMovingAverage.zeros((2,))
    avg.update(v, 0.0, 2.0)
    avg.sync("i")
    return avg.value, avg.weight

  value, weight = jax.pmap(step, axis_name="i")(values)
  np.testing.assert_allclose(value, np.broadcast_to(values.mean(0), (NDEV, 2)))
  np.testing.assert_allclose(weight, 2.0)


def test_multi_chunk_accumulator():
  acc = utils.MultiChunkAccumulator.empty(False)
  assert acc.accumulator is None and int(acc.weight) == 0
  chunks = [
    ({"x": jnp.asarray(rand(i, 3))}, w) for i, w in enumerate((2, 1, 3))
  ]
  for obj, w in chunks:
    acc.add(obj, w)
  expected = sum(w * obj["x"] for obj, w in chunks) / 6
  np.testing.assert_allclose(acc.value["x"], expected)
  assert int(acc.weight) == 6
  np.testing.assert_allclose(acc.copy().value["x"], expected)
  np.testing.assert_allclose(acc.value_and_clear()["x"], expected)
  assert acc.accumulator is None and acc.weight is None
  zeros = utils.MultiChunkAccumulator.zeros_like({"x": jnp.ones(3)}, False)
  zeros.add({"x": jnp.full(3, 4.0)}, jnp.asarray(2, jnp.int32))
  np.testing.assert_allclose(zeros.value["x"], 4.0)
  with pytest.raises(ValueError, match="both have leaves"):
    zeros.add({}, 1)
  with pytest.raises(ValueError, match="shape"):
    utils.MultiChunkAccumulator.empty(False).add({"x": 1.0}, jnp.ones(2))
  # Per device: one entry per device, averaged over them by `value`.
  multi = utils.MultiChunkAccumulator.empty(True)
  assert multi.weight.shape == (NDEV,)
  per_device = jnp.arange(NDEV * 2.0).reshape(NDEV, 2)
  multi.add(per_device, 1)
  multi.add(per_device, 1)
  np.testing.assert_allclose(
    multi.value, np.broadcast_to(per_device.mean(0), (NDEV, 2))
  )


@utils.register_state_class
class _Pair(utils.State):
  first: jax.Array
  second: dict


def test_state_classes_and_serialisation():
  pair = _Pair(first=jnp.ones(2), second={"x": [jnp.zeros(1), 3]})
  assert dataclasses.is_dataclass(pair)
  assert _Pair.field_names() == ("first", "second")
  assert len(jax.tree.leaves(pair)) == 3
  doubled = jax.tree.map(lambda x: 2 * x, pair)
  assert isinstance(doubled, _Pair)
  np.testing.assert_allclose(doubled.first, 2.0)
  copy = pair.copy()
  assert copy is not pair and copy.first is pair.first
  rep = utils.serialize_state_tree([pair, (pair,)])
  assert rep[0]["__class__"].endswith("_Pair") and isinstance(rep[1], tuple)
  back = utils.deserialize_state_tree(rep)
  assert isinstance(back[0], _Pair) and isinstance(back[1][0], _Pair)
  assert back[0].second["x"][1] == 3
  assert "__class__" in rep[0]  # the input is left as it was
  with pytest.raises(ValueError, match="not registered"):
    utils.deserialize_state_tree({"__class__": "nowhere.Nothing"})
  with pytest.raises(ValueError, match="subclass of"):
    utils.register_state_class(dict)


# --- mixins and staging ---------------------------------------------------


class _Box(utils.Finalizable):
  def __init__(self):
    super().__init__(excluded_attribute_names=("free",))
    self.locked = 1
    self.free = 1


def test_finalizable():
  box = _Box()
  box.locked = 2
  box.finalize()
  assert box.finalized
  box.free = 3
  with pytest.raises(AttributeError, match="finalized"):
    box.locked = 4
  with pytest.raises(AttributeError, match="create"):
    box.new = 1
  box.unlock_attributes()
  box.locked = 5
  box.lock_attributes()
  with pytest.raises(AttributeError):
    box.locked = 6
  with pytest.raises(ValueError, match="already finalized"):
    box.finalize()


class _Stager(utils.WithStagedMethods):
  def __init__(self, **kwargs):
    super().__init__(**kwargs)
    self.traces = 0

  @utils.staged
  def outer(self, x, scale=2.0):
    self.traces += 1
    return self.inner(x) * scale

  @functools.partial(utils.staged, static_argnums=1)
  def inner(self, x, power=2):
    return x**power


def test_staged_methods_compile_once_and_nest():
  stager = _Stager()
  x = jnp.arange(3.0)
  np.testing.assert_allclose(stager.outer(x), 2 * x**2)
  np.testing.assert_allclose(stager.outer(x + 1), 2 * (x + 1) ** 2)
  assert stager.traces == 1  # jitted: traced once, the inner call inlined
  assert not stager.in_staging
  np.testing.assert_allclose(stager.inner(x, 3), x**3)
  debug = _Stager(debug=True)
  debug.outer(x)
  debug.outer(x)
  assert debug.traces == 2  # eager
  multi = _Stager(multi_device=True, pmap_axis_name="i")
  xs = jnp.arange(NDEV * 2.0).reshape(NDEV, 2)
  np.testing.assert_allclose(multi.outer(xs, 3.0), 3 * xs**2)
  assert multi.replicate(jnp.ones(2)).shape == (NDEV, 2)
  np.testing.assert_allclose(multi.get_first(xs), xs[0])
  mean = multi.pmean_if_pmap_wrapper(lambda v: v)
  np.testing.assert_allclose(
    jax.pmap(mean, axis_name="i")(xs), np.broadcast_to(xs.mean(0), xs.shape)
  )
  with pytest.raises(ValueError, match="pmap_axis_name"):
    _Stager(multi_device=True)


# --- small helpers --------------------------------------------------------


def test_misc_helpers():
  assert utils.to_tuple_or_repeat(2.0, 3) == (2.0, 2.0, 2.0)
  assert utils.to_tuple_or_repeat([1, 2], 2) == (1, 2)
  split = utils.to_tuple_or_repeat(jnp.arange(6.0).reshape(3, 2), 2)
  np.testing.assert_array_equal(split[1], [1.0, 3.0, 5.0])
  with pytest.raises(ValueError):
    utils.to_tuple_or_repeat([1, 2], 3)
  with pytest.raises(ValueError):
    utils.to_tuple_or_repeat("a", 3)
  assert utils.filter_sequence((1, 2, 3), [True, False, True]) == (1, 3)
  assert utils.filter_sequence([1, 2, 3], [False, True, True]) == [2, 3]
  fake, it = utils.fake_element_from_iterator(iter([jnp.ones(2), jnp.ones(3)]))
  np.testing.assert_array_equal(fake, [0.0, 0.0])
  assert [x.shape for x in it] == [(2,), (3,)]
  assert utils.replace_char("abcd", "XY", 1) == "aXYcd"
  f = lambda a, b=1: a + b
  assert utils.call_func_with_conditional_kwargs(f, 1, b=5, unused=9) == 6

  @utils.auto_scope_function
  def scoped_fn(x):
    return jnp.sin(x)

  class Named:
    @utils.auto_scope_method
    def _method(self, x):
      return jnp.cos(x)

  text = jax.jit(lambda x: scoped_fn(x) + Named()._method(x)).lower(1.0)
  hlo = text.as_text(debug_info=True)
  assert "scoped_fn" in hlo and "Named_method" in hlo


@pytest.mark.parametrize("max_parallel_size", [None, 1000, 6, 5, 1])
def test_loop_and_parallelize_average(max_parallel_size):
  def func(x, y):
    return {"outer": jnp.outer(x, y), "sum": jnp.sum(x) * jnp.sum(y)}

  xs, ys = jnp.asarray(rand(0, 7, 2)), jnp.asarray(rand(1, 7, 3))
  got = utils.loop_and_parallelize_average(func, max_parallel_size)(xs, ys)
  expected = jax.tree.map(lambda v: v.mean(0), jax.vmap(func)(xs, ys))
  for key in expected:
    np.testing.assert_allclose(got[key], expected[key], **TOL)
  with pytest.raises(ValueError, match="leading axis"):
    utils.loop_and_parallelize_average(func, 2)(xs, ys[:3])


# --- devices --------------------------------------------------------------


def test_replication_and_first_entries():
  tree = {"a": jnp.arange(3.0), "s": jnp.array(2.0)}
  rep = utils.replicate_all_local_devices(tree)
  assert rep["a"].shape == (NDEV, 3)
  assert len(rep["a"].sharding.device_set) == NDEV
  named = utils.replicate_all_local_devices(tree, axis_name="j")
  assert named["a"].sharding.mesh.axis_names == ("j",)
  first = utils.get_first(rep)
  np.testing.assert_array_equal(first["a"], tree["a"])
  assert first["a"].shape == (3,)
  assert utils.get_first({"n": 3, "f": 1.5}) == {"n": 3, "f": 1.5}
  assert utils.replicate_all_local_devices({}) == {}
  stacked = jnp.arange(NDEV * 2.0).reshape(NDEV, 2)
  spread = utils.broadcast_all_local_devices(stacked)
  np.testing.assert_array_equal(spread, stacked)
  assert len(spread.sharding.device_set) == NDEV
  np.testing.assert_allclose(utils.get_mean(spread), stacked.mean(0))
  np.testing.assert_allclose(utils.get_sum(spread), stacked.sum(0))
  np.testing.assert_allclose(
    utils.pmap_mean(spread), np.broadcast_to(stacked.mean(0), stacked.shape)
  )
  np.testing.assert_allclose(
    utils.pmap_sum(spread), np.broadcast_to(stacked.sum(0), stacked.shape)
  )
  np.testing.assert_array_equal(utils.pmap_zeros_like(spread), 0 * stacked)
  np.testing.assert_array_equal(utils.jit_zeros_like(tree)["a"], [0, 0, 0])
  assert utils.using_legacy_pmap() is (
    "jax_pmap_shmap_merge" in jax.config.values
    and not jax.config.values["jax_pmap_shmap_merge"]
  )


def test_random_keys_per_device():
  key = jax.random.PRNGKey(3)
  keys = utils.make_different_rng_key_on_all_devices(key)
  expected = jax.random.split(
    jax.random.fold_in(key, jax.process_index()), NDEV
  )
  np.testing.assert_array_equal(keys, expected)
  assert len({tuple(np.asarray(k)) for k in keys}) == NDEV
  first, second = utils.p_split(keys)
  np.testing.assert_array_equal(first[0], jax.random.split(keys[0])[0])
  np.testing.assert_array_equal(second[-1], jax.random.split(keys[-1])[1])
  parts = utils.p_split_num(keys, 3)
  assert len(parts) == 3
  np.testing.assert_array_equal(parts[2][0], jax.random.split(keys[0], 3)[2])


def test_hosts_and_division_and_copies():
  tree = {"x": jnp.arange(4.0)}
  # One process: the host collectives return their input.
  assert utils.host_sync(tree, jax.lax.pmean) is tree
  assert utils.host_mean(tree) is tree and utils.host_all_gather(tree) is tree
  np.testing.assert_allclose(
    utils.jit_sync_and_divide_value(tree, 4.0)["x"], tree["x"] / 4
  )
  stacked = jnp.arange(NDEV * 2.0).reshape(NDEV, 2)
  counters = jnp.full((NDEV,), 2.0)
  np.testing.assert_allclose(
    utils.pmap_sync_and_divide_value(stacked, counters),
    np.broadcast_to(stacked.mean(0) / 2, stacked.shape),
  )
  copied = utils.copy_obj(tree)
  np.testing.assert_array_equal(copied["x"], tree["x"])
  assert (
    copied["x"].unsafe_buffer_pointer() != tree["x"].unsafe_buffer_pointer()
  )
  np.testing.assert_array_equal(utils.copy_array(tree["x"]), tree["x"])
  np.testing.assert_array_equal(utils.pmap_copy_obj(stacked), stacked)
  assert utils.pmap_copy_obj(None) is None
  empty = {"a": []}
  assert utils.pmap_copy_obj(empty) == empty


def test_collectives_inside_pmap():
  psum_or_keep = utils.wrap_if_pmap(jax.lax.psum)
  assert psum_or_keep(5.0, "i") == 5.0
  stacked = jnp.arange(NDEV * 3.0).reshape(NDEV, 3)

  def step(x):
    thunks = [lambda k=k: jnp.full(2, k) + jnp.sum(x * 0) for k in range(3)]
    # Each thunk's result must not depend on the device: x * 0 is zero.
    return psum_or_keep(x, "i"), utils.distribute_thunks(thunks, "i")

  summed, results = jax.pmap(step, axis_name="i")(stacked)
  np.testing.assert_allclose(summed, np.broadcast_to(stacked.sum(0), (NDEV, 3)))
  assert isinstance(results, tuple) and len(results) == 3
  for k, r in enumerate(results):
    np.testing.assert_allclose(r, np.full((NDEV, 2), k))
  with pytest.raises(ValueError, match="inside pmap"):
    utils.distribute_thunks([lambda: 1.0], "i")
