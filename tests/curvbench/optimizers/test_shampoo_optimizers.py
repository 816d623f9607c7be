"""The Kronecker-factored optimizers (shampoo, soap, kl_shampoo) against
hand computations in numpy, step by step on a small tree (a matrix, a
vector and a 4-D kernel), in float64."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from curvbench import config
from curvbench.components import SettingsError
from curvbench.optimizers.kl_shampoo import kl_shampoo
from curvbench.optimizers.shampoo import shampoo
from curvbench.optimizers.soap import soap

jax.config.update("jax_enable_x64", True)

TOL = dict(rtol=1e-8, atol=1e-12)
SHAPES = {"w": (3, 4), "b": (3,), "k": (1, 2, 2, 3)}


def tree(seed, shapes=SHAPES):
  rng = np.random.default_rng(seed)
  return {k: rng.normal(size=s) for k, s in shapes.items()}


def run(tx, steps, shapes=SHAPES, scale=1.0):
  """`steps` updates of `tx` on random gradients (times `scale`), the
  parameters moved by each; returns the gradients, the parameters and the
  updates, in numpy."""
  params = tree(0, shapes)
  state = tx.init(jax.tree.map(jnp.asarray, params))
  update = jax.jit(tx.update)
  history = []
  for step in range(steps):
    grads = jax.tree.map(lambda g: scale * g, tree(step + 1, shapes))
    updates, state = update(
      jax.tree.map(jnp.asarray, grads), state, jax.tree.map(jnp.asarray, params)
    )
    updates = jax.tree.map(np.asarray, updates)
    history.append((grads, params, updates))
    params = jax.tree.map(np.add, params, updates)
  return history, state


def matrix(shape):
  """A parameter's matrix view, written out: size-1 axes dropped, leading
  axes merged, a vector a column."""
  dims = [d for d in shape if d > 1]
  return (dims[0], 1) if len(dims) == 1 else (int(np.prod(dims[:-1])), dims[-1])


def power(f, p):
  """A symmetric PSD matrix to the power p, by numpy's eigh."""
  w, v = np.linalg.eigh((f + f.T) / 2)
  return (v * np.maximum(w, 0) ** p) @ v.T


# --- Shampoo -----------------------------------------------------------------


def shampoo_by_hand(
  history_grads,
  p0,
  lr=0.1,
  beta1=0.9,
  beta2=0.999,
  epsilon=1e-12,
  momentum=0.0,
  nesterov=False,
  weight_decay=0.0,
  max_preconditioner_dim=1024,
  precondition_frequency=1,
  start_preconditioning_step=None,
  exponent_override=0,
  exponent_multiplier=1.0,
  use_bias_correction=True,
  grafting_type="adam",
  grafting_epsilon=1e-8,
  grafting_beta2=0.999,
  matrix_power_method="eigh",
):
  """Distributed Shampoo's steps on one parameter, its blocks cut with
  uneven ends as torch.split does."""
  del matrix_power_method
  m, n = matrix(p0.shape)
  start = start_preconditioning_step or precondition_frequency
  b = max_preconditioner_dim
  rows = [slice(i, min(i + b, m)) for i in range(0, m, b)]
  cols = [slice(j, min(j + b, n)) for j in range(0, n, b)]
  two = n > 1
  root = exponent_override or (4 if two else 2)
  blocks = [(r, c) for r in rows for c in cols]
  left, right = [0.0] * len(blocks), [0.0] * len(blocks)
  size = lambda sl: sl.stop - sl.start
  xl = [np.zeros((size(r), size(r))) for r, _ in blocks]  # zero until
  xr = [np.zeros((size(c), size(c))) for _, c in blocks]  # the first roots
  second, avg, buf, p, out = 0.0, 0.0, 0.0, p0, []
  ema = (
    lambda old, new, beta: old + new
    if beta == 1
    else (beta * old + (1 - beta) * new)
  )
  for t, g in enumerate(history_grads, 1):
    gm = g.reshape(m, n)
    for k, (r, c) in enumerate(blocks):
      left[k] = ema(left[k], gm[r, c] @ gm[r, c].T, beta2)
      right[k] = ema(right[k], gm[r, c].T @ gm[r, c], beta2)
    if grafting_type in ("adagrad", "rmsprop", "adam"):
      second = ema(
        second, g * g, 1 if grafting_type == "adagrad" else grafting_beta2
      )
    avg = ema(avg, g, beta1) if beta1 else g
    hat = avg / (1 - beta1**t) if beta1 and use_bias_correction else avg
    if (t % precondition_frequency == 0 and t > start) or t == start:
      scale = 1 - beta2**t if use_bias_correction and beta2 < 1 else 1
      for k in range(len(blocks)):
        xl[k] = power(
          left[k] / scale + epsilon * np.eye(len(left[k])),
          -exponent_multiplier / root,
        )
        xr[k] = (
          power(
            right[k] / scale + epsilon * np.eye(len(right[k])),
            -exponent_multiplier / root,
          )
          if two
          else np.eye(1)
        )
    graft = hat
    if grafting_type == "adam":
      graft = hat / (
        np.sqrt(second / (1 - grafting_beta2**t)) + grafting_epsilon
      )
    elif grafting_type in ("adagrad", "rmsprop"):
      graft = hat / (np.sqrt(second) + grafting_epsilon)
    hm, gfm = hat.reshape(m, n), graft.reshape(m, n)
    d = np.zeros((m, n))
    for k, (r, c) in enumerate(blocks):
      db = xl[k] @ hm[r, c] @ (xr[k] if two else np.eye(1))
      if grafting_type != "none":
        db = db * np.linalg.norm(gfm[r, c]) / (np.linalg.norm(db) + 1e-16)
      d[r, c] = db
    d = d.reshape(p.shape)
    if grafting_type != "none" and t < start:
      d = graft
    d = d + weight_decay * p
    if momentum:
      buf = momentum * buf + d
      d = d + momentum * buf if nesterov else buf
    out.append(-lr * d)
    p = p + out[-1]
  return out


