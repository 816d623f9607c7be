"""Ghorbani, Krishnan & Xiao (2019), "An Investigation into Neural Net
Optimization via Hessian Eigenvalue Density" (ICML): without batch
normalisation a network's Hessian has a few large eigenvalues isolated
from the rest of its spectrum; with batch normalisation (in training
mode) they are gone.
"""

import numpy as np

from curvbench.gallery import (
  Claim,
  Entry,
  Evidence,
  Verdict,
  by,
  lower,
  trained_eigenvalues,
)

STEPS = 200
# The isolation of the top of the spectrum: the largest eigenvalue over
# the RANK-th largest.
RANK = 10


def _tops(evidence: Evidence) -> dict[str, dict[int, np.ndarray]]:
  """Per normalisation and seed, the Hessian's eigenvalues (descending)
  after training, on the first measured batch."""
  found = trained_eigenvalues(evidence, "hessian")
  runs = evidence.done.set_index("run_id")
  out: dict[str, dict[int, np.ndarray]] = {}
  for run_id, values in found.items():
    norm, seed = runs.loc[run_id, ["config:problem.norm", "config:seed"]]
    out.setdefault(norm, {})[int(seed)] = values
  return out


def isolation(values: np.ndarray) -> float:
  return float(values[0] / values[RANK - 1])


def batch_norm_removes_outliers(evidence: Evidence) -> Verdict:
  norms = ("batch", "none")
  logs = dict(
    zip(
      norms,
      (
        np.log10([isolation(v) for v in top.values()])
        for top in by(
          _tops(evidence), norms, "runs with and without batch norm"
        )
      ),
    )
  )
  verdict = lower(
    logs["batch"],
    logs["none"],
    f"log10 of the top eigenvalue over the {RANK}th",
    ("batch norm", "no normalisation"),
  )
  ratios = {n: ", ".join(f"{10**x:.3g}" for x in v) for n, v in logs.items()}
  return Verdict(
    verdict.outcome,
    verdict.evidence
    + (
      f"; the ratio per seed: batch norm {ratios['batch']}, none "
      f"{ratios['none']}"
    ),
  )


def draw(evidence: Evidence, ax) -> None:
  """The top 30 Hessian eigenvalues after training, with and without
  batch norm, one line per seed."""
  for norm, style in (("batch", "-"), ("none", "--")):
    for seed, values in _tops(evidence).get(norm, {}).items():
      top = values[:30]
      ax.semilogy(
        np.arange(1, top.size + 1),
        np.clip(top, 1e-8, None),
        ls=style,
        marker="o",
        ms=2,
        label=f"{'batch norm' if norm == 'batch' else 'none'}, seed {seed}",
      )
  ax.set(
    xlabel="rank",
    ylabel="eigenvalue",
    title=f"Trained Hessian, top 30 (after {STEPS} steps)",
  )


SPECTRA = {
  "problem": "resnet_small",
  "problem.norm": "batch,none",
  "measure": "spectra",
  "curvature": "diagonal",
  "measure/spectra/trainer": "adam",
  "measure.spectra.references": ["hessian"],
  "measure.spectra.samples": 1,
}

ENTRY = Entry(
  name="ghorbani2019_batch_norm",
  title="Batch norm removes the Hessian's isolated large eigenvalues",
  paper="B. Ghorbani, S. Krishnan, Y. Xiao. An Investigation into Neural "
  "Net Optimization via Hessian Eigenvalue Density. ICML 2019.",
  reproduces="the paper's Hessian spectral densities of ResNets with and "
  "without batch normalisation (section 4)",
  differs=(
    "the ResNet-8 of problem=resnet_small (widths 4, 4, 8; 1,710 "
    "parameters with batch norm) on the 8x8 digits, trained by Adam "
    f"for {STEPS} steps, where the paper trains ResNet-32 on CIFAR-10 "
    "and ImageNet models;",
    "the exact Hessian of one batch of 64, by eigendecomposition, not "
    "SLQ over the whole training set;",
    f"isolation read as the top eigenvalue over the {RANK}th, a number "
    "of ours: the paper shows the densities.",
  ),
  sweeps={
    "cpu": [
      dict(
        SPECTRA,
        seed="0,1,2",
        **{
          "measure.spectra.steps": [0, STEPS],
          "measure.training.num_steps": STEPS,
        },
      )
    ],
    "tiny": [
      dict(
        SPECTRA,
        seed="0",
        **{
          "problem.widths": [2, 2, 2],
          "problem.batch_size": 16,
          "measure.spectra.steps": [0, 2],
          "measure.training.num_steps": 2,
        },
      )
    ],
  },
  claims=(
    Claim(
      "Without batch normalisation the trained network's Hessian "
      "has large eigenvalues isolated from the rest; with it, the "
      "top of the spectrum is less isolated.",
      "section 4 (spectral densities with and without batch norm)",
      batch_norm_removes_outliers,
    ),
  ),
  draw=draw,
)
