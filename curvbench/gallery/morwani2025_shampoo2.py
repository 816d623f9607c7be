"""Morwani, Shapira, Vyas, Malach, Kakade & Janson (2025), "A New
Perspective on Shampoo's Preconditioner" (ICLR): Shampoo's factors squared
(Shampoo², `L ⊗ R / tr L`) are one power-iteration step toward the
Frobenius-nearest Kronecker product of a layer's curvature block, and close
to it, much nearer the block than Shampoo itself.
"""

import numpy as np

from curvbench.gallery import (
  FAILS,
  HOLDS,
  UNSETTLED,
  Claim,
  Entry,
  Evidence,
  MissingRecords,
  Verdict,
  all_hold,
  rows,
)
from curvbench.measurements.spectra import summary

NAMES = ("shampoo", "shampoo2", "optimal_kronecker")


def nearer_than_shampoo(evidence: Evidence) -> Verdict:
  """The spectra report's own check of Shampoo²'s declared claim
  (`approximations.Nearer`), over every cell of these runs."""
  q = rows(
    evidence,
    "quality",
    "the quality of Shampoo and Shampoo²",
    metric="relative_frobenius",
  )
  _, table = summary.claims(q)
  cells = (
    None
    if table is None
    else table.data[table.data.claim == "shampoo2 nearer than shampoo"]
  )
  if cells is None or cells.empty:
    raise MissingRecords("cells where Shampoo and Shampoo² were measured alike")
  counts = cells.verdict.value_counts()
  text = (
    f"{counts.get('holds', 0)} of {len(cells)} (problem, block type, "
    f"step) cells hold, {counts.get('does not hold', 0)} do not, "
    f"{counts.get('not settled', 0)} are not settled (each a 95 % "
    "interval of the paired difference over seeds and batches)"
  )
  if "gap_mean" in cells:
    text += (
      f"; over the optimal Kronecker product, Shampoo²'s gap has "
      f"median {cells.gap_mean.median():.3g}, Shampoo's "
      f"{cells.than_gap_mean.median():.3g}"
    )
  outcome = (
    FAILS
    if counts.get("does not hold", 0)
    else HOLDS
    if counts.get("holds", 0) == len(cells)
    else UNSETTLED
  )
  return Verdict(outcome, text)


def optimal_is_nearest(evidence: Evidence) -> Verdict:
  q = rows(
    evidence,
    "quality",
    "the per-layer quality",
    metric="relative_frobenius",
    level="layer",
  )
  keys = ["seed", "step", "sample", "reference", "block"]
  wide = q.pivot_table(index=keys, columns="curvature", values="value")
  if not set(NAMES) <= set(wide.columns):
    raise MissingRecords("per-layer errors of all three")
  wide = wide[list(NAMES)].dropna()
  best = wide.optimal_kronecker
  checks = [
    (
      f"seed {s}, step {t}, {b}: optimal {o:.4g} above "
      f"{'Shampoo²' if s2 < o else 'Shampoo'}",
      o <= min(s1, s2) * (1 + 1e-6) + 1e-12,
    )
    for (s, t, _, _, b), (s1, s2, o) in wide.iterrows()
  ]
  verdict = all_hold(
    checks,
    "the optimal Kronecker product at most as far "
    "as Shampoo² and Shampoo, per seed, step, batch and "
    "layer",
  )
  ratio = (wide.shampoo2 / best).replace(np.inf, np.nan).median()
  return Verdict(
    verdict.outcome,
    verdict.evidence
    + (
      f"; Shampoo² / optimal error median {ratio:.3g}, Shampoo / optimal "
      f"{(wide.shampoo / best).replace(np.inf, np.nan).median():.3g}"
    ),
  )


SPECTRA = {
  "problem": "mlp",
  "measure": "spectra",
  "curvature": ",".join(NAMES),
  "measure/spectra/trainer": "adam",
  "measure.spectra.references": ["ggn"],
  "measure.batch_size": 32,
}

ENTRY = Entry(
  name="morwani2025_shampoo2",
  title="Shampoo² is near the optimal Kronecker product, Shampoo is not",
  paper="D. Morwani, I. Shapira, N. Vyas, E. Malach, S. Kakade, L. "
  "Janson. A New Perspective on Shampoo's Preconditioner. ICLR 2025.",
  reproduces="the paper's comparison of Shampoo, Shampoo² and the "
  "optimal Kronecker approximation of each layer's Gauss-Newton block "
  "(its experiments section)",
  differs=(
    "the MLP of problem=mlp (64-16-16-10) on the 8x8 digits, where the "
    "paper uses MNIST and CIFAR networks;",
    "every approximation built from the exact GGN's per-example "
    "factors of the batch it is compared on (ggn_exact), at "
    "initialisation and after 50 Adam steps, three seeds, three "
    "batches of 32 each;",
    "the optimal Kronecker product by power iteration (Van Loan & "
    "Pitsianis), stopped at its tolerance.",
  ),
  sweeps={
    "cpu": [
      dict(
        SPECTRA,
        seed="0,1,2",
        **{"measure.spectra.steps": [0, 50], "measure.training.num_steps": 50},
      )
    ],
    "tiny": [
      dict(
        SPECTRA,
        seed="0",
        **{"measure.spectra.steps": [0], "measure.spectra.samples": 2},
      )
    ],
  },
  claims=(
    Claim(
      "Shampoo² is nearer the curvature than Shampoo (relative "
      "Frobenius error, per block type and whole network).",
      "the paper's comparison of the two with the optimal "
      "Kronecker approximation",
      nearer_than_shampoo,
    ),
    Claim(
      "The optimal Kronecker product is at most as far as either, "
      "in every layer (it is the nearest Kronecker product).",
      "its definition (Van Loan & Pitsianis 1993)",
      optimal_is_nearest,
    ),
  ),
)
