"""Ghorbani, Krishnan & Xiao (2019), "An Investigation into Neural Net
Optimization via Hessian Eigenvalue Density" (ICML; arXiv:1901.10159):
without batch normalisation, large eigenvalues isolated from the bulk of
the training loss's Hessian appear early in training, and the gradient
concentrates in their eigenspace; with batch normalisation (in training
mode) both effects are almost absent.
"""

import numpy as np

from curvbench.gallery import (
  CHANCE_SLACK,
  FINDING,
  INCONCLUSIVE,
  TOO_FEW,
  Claim,
  Entry,
  Evidence,
  MissingRecords,
  Size,
  Verdict,
  at_chance,
  by,
  compare,
  rows,
  setting_in,
  trained,
  trained_eigenvalues,
)
from curvbench.measurements.spectra.compute import GRADIENT_SHARE

CLASSES = 10  # digits
# Where the bulk starts, as an eigenvalue's rank: just past the C
# class-driven outliers (Papyan 2020) to well inside the bulk. The paper
# reads the outliers off the density and names no edge: the verdict is
# given over this range.
EDGES = (CLASSES + 1, 2 * CLASSES + 1, 4 * CLASSES + 1)
NORMS = ("batch", "none")


def _by_norm(evidence: Evidence, found: dict) -> dict[str, list]:
  """`found` (per run) split by the runs' normalisation, the runs that did
  not train left out: the claims are about trained networks."""
  runs = evidence.done.set_index("run_id")
  if "config:problem.norm" not in runs:
    raise MissingRecords("the runs' normalisation")
  untrained = at_chance(evidence, CLASSES)
  out: dict[str, list] = {}
  for run_id, value in found.items():
    if run_id not in untrained:
      out.setdefault(runs.loc[run_id, "config:problem.norm"], []).append(value)
  return out


def _untrained_words(evidence: Evidence) -> str:
  """What was left out for not training, if anything."""
  untrained = at_chance(evidence, CLASSES)
  if not untrained:
    return ""
  norms = evidence.done.set_index("run_id")["config:problem.norm"]
  left = ", ".join(
    f"{norms[r]} (training error {e:.2f})" for r, e in untrained.items()
  )
  return (
    f"; left out, not trained (error within {CHANCE_SLACK:g} of chance, "
    f"{1 - 1 / CLASSES:.2f}): {left}"
  )


def _nth(k: int) -> str:
  """11th, 21st, 41st."""
  end = (
    "th"
    if 10 <= k % 100 <= 20
    else {1: "st", 2: "nd", 3: "rd"}.get(k % 10, "th")
  )
  return f"{k}{end}"


def isolation(values: np.ndarray, edge: int) -> float:
  """The top eigenvalue over the `edge`-th (the bulk's edge); infinite
  where the edge is at or below zero (nothing of the bulk above zero)."""
  if values[edge - 1] <= 0:
    return np.inf
  return float(values[0] / values[edge - 1])


def outliers_isolated(evidence: Evidence) -> Verdict:
  """The top eigenvalue over the bulk's edge (log10), trained Hessians
  with batch norm against those without, below; judged at each of
  the ranks `EDGES` taken as the edge, inconclusive where they
  disagree."""
  tops = _by_norm(evidence, trained_eigenvalues(evidence, "hessian"))
  batch, none = by(tops, NORMS, "trained Hessians with and without batch norm")
  verdicts = {
    edge: compare(
      [np.log10(isolation(v, edge)) for v in batch],
      [np.log10(isolation(v, edge)) for v in none],
      ("batch norm", "no normalisation"),
      f"log10 of the top eigenvalue over the {_nth(edge)}",
    )
    for edge in EDGES
  }
  outcomes = {v.outcome for v in verdicts.values()}
  outcome = (
    outcomes.pop()
    if len(outcomes) == 1
    else TOO_FEW
    if TOO_FEW in outcomes
    else INCONCLUSIVE
  )
  flips = (
    ""
    if outcome != INCONCLUSIVE
    else "; the verdict depends on where the bulk starts: "
    + ", ".join(f"{v.outcome} at the {_nth(e)}" for e, v in verdicts.items())
  )
  return Verdict(
    outcome,
    "; ".join(v.evidence for v in verdicts.values())
    + f" (the bulk's edge taken at ranks {', '.join(map(str, EDGES))}, "
    "ours: the paper reads the outliers off the density)"
    + flips
    + _untrained_words(evidence),
  )


def gradient_in_outliers(evidence: Evidence) -> Verdict:
  """The share of the gradient's squared norm in the trained Hessian's
  top eigenspace, with batch norm against without, smaller."""
  what = "the gradient's share in the trained Hessian's top eigenspace"
  share = rows(
    evidence,
    "statistics",
    what,
    source="exact",
    matrix="hessian",
    statistic=GRADIENT_SHARE,
  )
  last = trained(evidence, share, what)
  per_run = dict(zip(last.run_id, last.value))
  batch, none = by(
    _by_norm(evidence, per_run),
    NORMS,
    "the gradient's share with and without batch norm",
  )
  verdict = compare(
    batch,
    none,
    ("batch norm", "no normalisation"),
    f"the share of the gradient's squared norm in the top {CLASSES} "
    "eigenvectors",
  )
  return Verdict(verdict.outcome, verdict.evidence + _untrained_words(evidence))


