"""
Measure your own model
======================

How close does K-FAC come to the exact curvature of *your* network? This
tutorial hands a small Haiku classifier and scikit-learn's 8x8 digits to
:func:`curvbench.measure`, asks for two approximations (K-FAC and a
diagonal) and the ``spectra`` measurement, and reads the answer off the
records: each approximation's distance to the exact generalised
Gauss-Newton matrix (GGN), per layer and for the whole network, with the
spread over seeds and batches that the answer rests on.

Nothing here is specific to Haiku: any pair of functions
``init(rng, inputs) -> params`` and ``apply(params, inputs) -> outputs``
will do (Flax and Equinox versions are in ``examples/``).
"""

# %%
# The model and the data
# ----------------------
#
# A 64-6-10 tanh network (460 parameters): small enough that the exact GGN
# is a dense 460 x 460 matrix we can eigendecompose in a moment. The
# outputs are the logits; ``loss="softmax_cross_entropy"`` tells curvbench
# which loss they feed, and with it which exact matrices exist (for this
# loss the Fisher and the GGN coincide).

import tempfile

import haiku as hk
import jax
import matplotlib.pyplot as plt
import numpy as np
from sklearn.datasets import load_digits

import curvbench
from curvbench.core import stats

net = hk.without_apply_rng(
  hk.transform(lambda x: hk.nets.MLP([6, 10], activation=jax.nn.tanh)(x))
)
x, y = load_digits(return_X_y=True)
model = curvbench.Model(net.apply, init=net.init)
data = curvbench.Data(x / 16.0, y)  # the last 20 % is held out as a test split

# %%
# Measuring
# ---------
#
# :func:`curvbench.measure` runs the sweep the command line would run:
# every approximation x measurement x seed is one run, with its own folder
# of records. We keep the records in a temporary folder (``out=``; the
# default is ``reports/<name>`` under the working directory) and keep JAX's
# compiled programs in another, as the ``curvbench`` command does, so
# that the second seed does not compile again.
#
# The ``settings`` are the command line's overrides and keep this page
# quick: the GGN as the only reference (the default also measures the
# Fisher, the empirical Fisher and the Hessian), two batches per seed, one
# damping for the natural-gradient cosine, no heatmaps.

results = curvbench.measure(
  model,
  data,
  loss="softmax_cross_entropy",
  name="digits_mlp",
  out=tempfile.mkdtemp(),
  approximations=["kfac", "diagonal"],
  measurements=["spectra"],
  seeds=[0, 1],
  settings=[
    f"compilation_cache={tempfile.mkdtemp()}",  # seeds share programs
    "measure.spectra.references=[ggn]",
    "measure.spectra.samples=3",
    "measure.spectra.relative_dampings=[1e-3]",
    "measure.spectra.heatmap_blocks=0",
    "progress=false",
  ],
)
results.runs[["method", "status", "config:seed"]]

# %%
# Each seed draws its own initial parameters and its own batch order; each
# run measures its first three batches of 64 examples apart (``samples``).
# So every number below has 2 seeds x 3 batches = 6 samples behind it.
#
# The quality table
# -----------------
#
# ``results.tables`` holds every table the runs wrote, merged over runs,
# in long form: one row per run, batch, block and metric. ``quality``
# compares each approximation with each exact reference. The column
# ``level`` says what was compared: ``network`` (the whole matrix, every
# cross-layer block included) or ``layer`` (one layer's diagonal block).

quality = results.tables["quality"]
quality[["method", "seed", "sample", "level", "block", "metric", "value"]].head(
  8
)

# %%
# Three metrics say most of it:
#
# * ``relative_frobenius``: ``||approx - exact||_F / ||exact||_F``; 0 is
#   exact.
# * ``natural_gradient_cosine``: the cosine between the mean gradient
#   preconditioned by the damped approximation and by the damped exact
#   matrix (each damped by ``1e-3`` times its own largest eigenvalue): does
#   the approximation point a natural-gradient step the same way?
# * ``top_eigenvalue_ratio``: approximate over exact largest eigenvalue,
#   the scale that sets a stable step size.
#
# Below, each cell is the median over the 6 samples with its quartiles,
# computed with :func:`curvbench.core.stats.quartiles`, as the report does.

METRICS = [
  "relative_frobenius",
  "natural_gradient_cosine",
  "top_eigenvalue_ratio",
]


def median_and_quartiles(values):
  median, q25, q75 = stats.quartiles(values)
  return f"{median:.3f} [{q25:.3f}, {q75:.3f}]"


network = quality[quality.level.eq("network") & quality.metric.isin(METRICS)]
network.pivot_table(
  index="method", columns="metric", values="value", aggfunc=median_and_quartiles
)

