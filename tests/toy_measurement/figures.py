"""The toy measurement's figure."""

import matplotlib.pyplot as plt

from curvbench.core import plots


def norms(rows, out):
  fig, ax = plt.subplots()
  ax.bar(rows.leaf, rows.norm)
  ax.set(ylabel="gradient norm", title="toy")
  return plots.save(fig, out / "toy_gradient_norms")
