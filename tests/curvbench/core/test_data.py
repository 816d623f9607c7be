"""Which examples a measurement sees: chunks, remainders and their means, and
the layout of the CPU convolutions in the means' loops."""

from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import problems
from curvbench import config
from curvbench.core import curvatures, data


def test_mean_over_chunks_and_remainder_is_the_mean_over_examples():
  x = np.random.default_rng(0).normal(size=(23, 3))
  examples = data.Data(
    jnp.asarray(x[:20].reshape(4, 5, 3)), jnp.asarray(x[20:])
  )
  assert (
    examples.num_chunks,
    examples.chunk_size,
    examples.rest_size,
    examples.num_examples,
  ) == (4, 5, 3, 23)
  mean = jax.jit(lambda d: d.mean(lambda b: (jnp.mean(b, 0), jnp.mean(b**2))))(
    examples
  )
  np.testing.assert_allclose(mean[0], x.mean(0), rtol=1e-12)
  np.testing.assert_allclose(mean[1], (x**2).mean(), rtol=1e-12)
  np.testing.assert_array_equal(examples.concatenated(), x)


def test_scopes_select_the_documented_examples(tiny):
  problem = tiny[0]
  one = data.select(problem, "batch", dtype=np.float64)
  for a, b in zip(
    jax.tree.leaves(one.first), problem.fixed_batch(dtype=np.float64)
  ):
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


@pytest.mark.parametrize(
  "scope", ["all", "batches:0", "batches:", "batch:2", "train "]
)
def test_bad_scopes_name_the_allowed_ones(scope):
  with pytest.raises(ValueError, match="'batches:N'"):
    data.parse_scope(scope)


def test_impossible_selections_say_what_to_do(tiny):
  problem = tiny[0]
  with pytest.raises(ValueError, match="use 'train'"):
    data.select(problem, "batches:1000")
  empty = SimpleNamespace(
    name="empty",
    batch_size=8,
    data=SimpleNamespace(x_train=np.zeros((0, 4)), y_train=np.zeros(0)),
  )
  with pytest.raises(ValueError, match="has no training examples"):
    data.select(empty, "train")


# --- CPU convolutions in XLA's fast layout, loops included ------------------


def _transpose(a, src, dst):
  return np.transpose(a, [src.index(c) for c in dst])


def _direct_conv(x, w, strides, padding, lhs_dilation, rhs_dilation):
  """A 2-D convolution as sums over kernel offsets, NHWC / HWIO / NHWC."""
  n, h, wd, c = x.shape
  dilated = np.zeros(
    (n, (h - 1) * lhs_dilation[0] + 1, (wd - 1) * lhs_dilation[1] + 1, c)
  )
  dilated[:, :: lhs_dilation[0], :: lhs_dilation[1]] = x
  x = np.pad(dilated, ((0, 0), *padding, (0, 0)))
  kh, kw = w.shape[:2]
  size = [
    (x.shape[1 + d] - (k - 1) * rhs_dilation[d] - 1) // strides[d] + 1
    for d, k in enumerate((kh, kw))
  ]
  out = 0
  for i in range(kh):
    for j in range(kw):
      a, b = i * rhs_dilation[0], j * rhs_dilation[1]
      patch = x[
        :,
        a : a + (size[0] - 1) * strides[0] + 1 : strides[0],
        b : b + (size[1] - 1) * strides[1] + 1 : strides[1],
      ]
      out = out + np.einsum("nhwc,co->nhwo", patch, w[i, j])
  return out


def _conv_labels(compiled_text):
  """The layouts of a compiled program's convolutions, but for those XLA has
  rewritten with swapped operands (a reversed kernel): it does so after
  lowering and in or out of loops alike."""
  return [
    line.split("dim_labels=")[1].split(",")[0]
    for line in compiled_text.splitlines()
    if " convolution(" in line and "rhs_reversal" not in line
  ]


CONV_CASES = [  # layouts, strides, padding, lhs and rhs dilation
  (("NCHW", "OIHW", "NCHW"), (1, 1), ((1, 1), (1, 1)), (1, 1), (1, 1)),
  (("NHWC", "HWIO", "NHWC"), (2, 1), ((0, 1), (1, 0)), (1, 1), (1, 2)),
  (("CHWN", "IHWO", "HWNC"), (1, 2), ((2, 2), (0, 1)), (2, 1), (1, 1)),
]