SHAMPOO_CASES = {
  "adam grafting, stale roots, momentum, decay": dict(
    beta1=0.9,
    beta2=0.99,
    epsilon=1e-3,
    momentum=0.5,
    weight_decay=0.1,
    precondition_frequency=2,
  ),
  "sums, blocks, adagrad grafting, Nesterov, no bias correction": dict(
    beta1=0.0,
    beta2=1.0,
    epsilon=1e-2,
    momentum=0.9,
    nesterov=True,
    max_preconditioner_dim=2,
    grafting_type="adagrad",
    grafting_epsilon=1e-3,
    use_bias_correction=False,
  ),
  "rmsprop grafting, late start, exponent multiplier": dict(
    beta1=0.5,
    beta2=0.9,
    epsilon=1e-3,
    grafting_type="rmsprop",
    grafting_beta2=0.8,
    start_preconditioning_step=2,
    exponent_multiplier=0.5,
    max_preconditioner_dim=3,
  ),
  "sgd grafting, root 2": dict(
    beta2=0.5,
    epsilon=1e-2,
    grafting_type="sgd",
    exponent_override=2,
    weight_decay=0.01,
  ),
  "no grafting, zero steps before the first roots": dict(
    beta2=0.9, epsilon=1e-2, grafting_type="none", precondition_frequency=2
  ),
  "Newton roots": dict(
    beta2=0.9,
    epsilon=1e-2,
    matrix_power_method="newton",
    precondition_frequency=2,
  ),
}


@pytest.mark.parametrize("case", SHAMPOO_CASES)
def test_shampoo_steps_as_by_hand(case):
  options = SHAMPOO_CASES[case]
  history, _ = run(shampoo(0.1, **options), 3)
  tol = dict(rtol=1e-7, atol=1e-10) if "newton" in str(options) else TOL
  for name in SHAPES:
    grads = [g[name] for g, _, _ in history]
    expected = shampoo_by_hand(grads, history[0][1][name], **options)
    for step, ((_, _, updates), want) in enumerate(zip(history, expected)):
      np.testing.assert_allclose(
        updates[name], want, **tol, err_msg=f"{name} at step {step + 1}"
      )
  if options.get("grafting_type") == "none":  # no roots before step 2
    assert all(np.all(u == 0) for u in history[0][2].values())


