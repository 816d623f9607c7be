"""Your Equinox model's curvature: K-FAC and EKFAC against the exact GGN.

    python examples/equinox_model.py [OVERRIDES...]   # the Python API
    curvbench plugins=[examples/equinox_model.py] problem=equinox_mlp \
        curvature=ekfac measure=spectra               # the command line

An Equinox model computes one example; mapped over the batch with
`jax.vmap`, its layers are found as a batched model's are. Its arrays are
the parameters, the rest (activations, shapes) stays fixed.
"""

import sys

import equinox as eqx
import jax
from sklearn.datasets import load_digits

import curvbench


class MLP(eqx.Module):
  hidden: eqx.nn.Linear
  out: eqx.nn.Linear

  def __init__(self, key):
    one, two = jax.random.split(key)
    self.hidden = eqx.nn.Linear(64, 16, key=one)
    self.out = eqx.nn.Linear(16, 10, key=two)

  def __call__(self, x):
    return self.out(jax.nn.tanh(self.hidden(x)))


_, static = eqx.partition(MLP(jax.random.PRNGKey(0)), eqx.is_array)
model = curvbench.Model(
  apply=lambda params, x: jax.vmap(eqx.combine(params, static))(x),
  init=lambda rng, x: eqx.partition(MLP(rng), eqx.is_array)[0],
)
x, y = load_digits(return_X_y=True)
curvbench.register_model(
  "equinox_mlp",
  model,
  curvbench.Data(x / 16.0, y),
  loss="softmax_cross_entropy",
)

if __name__ == "__main__":
  results = curvbench.measure(
    "equinox_mlp",
    approximations=["kfac", "ekfac"],
    measurements=["spectra"],
    settings=["measure.spectra.references=[ggn]", *sys.argv[1:]],
  )
  quality = results.tables["quality"]
  print(
    quality[
      quality.metric.eq("relative_frobenius") & quality.level.eq("network")
    ]
    .groupby("method")
    .value.median()
  )
  print("report:", results.report()["tables"][-1])
