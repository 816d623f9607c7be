"""Sparse initialization (Martens 2010) and the autoencoder's `init` setting."""

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import problems
from curvbench import config
from problems import layers


def sparse_weights(shape, connections=15, seed=0, dtype=jnp.float32):
  init = hk.transform(lambda: layers.SparseInit(connections)(shape, dtype))
  return np.asarray(init.apply({}, jax.random.PRNGKey(seed)))


def dense_params(d_in, size, seed=0, w_init=None):
  net = hk.transform(lambda x: layers.Dense(size, w_init=w_init)(x))
  return net.init(jax.random.PRNGKey(seed), jnp.zeros((1, d_in), jnp.float32))[
    "dense"
  ]


@pytest.mark.parametrize(
  "d_in, d_out, k",
  [(5, 7, 15), (15, 4, 15), (16, 3, 15), (200, 30, 15), (40, 9, 1), (8, 8, 8)],
)
def test_every_unit_has_min_k_d_in_nonzeros(d_in, d_out, k):
  w = sparse_weights((d_in, d_out), k)
  assert w.shape == (d_in, d_out)
  np.testing.assert_array_equal((w != 0).sum(0), min(k, d_in))


def test_dense_with_sparse_init_has_zero_biases():
  p = dense_params(50, 20, w_init=layers.SparseInit())
  np.testing.assert_array_equal(p["b"], 0)
  np.testing.assert_array_equal((p["w"] != 0).sum(0), 15)


def test_nonzeros_are_unit_gaussian_at_uniform_positions():
  w = sparse_weights((1000, 2000), seed=3)
  nz = w[w != 0]
  assert nz.size == 15 * 2000
  # 30,000 N(0, 1) draws: the sample mean's standard error is
  # 1/sqrt(30000) ~ 0.006 and the sample std's 1/sqrt(2 * 30000) ~ 0.004,
  # so 0.03 is over 5 standard errors for both.
  assert abs(nz.mean()) < 0.03 and abs(nz.std() - 1) < 0.03
  # Each input is picked by each of the 2000 units with chance 15/1000: its
  # count has mean 30 and variance 30 * (1 - 0.015) ~ 29.6. The variance of
  # 1000 such counts has a standard error ~ 29.6 * sqrt(2 / 1000) ~ 1.3, so
  # [24, 35] is over 4 standard errors each side.
  counts = (w != 0).sum(1)
  assert counts.mean() == 30 and 24 < counts.var() < 35


def test_positions_differ_between_units_and_seeds():
  masks = sparse_weights((100, 50)) != 0
  assert len({m.tobytes() for m in masks.T}) == 50
  other = sparse_weights((100, 50), seed=1) != 0
  assert not np.array_equal(masks, other)
  np.testing.assert_array_equal(
    sparse_weights((100, 50)), sparse_weights((100, 50))
  )


def test_sparse_init_keeps_dtype_and_refuses_bad_input():
  assert sparse_weights((20, 3), dtype=jnp.float64).dtype == np.float64
  with pytest.raises(ValueError, match="connections"):
    layers.SparseInit(0)
  with pytest.raises(ValueError, match="biases"):
    sparse_weights((7,))


def autoencoder(*overrides):
  return problems.make(
    config.plain(
      config.compose(
        "problem=autoencoder", "problem.batch_size=8", *overrides
      ).problem
    )
  )


@pytest.mark.parametrize("k", [15, 6])
def test_autoencoder_sparse_init_follows_the_rule(k):
  p = autoencoder("problem.init=sparse", f"problem.sparse_connections={k}")
  params = p.init_params(jax.random.PRNGKey(0))
  names = ["enc_0", "enc_1", "code", "dec_0", "dec_1", "logits"]
  assert sorted(params) == sorted(names)
  for name in names:
    w, b = np.asarray(params[name]["w"]), np.asarray(params[name]["b"])
    np.testing.assert_array_equal((w != 0).sum(0), min(k, w.shape[0]), name)
    np.testing.assert_array_equal(b, 0)
  x, _ = p.fixed_batch()
  assert np.isfinite(p.net.apply(params, x)).all()


def test_sparse_connections_is_ignored_with_gaussian_init():
  with pytest.raises(ValueError, match="sparse_connections=10 is ignored"):
    autoencoder("problem.sparse_connections=10")
  with pytest.raises(ValueError, match="problem.init"):
    autoencoder("problem.init=orthogonal")


def test_gaussian_default_is_unchanged():
  """The default draws exactly what N(0, 1/d_in) did before `w_init`."""
  w = dense_params(1000, 500)["w"]
  # 500,000 draws: the sample std is within 0.1% of the true one (1 s.e.).
  assert abs(float(jnp.std(w)) - 1000**-0.5) < 0.02 * 1000**-0.5
  direct = hk.transform(
    lambda: hk.get_parameter(
      "w", (1000, 500), jnp.float32, hk.initializers.RandomNormal(1000**-0.5)
    )
  )
  np.testing.assert_array_equal(w, direct.init(jax.random.PRNGKey(0))["~"]["w"])

  # The whole autoencoder, default settings, against the layers drawn by hand.
  p = autoencoder()
  params = p.init_params(jax.random.PRNGKey(0))
  sizes = [
    ("enc_0", 64, 16),
    ("enc_1", 16, 8),
    ("code", 8, 4),
    ("dec_0", 4, 8),
    ("dec_1", 8, 16),
    ("logits", 16, 64),
  ]

  def by_hand():
    return {
      name: hk.get_parameter(
        name,
        (d_in, d_out),
        jnp.float32,
        hk.initializers.RandomNormal(d_in**-0.5),
      )
      for name, d_in, d_out in sizes
    }

  # Jitted as `init_params` is, so both round alike.
  expected = jax.jit(hk.transform(by_hand).init)(jax.random.PRNGKey(0))["~"]
  for name, _, _ in sizes:
    np.testing.assert_array_equal(params[name]["w"], expected[name])
    np.testing.assert_array_equal(params[name]["b"], 0)
