"""Sagun, Evci, Güney, Dauphin & Bottou (2017), "Empirical Analysis of the
Hessian of Over-Parametrized Neural Networks" (arXiv:1706.04454), and
Papyan (2019, 2020), "Measurements of Three-Level Hierarchical Structure in
the Outliers in the Spectrum of Deepnet Hessians" (ICML) and "Traces of
Class/Cross-Class Structure Pervade Deep Learning Spectra" (JMLR): after
training, the spectrum of a C-class classifier's Gauss-Newton matrix is a
bulk near zero and about C outliers set apart from it, and the outliers'
eigenspace is spanned by C class means of the per-example gradient terms.
"""

import numpy as np

from curvbench.gallery import (
  FINDING,
  Claim,
  Condition,
  Entry,
  Evidence,
  Size,
  Threshold,
  Verdict,
  against,
  column_in,
  rows,
  setting_in,
  trained_eigenvalues,
)

CLASSES = 10  # digits
STEPS = 2000
WIDTH = 32
# The class-mean test's statistic (the subspace overlap of the GGN's top C
# eigenvectors with the span of the C class means).
OVERLAP = "class_mean_overlap"
GAP = Threshold(
  2.0,
  5.0,
  "ours: the papers read the gap off plotted spectra; from twice to five "
  "times the typical ratio of consecutive eigenvalues below it",
)
BULK = Threshold(
  1e-4,
  1e-2,
  "ours: the papers show the bulk 'near zero' on plots; from 1e-4 to 1e-2 "
  "of the top eigenvalue",
)
SPANNED = Threshold(
  0.5,
  0.9,
  "ours: 'spanned' read as from half to 90 % of the outlier subspace; "
  "Papyan compares the eigenvalues by eye ('usually very close')",
)


def gap_ratio(values: np.ndarray) -> float:
  """λ_C / λ_{C+1} over the median consecutive ratio λ_k / λ_{k+1} of the
  next 2C eigenvalues: how many times the drop after the C-th eigenvalue
  exceeds a typical drop below it."""
  top = values[: 3 * CLASSES + 1]
  ratios = top[:-1] / top[1:]
  return float(ratios[CLASSES - 1] / np.median(ratios[CLASSES:]))


def _per_run(evidence: Evidence, quantity) -> tuple[np.ndarray, float]:
  """`quantity` of the trained GGN's eigenvalues per run, and its median
  at initialisation."""
  spectra = rows(
    evidence, "spectra", "the GGN's eigenvalues", source="exact", matrix="ggn"
  )
  trained = trained_eigenvalues(evidence, "ggn")
  first = spectra[spectra.step == spectra.step.min()]
  init = [
    quantity(np.sort(g.eigenvalue.to_numpy())[::-1])
    for _, g in first.groupby("run_id")
  ]
  return np.array([quantity(v) for v in trained.values()]), float(
    np.median(init)
  )


def c_outliers(evidence: Evidence) -> Verdict:
  found, init = _per_run(evidence, gap_ratio)
  return against(
    found,
    GAP,
    above=True,
    what=f"the drop after the {CLASSES}th eigenvalue over a typical drop "
    "below it, per seed",
    baseline=f"at initialisation {init:.3g}; 1 where the C-th is no edge",
  )


def bulk_near_zero(evidence: Evidence) -> Verdict:
  found, init = _per_run(evidence, lambda v: float(np.median(np.abs(v)) / v[0]))
  return against(
    found,
    BULK,
    above=False,
    what="the median eigenvalue's magnitude over the top eigenvalue, per seed",
    baseline=f"at initialisation {init:.3g}",
  )


def class_means_span(evidence: Evidence) -> Verdict:
  overlap = rows(
    evidence,
    "statistics",
    "the class-mean test (measure.spectra.class_means)",
    matrix="ggn",
    statistic=OVERLAP,
  )
  last = (
    overlap[overlap.step == overlap.step.max()].groupby("run_id").value.first()
  )
  init = overlap[overlap.step == overlap.step.min()].value.median()
  chance = CLASSES / overlap.num_params.iloc[0]
  verdict = against(
    last.to_numpy(),
    SPANNED,
    above=True,
    what=f"|UᵀQ|²/C, U the GGN's top {CLASSES} eigenvectors, Q the span of "
    "the C class means, per seed",
    baseline=f"chance {chance:.2g}; at initialisation {init:.3g}",
  )
  return Verdict(
    verdict.outcome, f"{verdict.evidence}; {_eigenvalue_match(evidence)}"
  )


def _eigenvalue_match(evidence: Evidence) -> str:
  """Papyan's own comparison in words: the class means' eigenvalues against
  the GGN's top C, their median relative gap."""
  try:
    means = trained_eigenvalues(evidence, "ggn", source="class_means")
  except LookupError:
    return "the class means' eigenvalues were not recorded"
  exact = trained_eigenvalues(evidence, "ggn")
  gaps = [
    np.median(np.abs(exact[r][:CLASSES] - m[:CLASSES]) / exact[r][:CLASSES])
    for r, m in means.items()
    if r in exact
  ]
  return (
    "Papyan's comparison: the top C eigenvalues of the GGN and of the "
    f"class means differ by a median {np.median(gaps):.1%} of the GGN's "
    f"(over {len(gaps)} runs)"
  )


def _terminal(evidence: Evidence) -> tuple[bool, str]:
  """Trained to zero training error, where Papyan measures."""
  train = rows(evidence, "training", "the runs' training error")
  final = (
    train.dropna(subset=["train_error"])
    .sort_values("step")
    .groupby("run_id")
    .train_error.last()
  )
  return bool((final == 0).all()), (
    f"final training error {final.min():.3g} to {final.max():.3g}"
  )


