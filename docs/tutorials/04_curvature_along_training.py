"""
Curvature along training
========================

A curvature approximation is judged where an optimizer uses it: along
training, not only at initialisation. This tutorial trains a small MLP
with Adam and, at chosen steps, measures the exact GGN and the exact
Hessian over the *whole training split*, their spectra, and how far
K-FAC and a diagonal approximation are from each, as the
``curvature_through_training`` experiment does (Ghorbani, Krishnan & Xiao,
2019, track the Hessian's spectrum this way; Martens & Grosse, 2015,
Fig. 2, compare K-FAC with the exact matrix along training).
"""

# %%
# One spectra run, several steps
# ------------------------------
#
# The ``spectra`` measurement takes ``measure.spectra.steps``: it trains
# with the run's optimizer and stops to measure at each listed step
# (``log:N`` spaces N steps logarithmically). ``measure.spectra.data=train``
# averages every matrix over the whole training split (1,500 digits here),
# accumulated chunk by chunk (``chunk_size``) inside one compiled scan, so
# the measurement does not depend on which batch was drawn.
#
# Adam trains and does not use the curvature, so every approximation is
# measured at the same parameters: the sweep trains once per seed and the
# other approximation's run reads the trajectory and the exact references
# from the sweep's store instead of computing them again. With ``data=train``
# each step is one sample per seed, so two seeds give each point its
# spread.

import tempfile

import matplotlib.pyplot as plt
import numpy as np
from safetensors.numpy import load_file

import curvbench

STEPS = [0, 10, 40, 150]
results = curvbench.measure(
  "mlp",
  name="along_training",
  out=tempfile.mkdtemp(),
  approximations=["kfac", "diagonal"],
  measurements=["spectra"],
  optimizers=["adam"],
  seeds=[0, 1],
  settings=[
    f"compilation_cache={tempfile.mkdtemp()}",  # seeds share programs
    "problem.width=6",
    "problem.depth=1",
    "optimizer.learning_rate=0.01",
    f"measure.spectra.steps=[{','.join(map(str, STEPS))}]",
    f"measure.training.num_steps={STEPS[-1]}",
    "measure.training.eval_every=10",
    "measure.spectra.data=train",
    "measure.spectra.chunk_size=500",
    "measure.spectra.references=[ggn,hessian]",
    "measure.spectra.save_checkpoints=true",
    "measure.spectra.relative_dampings=[1e-3]",
    "measure.spectra.heatmap_blocks=0",
    "progress=false",
  ],
)
sorted(results.tables)

# %%
# Every row of every table carries ``step``, ``sample`` and ``data``. The
# ``statistics`` table has one row per matrix and statistic: the exact
# matrices (``source == "exact"``) and each approximation's own. Here are
# the largest eigenvalue, the trace and ``negative_ratio``
# (``|λ_min| / λ_max``, the ratio Ghorbani et al. track) of the two exact
# matrices, the median over the two seeds:

statistics = results.tables["statistics"]
exact = statistics[
  statistics.source.eq("exact")
  & statistics.statistic.isin(["max_eigenvalue", "trace", "negative_ratio"])
].drop_duplicates(["matrix", "statistic", "step", "seed"])
exact.pivot_table(
  index=["matrix", "statistic"],
  columns="step",
  values="value",
  aggfunc="median",
).round(3)

# %%
# The GGN is positive semi-definite by construction; the Hessian is not,
# and its negative eigenvalues are the part of the curvature that every
# GGN-based approximation leaves out by design.
#
# How close the approximations stay
# ---------------------------------
#
# ``quality`` compares each approximation with each reference at each
# step. The approximations were estimated in the ``ggn_exact`` mode: their
# distance to the GGN is the price of the block structure alone; their
# distance to the Hessian adds the Hessian's second-order term.

quality = results.tables["quality"]
network = quality[quality.level.eq("network")]
network[network.metric.eq("relative_frobenius")].pivot_table(
  index=["reference", "method"],
  columns="step",
  values="value",
  aggfunc="median",
).round(3)