def test_shampoo_root_two_is_the_inverse_root_of_the_kronecker_product():
  """Shampoo² on one matrix with β2 = 0: the step is (L ⊗ R)^(-1/2) of the
  current gradient, L = G Gᵀ + εI and R = Gᵀ G + εI, built by brute force."""
  eps, lr = 1e-2, 0.1
  tx = shampoo(
    lr,
    beta1=0.0,
    beta2=0.0,
    epsilon=eps,
    exponent_override=2,
    grafting_type="none",
  )
  history, _ = run(tx, 2, {"w": (3, 4)})
  for grads, _, updates in history:
    g = grads["w"]
    kron = np.kron(g @ g.T + eps * np.eye(3), g.T @ g + eps * np.eye(4))
    want = -lr * power(kron, -0.5) @ g.reshape(-1)  # row-major vec
    np.testing.assert_allclose(updates["w"].reshape(-1), want, **TOL)


def test_shampoo_state_holds_sums_and_refreshes_roots_at_the_period():
  _, state = run(
    shampoo(0.1, beta2=1.0, precondition_frequency=2, epsilon=1e-3), 3
  )
  w = state.parameters["w"]
  grads = [tree(s)["w"] for s in (1, 2, 3)]
  np.testing.assert_allclose(
    w.left.statistics[0, 0], sum(g @ g.T for g in grads), **TOL
  )
  # The roots are those of step 2's sums: stale at step 3.
  at_two = sum(g @ g.T for g in grads[:2]) + 1e-3 * np.eye(3)
  np.testing.assert_allclose(w.left.root[0, 0], power(at_two, -0.25), **TOL)
  assert int(state.count) == 3


# --- settings ----------------------------------------------------------------


@pytest.mark.parametrize(
  "build, message",
  [
    (lambda: shampoo(0.1, epsilon=-1.0), "epsilon must be a number > 0"),
    (lambda: shampoo(0.1, beta2=1.5), r"beta2: must be a number in \[0, 1\]"),
    (lambda: shampoo(0.1, precondition_frequency=0), "precondition_frequency"),
    (lambda: shampoo(0.1, grafting_type="adamw"), "grafting_type"),
    (
      lambda: shampoo(
        0.1, precondition_frequency=10, start_preconditioning_step=5
      ),
      "below",
    ),
    (
      lambda: shampoo(
        0.1, matrix_power_method="newton", exponent_multiplier=0.5
      ),
      "inverse p-th roots",
    ),
    (lambda: shampoo(0.1, grafting_type="sgd", grafting_beta2=0.9), "ignored"),
    (lambda: shampoo(0.1, epsilom=1e-6), "did you mean epsilon"),
    (lambda: shampoo(-0.1), "learning_rate"),
    (lambda: soap(0.1, eps=-1e-8), "eps must be a number > 0"),
    (lambda: soap(0.1, shampoo_beta=1.0), r"shampoo_beta must be .*\[0, 1\)"),
    (lambda: soap(0.1, eigenbasis="svd"), "eigenbasis"),
    (lambda: kl_shampoo(0.1, eigenvalue_init=0.0), "eigenvalue_init"),
    (
      lambda: kl_shampoo(0.1, clamping=False, max_clamp_value=100),
      "max_clamp_value=100 is ignored",
    ),
    (lambda: kl_shampoo(0.1, betas=(0.9, 0.95)), "no setting 'betas'"),
  ],
)
def test_bad_settings_are_refused_by_name(build, message):
  with pytest.raises(SettingsError, match=message):
    build()


def test_bad_settings_are_refused_when_composed():
  with pytest.raises(config.ConfigError, match="epsilon"):
    config.compose(
      "measure=training", "optimizer=shampoo", "optimizer.epsilon=-1e-6"
    )


# --- SOAP --------------------------------------------------------------------


def descending_eigenvectors(f):
  return np.linalg.eigh((f + f.T) / 2)[1][:, ::-1]


