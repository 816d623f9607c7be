"""Sagun, Evci, Güney, Dauphin & Bottou (2017), "Empirical Analysis of the
Hessian of Over-Parametrized Neural Networks" (ICLR workshop), and Papyan
(2020), "Traces of Class/Cross-Class Structure Pervade Deep Learning
Spectra" (JMLR): after training, the spectrum of a C-class classifier's
GGN is a bulk near zero and about C outliers, set apart by a gap.
"""

import numpy as np

from curvbench import metrics
from curvbench.gallery import (
  FAILS,
  HOLDS,
  UNSETTLED,
  Claim,
  Entry,
  Evidence,
  Verdict,
  all_hold,
  trained_eigenvalues,
)

CLASSES = 10  # digits
STEPS = 1000
WIDTH = 32
# The bulk: eigenvalues below this fraction of the largest.
BULK = 1e-2


def about_c_outliers(evidence: Evidence) -> Verdict:
  found = {}
  for seed, values in trained_eigenvalues(evidence, "ggn", per="seed").items():
    top = values[: 2 * CLASSES + 1]
    ratios = top[:-1] / top[1:]
    widest = int(np.argmax(ratios))
    found[seed] = (
      metrics.num_outliers(values, 2 * CLASSES),
      widest + 1,
      ratios[widest],
    )
  near = [abs(c - CLASSES) <= 1 for c, _, _ in found.values()]
  text = (
    f"outliers (above the widest gap among the top {2 * CLASSES + 1} "
    "eigenvalues where its ratio is at least 2) per seed: "
    + "; ".join(
      f"seed {s}: {c} (widest gap after eigenvalue {i}, ratio {r:.3g})"
      for s, (c, i, r) in found.items()
    )
    + f"; C = {CLASSES}"
  )
  outcome = HOLDS if all(near) else FAILS if not any(near) else UNSETTLED
  return Verdict(outcome, text)


def bulk_near_zero(evidence: Evidence) -> Verdict:
  checks = []
  for seed, values in trained_eigenvalues(evidence, "ggn", per="seed").items():
    share = float(np.mean(values < BULK * values[0]))
    checks.append(
      (
        f"seed {seed}: {share:.1%} of the eigenvalues below "
        f"{BULK:g} of the largest",
        share >= 0.9,
      )
    )
  return all_hold(
    checks,
    f"at least 90 % of the eigenvalues below {BULK:g} of the largest, per seed",
    listed=True,
  )


def draw(evidence: Evidence, ax) -> None:
  """The top of the trained GGN's spectrum, one line per seed, with C
  marked: the outliers are the points left of the drop."""
  for seed, values in trained_eigenvalues(evidence, "ggn", per="seed").items():
    top = values[: 3 * CLASSES]
    ax.semilogy(
      np.arange(1, top.size + 1), top, marker="o", ms=3, label=f"seed {seed}"
    )
  ax.axvline(CLASSES + 0.5, color="0.5", ls="--", lw=1)
  ax.set(
    xlabel="rank",
    ylabel="eigenvalue",
    title=f"Trained GGN, top {3 * CLASSES} (C = {CLASSES} dashed)",
  )


ENTRY = Entry(
  name="sagun2017_outliers",
  title="A bulk near zero and about C outliers",
  paper="L. Sagun, U. Evci, V. U. Güney, Y. Dauphin, L. Bottou. Empirical "
  "Analysis of the Hessian of Over-Parametrized Neural Networks. ICLR "
  "2018 workshop; V. Papyan. Traces of Class/Cross-Class Structure "
  "Pervade Deep Learning Spectra. JMLR 2020.",
  reproduces="the spectra of trained classifiers with their bulk and "
  "outliers (Sagun et al., section 3; Papyan, the C outliers of the GGN)",
  differs=(
    f"the MLP of problem=mlp at width {WIDTH} (64-{WIDTH}-{WIDTH}-10, "
    "3,466 parameters) on the 8x8 digits (C = "
    f"{CLASSES}), trained by Adam for {STEPS} steps, where the papers "
    "train larger networks on MNIST and CIFAR-10 to near-zero loss;",
    "the exact GGN over the whole training split, in float64, by "
    "eigendecomposition (no sampling);",
    "outliers counted at the largest ratio gap among the top "
    f"{2 * CLASSES + 1} eigenvalues, a rule of ours: the papers read "
    "them off the plotted spectrum.",
  ),
  sweeps={
    "cpu": [
      {
        "problem": "mlp",
        "problem.width": WIDTH,
        "measure": "spectra",
        "seed": "0,1,2",
        "measure/spectra/trainer": "adam",
        "measure.spectra.steps": [0, STEPS],
        "measure.training.num_steps": STEPS,
        "measure.spectra.data": "train",
        "measure.spectra.references": ["ggn", "hessian"],
        "measure.spectra.top_k": 2 * CLASSES,
      },
    ],
    "tiny": [
      {
        "problem": "mlp",
        "problem.width": 8,
        "measure": "spectra",
        "seed": "0",
        "measure/spectra/trainer": "adam",
        "measure.spectra.steps": [0, 20],
        "measure.training.num_steps": 20,
        "measure.spectra.data": "train",
        "measure.spectra.references": ["ggn"],
        "measure.spectra.top_k": 2 * CLASSES,
      },
    ],
  },
  claims=(
    Claim(
      f"After training, the GGN has C outliers (here within one of "
      f"C = {CLASSES}) above a gap.",
      "Papyan (2020): C outliers "
      "of the GGN; Sagun et al.: outliers set by the data's classes",
      about_c_outliers,
    ),
    Claim(
      "After training, most of the spectrum is a bulk near zero "
      f"(90 % of the eigenvalues below {BULK:g} of the largest).",
      "Sagun et al., section 3 (the bulk)",
      bulk_near_zero,
    ),
  ),
  draw=draw,
)