# %%
# The picture
# -----------
#
# Left: the training loss on 1,000 fixed training examples (Adam's run,
# recorded along the spectra run). Middle: the largest eigenvalue of the
# exact GGN, the exact Hessian and K-FAC over the training split. Right:
# each approximation's relative Frobenius error against each exact matrix
# (colour: the approximation; line style: the exact matrix). Lines join
# the medians over the two seeds; the dots are the seeds.

COLOURS = {"ggn": "C0", "hessian": "C3", "kfac": "C2", "diagonal": "C1"}
training = results.tables["training"].dropna(subset=["train_loss"])
fig, (loss_ax, top_ax, err_ax) = plt.subplots(1, 3, figsize=(13, 4))
for seed, run in training.drop_duplicates(["seed", "step"]).groupby("seed"):
  loss_ax.plot(run.step, run.train_loss, marker=".", label=f"seed {seed}")
loss_ax.set(
  xlabel="training step", ylabel="training loss", title="Adam, lr 0.01"
)
loss_ax.legend()


def median_line(ax, rows, label, colour, style):
  per_step = rows.groupby("step").value.median()
  ax.plot(per_step.index, per_step, style, color=colour, label=label)
  ax.plot(rows.step, rows.value, ".", color=colour)


tops = statistics[statistics.statistic.eq("max_eigenvalue")]
for matrix in ["ggn", "hessian"]:
  rows = tops[tops.source.eq("exact") & tops.matrix.eq(matrix)]
  rows = rows.drop_duplicates(["step", "seed"])
  median_line(top_ax, rows, f"exact {matrix}", COLOURS[matrix], "-")
rows = tops[tops.matrix.eq("kfac/ggn_exact")]
median_line(top_ax, rows, "K-FAC", COLOURS["kfac"], ":")
top_ax.set(
  xlabel="training step",
  ylabel="largest eigenvalue",
  title="Sharpness over the training split",
)
top_ax.legend()

errors = network[network.metric.eq("relative_frobenius")]
for method in ["kfac", "diagonal"]:
  for reference, style in [("ggn", "-"), ("hessian", "--")]:
    rows = errors[errors.curvature.eq(method) & errors.reference.eq(reference)]
    median_line(
      err_ax, rows, f"{method} vs {reference}", COLOURS[method], style
    )
err_ax.set(
  xlabel="training step",
  ylabel="relative Frobenius error",
  ylim=(0, 1.05),
  title="Distance to the exact matrices",
)
err_ax.legend(fontsize="small")
for ax in (loss_ax, top_ax, err_ax):
  ax.set_xscale("symlog", linthresh=10)
  ax.set_xticks(STEPS, [str(s) for s in STEPS])
fig.tight_layout()

# %%
# How to read it, for this run: at initialisation the Hessian has a
# sizeable negative part (``negative_ratio`` 0.26), which training removes
# almost entirely by step 150; its largest eigenvalue first rises above the
# GGN's and then falls back towards it. K-FAC follows the GGN's largest
# eigenvalue closely and stays at a similar distance from the GGN
# throughout, while its distance from the Hessian shrinks as the Hessian
# itself approaches the GGN. The diagonal approximation is far from both at
# every step. Two seeds and four steps make these trends, not findings: the
# dots show how far apart the seeds are.
#
# With a larger problem, more steps and three seeds this is the
# ``curvature_through_training`` experiment
# (``curvbench -m +experiment=curvature_through_training``), whose report
# adds the heatmaps of exact and approximate matrices and their damped
# inverses (Martens & Grosse's Fig. 2) at each step.
#
# The parameters it measured
# --------------------------
#
# With ``measure.spectra.save_checkpoints=true`` each run keeps the
# parameters of every measured step as a ``safetensors`` file: a JSON
# header and raw tensors, readable without curvbench, and usable as the
# input of another spectra run
# (``measure.spectra.checkpoint=<run folder>/checkpoints``).

run_dir = results.path / results.runs.run_dir.iloc[0]
checkpoints = sorted((run_dir / "checkpoints").glob("*.safetensors"))
print([path.name for path in checkpoints])
first, last = load_file(checkpoints[0]), load_file(checkpoints[-1])
for key, value in last.items():
  change = np.linalg.norm(value - first[key])
  print(
    f"{key:10} {str(value.shape):8} moved {change:.3f} in {STEPS[-1]} steps"
  )