def soap_by_hand(
  grads,
  p0,
  lr=3e-3,
  b1=0.95,
  b2=0.95,
  shampoo_beta=None,
  eps=1e-8,
  weight_decay=0.01,
  precondition_frequency=10,
  max_precond_dim=10000,
  precondition_1d=False,
  normalize_grads=False,
  correct_bias=True,
  eigenbasis="qr",
):
  """The reference SOAP's steps on one parameter; a side without a factor
  has the identity for its basis."""
  m, n = matrix(p0.shape)
  has = [
    1 < d <= max_precond_dim and (precondition_1d or n > 1) for d in (m, n)
  ]
  beta = b2 if shampoo_beta is None else shampoo_beta
  factors = [np.zeros((m, m)), np.zeros((n, n))]
  bases = [np.eye(m), np.eye(n)]
  mu, nu, p, out = np.zeros((m, n)), np.zeros((m, n)), p0, []
  for c, g in enumerate(grads):
    gm = g.reshape(m, n)
    new = [gm @ gm.T, gm.T @ gm]
    if c == 0:
      factors = [(1 - beta) * f for f in new]
      bases = [
        descending_eigenvectors(f) if h else b
        for f, h, b in zip(factors, has, bases)
      ]
      out.append(np.zeros_like(p))
      continue
    rotated = bases[0].T @ gm @ bases[1]
    mu = b1 * mu + (1 - b1) * rotated
    nu = b2 * nu + (1 - b2) * rotated**2
    d = bases[0] @ (mu / (np.sqrt(nu) + eps)) @ bases[1].T
    if normalize_grads:
      d = d / (1e-30 + np.sqrt(np.mean(d**2)))
    size = lr * np.sqrt(1 - b2**c) / (1 - b1**c) if correct_bias else lr
    stepped = p - size * d.reshape(p.shape)
    stepped = stepped - lr * weight_decay * stepped
    out.append(stepped - p)
    p = stepped
    factors = [beta * f + (1 - beta) * x for f, x in zip(factors, new)]
    if c % precondition_frequency == 0:
      original = bases[0] @ mu @ bases[1].T
      for axis in (0, 1):
        if not has[axis]:
          continue
        f, q = factors[axis], bases[axis]
        if eigenbasis == "eigh":
          bases[axis] = descending_eigenvectors(f)
        else:
          order = np.argsort(-np.diag(q.T @ f @ q), kind="stable")
          nu = np.take(nu, order, axis=axis)
          bases[axis] = np.linalg.qr(f @ q[:, order])[0]
      mu = bases[0].T @ original @ bases[1]
  return out


SOAP_CASES = {
  "reference defaults, QR refresh at step 2": dict(precondition_frequency=2),
  "vectors preconditioned, eigh every step, normalized, no bias "
  "correction": dict(
    b1=0.8,
    b2=0.9,
    shampoo_beta=0.7,
    precondition_frequency=1,
    precondition_1d=True,
    normalize_grads=True,
    correct_bias=False,
    eigenbasis="eigh",
    weight_decay=0.1,
  ),
  "long sides in the standard basis, QR every step": dict(
    max_precond_dim=3, precondition_frequency=1, b1=0.5, b2=0.99
  ),
}


@pytest.mark.parametrize("case", SOAP_CASES)
def test_soap_steps_as_by_hand(case):
  options = SOAP_CASES[case]
  # A vector of two: its first factor has rank one, so its eigenbasis is
  # unique up to signs (which no step depends on).
  shapes = {**SHAPES, "b": (2,)}
  history, _ = run(soap(0.1, **options), 4, shapes)
  for name in shapes:
    grads = [g[name] for g, _, _ in history]
    expected = soap_by_hand(grads, history[0][1][name], lr=0.1, **options)
    for step, ((_, _, updates), want) in enumerate(zip(history, expected)):
      np.testing.assert_allclose(
        updates[name], want, **TOL, err_msg=f"{name} at call {step}"
      )
  assert all(np.all(u == 0) for u in history[0][2].values())