def draw(evidence: Evidence, ax) -> None:
  """The top of the trained GGN's spectrum, one line per seed, C marked,
  and the class means' eigenvalues as crosses."""
  for run_id, values in trained_eigenvalues(evidence, "ggn").items():
    top = values[: 4 * CLASSES]
    (line,) = ax.semilogy(
      np.arange(1, top.size + 1), top, marker="o", ms=2, lw=1
    )
  try:
    means = trained_eigenvalues(evidence, "ggn", source="class_means")
  except LookupError:
    means = {}
  for values in means.values():
    ax.semilogy(np.arange(1, values.size + 1), values, "x", color="k", ms=4)
  ax.plot([], [], "x", color="k", label="class means (Papyan)")
  ax.plot([], [], "o-", color="0.5", ms=2, label="exact GGN, a line per seed")
  ax.axvline(CLASSES + 0.5, color="0.5", ls="--", lw=1)
  ax.set(
    xlabel="rank",
    ylabel="eigenvalue",
    title=f"Trained GGN, top {4 * CLASSES}; dashed: C = {CLASSES}",
  )


def spectra(seeds: str, steps: int, width: int, **more) -> dict:
  return {
    "problem": "mlp",
    "problem.width": width,
    "measure": "spectra",
    "curvature": "diagonal",
    "seed": seeds,
    "measure/spectra/trainer": "adam",
    "measure.spectra.steps": [0, steps],
    "measure.training.num_steps": steps,
    "measure.training.eval_every": 100,
    "measure.spectra.data": "train",
    "measure.spectra.references": ["ggn"],
    "measure.spectra.top_k": CLASSES,
    "measure.spectra.class_means": True,
    "measure.spectra.per_block": False,
    "measure.spectra.per_block_type": False,
    "measure.spectra.heatmap_blocks": 0,
    **more,
  }


CONDITIONS = (
  column_in(
    "softmax cross-entropy",
    "loss",
    ("softmax_cross_entropy",),
    "C-class softmax classifiers",
  ),
  setting_in(
    "the training set",
    "measure.spectra.data",
    ("train",),
    "the Gauss-Newton matrix of the loss over the training set",
  ),
  Condition(
    "the terminal phase",
    "trained to zero training error (Papyan: hundreds of epochs); the "
    "class structure forms during training",
    _terminal,
  ),
)

ENTRY = Entry(
  name="sagun2017_outliers",
  title="A bulk near zero and C outliers spanned by the class means",
  paper="L. Sagun, U. Evci, V. U. Güney, Y. Dauphin, L. Bottou. Empirical "
  "Analysis of the Hessian of Over-Parametrized Neural Networks. ICLR 2018 "
  "workshop (arXiv:1706.04454); V. Papyan. Measurements of Three-Level "
  "Hierarchical Structure in the Outliers in the Spectrum of Deepnet "
  "Hessians. ICML 2019; V. Papyan. Traces of Class/Cross-Class Structure "
  "Pervade Deep Learning Spectra. JMLR 2020.",
  reproduces="the spectra of trained classifiers with their bulk and "
  "outliers (Sagun et al.), the C outliers of the Gauss-Newton term and "
  "their class means (Papyan)",
  differs=(
    f"the MLP of problem=mlp at width {WIDTH} (64-{WIDTH}-{WIDTH}-10, "
    f"3,466 parameters) on the 8x8 digits (C = {CLASSES}), trained by "
    "Adam, where the papers train larger networks on MNIST, CIFAR-10 and "
    "ImageNet by SGD for hundreds of epochs;",
    "the exact GGN over the whole training split, in float64, by "
    "eigendecomposition; the class means from Papyan's released code "
    "(his papers' bodies could not be read in the stored text);",
    "the gap and the bulk are numbers of ours, judged over ranges: the "
    "papers read both off plotted spectra.",
  ),
  sizes={
    "cpu": Size(
      [spectra("0,1,2,3,4,5", STEPS, WIDTH)],
      f"six seeds, {STEPS} Adam steps, the GGN at initialisation and at the "
      "end",
    ),
    "accelerator": Size(
      [spectra("0,1,2,3,4,5", 5000, 64)],
      "the 64-64-64-10 MLP (9,034 parameters), six seeds, 5,000 Adam "
      "steps; sized by arithmetic for a minute of a 10-minute window",
    ),
    "tiny": Size(
      [spectra("0", 20, 8)], "an MLP of width 8, one seed, 20 steps"
    ),
  },
  claims=(
    Claim(
      FINDING,
      "After training, the Gauss-Newton matrix of a C-class classifier has "
      "C outlying eigenvalues, set apart from the rest by a gap.",
      "Papyan 2020, section 1.1 (definitions of bulk and outliers) and "
      "Papyan 2019 (C outliers of the G term); Sagun et al. 2017, abstract "
      "(outliers set by the data's clusters)",
      c_outliers,
      CONDITIONS,
      unverified="the section and figure numbers in the papers' bodies, "
      "and whether Sagun et al. state the number C",
    ),
    Claim(
      FINDING,
      "After training, most of the spectrum is a bulk concentrated near zero.",
      "Sagun et al. 2017, abstract (the bulk around zero)",
      bulk_near_zero,
      CONDITIONS,
      unverified="the figure numbers",
    ),
    Claim(
      FINDING,
      "The outliers' eigenspace is the span of the C class means of the "
      "per-example gradient terms, whose eigenvalues are close to the "
      "outliers'.",
      "Papyan 2019 (the top-C eigenvalues against the class means' Gram "
      "matrix) and Papyan 2020",
      class_means_span,
      CONDITIONS,
      unverified="the figure numbers; the definitions follow Papyan's "
      "released code (deep-lab/DeepnetHessian)",
    ),
  ),
  draw=draw,
)