def draw(evidence: Evidence, ax) -> None:
  """The top 50 Hessian eigenvalues after training, with and without batch
  norm, one line per seed, the range of bulk edges shaded."""
  for norm, style in zip(NORMS, ("-", "--")):
    for values in _by_norm(
      evidence, trained_eigenvalues(evidence, "hessian")
    ).get(norm, []):
      top = values[:50]
      ax.semilogy(
        np.arange(1, top.size + 1),
        np.clip(top, 1e-8, None),
        ls=style,
        marker="o",
        ms=2,
        color="tab:blue" if norm == "batch" else "tab:red",
      )
    ax.plot(
      [],
      [],
      ls=style,
      color="tab:blue" if norm == "batch" else "tab:red",
      label="batch norm" if norm == "batch" else "no normalisation",
    )
  ax.axvspan(
    EDGES[0], EDGES[-1], color="0.9", label="the bulk's edge, range judged"
  )
  ax.set(
    xlabel="rank",
    ylabel="eigenvalue of the training-set Hessian",
    title="Trained Hessian, top 50: a steeper drop is a more isolated top",
  )


def spectra(seeds: str, steps: int, **more) -> dict:
  """The overrides of a sweep that trains the small ResNet with and
  without batch norm by SGD for `steps` steps, for the `seeds`, and
  measures the training set's Hessian at the end; `more` added
  last."""
  return {
    "problem": "resnet_small",
    "problem.norm": ",".join(NORMS),
    "problem.widths": [2, 2, 4],
    "problem.data.num_train": 256,
    "measure": "spectra",
    # The Hessian is what is measured; the cheapest approximation beside it.
    "curvature": "identity",
    "curvature.mode": "fisher_empirical",
    "measure/spectra/trainer": "sgd",
    # The same for both; at 0.1 two of four runs without normalisation
    # collapsed to one class (training error 0.88) on the CPU size.
    "measure.spectra.trainer.learning_rate": 0.05,
    "measure.spectra.trainer.momentum": 0.9,
    "measure.spectra.references": ["hessian"],
    "measure.spectra.data": "train",
    "measure.spectra.top_k": CLASSES,
    "measure.spectra.steps": [steps],
    "measure.training.num_steps": steps,
    "measure.spectra.per_block": False,
    "measure.spectra.per_block_type": False,
    "measure.spectra.heatmap_blocks": 0,
    "seed": seeds,
    **more,
  }


ENTRY = Entry(
  name="ghorbani2019_batch_norm",
  title="Batch norm removes the Hessian's isolated outliers and the "
  "gradient's concentration in them",
  paper="B. Ghorbani, S. Krishnan, Y. Xiao. An Investigation into Neural "
  "Net Optimization via Hessian Eigenvalue Density. ICML 2019 "
  "(arXiv:1901.10159).",
  reproduces="the paper's Hessian spectral densities of networks trained "
  "with and without batch normalisation, and the gradient's share in the "
  "outliers' eigenspace",
  differs=(
    "the ResNet-8 of problem=resnet_small at widths 2, 2, 4 (488 "
    "parameters with batch norm) on 256 of the 8x8 digits, trained by SGD "
    "with momentum 0.9 (step 0.05, batches of 64), where the paper trains "
    "ResNet-32 on CIFAR-10 (and ImageNet models);",
    "the exact Hessian of the whole training split (256 examples in "
    "batches of 64, batch norm in training mode on each, as the authors' "
    "code does), by eigendecomposition, where the paper estimates the "
    "density by stochastic Lanczos quadrature; their L2 term (2e-4) is "
    "not in our loss;",
    "the stored text held the abstract and introduction only: the section "
    "and figure numbers, and the paper's own numbers, could not be read.",
  ),
  sizes={
    "cpu": Size(
      # Five seeds: a run without normalisation can still collapse to one
      # class (two of five did at step 0.05); the trained ones are compared.
      [spectra("0,1,2,3,4", 300)],
      "the 488-parameter ResNet-8 with and without batch norm, 300 SGD "
      "steps (75 epochs), five seeds each (10 runs)",
    ),
    "accelerator": Size(
      [
        spectra(
          "0,1,2,3",
          1000,
          **{"problem.widths": [4, 4, 8], "problem.data.num_train": 1500},
        )
      ],
      "the 1,710-parameter ResNet-8 with and without batch norm on the "
      "1,500 training digits, 1,000 SGD steps, four seeds each; sized by "
      "arithmetic for a minute of a 10-minute window",
    ),
    "tiny": Size(
      [
        spectra(
          "0",
          2,
          **{
            "problem.widths": [2, 2, 2],
            "problem.data.num_train": 64,
            "problem.batch_size": 16,
          },
        )
      ],
      "a ResNet-8 of widths 2 on 64 digits, one seed",
    ),
  },
  claims=(
    Claim(
      FINDING,
      "Without batch normalisation the trained network's Hessian has large "
      "eigenvalues isolated from the bulk of its spectrum; with batch "
      "normalisation (training mode) they are almost gone.",
      "abstract; the spectral densities with and without batch norm "
      "(section 4)",
      outliers_isolated,
      (
        setting_in(
          "a residual network",
          "problem.name",
          ("resnet_small", "resnet", "resnet20_cifar10", "resnet18"),
          "ResNet-32 on CIFAR-10, and ImageNet networks",
        ),
        setting_in(
          "the whole training set",
          "measure.spectra.data",
          ("train",),
          "the Hessian of the loss over the whole training set",
        ),
      ),
      unverified="the section and figure numbers",
    ),
    Claim(
      FINDING,
      "Without batch normalisation the gradient concentrates in the "
      "eigenspace of the isolated eigenvalues; with it, it does not.",
      "abstract (the gradient's energy in the outlier eigenspace)",
      gradient_in_outliers,
      (
        setting_in(
          "the whole training set",
          "measure.spectra.data",
          ("train",),
          "the gradient and the Hessian over the whole training set",
        ),
      ),
      unverified="the section and figure numbers, and how many top "
      "eigenvectors the paper's share uses (here C = 10)",
    ),
  ),
  draw=draw,
)
