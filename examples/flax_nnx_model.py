"""Your Flax NNX model's curvature: K-FAC and EKFAC against the exact GGN.

    python examples/flax_nnx_model.py [OVERRIDES...]  # the Python API
    curvbench plugins=[examples/flax_nnx_model.py] problem=nnx_mlp \
        curvature=ekfac measure=spectra               # the command line

An NNX model is split into its graph (fixed) and its state (the
parameters curvbench differentiates); each seed builds its own.
"""

import sys

import jax
from flax import nnx
from sklearn.datasets import load_digits

import curvbench


class MLP(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.hidden = nnx.Linear(64, 16, rngs=rngs)
    self.out = nnx.Linear(16, 10, rngs=rngs)

  def __call__(self, x):
    return self.out(jax.nn.tanh(self.hidden(x)))


graph, _ = nnx.split(MLP(nnx.Rngs(0)))
model = curvbench.Model(
  apply=lambda params, x: nnx.merge(graph, params)(x),
  init=lambda rng, x: nnx.split(MLP(nnx.Rngs(rng)))[1],
)
x, y = load_digits(return_X_y=True)
curvbench.register_model(
  "nnx_mlp", model, curvbench.Data(x / 16.0, y), loss="softmax_cross_entropy"
)

if __name__ == "__main__":
  results = curvbench.measure(
    "nnx_mlp",
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
