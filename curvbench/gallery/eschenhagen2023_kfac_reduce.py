"""Eschenhagen, Immer, Turner, Schneider & Hennig (2023), "Kronecker-
Factored Approximate Curvature for Modern Neural Network Architectures"
(NeurIPS): where a layer's weights are shared over a sequence, K-FAC-reduce
(its factors from the activations and gradients summed over the shared
positions) costs less per curvature update than K-FAC-expand (every
position an example), and training with either makes about the same
progress.
"""

import numpy as np

from curvbench import stats
from curvbench.gallery import (
  FAILS,
  HOLDS,
  UNSETTLED,
  Claim,
  Entry,
  Evidence,
  Verdict,
  by,
  load_note,
  lower,
  mean_interval,
  rows,
)

NUM_STEPS = 100
# "About the same progress": the mean training loss within this fraction
# of K-FAC-expand's.
MARGIN = 0.05
# The approximations compared: K-FAC-expand's and K-FAC-reduce's.
COMPARED = ("kfac", "kfac_reduce")
PROBLEM = {
  "problem": "transformer",
  "curvature": ",".join(COMPARED),
  "curvature.mode": "fisher_gradients",
  "optimizer": "kfac",
  "seed": "0,1,2",
}


def cheaper_update(evidence: Evidence) -> Verdict:
  timing = rows(
    evidence,
    "timing",
    "the curvature update's timings",
    phase="curvature_update",
  )
  expand, reduce = by(
    {name: t.median_s.to_numpy() for name, t in timing.groupby("curvature")},
    COMPARED,
    "timings of K-FAC-expand and K-FAC-reduce",
  )
  verdict = lower(
    reduce,
    expand,
    "median seconds per curvature update",
    ("K-FAC-reduce", "K-FAC-expand"),
  )
  ratio = np.mean(reduce) / np.mean(expand)
  text = (
    f"{verdict.evidence} (reduce / expand {ratio:.2f}); "
    f"{int(timing.repeats.min())} timed repeats per run on "
    f"{timing.device_kind.iloc[0]}" + load_note(timing, "timed")
  )
  return Verdict(verdict.outcome, text)


def same_progress(evidence: Evidence) -> Verdict:
  train = rows(evidence, "training", "the training runs", measure="training")
  last = train.dropna(subset=["train_loss"]).sort_values("step")
  expand, reduce = by(
    {
      name: t.groupby("run_id").train_loss.last().to_numpy()
      for name, t in last.groupby("curvature")
    },
    COMPARED,
    "training runs of K-FAC-expand and K-FAC-reduce",
  )
  diff = stats.difference(reduce, expand)
  margin = MARGIN * abs(float(np.mean(expand)))
  text = (
    mean_interval(
      f"final training loss after {int(last.step.max())} steps, "
      f"K-FAC-reduce minus K-FAC-expand over {len(expand)} seeds:",
      diff,
    )
    + f"; the margin is +-{margin:.3g} ({MARGIN:.0%} of expand's)"
  )
  _, low, high = diff
  if not np.isfinite([low, high]).all():
    return Verdict(UNSETTLED, text)
  if -margin <= low and high <= margin:
    return Verdict(HOLDS, text)
  if high < -margin or low > margin:
    return Verdict(FAILS, text)
  return Verdict(UNSETTLED, text)


ENTRY = Entry(
  name="eschenhagen2023_kfac_reduce",
  title="K-FAC-reduce is cheaper than K-FAC-expand, and trains as well",
  paper="R. Eschenhagen, A. Immer, R. E. Turner, F. Schneider, P. Hennig. "
  "Kronecker-Factored Approximate Curvature for Modern Neural Network "
  "Architectures. NeurIPS 2023.",
  reproduces="the paper's comparison of the two flavours' cost per "
  "update and its training runs of a graph network and a vision "
  "transformer with each (section 4)",
  differs=(
    "problem=transformer: a two-block decoder of width 64 on modular "
    "addition (103,577 parameters), not the paper's graph network and "
    "vision transformer;",
    "one sampled Fisher column per example (fisher_gradients) for "
    f"both; {NUM_STEPS} steps of K-FAC with its default settings, three "
    "seeds, no tuning;",
    "timed on the machine that runs the gallery, each run's steady-"
    "state median, with the load recorded.",
  ),
  sweeps={
    "cpu": [
      dict(PROBLEM, measure="timing"),
      dict(
        PROBLEM,
        measure="training",
        **{
          "measure.training.num_steps": NUM_STEPS,
          "measure.training.eval_every": 10,
        },
      ),
    ],
    "tiny": [
      dict(
        PROBLEM,
        problem="transformer_small",
        seed="0",
        measure="timing",
        **{"measure.timing.repeats": 3},
      ),
      dict(
        PROBLEM,
        problem="transformer_small",
        seed="0",
        measure="training",
        **{"measure.training.num_steps": 4, "measure.training.eval_every": 2},
      ),
    ],
  },
  claims=(
    Claim(
      "K-FAC-reduce's curvature update takes less time than K-FAC-expand's.",
      "section 3 (the flavours' costs) and the timings of section 4",
      cheaper_update,
    ),
    Claim(
      f"Trained for the same number of steps with either flavour, "
      f"the training loss is the same within {MARGIN:.0%}.",
      "section 4 (the graph network's and the vision transformer's "
      "training curves)",
      same_progress,
    ),
  ),
)
