"""Gur-Ari, Roberts & Dyer (2018), "Gradient Descent Happens in a Tiny
Subspace" (arXiv:1812.04754): after a short initial phase of training, the
gradient lies mostly in the span of the Hessian's top k eigenvectors, k
the number of classes, and stays there as that subspace changes.
"""

import pandas as pd

from curvbench.gallery import Claim, Entry, Evidence, Verdict, all_hold, rows
from curvbench.measurements.spectra.compute import GRADIENT_SHARE

CLASSES = 10  # digits
STEPS = [0, 5, 20, 50, 100, 200, 400]
# "After a short phase": from this step on.
SETTLED = 50
# "Mostly": the median share over those steps at least this.
MOSTLY = 0.8


def shares(evidence: Evidence) -> pd.DataFrame:
  """Per seed and measured step, the share of the gradient's squared norm
  in the Hessian's top-k eigenspace."""
  found = rows(
    evidence,
    "statistics",
    "the gradient's share in the top Hessian eigenspace",
    source="exact",
    matrix="hessian",
    statistic=GRADIENT_SHARE,
  )
  return found[["seed", "step", "value"]].sort_values("step")


def mostly_in_top_subspace(evidence: Evidence) -> Verdict:
  checks = []
  for seed, run in shares(evidence).groupby("seed"):
    late = run[run.step >= SETTLED].value
    checks.append(
      (
        f"seed {seed}: median {late.median():.3f} over steps "
        f">= {SETTLED} (at step 0: "
        f"{run[run.step == 0].value.iloc[0]:.3f})",
        late.median() >= MOSTLY,
      )
    )
  return all_hold(
    checks,
    f"the median share from step {SETTLED} on at least {MOSTLY:g}, per seed",
    listed=True,
  )


def draw(evidence: Evidence, ax) -> None:
  """The gradient's share in the top-C Hessian eigenspace along training,
  a line per seed."""
  for seed, run in shares(evidence).groupby("seed"):
    ax.plot(run.step, run.value, marker="o", ms=3, label=f"seed {seed}")
  ax.axhline(MOSTLY, color="0.5", ls="--", lw=1)
  ax.set(
    xlabel="step",
    ylabel=f"share of |g|^2 in the top {CLASSES}",
    ylim=(0, 1.02),
    title="The gradient in the top Hessian eigenspace",
  )


SGD = {
  "problem": "mlp",
  "measure": "spectra",
  "curvature": "diagonal",
  "measure/spectra/trainer": "sgd",
  "measure.spectra.trainer.momentum": 0,
  "measure.spectra.data": "train",
  "measure.spectra.references": ["hessian"],
  "measure.spectra.top_k": CLASSES,
  "measure.spectra.per_block": False,
  "measure.spectra.per_block_type": False,
  "measure.spectra.heatmap_blocks": 0,
}

ENTRY = Entry(
  name="gurari2018_tiny_subspace",
  title="Gradient descent happens in a tiny subspace",
  paper="G. Gur-Ari, D. A. Roberts, E. Dyer. Gradient Descent Happens in "
  "a Tiny Subspace. arXiv:1812.04754, 2018.",
  reproduces="the paper's overlap of the gradient with the top-k "
  "Hessian eigenspace along training, k the number of classes "
  "(section 2)",
  differs=(
    f"the MLP of problem=mlp (64-16-16-10) on the 8x8 digits (C = "
    f"{CLASSES}), trained by SGD (step 0.1, batches of 64, no momentum) "
    f"for {STEPS[-1]} steps, where the paper trains larger networks on "
    "MNIST and CIFAR-10;",
    "the gradient and the Hessian over the whole training split, "
    f"measured exactly (dense) at steps {STEPS};",
    f"'mostly' read as a median share of at least {MOSTLY:g} from step "
    f"{SETTLED} on: thresholds of ours.",
  ),
  sweeps={
    "cpu": [
      dict(
        SGD,
        seed="0,1,2",
        **{
          "measure.spectra.steps": STEPS,
          "measure.training.num_steps": STEPS[-1],
        },
      )
    ],
    "tiny": [
      dict(
        SGD,
        seed="0",
        **{
          "problem.width": 8,
          "measure.spectra.steps": [0, 5],
          "measure.training.num_steps": 5,
        },
      )
    ],
  },
  claims=(
    Claim(
      f"After a short phase the gradient lies mostly in the span of "
      f"the Hessian's top C eigenvectors (C = {CLASSES}).",
      "section 2 (the overlap along training)",
      mostly_in_top_subspace,
    ),
  ),
  draw=draw,
)
