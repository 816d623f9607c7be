"""Our Shampoo (`curvbench.optimizers.shampoo.shampoo`) against Google's
Distributed Shampoo in JAX (`precondition.distributed_shampoo` from the
PyPI package `precondition-opt`), fed the same gradients.

Both optimizers see ten steps of the same standard-normal gradients of a
20×10 weight, a 10-vector bias and a 3×3×4×8 conv kernel, under each
configuration below, in float32 (JAX's x64 off, as the peer normally runs)
and in float64 (x64 on); the script prints the largest per-step relative
error `|ours - peer| / |peer|` of the updates (all parameters together)
and exits with status 1 if one exceeds its tolerance:

* float64, eigendecomposition roots on both sides: 1e-10 (both call the
  same LAPACK eigh through JAX; what is left is round-off);
* float32, eigendecomposition roots: 2e-4 (round-off of float32 eigh on
  factors whose condition numbers reach ~1e4 at epsilon 1e-6);
* coupled Newton roots (ours `matrix_power_method="newton"`, the peer's
  default): 1e-5 in either dtype (each side stops its iteration at its
  own tolerance, the peer at max|M - I| < 1e-6).

How the peer is set to our semantics (each is a documented choice of the
peer, not a fault of either side):

* the peer refreshes its roots at steps 1, k+1, 2k+1, ... (it counts from
  0), ours at k, 2k, ... (from 1, the first at `start_preconditioning_step`,
  by default k). The peer is first fed a zero gradient, which leaves its
  statistics, grafting accumulators and momentum at zero (all start at
  zero and are linear in the gradient) but moves its clock by one; its
  update for that step is dropped. Its `start_preconditioning_step` is then
  ours. (With weight decay and momentum both on, the zero step would put
  `weight_decay * w` into its momentum, so no configuration combines them.)
* the peer starts its factors at `matrix_epsilon * I`; ours at zero: the
  script zeroes the peer's after `init`. Its `relative_matrix_epsilon` is
  off, so both roots are `(F + epsilon I)^(-1/p)`.
* before `start_preconditioning_step` without grafting the peer takes SGD
  steps and ours zero steps (as Meta's Distributed Shampoo does); those
  steps are left out of the comparison (column `from`).
* the peer has no bias correction, no Adam grafting and no β1 average of
  the gradient; ours runs with `use_bias_correction=False` and `beta1=0`.
  Its `beta1` is a heavy-ball buffer on the grafted direction (plus the
  coupled weight decay), which is our `momentum`; its Nesterov is ours.
  Its RMSProp grafting decays with its `beta2`, so `grafting_beta2=beta2`.
* the peer grafts each parameter as a whole, ours each block (as Meta's
  does): the same with one block per parameter, so the blocked
  configuration runs without grafting.
* a conv kernel: ours is the matrix `(kh·kw·c_in, c_out)`; the peer merges
  small leading axes up to `merge_small_dims_block_size`, set to
  `kh·kw·c_in` = 36 (which leaves 20×10 and the bias as they are). A
  vector has one factor and root 2 on both sides.
* float64: the peer makes its factors and roots float32 at `init`; the
  script casts them to the parameters' dtype.
* `jax.tree_map`, `tree_flatten` and `tree_unflatten`, which the peer
  calls, are gone from current JAX: the script aliases them to
  `jax.tree.map`, `jax.tree.flatten` and `jax.tree.unflatten`.

Then, unless `--no-timing`, it times one update of a 512×512 weight and its
bias on each side (roots refreshed every step, SGD grafting, float32), in
interleaved rounds (the optional argument, 15 by default).
"""

import sys
import warnings
from importlib import metadata

import common
import jax
import jax.numpy as jnp
import numpy as np

warnings.filterwarnings("ignore", message="Explicitly requested dtype")
for _old, _new in (
  ("tree_map", jax.tree.map),
  ("tree_flatten", jax.tree.flatten),
  ("tree_unflatten", jax.tree.unflatten),
):
  if not hasattr(jax, _old):
    setattr(jax, _old, _new)
