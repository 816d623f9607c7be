"""Morwani, Shapira, Vyas, Malach, Kakade & Janson (2025), "A New
Perspective on Shampoo's Preconditioner" (ICLR; arXiv:2406.17748):
Shampoo's factors squared (Shampoo², `L ⊗ R / tr L`) are one step of power
iteration towards the Frobenius-optimal Kronecker product of a layer's
curvature block, and in practice close to it, much closer than Shampoo
itself; the paper compares them by cosine similarity with the
Gauss-Newton matrix along training (Figure 1).
"""

import pandas as pd

from curvbench.gallery import (
  CHECK,
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
  compare,
  every,
  rows,
  setting_in,
)

NAMES = ("shampoo", "shampoo2", "optimal_kronecker")
CLOSE = Threshold(
  0.9,
  0.99,
  "ours: the paper says 'close' and plots the two without a stated tolerance",
)


def _per_layer(evidence: Evidence, metric: str) -> pd.DataFrame:
  """Per seed, step, batch and layer block: each approximation's `metric`
  against the matrix it was built from, side by side."""
  q = rows(
    evidence, "quality", f"the per-layer {metric}", metric=metric, level="layer"
  )
  keys = ["seed", "step", "sample", "reference", "block"]
  wide = q.pivot_table(index=keys, columns="curvature", values="value")
  if not set(NAMES) <= set(wide.columns):
    raise MissingRecords(f"per-layer {metric} of all three")
  return wide[list(NAMES)].dropna()


def _per_seed(wide: pd.DataFrame) -> pd.DataFrame:
  """The mean over a seed's layers, steps and batches: one sample per
  trained network."""
  return wide.groupby(level="seed").mean()


def close_to_optimal(evidence: Evidence) -> Verdict:
  """Per seed, Shampoo²'s cosine similarity with the GGN over the
  optimal Kronecker product's (mean over layers, steps and batches),
  near 1; Shampoo's ratio is the baseline."""
  seeds = _per_seed(_per_layer(evidence, "cosine_similarity"))
  shampoo2 = seeds.shampoo2 / seeds.optimal_kronecker
  shampoo = seeds.shampoo / seeds.optimal_kronecker
  closed = (seeds.shampoo2 - seeds.shampoo) / (
    seeds.optimal_kronecker - seeds.shampoo
  )
  return against(
    shampoo2.to_numpy(),
    CLOSE,
    above=True,
    what="Shampoo²'s cosine similarity with the GGN over the optimal "
    "Kronecker product's, mean over layers, steps and batches, per seed",
    baseline=f"Shampoo's: median {shampoo.median():.3g}; Shampoo² closes a "
    f"median {closed.median():.0%} of Shampoo's gap to the optimum",
  )


def nearer_than_shampoo(evidence: Evidence) -> Verdict:
  """Shampoo²'s cosine similarity with the GGN against Shampoo's, seed
  by seed, higher; the relative Frobenius errors beside it."""
  cosine = _per_seed(_per_layer(evidence, "cosine_similarity"))
  verdict = compare(
    cosine.shampoo2,
    cosine.shampoo,
    ("Shampoo²", "Shampoo"),
    "cosine similarity with the GGN (the paper's measure), mean over "
    "layers, steps and batches, per seed",
    lower=False,
    paired=True,
  )
  frobenius = _per_seed(_per_layer(evidence, "relative_frobenius"))
  return Verdict(
    verdict.outcome,
    f"{verdict.evidence}; relative Frobenius error (ours, not scale-free): "
    f"Shampoo² median {frobenius.shampoo2.median():.3g}, Shampoo "
    f"{frobenius.shampoo.median():.3g}",
  )


def optimal_is_nearest(evidence: Evidence) -> Verdict:
  """The construction: the optimal Kronecker product's relative
  Frobenius error at most Shampoo²'s and Shampoo's in every layer,
  seed, step and batch (to round-off)."""
  wide = _per_layer(evidence, "relative_frobenius")
  return every(
    (
      (
        f"seed {s}, step {t}, {b}: optimal {o:.4g} above "
        f"{'Shampoo²' if s2 < o else 'Shampoo'}",
        o <= min(s1, s2) * (1 + 1e-6) + 1e-12,
      )
      for (s, t, _, _, b), (s1, s2, o) in wide.iterrows()
    ),
    "the optimal Kronecker product at most as far as Shampoo² and Shampoo, "
    "per seed, step, batch and layer",
    wide.index.get_level_values("seed").nunique(),
  )


def _along_training(evidence: Evidence) -> tuple[bool, str]:
  steps = evidence.column("step")
  if not steps:
    raise MissingRecords("the measured steps")
  return max(steps) > 0, f"steps {', '.join(map(str, sorted(steps)))}"