@pytest.mark.parametrize(
  "layouts, strides, padding, lhs_dil, rhs_dil", CONV_CASES
)
def test_cpu_convolutions_in_a_loop_take_the_fast_layout_and_keep_values(
  layouts, strides, padding, lhs_dil, rhs_dil
):
  """A convolution and its two gradients (whose layouts autodiff permutes)
  inside a scan equal direct sums over kernel offsets, float64; compiled for
  float32, the program's convolutions are all in the layout of XLA's fast
  kernel."""
  lhs, rhs, out = layouts
  rng = np.random.default_rng(0)
  xs = rng.normal(size=(2, 2, 6, 6, 3))  # two (N, H, W, C) batches
  w = rng.normal(size=(3, 3, 3, 4))  # HWIO
  dims = jax.lax.conv_dimension_numbers(
    _transpose(xs[0], "NHWC", lhs).shape,
    _transpose(w, "HWIO", rhs).shape,
    layouts,
  )

  def conv(x, kernel):
    return jax.lax.conv_general_dilated(
      x, kernel, strides, padding, lhs_dil, rhs_dil, dims
    )

  expected = [
    _direct_conv(x, w, strides, padding, lhs_dil, rhs_dil) for x in xs
  ]
  cot = [rng.normal(size=e.shape) for e in expected]

  def program(xs, cot, kernel):
    def chunk(total, inputs):
      x, c = inputs
      y, pullback = jax.vjp(conv, x, kernel)
      dx, dw = pullback(c)
      return total + dw, (y, dx)

    return jax.lax.scan(chunk, jnp.zeros_like(kernel), (xs, cot))

  args = (
    np.stack([_transpose(x, "NHWC", lhs) for x in xs]),
    np.stack([_transpose(c, "NHWC", out) for c in cot]),
    _transpose(w, "HWIO", rhs),
  )
  kernel_grad, (ys, input_grads) = jax.jit(program)(*args)
  for k in range(2):
    np.testing.assert_allclose(
      _transpose(ys[k], out, "NHWC"), expected[k], rtol=1e-12, atol=1e-12
    )
  # The gradients by linearity: each entry's unit array through the sums.
  unit = lambda shape, i: np.eye(np.prod(shape))[i].reshape(shape)
  grad_w = sum(
    np.array(
      [
        np.sum(
          c
          * _direct_conv(
            x, unit(w.shape, i), strides, padding, lhs_dil, rhs_dil
          )
        )
        for i in range(w.size)
      ]
    ).reshape(w.shape)
    for x, c in zip(xs, cot)
  )
  np.testing.assert_allclose(
    _transpose(kernel_grad, rhs, "HWIO"), grad_w, rtol=1e-12, atol=1e-12
  )
  grad_x = np.array(
    [
      np.sum(
        cot[0]
        * _direct_conv(
          unit(xs[0].shape, i), w, strides, padding, lhs_dil, rhs_dil
        )
      )
      for i in range(xs[0].size)
    ]
  ).reshape(xs[0].shape)
  np.testing.assert_allclose(
    _transpose(input_grads[0], lhs, "NHWC"), grad_x, rtol=1e-12, atol=1e-12
  )
  # XLA's fast kernel is for float32 (in float64 it may fold transposes back
  # into a convolution, as it runs the same generic loop either way).
  args32 = [a.astype(np.float32) for a in args]
  labels = _conv_labels(jax.jit(program).lower(*args32).compile().as_text())
  assert labels and set(labels) == {"b01f_01io->b01f"}, labels
  assert data.canonical_cpu_convolutions()  # in place, and idempotent


@pytest.fixture(scope="module")
def convnet():
  """The convnet problem in float64, 300 of its training examples in 3
  chunks of 80 and a remainder of 60, and the same examples as one batch."""
  problem = problems.make(config.compose("problem=convnet").problem)
  params = problem.init_params(jax.random.PRNGKey(0), jnp.float64)
  train = data.select(problem, "train", chunk_size=100, dtype=np.float64)
  x, y = jax.tree.map(lambda a: a[:300], train.concatenated())
  chunks = data.Data(
    (
      x[:240].reshape(3, 80, *x.shape[1:]),
      y[:240].reshape(3, 80, *y.shape[1:]),
    ),
    (x[240:], y[240:]),
  )
  return problem, params, chunks, data.Data.of((x, y))


@pytest.mark.parametrize("work", ["gradient", "ggn", "hessian"])
def test_dataset_products_over_chunks_equal_one_batch_of_all(convnet, work):
  problem, params, chunks, whole = convnet
  if work == "gradient":
    fn = lambda p, d: d.mean(lambda b: jax.grad(problem.loss_fn)(p, b))
  else:
    exact = curvatures.exact(work, problem.loss_fn, matrix_free=True)
    fn = lambda p, d: exact.multiply(exact.estimate(None, p, d), p)
  program = jax.jit(fn)
  got, expected = program(params, chunks), program(params, whole)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected)):
    np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-15)
  if work == "hessian":  # its program holds every kind of convolution
    as32 = lambda t: jax.tree.map(
      lambda a: a.astype(np.float32)
      if jnp.issubdtype(a.dtype, jnp.floating)
      else a,
      t,
    )
    labels = _conv_labels(
      program.lower(as32(params), as32(chunks)).compile().as_text()
    )
    assert labels and set(labels) == {"b01f_01io->b01f"}, labels
