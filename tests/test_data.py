"""Which examples a measurement sees: chunks, remainders and their means."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from types import SimpleNamespace

from curvbench import data


def test_mean_over_chunks_and_remainder_is_the_mean_over_examples():
  x = np.random.default_rng(0).normal(size=(23, 3))
  examples = data.Data(jnp.asarray(x[:20].reshape(4, 5, 3)),
                       jnp.asarray(x[20:]))
  assert (examples.num_chunks, examples.chunk_size, examples.rest_size,
          examples.num_examples) == (4, 5, 3, 23)
  mean = jax.jit(lambda d: d.mean(lambda b: (jnp.mean(b, 0),
                                             jnp.mean(b ** 2))))(examples)
  np.testing.assert_allclose(mean[0], x.mean(0), rtol=1e-12)
  np.testing.assert_allclose(mean[1], (x ** 2).mean(), rtol=1e-12)
  np.testing.assert_array_equal(examples.concatenated(), x)


def test_scopes_select_the_documented_examples(tiny):
  problem = tiny[0]
  one = data.select(problem, "batch", dtype=np.float64)
  for a, b in zip(jax.tree.leaves(one.first),
                  problem.fixed_batch(dtype=np.float64)):
    np.testing.assert_array_equal(a, b)
  three = data.select(problem, "batches:3", dtype=np.float64)
  order = problem.batches(dtype=np.float64)
  for i in range(3):
    np.testing.assert_array_equal(three.chunks[0][i], next(order)[0])
  train = data.select(problem, "train", chunk_size=64, dtype=np.float64)
  x, y = train.concatenated()
  np.testing.assert_array_equal(x, problem.data.x_train)
  np.testing.assert_array_equal(y, problem.data.y_train)
  assert (train.chunk_size, train.rest_size) == (64, 1500 % 64)


@pytest.mark.parametrize("scope", ["all", "batches:0", "batches:", "batch:2",
                                   "train "])
def test_bad_scopes_name_the_allowed_ones(scope):
  with pytest.raises(ValueError, match="'batches:N'"):
    data.parse_scope(scope)


def test_impossible_selections_say_what_to_do(tiny):
  problem = tiny[0]
  with pytest.raises(ValueError, match="use 'train'"):
    data.select(problem, "batches:1000")
  empty = SimpleNamespace(name="empty", batch_size=8, data=SimpleNamespace(
      x_train=np.zeros((0, 4)), y_train=np.zeros(0)))
  with pytest.raises(ValueError, match="has no training examples"):
    data.select(empty, "train")
