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
  MissingRecords,
  Size,
  Threshold,
  Verdict,
  against,
  column_in,
  final,
  rows,
  setting_in,
  trained,
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

# The papers train by SGD (with weight decay, Papyan 2020).
TRAINER = "sgd"


def gap_ratio(values: np.ndarray) -> float:
  """The larger drop after the (C-1)-th or the C-th eigenvalue (λ_k /
  λ_{k+1}: 'about C' outliers, the softmax's C-1 directions or C) over the
  median consecutive drop of the next 2C eigenvalues: how many times the
  edge exceeds a typical drop below it."""
  top = values[: 3 * CLASSES + 1]
  ratios = top[:-1] / top[1:]
  return float(
    ratios[CLASSES - 2 : CLASSES].max() / np.median(ratios[CLASSES:])
  )


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
  """Per seed, the drop after the (C-1)th or Cth eigenvalue of the
  trained GGN over a typical drop below it, above the threshold: C
  outliers set apart by a gap."""
  found, init = _per_run(evidence, gap_ratio)
  return against(
    found,
    GAP,
    above=True,
    what=f"the drop after the {CLASSES - 1}th or {CLASSES}th eigenvalue "
    "over a typical drop below it, per seed",
    baseline=f"at initialisation {init:.3g}; 1 where the C-th is no edge",
  )


def bulk_near_zero(evidence: Evidence) -> Verdict:
  """Per seed, the trained GGN's median eigenvalue magnitude over its
  top eigenvalue, small: the bulk sits near zero."""
  found, init = _per_run(evidence, lambda v: float(np.median(np.abs(v)) / v[0]))
  return against(
    found,
    BULK,
    above=False,
    what="the median eigenvalue's magnitude over the top eigenvalue, per seed",
    baseline=f"at initialisation {init:.3g}",
  )


def class_means_span(evidence: Evidence) -> Verdict:
  """Per seed, the overlap |UᵀQ|²/C of the trained GGN's top C
  eigenvectors with the span of the C class means, above the
  threshold; Papyan's eigenvalue comparison beside it."""
  what = "the class-mean test (measure.spectra.class_means)"
  overlap = rows(evidence, "statistics", what, matrix="ggn", statistic=OVERLAP)
  last = trained(evidence, overlap, what).groupby("run_id").value.first()
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
  error = final(evidence, "train_error", "the runs' training error")
  return bool((error == 0).all()), (
    f"final training error {error.min():.3g} to {error.max():.3g}"
  )


def draw(evidence: Evidence, ax) -> None:
  """The top of the trained GGN's spectrum, one line per seed, C marked,
  and the class means' eigenvalues as crosses."""
  for _run_id, values in trained_eigenvalues(evidence, "ggn").items():
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


def spectra(seeds: str, steps: int, problem="mlp", **more) -> dict:
  """The overrides of a sweep that trains `problem` by SGD with weight
  decay for `steps` steps and measures the training set's GGN at
  initialisation and at the end, for the `seeds`; `more` added
  last."""
  return {
    "problem": problem,
    "problem.data.num_train": 750,
    "measure": "spectra",
    "curvature": "diagonal",
    "seed": seeds,
    "measure/spectra/trainer": TRAINER,
    "measure.spectra.trainer.learning_rate": 0.05,
    "measure.spectra.trainer.momentum": 0.9,
    "measure.spectra.trainer.weight_decay": 5e-4,
    "measure.spectra.steps": [0, steps],
    "measure.training.num_steps": steps,
    "measure.training.eval_every": 100,
    "measure.training.train_eval_size": "null",
    "measure.spectra.data": "train",
    "measure.spectra.references": ["ggn"],
    "measure.spectra.top_k": CLASSES,
    "measure.spectra.class_means": True,
    "measure.spectra.per_block": False,
    "measure.spectra.per_block_type": False,
    "measure.spectra.heatmap_blocks": 0,
    **more,
  }


def _trained_by_sgd(evidence: Evidence) -> tuple[bool, str]:
  name = evidence.setting("measure.spectra.trainer.name")
  decay = evidence.setting("measure.spectra.trainer.weight_decay")
  if not name:
    raise MissingRecords("the trainer")
  ok = name == {TRAINER} and bool(decay) and min(decay) > 0
  return (
    ok,
    f"{', '.join(map(str, name))}, weight decay {', '.join(map(str, decay)) or 'none'}",
  )


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
  Condition(
    "SGD with weight decay",
    "trained by SGD with momentum and weight decay, as Papyan's networks "
    "(his released checkpoints; the text could not be read)",
    _trained_by_sgd,
  ),
)
# Papyan's networks: deep convolutional classifiers.
PAPYAN = CONDITIONS + (
  setting_in(
    "Papyan's network families",
    "problem.name",
    (
      "convnet",
      "convnet_norm",
      "convnet_cifar10",
      "resnet18",
      "resnet20_cifar10",
    ),
    "deep convolutional classifiers (VGG, ResNet, DenseNet) on MNIST, "
    "Fashion-MNIST, CIFAR and ImageNet subsets",
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
    f"at the CPU size the MLP of problem=mlp at width {WIDTH} "
    f"(64-{WIDTH}-{WIDTH}-10, 3,466 parameters) on 750 of the 8x8 digits "
    f"(C = {CLASSES}), trained by SGD (step 0.05, momentum 0.9, weight "
    "decay 5e-4, batches of 64) to zero training error; the papers train "
    "far larger networks on MNIST, CIFAR-10 and ImageNet for hundreds of "
    "epochs;",
    "the exact GGN over the whole training split, in float64, by "
    "eigendecomposition; the class means from Papyan's released code "
    "(his papers' bodies could not be read in the stored text);",
    "the gap and the bulk are numbers of ours, judged over ranges: the "
    "papers read both off plotted spectra.",
  ),
  sizes={
    "cpu": Size(
      [spectra("0,1,2,3,4,5", STEPS, **{"problem.width": WIDTH})],
      f"the 3,466-parameter MLP on 750 digits, six seeds, {STEPS} SGD steps "
      "(170 epochs), the GGN at initialisation and at the end",
    ),
    "accelerator": Size(
      [
        spectra(
          "0,1,2,3,4,5",
          4000,
          problem="convnet",
          **{"problem.channels": [16, 32], "problem.data.num_train": 1500},
        )
      ],
      "a convolutional network (16 and 32 channels) on the 1,500 training "
      "digits, six seeds, 4,000 SGD steps; sized by arithmetic for a "
      "minute of a 10-minute window",
    ),
    "tiny": Size(
      [spectra("0", 20, **{"problem.width": 8})],
      "an MLP of width 8, one seed, 20 steps",
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
      PAPYAN,
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
      PAPYAN,
      unverified="the figure numbers; the definitions follow Papyan's "
      "released code (deep-lab/DeepnetHessian)",
    ),
  ),
  draw=draw,
)