def draw(evidence: Evidence, ax) -> None:
  """Each approximation's cosine similarity with the GGN per layer block,
  along training: the median over seeds and batches."""
  wide = _per_layer(evidence, "cosine_similarity").reset_index()
  for name, marker in zip(NAMES, ("o", "s", "^")):
    for block, b in wide.groupby("block"):
      by_step = b.groupby("step")[name].median()
      ax.plot(
        by_step.index,
        by_step,
        marker=marker,
        ms=3,
        lw=1,
        label=f"{name}, {block}",
      )
  ax.set(
    xlabel="Adam step",
    ylabel="cosine similarity with the exact GGN block",
    title="Per layer: higher is nearer (the paper's Figure 1 measure)",
  )


def spectra(seeds: str, steps: list[int], **more) -> dict:
  """The overrides of a sweep that compares Shampoo, Shampoo² and the
  optimal Kronecker product with the exact GGN on the MLP at `steps`
  of Adam training, for the `seeds`; `more` added last."""
  return {
    "problem": "mlp",
    "measure": "spectra",
    "curvature": ",".join(NAMES),
    "measure/spectra/trainer": "adam",
    "measure.spectra.references": ["ggn"],
    "measure.batch_size": 32,
    "measure.spectra.relative_dampings": [1e-3],
    "measure.spectra.heatmap_blocks": 0,
    "measure.spectra.per_block_type": False,
    "seed": seeds,
    "measure.spectra.steps": steps,
    **({"measure.training.num_steps": steps[-1]} if steps[-1] else {}),
    **more,
  }


ENTRY = Entry(
  name="morwani2025_shampoo2",
  title="Shampoo² is close to the optimal Kronecker product, Shampoo is not",
  paper="D. Morwani, I. Shapira, N. Vyas, E. Malach, S. Kakade, L. "
  "Janson. A New Perspective on Shampoo's Preconditioner. ICLR 2025 "
  "(arXiv:2406.17748).",
  reproduces="the paper's comparison of Shampoo², the optimal Kronecker "
  "approximation and Shampoo by cosine similarity with each layer's "
  "Gauss-Newton block along training (Figure 1)",
  differs=(
    "the MLP of problem=mlp (64-16-16-10) on the 8x8 digits, where the "
    "paper uses a binary MNIST subset, CIFAR-5M and ImageNet networks;",
    "every approximation built from the exact GGN's per-example factors "
    "of the batch it is compared on (ggn_exact: the labels' exact "
    "expectation, which the paper's sampled labels estimate), at "
    "initialisation and after 50 Adam steps, batches of 32;",
    "the optimal Kronecker product by power iteration (Van Loan & "
    "Pitsianis), stopped at its tolerance; the stored text held the "
    "abstract and Figure 1's caption only.",
  ),
  sizes={
    "cpu": Size(
      [spectra("0,1,2,3,4,5", [0, 50], **{"measure.spectra.samples": 2})],
      "six seeds, the layers at initialisation and after 50 Adam steps, "
      "two batches each (18 runs)",
    ),
    "accelerator": Size(
      [spectra("0,1,2,3,4,5", [0, 200, 1000], **{"problem.width": 64})],
      "the 64-64-64-10 MLP, six seeds, steps 0, 200 and 1,000; sized by "
      "arithmetic for a minute of a 10-minute window",
    ),
    "tiny": Size(
      [spectra("0", [0], **{"measure.spectra.samples": 2})],
      "one seed at initialisation",
    ),
  },
  claims=(
    Claim(
      FINDING,
      "Shampoo² is close to the optimal Kronecker-factored approximation "
      "of each layer's Gauss-Newton block, by cosine similarity, "
      "throughout training.",
      "Figure 1 (cosine similarity against training iterations) and "
      "section 3 (Shampoo² as one power-iteration step, Proposition 1)",
      close_to_optimal,
      (
        setting_in(
          "the Gauss-Newton matrix",
          "curvature.mode",
          ("ggn_exact", "fisher_exact"),
          "the Gauss-Newton with labels drawn from the model; with real "
          "labels and mini-batches Shampoo² is a much worse approximation "
          "(section 4, Figure 3)",
        ),
        Condition(
          "along training",
          "the similarity tracked along training (Figure 1)",
          _along_training,
        ),
      ),
      unverified="the networks and the values plotted: the stored text "
      "held the abstract and Figure 1's caption",
    ),
    Claim(
      FINDING,
      "Shampoo² is nearer each layer's Gauss-Newton block than Shampoo.",
      "Figure 1 (both against the optimal Kronecker product)",
      nearer_than_shampoo,
      (
        setting_in(
          "the Gauss-Newton matrix",
          "curvature.mode",
          ("ggn_exact", "fisher_exact"),
          "the Gauss-Newton with labels drawn from the model (section 4)",
        ),
      ),
      unverified="whether Figure 1 plots Shampoo itself",
    ),
    Claim(
      CHECK,
      "The optimal Kronecker product is at most as far as either, in every "
      "layer: it is the nearest Kronecker product.",
      "its definition (Van Loan & Pitsianis 1993): true by construction",
      optimal_is_nearest,
    ),
  ),
  draw=draw,
)
