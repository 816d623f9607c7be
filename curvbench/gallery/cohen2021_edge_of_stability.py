"""Cohen, Kaur, Li, Kolter & Talwalkar (2021), "Gradient Descent on
Neural Networks Typically Occurs at the Edge of Stability" (ICLR): under
full-batch gradient descent with step size η, the sharpness (the top
eigenvalue of the training loss's Hessian) rises during training
(progressive sharpening) until it reaches about 2/η, the largest a
quadratic model allows GD to be stable at, and it does not settle above.
"""

import numpy as np
import pandas as pd

from curvbench import plots
from curvbench.gallery import (
  Claim,
  Entry,
  Evidence,
  MissingRecords,
  Verdict,
  all_hold,
  rows,
)

RATE = "config:measure.spectra.trainer.learning_rate"
STEPS = [0, 25, 50, 100, 200, 350, 500]
# "About 2/η": the sharpness's largest value at least this share of it.
REACHED = 0.9
# "Not above": its median over the second half of training at most this
# multiple of 2/η.
ABOVE = 1.1


def sharpness(evidence: Evidence) -> pd.DataFrame:
  """Per run: its step size and, at each measured step, the Hessian's
  top eigenvalue over the training split."""
  top = rows(
    evidence,
    "statistics",
    "the Hessian's top eigenvalues",
    source="exact",
    matrix="hessian",
    statistic="max_eigenvalue",
  )
  if RATE not in evidence.done:
    raise MissingRecords("the runs' step sizes")
  rate = evidence.done.set_index("run_id")[RATE]
  return top.assign(eta=top.run_id.map(rate))[
    ["run_id", "eta", "seed", "step", "value"]
  ].sort_values("step")


def _per_run(evidence: Evidence):
  for (eta, seed), run in sharpness(evidence).groupby(["eta", "seed"]):
    yield eta, seed, run.step.to_numpy(), run.value.to_numpy()


def sharpens(evidence: Evidence) -> Verdict:
  checks = [
    (
      f"eta {eta:g}, seed {seed}: from {s[0]:.3g} to at most {s.max():.3g}",
      s.max() > 1.1 * s[0],
    )
    for eta, seed, _, s in _per_run(evidence)
  ]
  return all_hold(
    checks,
    "the sharpness rises by more than 10 % above its "
    "initial value, per step size and seed",
  )


def reaches_two_over_eta(evidence: Evidence) -> Verdict:
  checks = [
    (
      f"eta {eta:g}, seed {seed}: largest {s.max():.3g} = "
      f"{s.max() * eta / 2:.2f} x 2/eta",
      s.max() >= REACHED * 2 / eta,
    )
    for eta, seed, _, s in _per_run(evidence)
  ]
  return all_hold(
    checks,
    f"the largest sharpness at least {REACHED:g} x "
    "2/eta, per step size and seed",
    listed=True,
  )


def not_above(evidence: Evidence) -> Verdict:
  checks = []
  for eta, seed, steps, s in _per_run(evidence):
    late = np.median(s[steps >= steps.max() / 2])
    checks.append(
      (
        f"eta {eta:g}, seed {seed}: {late * eta / 2:.2f} x 2/eta",
        late <= ABOVE * 2 / eta,
      )
    )
  return all_hold(
    checks,
    "the median sharpness over the second half of "
    f"training at most {ABOVE:g} x 2/eta, per step size and "
    "seed",
    listed=True,
  )


def draw(evidence: Evidence, ax) -> None:
  """Sharpness against step, a colour per step size (a line per seed),
  each with its 2/η dashed."""
  colours = dict(
    zip(
      sorted({eta for eta, *_ in _per_run(evidence)}),
      plots.colours([f"{i}" for i in range(9)]).values(),
    )
  )
  for eta, seed, steps, s in _per_run(evidence):
    ax.plot(
      steps,
      s,
      color=colours[eta],
      marker="o",
      ms=3,
      label=f"eta {eta:g}" if seed == 0 else None,
    )
  for eta, colour in colours.items():
    ax.axhline(2 / eta, color=colour, ls="--", lw=1)
  ax.set(
    xlabel="step (full-batch gradient descent)",
    ylabel="sharpness (top Hessian eigenvalue)",
    title="Sharpness along training; dashed: 2/eta",
  )


GD = {
  "problem": "mlp",
  "problem.batch_size": 1500,
  "measure": "spectra",
  "curvature": "diagonal",
  "measure/spectra/trainer": "sgd",
  "measure.spectra.trainer.momentum": 0,
  "measure.spectra.references": ["hessian"],
  "measure.spectra.samples": 1,
  "measure.spectra.per_block": False,
  "measure.spectra.per_block_type": False,
  "measure.spectra.heatmap_blocks": 0,
}

ENTRY = Entry(
  name="cohen2021_edge_of_stability",
  title="Full-batch gradient descent sharpens up to 2/η, and no further",
  paper="J. M. Cohen, S. Kaur, Y. Li, J. Z. Kolter, A. Talwalkar. "
  "Gradient Descent on Neural Networks Typically Occurs at the Edge of "
  "Stability. ICLR 2021.",
  reproduces="the paper's sharpness-along-training curves of full-batch "
  "gradient descent at several step sizes (section 3), with "
  "cross-entropy loss",
  differs=(
    "the MLP of problem=mlp (64-16-16-10, tanh) on the 8x8 digits, the "
    "whole training split (1,500 examples) as one batch, with "
    "cross-entropy, where the paper trains on a 5,000-example CIFAR-10 "
    "subset, mostly with squared loss (under cross-entropy it reports "
    "the sharpness falling once the loss is small);",
    f"{STEPS[-1]} steps at step sizes 0.2, 0.35 and 0.5, two seeds; "
    f"the sharpness measured exactly (dense Hessian) at steps {STEPS}, "
    "where the paper measures it every few steps by Lanczos;",
    f"'about 2/η' read as reaching {REACHED:g} x 2/η and 'not above' as "
    f"a late-training median at most {ABOVE:g} x 2/η: thresholds of "
    "ours.",
  ),
  sweeps={
    "cpu": [
      dict(
        GD,
        seed="0,1",
        **{
          "measure.spectra.trainer.learning_rate": "0.2,0.35,0.5",
          "measure.spectra.steps": STEPS,
          "measure.training.num_steps": STEPS[-1],
        },
      )
    ],
    "tiny": [
      dict(
        GD,
        seed="0",
        **{
          "problem.width": 8,
          "measure.spectra.trainer.learning_rate": 0.5,
          "measure.spectra.steps": [0, 5, 10],
          "measure.training.num_steps": 10,
        },
      )
    ],
  },
  claims=(
    Claim(
      "The sharpness rises during training (progressive sharpening).",
      "section 3 (sharpness along training)",
      sharpens,
    ),
    Claim(
      f"It rises to about 2/η (at least {REACHED:g} x 2/η).",
      "section 3 (the edge of stability)",
      reaches_two_over_eta,
    ),
    Claim(
      f"It does not settle above 2/η (late-training median at most "
      f"{ABOVE:g} x 2/η).",
      "section 3 (the sharpness hovers at 2/η)",
      not_above,
    ),
  ),
  draw=draw,
)
