"""
The library as a KFAC-JAX drop-in
==================================

curvbench's curvature library, ``estimators``, follows the public API of
KFAC-JAX: the same names, arguments, defaults and meaning. Code written
for KFAC-JAX runs after one changed import,
``import estimators as kfac_jax``. This tutorial trains a Haiku
classifier with ``kfac_jax.Optimizer`` as KFAC-JAX's README example does
(the same loss registration, L2 term and constructor arguments), then
checks the curvature the library computes against a
brute-force computation in float64 that uses nothing but ``jax.jacobian``:
one K-FAC block's Kronecker factors, and the whole exact GGN.
"""

# %%
# A model that registers its loss
# -------------------------------
#
# The only thing K-FAC needs from the model is which loss it minimises:
# ``register_softmax_cross_entropy_loss`` marks the logits as the inputs
# of a softmax cross-entropy. The layers themselves are found by automatic
# registration in the traced computation. As in KFAC-JAX's example, the
# loss holds an L2 term, which the optimizer is told about (``l2_reg``) so
# that it can add it to the curvature.

import haiku as hk
import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np
from jax.flatten_util import ravel_pytree
from sklearn.datasets import load_digits

import estimators as kfac_jax

L2_REG = 1e-4
BATCH_SIZE = 128
NUM_STEPS = 50

images, labels = load_digits(return_X_y=True)
images, labels = (images / 16.0).astype(np.float32), labels.astype(np.int32)

net = hk.without_apply_rng(
  hk.transform(lambda x: hk.nets.MLP([16, 10], activation=jnp.tanh)(x))
)


def softmax_cross_entropy(logits, targets):
  log_p = jax.nn.log_softmax(logits)
  return -jnp.mean(jnp.take_along_axis(log_p, targets[:, None], axis=1))


def loss_fn(params, batch):
  x, y = batch
  logits = net.apply(params, x)
  kfac_jax.register_softmax_cross_entropy_loss(logits, y)
  l2 = kfac_jax.utils.inner_product(params, params) / 2.0
  return softmax_cross_entropy(logits, y) + L2_REG * l2


def dataset_iterator(seed):
  """Endless batches drawn at random from the digits."""
  rng = np.random.default_rng(seed)
  while True:
    index = rng.choice(len(images), BATCH_SIZE, replace=False)
    yield images[index], labels[index]


# %%
# The optimizer, with KFAC-JAX's arguments
# ----------------------------------------
#
# Adaptive learning rate and momentum (chosen each step from the quadratic
# model) and Levenberg-Marquardt damping, as in the K-FAC paper; the
# curvature is estimated in KFAC-JAX's default ``fisher_gradients`` mode
# (one sampled backward pass per step) with its default moving average and
# inverse refresh period. The first ``step`` also runs
# ``num_burnin_steps`` curvature-only updates.

optimizer = kfac_jax.Optimizer(
  value_and_grad_func=jax.value_and_grad(loss_fn),
  l2_reg=L2_REG,
  value_func_has_aux=False,
  value_func_has_state=False,
  value_func_has_rng=False,
  use_adaptive_learning_rate=True,
  use_adaptive_momentum=True,
  use_adaptive_damping=True,
  initial_damping=1.0,
  multi_device=False,
)

data = dataset_iterator(seed=0)
rng = jax.random.PRNGKey(42)
rng, key = jax.random.split(rng)
batch = next(data)
params = net.init(key, batch[0])
rng, key = jax.random.split(rng)
opt_state = optimizer.init(params, key, batch)

history = []
for step in range(NUM_STEPS):
  rng, key = jax.random.split(rng)
  params, opt_state, stats = optimizer.step(
    params, opt_state, key, data_iterator=data, global_step_int=step
  )
  history.append(
    {name: float(value) for name, value in stats.items() if value is not None}
  )
  if step % 10 == 0 or step == NUM_STEPS - 1:
    print(
      f"step {step:2d}  loss {stats['loss']:.4f}  "
      f"learning rate {stats['learning_rate']:.3f}  "
      f"momentum {stats['momentum']:.3f}  damping {stats['damping']:.2e}"
    )

# %%
# The ``stats`` are KFAC-JAX's: the loss of the batch, the learning rate
# and momentum the quadratic model chose, the damping, and ``rho``, the
# reduction ratio (actual over predicted loss change) that drives the
# damping up or down.

steps = np.arange(1, NUM_STEPS + 1)
fig, (loss_ax, damping_ax) = plt.subplots(1, 2, figsize=(10, 3.5))
loss_ax.semilogy(steps, [h["loss"] for h in history])
loss_ax.set(
  xlabel="step", ylabel="batch loss (with L2 term)", title="K-FAC on the digits"
)
damping_ax.semilogy(steps, [h["damping"] for h in history], label="damping")
damping_ax.semilogy(
  steps, [h["learning_rate"] for h in history], label="learning rate"
)
damping_ax.set(
  xlabel="step", ylabel="value", title="What the adaptive rules chose"
)
damping_ax.legend()
fig.tight_layout()