ds = common.require(
  "precondition.distributed_shampoo",
  "precondition-opt (Google's Distributed Shampoo)",
)

from curvbench.optimizers.shampoo import shampoo  # noqa: E402

SHAPES = {"w": (20, 10), "b": (10,), "k": (3, 3, 4, 8)}
MERGE = 36  # the conv kernel's kh·kw·c_in
STEPS = 10
LR = 0.01
GRAFTS = {
  "none": ds.GraftingType.NONE,
  "sgd": ds.GraftingType.SGD,
  "adagrad": ds.GraftingType.ADAGRAD,
  "rmsprop": ds.GraftingType.RMSPROP,
}

# Ours common to every case: no β1 average, no bias correction (the peer
# has neither), epsilon 1e-3.
BASE = dict(
  beta1=0.0,
  beta2=0.99,
  epsilon=1e-3,
  use_bias_correction=False,
  grafting_type="none",
  grafting_epsilon=1e-8,
)
CASES = {
  "every step, no grafting": {},
  "period 3, no grafting": dict(precondition_frequency=3),
  "every step, SGD grafting": dict(grafting_type="sgd"),
  "period 3, AdaGrad grafting": dict(
    precondition_frequency=3, grafting_type="adagrad"
  ),
  "period 2, RMSProp grafting": dict(
    precondition_frequency=2, grafting_type="rmsprop", grafting_beta2=0.99
  ),
  "start 4, period 2, SGD grafting": dict(
    precondition_frequency=2, start_preconditioning_step=4, grafting_type="sgd"
  ),
  "momentum 0.9, SGD grafting": dict(momentum=0.9, grafting_type="sgd"),
  "Nesterov 0.9, AdaGrad grafting": dict(
    momentum=0.9, nesterov=True, grafting_type="adagrad"
  ),
  "momentum 0.9, period 3, SGD grafting": dict(
    momentum=0.9, precondition_frequency=3, grafting_type="sgd"
  ),
  "beta2 = 1 (sums), no grafting": dict(beta2=1.0),
  "exponent_override 2 (Shampoo²)": dict(exponent_override=2),
  "blocks of 8, no grafting": dict(max_preconditioner_dim=8),
  "weight decay 0.1, SGD grafting": dict(weight_decay=0.1, grafting_type="sgd"),
  "Newton roots, SGD grafting": dict(
    matrix_power_method="newton", grafting_type="sgd"
  ),
}
TOLERANCE = {"float64": 1e-10, "float32": 2e-4}
NEWTON_TOLERANCE = 1e-5


def peer_options(o: dict) -> dict:
  """The peer's arguments for our options `o` (after `BASE`)."""
  unsupported = {
    k: v
    for k, v in o.items()
    if k in ("beta1", "use_bias_correction", "exponent_multiplier")
    and v not in (0.0, False, 1.0)
  }
  if unsupported or o["grafting_type"] not in GRAFTS:
    raise ValueError(f"no peer equivalent for {unsupported or o}")
  if o["grafting_type"] == "rmsprop" and o["grafting_beta2"] != o["beta2"]:
    raise ValueError("the peer's RMSProp grafting decays with beta2")
  if o.get("weight_decay") and o.get("momentum"):
    raise ValueError("weight decay with momentum: see the docstring")
  frequency = o.get("precondition_frequency", 1)
  return dict(
    block_size=o.get("max_preconditioner_dim", 1024),
    beta1=o.get("momentum", 0.0),
    beta2=o["beta2"],
    diagonal_epsilon=o["grafting_epsilon"],
    matrix_epsilon=o["epsilon"],
    relative_matrix_epsilon=False,
    weight_decay=o.get("weight_decay", 0.0),
    decoupled_weight_decay=False,
    start_preconditioning_step=o.get("start_preconditioning_step", frequency),
    preconditioning_compute_steps=frequency,
    graft_type=GRAFTS[o["grafting_type"]],
    nesterov=o.get("nesterov", False),
    exponent_override=o.get("exponent_override", 0),
    eigh=o.get("matrix_power_method", "eigh") == "eigh",
    best_effort_shape_interpretation=True,
    merge_small_dims_block_size=MERGE,
    generate_training_metrics=False,
  )