# %%
# Per layer, K-FAC is within a few per cent of the exact diagonal blocks:
# for a dense layer ``A ⊗ G`` misses only the correlation between a
# layer's inputs and its output derivatives. Over the whole network its
# relative error is much larger, because the exact GGN also couples the
# two layers and every block-diagonal approximation drops those
# off-diagonal blocks. The diagonal approximation is exact on the diagonal
# and nowhere else; it gets the trace right and little more.

layers = quality[
  quality.level.eq("layer") & quality.metric.eq("relative_frobenius")
]
layers.pivot_table(
  index="block", columns="method", values="value", aggfunc=median_and_quartiles
)

# %%
# A picture of it
# ---------------
#
# ``spectra`` holds every eigenvalue of the exact matrix (``source ==
# "exact"``) and of the approximation (``source == "approx"``) at each
# sample. Left: the three spectra of one sample, largest first. Right: the
# relative Frobenius error per block, one dot per sample (seed and
# batch), the bar at the median.

spectra = results.tables["spectra"]
one = spectra[spectra.seed.eq(0) & spectra["sample"].eq(0)]
fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
curves = {"exact GGN": one[one.source.eq("exact")].drop_duplicates("index")}
for method, rows in one[one.source.eq("approx")].groupby("method"):
  curves[method] = rows
for label, rows in curves.items():
  values = np.sort(rows.eigenvalue.to_numpy())[::-1]
  left.semilogy(
    np.arange(1, len(values) + 1), np.clip(values, 1e-12, None), label=label
  )
left.set(
  xlabel="eigenvalue index (largest first)",
  ylabel="eigenvalue (clipped at 1e-12)",
  title="Spectra, seed 0, first batch",
)
left.legend(loc="lower left")

errors = quality[quality.metric.eq("relative_frobenius")]
blocks = sorted(errors.block.unique(), key=lambda b: (b == "all", b))
methods = sorted(errors.method.unique())
width = 0.8 / len(methods)
for i, method in enumerate(methods):
  for j, block in enumerate(blocks):
    values = errors[errors.method.eq(method) & errors.block.eq(block)].value
    position = j + (i - (len(methods) - 1) / 2) * width
    right.bar(
      position,
      values.median(),
      width,
      color=f"C{i + 1}",
      alpha=0.5,
      label=method if j == 0 else None,
    )
    right.plot([position] * len(values), values, "k.", markersize=4)
right.set_xticks(range(len(blocks)))
right.set_xticklabels(["whole network" if b == "all" else b for b in blocks])
right.set(
  xlabel="block",
  ylabel="relative Frobenius error vs exact GGN",
  title="Distance to the exact GGN (dots: seed x batch)",
)
right.legend(loc="upper left")
right.set_ylim(0, 1.25)
fig.tight_layout()

# %%
# Telling two approximations apart
# ---------------------------------
#
# Six samples are few, so is K-FAC's lead over the diagonal real? The
# report answers with the interval of the *paired* difference: both
# approximations were measured on the same seed and the same batch, so we
# subtract sample by sample, and what a batch shares (its own difficulty)
# cancels. :func:`curvbench.core.stats.paired_difference` gives the median
# difference with its exact 95 % sign-test interval, which holds its level
# for any distribution of the differences; six pairs are the fewest such
# an interval exists for (with fewer, the report says *too few samples to
# tell*). :func:`curvbench.core.stats.verdict` puts it into words.

whole = quality[
  quality.level.eq("network") & quality.metric.eq("relative_frobenius")
]
paired = whole.pivot_table(
  index=["seed", "sample"], columns="method", values="value"
)
difference = stats.paired_difference(
  paired["kfac/ggn_exact"], paired["diagonal/ggn_exact"]
)
print(
  stats.verdict(
    "kfac",
    "diagonal",
    difference,
    "relative Frobenius error",
    "seeds x batches",
  )
)

# %%
# Where the evidence lives
# ------------------------
#
# Every row carries what it was measured on: ``seed``, ``sample``,
# ``step`` and ``data`` (where), ``run_id`` (a hash of the resolved
# config), ``code`` and ``dataset`` (the commit and a hash of the arrays),
# the device and the library versions. ``results.path`` is the sweep
# folder, one run folder per seed and approximation, each with its tables
# as parquet files; ``results.report()`` would write the full report there
# (``report.md``, ``report.html``, figures and CSVs). A run is identified
# by its config, code, data and the model's computation: calling
# :func:`curvbench.measure` again with the same ``out`` measures nothing
# new.

run_folder = next(
  p
  for p in sorted(results.path.iterdir())
  if p.is_dir() and not p.name.startswith(".")
)
sorted(f.name for f in run_folder.iterdir())