def test_soap_without_momentum_is_adam_in_the_rotating_eigenbasis():
  """b1 = 0 and a refresh every step: each step is Adam's (optax's, on the
  gradients rotated into the bases of the call) rotated back."""
  lr, b2 = 0.1, 0.9
  tx = soap(
    lr,
    b1=0.0,
    b2=b2,
    eps=1e-30,
    weight_decay=0.0,
    precondition_frequency=1,
    eigenbasis="eigh",
  )
  shapes = {"w": (3, 4)}
  params = jax.tree.map(jnp.asarray, tree(0, shapes))
  state, update = tx.init(params), jax.jit(tx.update)
  adam = optax.scale_by_adam(b1=0.0, b2=b2, eps=0.0)
  adam_state = adam.init(params)
  for call in range(3):
    grads = jax.tree.map(jnp.asarray, tree(call + 1, shapes))
    w = state.parameters["w"]
    left, right = np.asarray(w.left_basis), np.asarray(w.right_basis)
    updates, state = update(grads, state, params)
    if call == 0:
      continue
    rotated = {"w": left.T @ np.asarray(grads["w"]) @ right}
    direction, adam_state = adam.update(rotated, adam_state)
    np.testing.assert_allclose(
      np.asarray(updates["w"]),
      -lr * left @ np.asarray(direction["w"]) @ right.T,
      rtol=1e-9,
    )


# --- KL-Shampoo --------------------------------------------------------------


def kl_shampoo_by_hand(
  grads,
  p0,
  lr=3e-3,
  b1=0.9,
  shampoo_beta=0.98,
  eps=1e-8,
  weight_decay=0.01,
  precondition_frequency=10,
  eigenvalue_init=0.1,
  clamping=True,
  max_clamp_value=4000,
  max_precond_dim=10000,
  precondition_1d=False,
  normalize_grads=False,
  eigenbasis="qr",
):
  """The reference KL-Shampoo's steps on one parameter, keeping λ^(-1/2)
  (clamped) as the reference does; a side without a factor has the
  identity for its basis."""
  m, n = matrix(p0.shape)
  has = [
    1 < d <= max_precond_dim and (precondition_1d or n > 1) for d in (m, n)
  ]
  beta, dims = shampoo_beta, (m, n)
  bound = [max(10, min(d, max_clamp_value)) for d in dims]
  factors, bases = [None, None], [np.eye(m), np.eye(n)]
  roots = [None, None]  # λ^(-1/2) per side
  avg, p, out = np.zeros((m, n)), p0, []
  for c, g in enumerate(grads):
    gm = g.reshape(m, n)
    if c == 0:
      factors = [(1 - beta) * gm @ gm.T / n, (1 - beta) * gm.T @ gm / m]
      bases = [
        descending_eigenvectors(f) if h else b
        for f, h, b in zip(factors, has, bases)
      ]
      roots = [np.full(d, eigenvalue_init**-0.5) for d in dims]
      out.append(np.zeros_like(p))
      continue
    avg = b1 * avg + (1 - b1) * gm
    x = np.outer(*roots)
    d = (
      bases[0]
      @ ((bases[0].T @ avg @ bases[1]) * x / (1 + x * eps))
      @ bases[1].T
    )
    if normalize_grads:
      d = d / (1e-30 + np.sqrt(np.mean(d**2)))
    stepped = p - lr * d.reshape(p.shape)
    stepped = stepped - lr * weight_decay * stepped
    out.append(stepped - p)
    p = stepped
    inverse = [q @ np.diag(r**2) @ q.T for q, r in zip(bases, roots)]
    if has[0]:
      factors[0] = beta * factors[0] + (1 - beta) * gm @ inverse[1] @ gm.T / n
    if has[1]:
      factors[1] = beta * factors[1] + (1 - beta) * gm.T @ inverse[0] @ gm / m
    hat2 = (bases[0].T @ gm @ bases[1]) ** 2
    diags = [
      np.mean(hat2 * roots[1][None, :] ** 2, axis=1),
      np.mean(hat2 * roots[0][:, None] ** 2, axis=0),
    ]
    for k in (0, 1):
      lam = beta / roots[k] ** 2 + (1 - beta) * diags[k]
      roots[k] = lam**-0.5
      if clamping:
        roots[k] = np.minimum(roots[k], bound[k])
    if c % precondition_frequency == 0:
      for k in (0, 1):
        if has[k]:
          bases[k] = (
            descending_eigenvectors(factors[k])
            if eigenbasis == "eigh"
            else np.linalg.qr(factors[k] @ bases[k])[0]
          )
  return out