def peer(learning_rate: float, options: dict):
  """The peer's optax transformation, its factors starting at zero and its
  factors and roots kept in the parameters' dtype."""
  inner = ds.distributed_shampoo(learning_rate, **options)

  def init(params):
    state = inner.init(params)
    fix = lambda st, p: st._replace(
      statistics=[jnp.zeros(s.shape, p.dtype) for s in st.statistics],
      preconditioners=[x.astype(p.dtype) for x in st.preconditioners],
    )
    stats = jax.tree.map(
      fix,
      state.stats,
      params,
      is_leaf=lambda x: isinstance(x, ds.ParameterStats),
    )
    return state._replace(stats=stats)

  return inner._replace(init=init)


def compare(agreement: common.Agreement):
  params = common.draw(SHAPES, 1, seed=1)[0]
  grads = common.draw(SHAPES, STEPS, seed=2)
  zero = {k: np.zeros(s) for k, s in SHAPES.items()}
  for case, extra in CASES.items():
    options = {**BASE, **extra}
    theirs = peer_options(options)
    start = theirs["start_preconditioning_step"]
    skip = start - 1 if options["grafting_type"] == "none" else 0
    newton = options.get("matrix_power_method") == "newton"
    for dtype in common.DTYPES:
      with common.x64(dtype):
        ours = common.run_optax(shampoo(LR, **options), params, grads, dtype)
        peer_updates = common.run_optax(
          peer(LR, theirs), params, [zero] + grads, dtype
        )[1:]
      errors = [
        common.relative_error(a, b)
        for a, b in zip(ours[skip:], peer_updates[skip:])
      ]
      tolerance = NEWTON_TOLERANCE if newton else TOLERANCE[dtype]
      agreement.add(
        case,
        dtype,
        errors,
        tolerance,
        f"steps {skip + 1}-{STEPS}" if skip else "",
      )


def timing(rounds: int):
  shapes = {"w": (512, 512), "b": (512,)}
  params = {
    k: jnp.asarray(v, jnp.float32)
    for k, v in common.draw(shapes, 1, seed=3)[0].items()
  }
  grads = {
    k: jnp.asarray(v, jnp.float32)
    for k, v in common.draw(shapes, 1, seed=4)[0].items()
  }
  options = {**BASE, "grafting_type": "sgd"}
  sides = {
    "ours (eigh)": shampoo(LR, **options),
    "ours (Newton)": shampoo(LR, **options, matrix_power_method="newton"),
  }
  theirs = peer_options(options)
  sides["peer (eigh)"] = peer(LR, theirs)
  sides["peer (Newton)"] = peer(LR, {**theirs, "eigh": False})
  runs = {}
  for name, transform in sides.items():
    state = transform.init(params)
    update = jax.jit(transform.update)
    jax.block_until_ready(update(grads, state, params))  # compile
    runs[name] = lambda u=update, s=state: common.timed(
      lambda: jax.block_until_ready(u(grads, s, params))
    )
  common.describe_machine(
    {"precondition-opt": metadata.version("precondition-opt")}, rounds
  )
  print(
    "  one update of a 512×512 weight and its bias, float32, roots "
    "refreshed (SGD grafting):"
  )
  seconds = common.interleaved(runs, rounds)
  common.report(
    seconds,
    [("ours (eigh)", "peer (eigh)"), ("ours (Newton)", "peer (Newton)")],
  )
  common.load()


def main():
  args = [a for a in sys.argv[1:] if not a.startswith("--")]
  rounds = int(args[0]) if args else 15
  agreement = common.Agreement(
    f"Shampoo: ours against precondition-opt "
    f"{metadata.version('precondition-opt')} (jax {jax.__version__}), "
    f"{STEPS} steps of {SHAPES}"
  )
  compare(agreement)
  if not agreement.finish():
    raise SystemExit(
      "ours and the peer disagree beyond tolerance (above); no timings taken."
    )
  if "--no-timing" not in sys.argv:
    timing(rounds)


if __name__ == "__main__":
  main()
