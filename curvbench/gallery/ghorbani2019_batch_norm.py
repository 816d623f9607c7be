"""Ghorbani, Krishnan & Xiao (2019), "An Investigation into Neural Net
Optimization via Hessian Eigenvalue Density" (ICML): without batch
normalisation a network's Hessian has a few large eigenvalues isolated
from the rest of its spectrum; with batch normalisation (in training
mode) they are gone.
"""

from pathlib import Path

import numpy as np

from curvbench import plots
from curvbench.gallery import (Claim, Entry, Evidence, MissingRecords,
                               Verdict, lower, rows)

STEPS = 200
# The isolation of the top of the spectrum: the largest eigenvalue over
# the RANK-th largest.
RANK = 10


def _tops(evidence: Evidence) -> dict[str, dict[int, np.ndarray]]:
  """Per normalisation and seed, the Hessian's eigenvalues (descending)
  after training, on the first measured batch."""
  spectra = rows(evidence, "spectra", "the trained Hessian's eigenvalues",
                 source="exact", matrix="hessian")
  spectra = spectra[(spectra.step == spectra.step.max())
                    & (spectra["sample"] == 0)]
  norms = evidence.done.set_index("run_id")["config:problem.norm"]
  out = {}
  for run_id, s in spectra.groupby("run_id"):
    out.setdefault(norms[run_id], {})[int(s.seed.iloc[0])] = np.sort(
        s.eigenvalue.to_numpy())[::-1]
  return out


def isolation(values: np.ndarray) -> float:
  return float(values[0] / values[RANK - 1])


def batch_norm_removes_outliers(evidence: Evidence) -> Verdict:
  tops = _tops(evidence)
  if not {"batch", "none"} <= set(tops):
    raise MissingRecords("runs with and without batch norm")
  logs = {norm: np.log10([isolation(v) for v in tops[norm].values()])
          for norm in ("batch", "none")}
  verdict = lower(logs["batch"], logs["none"],
                  f"log10 of the top eigenvalue over the {RANK}th",
                  ("batch norm", "no normalisation"))
  ratios = {n: ", ".join(f"{10 ** x:.3g}" for x in v)
            for n, v in logs.items()}
  return Verdict(verdict.outcome, verdict.evidence + (
      f"; the ratio per seed: batch norm {ratios['batch']}, none "
      f"{ratios['none']}"))


def draw(evidence: Evidence, folder: Path) -> list[Path]:
  """The top 30 Hessian eigenvalues after training, with and without
  batch norm, one line per seed."""
  fig, (ax,) = plots.grid(1, width=5.0, height=3.6)
  for norm, style in (("batch", "-"), ("none", "--")):
    for seed, values in _tops(evidence).get(norm, {}).items():
      top = values[:30]
      ax.semilogy(np.arange(1, top.size + 1), np.clip(top, 1e-8, None),
                  ls=style, marker="o", ms=2,
                  label=f"{'batch norm' if norm == 'batch' else 'none'}, "
                  f"seed {seed}")
  ax.set(xlabel="rank", ylabel="eigenvalue",
         title=f"Trained Hessian, top 30 (after {STEPS} steps)")
  ax.legend(fontsize=7)
  return plots.save(fig, folder / "gallery_ghorbani2019_batch_norm")


SPECTRA = {"problem": "resnet_small", "problem.norm": "batch,none",
           "measure": "spectra", "curvature": "diagonal",
           "measure/spectra/trainer": "adam",
           "measure.spectra.references": ["hessian"],
           "measure.spectra.samples": 1}

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
        "cpu": [dict(SPECTRA, seed="0,1,2", **{
            "measure.spectra.steps": [0, STEPS],
            "measure.training.num_steps": STEPS})],
        "tiny": [dict(SPECTRA, seed="0", **{
            "problem.widths": [2, 2, 2], "problem.batch_size": 16,
            "measure.spectra.steps": [0, 2],
            "measure.training.num_steps": 2})],
    },
    claims=(
        Claim("Without batch normalisation the trained network's Hessian "
              "has large eigenvalues isolated from the rest; with it, the "
              "top of the spectrum is less isolated.",
              "section 4 (spectral densities with and without batch norm)",
              batch_norm_removes_outliers),
    ),
    draw=draw)