KL_CASES = {
  "reference defaults, QR refresh at step 2": (
    dict(precondition_frequency=2),
    4,
    1.0,
  ),
  "vectors preconditioned, eigh, normalized, damped, unclamped": (
    dict(
      b1=0.5,
      shampoo_beta=0.7,
      eps=0.1,
      weight_decay=0.0,
      precondition_frequency=1,
      precondition_1d=True,
      normalize_grads=True,
      clamping=False,
      eigenbasis="eigh",
    ),
    3,
    1.0,
  ),
  "long sides in the standard basis, small gradients clamped": (
    dict(shampoo_beta=0.5, max_precond_dim=3, precondition_frequency=3),
    6,
    1e-3,
  ),
}


@pytest.mark.parametrize("case", KL_CASES)
def test_kl_shampoo_steps_as_by_hand(case):
  options, calls, scale = KL_CASES[case]
  shapes = {**SHAPES, "b": (2,)}
  history, state = run(kl_shampoo(0.1, **options), calls, shapes, scale)
  for name in shapes:
    grads = [g[name] for g, _, _ in history]
    expected = kl_shampoo_by_hand(grads, history[0][1][name], lr=0.1, **options)
    for step, ((_, _, updates), want) in enumerate(zip(history, expected)):
      np.testing.assert_allclose(
        updates[name], want, **TOL, err_msg=f"{name} at call {step}"
      )
  if scale < 1:  # the clamp bounds the last estimates
    lam = np.asarray(state.parameters["w"].left_eigenvalues)
    np.testing.assert_allclose(lam, 0.01, rtol=1e-12)


def test_kl_shampoo_factors_follow_their_update_equation():
  """S_a ← β S_a + (1-β) G S_b⁻¹ Gᵀ / d_b and S_b ← β S_b + (1-β) Gᵀ S_a⁻¹ G
  / d_a, each inverse the method's own: Q diag(1/λ) Qᵀ before the step."""
  beta = 0.9
  tx = kl_shampoo(0.1, shampoo_beta=beta, precondition_frequency=1)
  params = jax.tree.map(jnp.asarray, tree(0, {"w": (3, 4)}))
  state, update = tx.init(params), jax.jit(tx.update)
  for call in range(3):
    g = tree(call + 1, {"w": (3, 4)})["w"]
    old = jax.tree.map(np.asarray, state.parameters["w"])
    _, state = update({"w": jnp.asarray(g)}, state, params)
    new = state.parameters["w"]
    inv_a = (
      old.left_basis @ np.diag(1 / old.left_eigenvalues) @ old.left_basis.T
    )
    inv_b = (
      old.right_basis @ np.diag(1 / old.right_eigenvalues) @ old.right_basis.T
    )
    np.testing.assert_allclose(
      new.left, beta * old.left + (1 - beta) * g @ inv_b @ g.T / 4, **TOL
    )
    np.testing.assert_allclose(
      new.right, beta * old.right + (1 - beta) * g.T @ inv_a @ g / 3, **TOL
    )
    if call:  # the bases stay orthonormal
      for q in (new.left_basis, new.right_basis):
        np.testing.assert_allclose(q.T @ q, np.eye(len(q)), atol=1e-12)


# --- all three ---------------------------------------------------------------


@pytest.mark.parametrize(
  "make",
  [
    lambda: shampoo(0.1, beta2=0.99, momentum=0.9, weight_decay=0.1),
    lambda: shampoo(0.1, epsilon=1e-3, matrix_power_method="newton"),
    lambda: soap(0.1),
    lambda: kl_shampoo(0.1),
  ],
  ids=["shampoo", "shampoo_newton", "soap", "kl_shampoo"],
)
def test_float32_parameters_keep_float32_state_and_updates(make):
  """With x64 on, step counts must not promote a float32 state."""
  tx = make()
  params = {k: jnp.asarray(v, jnp.float32) for k, v in tree(0).items()}
  state, update = tx.init(params), jax.jit(tx.update)
  for step in range(3):
    grads = {k: jnp.asarray(v, jnp.float32) for k, v in tree(step + 1).items()}
    updates, state = update(grads, state, params)
  floats = {
    x.dtype
    for x in jax.tree.leaves((updates, state))
    if jnp.issubdtype(x.dtype, jnp.floating)
  }
  assert floats == {jnp.dtype("float32")}
  assert all(np.isfinite(np.asarray(u)).all() for u in updates.values())
