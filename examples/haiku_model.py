"""Your Haiku model's curvature: K-FAC and EKFAC against the exact GGN.

    python examples/haiku_model.py [OVERRIDES...]   # the Python API
    curvbench plugins=[examples/haiku_model.py] problem=haiku_mlp \
        curvature=ekfac measure=spectra             # the command line

Importing this file registers the model as problem `haiku_mlp` (its data,
scikit-learn's 8x8 digits, as `haiku_mlp_data`), which is all the command
line needs; run as a script, it measures it and writes the report.
"""

import sys

import haiku as hk
import jax
from sklearn.datasets import load_digits

import curvbench

net = hk.without_apply_rng(
  hk.transform(lambda x: hk.nets.MLP([16, 10], activation=jax.nn.tanh)(x))
)
x, y = load_digits(return_X_y=True)
curvbench.register_model(
  "haiku_mlp",
  curvbench.Model(net.apply, init=net.init),
  curvbench.Data(x / 16.0, y),
  loss="softmax_cross_entropy",
)

if __name__ == "__main__":
  results = curvbench.measure(
    "haiku_mlp",
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