# %%
# One block against brute force
# -----------------------------
#
# Now a check of what the library computes. We build a
# ``BlockDiagonalCurvature`` (the estimator behind the optimizer) on the
# trained parameters and a batch of 256 examples, in float64, and estimate
# it once (``ema_old=0``, ``ema_new=1``) in the ``ggn_exact`` mode: every
# output of the loss is backpropagated, so the Kronecker factors are exact
# rather than sampled.
#
# For the first dense layer, ``y = x W + b``, K-FAC's block is ``A ⊗ G``
# with ``A`` the mean of ``x̃ x̃ᵀ`` (``x̃`` the input with a 1 appended for
# the bias) and ``G`` the mean over examples of ``J_iᵀ H_i J_i``, where
# ``J_i`` is the Jacobian of example i's logits with respect to the layer's
# outputs ``y_i`` and ``H_i = diag(p_i) - p_i p_iᵀ`` the Hessian of the
# cross-entropy in the logits. We compute both from the forward pass alone.

with jax.enable_x64(True):
  params64 = jax.tree.map(lambda a: jnp.asarray(a, jnp.float64), params)
  x64 = jnp.asarray(images[:256], jnp.float64)
  batch64 = (x64, jnp.asarray(labels[:256]))
  estimator = kfac_jax.BlockDiagonalCurvature(loss_fn)
  est_state = estimator.init(key, (params64, batch64))
  est_state = estimator.update_curvature_matrix_estimate(
    est_state,
    ema_old=0.0,
    ema_new=1.0,
    batch_size=256,
    rng=key,
    func_args=(params64, batch64),
    estimation_mode="ggn_exact",
  )
  for block in estimator.blocks:
    print(type(block).__name__, block.name)

  first = params64["mlp/~/linear_0"]
  second = params64["mlp/~/linear_1"]

  def logits_of_first_layer_output(y):
    return jnp.tanh(y) @ second["w"] + second["b"]

  def outputs_factor_term(x):
    y = x @ first["w"] + first["b"]
    jac = jax.jacobian(logits_of_first_layer_output)(y)
    p = jax.nn.softmax(logits_of_first_layer_output(y))
    return jac.T @ (jnp.diag(p) - jnp.outer(p, p)) @ jac

  x_tilde = jnp.concatenate([x64, jnp.ones((len(x64), 1))], axis=1)
  inputs_factor = x_tilde.T @ x_tilde / len(x64)
  outputs_factor = jnp.mean(jax.vmap(outputs_factor_term)(x64), axis=0)

  block_state = est_state.blocks_states[0]
  for name, ours, truth in [
    ("A (inputs factor) ", block_state.inputs_factor.value, inputs_factor),
    ("G (outputs factor)", block_state.outputs_factor.value, outputs_factor),
  ]:
    error = jnp.max(jnp.abs(ours - truth)) / jnp.max(jnp.abs(truth))
    print(f"{name} {ours.shape}: max relative error {float(error):.1e}")

# %%
# The whole exact GGN
# -------------------
#
# ``ExplicitExactCurvature`` forms the exact GGN, ``mean_i J_iᵀ H_i J_i``
# with ``J_i`` now the Jacobian of example i's logits with respect to all
# 1,210 parameters, as a dense matrix in ``ravel_pytree`` order. The
# brute-force version differentiates the network with ``jax.jacobian`` on
# the flattened parameters. Last, K-FAC's distance to it: its
# block-diagonal, Kronecker-factored matrix against the exact one.

with jax.enable_x64(True):
  exact = kfac_jax.ExplicitExactCurvature(loss_fn)
  exact_state = exact.init(key, (params64, batch64))
  exact_state = exact.update_curvature_matrix_estimate(
    exact_state,
    ema_old=0.0,
    ema_new=1.0,
    batch_size=256,
    rng=key,
    func_args=(params64, batch64),
    estimation_mode="ggn_exact",
  )
  ggn = exact.to_dense_matrix(exact_state)

  flat, unravel = ravel_pytree(params64)

  def logits_of(theta, x):
    return net.apply(unravel(theta), x[None])[0]

  # Per example: J_i (10 x 1,210) and H_i J_i; then the mean of J_iᵀ H_i J_i.
  jacobians = jax.vmap(jax.jacobian(logits_of), in_axes=(None, 0))(flat, x64)
  probs = jax.nn.softmax(net.apply(params64, x64))
  hessians = jax.vmap(lambda p: jnp.diag(p) - jnp.outer(p, p))(probs)
  h_times_j = jnp.einsum("bkl,blp->bkp", hessians, jacobians)
  ggn_truth = jnp.einsum("bkp,bkq->pq", jacobians, h_times_j) / len(x64)
  error = jnp.max(jnp.abs(ggn - ggn_truth)) / jnp.max(jnp.abs(ggn_truth))
  print(f"exact GGN {ggn.shape}: max relative error {float(error):.1e}")

  kfac_matrix = estimator.to_dense_matrix(est_state)
  distance = jnp.linalg.norm(kfac_matrix - ggn) / jnp.linalg.norm(ggn)
  print(
    f"K-FAC vs exact GGN: relative Frobenius distance {float(distance):.3f}"
  )

# %%
# Both agree with the brute force to float64 round-off: the library
# computes what it says. The distance between K-FAC and the exact GGN is
# not an error of the library but the approximation's own: the blocks
# between the two layers, which K-FAC leaves out, and the Kronecker
# factorisation within each layer. How large that distance is, on which
# layers, and how it moves along training is what the harness measures
# (see the first and fourth tutorials). ``tests/`` holds such brute-force
# checks for every block family and estimation mode.
