"""A short tour of the `estimators` library on a small Haiku MLP.

Estimates the GGN of a classifier with K-FAC, diagonal and full blocks, forms
the exact GGN, and compares spectra and preconditioned gradients. Run it with
`make run`; it prints a table and finishes in well under a minute on a CPU.
"""

import time

import haiku as hk
import jax
import jax.flatten_util
import jax.numpy as jnp
import numpy as np

import estimators as kfac

BATCH, FEATURES, CLASSES, DAMPING = 128, 20, 5, 1e-3


def make_data(rng):
  """Inputs labelled by a random teacher network (no download needed)."""
  k1, k2 = jax.random.split(rng)
  x = jax.random.normal(k1, (BATCH, FEATURES))
  teacher = jax.random.normal(k2, (FEATURES, CLASSES))
  return x, jnp.argmax(jnp.tanh(x) @ teacher, axis=1)


def model(x):
  return hk.nets.MLP([32, 32, CLASSES], activation=jnp.tanh)(x)


net = hk.without_apply_rng(hk.transform(model))


def loss_fn(params, batch):
  x, labels = batch
  logits = net.apply(params, x)
  # The one line K-FAC needs from the model: which loss is being minimised.
  kfac.register_softmax_cross_entropy_loss(logits, labels)
  return jnp.mean(
    -jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], axis=1)
  )


def tagged_loss_fn(params, batch):
  """The same model with its dense layers registered by hand."""
  x, labels = batch
  h = x
  names = sorted(params)
  for i, name in enumerate(names):
    w, b = params[name]["w"], params[name]["b"]
    y = kfac.register_dense(h @ w + b, h, w, b)
    h = jnp.tanh(y) if i < len(names) - 1 else y
  kfac.register_softmax_cross_entropy_loss(h, labels)
  return jnp.mean(
    -jnp.take_along_axis(jax.nn.log_softmax(h), labels[:, None], axis=1)
  )


def main():
  rng = jax.random.PRNGKey(0)
  batch = make_data(rng)
  params = net.init(rng, batch[0])
  args = (params, batch)
  grads = jax.grad(loss_fn)(params, batch)
  g_flat = jax.flatten_util.ravel_pytree(grads)[0]
  print(
    f"MLP {FEATURES}-32-32-{CLASSES}, {g_flat.size} parameters, "
    f"batch {BATCH}, damping {DAMPING}, jax {jax.__version__} on "
    f"{jax.devices()[0].device_kind}"
  )

  exact = kfac.ExplicitExactCurvature(loss_fn)
  state = exact.init(rng, args)
  update = jax.jit(
    lambda s: exact.update_curvature_matrix_estimate(
      s, 0.0, 1.0, BATCH, rng, args, estimation_mode="ggn_exact"
    )
  )
  state = update(state)
  ggn = exact.to_dense_matrix(state)
  eye = jnp.eye(ggn.shape[0])
  exact_direction = jnp.linalg.solve(ggn + DAMPING * eye, g_flat)

  variants = {
    "kfac": None,
    "diagonal": {"dense_tag": kfac.DenseDiagonal},
    "full": {"dense_tag": kfac.DenseFull},
  }
  print(
    f"{'blocks':>9} {'rel. Frobenius err':>19} {'cos(nat. grad)':>15} "
    f"{'top eigenvalue':>15} {'update (ms)':>12}"
  )
  for name, ctor_map in variants.items():
    est = kfac.BlockDiagonalCurvature(
      tagged_loss_fn, layer_tag_to_block_ctor=ctor_map
    )
    block_state = est.init(rng, args)
    step = jax.jit(
      lambda s, est=est: est.update_curvature_matrix_estimate(
        s, 0.0, 1.0, BATCH, rng, args, estimation_mode="ggn_exact"
      )
    )
    block_state = jax.block_until_ready(step(block_state))  # compile
    start = time.perf_counter()
    block_state = jax.block_until_ready(step(block_state))
    elapsed_ms = 1e3 * (time.perf_counter() - start)
    approx = est.to_dense_matrix(block_state)
    direction = jax.flatten_util.ravel_pytree(
      est.multiply_inverse(block_state, grads, DAMPING, True, False)
    )[0]
    cosine = (
      direction
      @ exact_direction
      / (jnp.linalg.norm(direction) * jnp.linalg.norm(exact_direction))
    )
    error = jnp.linalg.norm(approx - ggn) / jnp.linalg.norm(ggn)
    top = jnp.max(est.eigenvalues(block_state))
    print(
      f"{name:>9} {float(error):19.4f} {float(cosine):15.4f} "
      f"{float(top):15.4f} {elapsed_ms:12.2f}"
    )
  exact_top = float(np.max(exact.eigenvalues(state)))
  print(f"{'exact':>9} {0.0:19.4f} {1.0:15.4f} {exact_top:15.4f}")


if __name__ == "__main__":
  main()
