"""The spectra measurement's part of the report: quality, statistics and
cost over every sample (seeds x batches, per step), the findings that
compare the approximations with the interval of their difference, and
what the tables cannot show (references that coincide, blocks every
method shares)."""

from __future__ import annotations

import numpy as np
import pandas as pd

from curvbench.approximations import CURVATURES
from curvbench.core import metrics, registration_report, stats
from curvbench.core.sections import Table, number, spread, wide
from curvbench.measurements.spectra.compute import SAME
from estimators import estimation_modes

# The relation a reader comparing with KFAC-JAX needs (README, porting).
EMPIRICAL_FISHER_SCALE = (
  "empirical_fisher, reference and estimates alike, is the mean of "
  "per-example gradient outer products: B (the batch size) times what "
  "KFAC-JAX's block-diagonal estimator, or ours at its default, holds."
)

# Why two exact matrices coincide, where the mathematics says.
WHY_SAME = {
  frozenset({"fisher", "ggn"}): (
    "for a loss that is the negative log-likelihood of an exponential "
    "family in its natural parameters, as every registered loss is "
    "(softmax and sigmoid cross-entropy, squared error), the Fisher is "
    "the GGN"
  ),
  frozenset({"ggn", "hessian"}): (
    "the Hessian is the GGN where the network's outputs are linear in "
    "its parameters (the network's second-derivative term vanishes)"
  ),
}

LEVELS = (
  (
    "network",
    "quality",
    "Approximation quality against each exact matrix, whole network",
  ),
  ("layer", "quality_blocks", "Approximation quality per layer block"),
  (
    "role",
    "quality_block_types",
    "Approximation quality per block "
    "type (the sub-matrices over every layer of that type)",
  ),
)

# The order the tables show the metrics in (`metrics.QUALITY`'s): the
# headline ones first.
METRICS = tuple(metrics.QUALITY)

# A sample: one seed's measurement of one draw of the data at one step.
SAMPLE = ["run_id", "sample"]
INDEX = [
  "problem",
  "data",
  "step",
  "reference",
  "level",
  "block",
  "label",
  "metric",
  "relative_damping",
]


def metric_order(names) -> list[str]:
  """`names` (metric names, dampings included) once each, headline ones
  first (`METRICS`), then by name."""
  rank = lambda m: (
    METRICS.index(m.split(" (")[0])
    if m.split(" (")[0] in METRICS
    else len(METRICS),
    m,
  )
  return sorted(set(names), key=rank)


def metric_name(metric: str, rho) -> str:
  """The metric as the tables name it, its relative damping included."""
  return metric if pd.isna(rho) else f"{metric} (rho={rho:g})"


def named(q: pd.DataFrame) -> pd.DataFrame:
  """Quality rows with each metric named by `metric_name`."""
  return q.assign(
    metric=[metric_name(m, r) for m, r in zip(q.metric, q.relative_damping)]
  )


def _summarise(
  df: pd.DataFrame, index: list[str], value: str = "value"
) -> pd.DataFrame:
  """Per `index`: median and quartiles, mean and its t interval of `value`
  over the samples (runs x draws), `n` samples and `seeds`."""
  out = []
  for key, group in df.groupby(index, dropna=False, sort=True):
    values = pd.to_numeric(group[value], errors="coerce").to_numpy(float)
    median, q25, q75 = stats.quartiles(values)
    mean, low, high = stats.interval(values[np.isfinite(values)])
    out.append(
      dict(
        zip(index, key),
        median=median,
        q25=q25,
        q75=q75,
        mean=mean,
        ci_low=low,
        ci_high=high,
        n=int(np.isfinite(values).sum()),
        seeds=group.run_id.nunique(),
      )
    )
  return pd.DataFrame(
    out,
    columns=[
      *index,
      "median",
      "q25",
      "q75",
      "mean",
      "ci_low",
      "ci_high",
      "n",
      "seeds",
    ],
  )


def quality(q: pd.DataFrame) -> pd.DataFrame:
  """Every quality metric over its samples (`_summarise`), its relative
  damping in its name; a probe estimate's (matrix-free method) `stderr`,
  the median over the samples of one sample's standard error, and
  `probes_needed`, the most any sample asked for (NaN for the others);
  layer and block-type rows say whether every method scores the same
  there (`same_in_every_method`)."""
  index = [c for c in INDEX if c != "relative_damping"]
  rows = named(q)
  out = _summarise(rows, index)
  # Records from before the probe errors lack their columns.
  groups = rows.assign(
    **{
      c: pd.to_numeric(rows.get(c, np.nan)) for c in ("stderr", "probes_needed")
    }
  ).groupby(index, dropna=False, sort=True)
  out["stderr"] = groups.stderr.median().to_numpy()
  out["probes_needed"] = groups.probes_needed.max().to_numpy()
  shared = _shared(q)
  out["same_in_every_method"] = [
    (p, lvl, b) in shared
    for p, lvl, b in zip(out.problem, out.level, out.block)
  ]
  return out


def quality_table(
  name: str, title: str, part: pd.DataFrame, detail: bool
) -> Table:
  """A quality table: CSV long, the page a row per method (and block) and
  a column per metric, each cell the median [quartiles] over samples."""
  index = ["problem", "reference", "step", "label"]
  if part.level.iloc[0] != "network":
    index.insert(3, "block")
  if part.step.nunique() == 1:
    index.remove("step")
  if "why_alike" in part and part.why_alike.fillna("").astype(bool).any():
    index.append("why_alike")
  rank = {m: i for i, m in enumerate(metric_order(part.metric))}
  part = part.iloc[np.argsort([rank[m] for m in part.metric], kind="stable")]
  stderr = part.get("stderr", pd.Series(np.nan, part.index))
  errors = ""
  if np.isfinite(stderr).any():
    # A probe estimate's cell ends in its standard error; text as the
    # centre and no ends make `wide` show the cell as it is.
    part = part.assign(
      _cell=[
        spread(c, lo, hi) + (f" ±{number(se, 2)}" if np.isfinite(se) else "")
        for c, lo, hi, se in zip(part["median"], part.q25, part.q75, stderr)
      ],
      _none=np.nan,
    )
    errors = (
      "; ± a matrix-free probe estimate's standard error (median "
      "over the samples)"
    )
  view = (
    wide(part, index, "metric", centre="_cell", low="_none", high="_none")
    if errors
    else wide(part, index, "metric")
  )
  return Table(
    name,
    f"{title}: median [quartiles] over the samples "
    f"(seeds x data draws; n per row){errors}",
    part.drop(columns=["level", "_cell", "_none"], errors="ignore"),
    view=view,
    detail=detail,
  )


def _shared(q: pd.DataFrame) -> set[tuple]:
  """`(problem, level, block)` of the layer blocks and block types whose
  every score is the same in every method compared (two or more): they
  all approximate it with the same block."""
  parts = q[q.level != "network"]
  if parts.empty:
    return set()
  where = [
    "problem",
    "data",
    "step",
    "reference",
    "level",
    "block",
    "metric",
    "relative_damping",
    "seed",
    "sample",
  ]
  where = [c for c in where if c in parts]
  groups = parts.groupby(where, dropna=False).value
  values = groups.agg(["min", "max", "size"]).join(
    parts.groupby(where, dropna=False).label.nunique().rename("methods")
  )
  scale = np.maximum(values["max"].abs(), values["min"].abs())
  agree = (values["max"] - values["min"] <= 1e-9 * scale) | (scale == 0)
  values = values.assign(agree=agree & (values.methods > 1))
  per_block = values.groupby(level=["problem", "level", "block"]).agree.all()
  return set(per_block[per_block].index)


def with_reasons(q: pd.DataFrame, alike: dict[tuple, str]) -> pd.DataFrame:
  """`quality(...)` with a column `why_alike`: on the layer rows every
  method scores alike, the reason where the registrations give one (the
  same block class under every approximation, `alike` by problem and
  block, from `registration_report.same_blocks`)."""
  return q.assign(
    why_alike=[
      registration_report.reason(alike[p, b])
      if same and lvl == "layer" and (p, b) in alike
      else ""
      for p, lvl, b, same in zip(
        q.problem, q.level, q.block, q.same_in_every_method
      )
    ]
  )


def shared_blocks(q: pd.DataFrame, alike: dict | None = None) -> list[str]:
  """A note per problem naming the blocks every method scores alike, and
  the block they all get where the registrations say (`alike`, as
  `with_reasons` takes it)."""
  notes = []
  shared = sorted(_shared(q))
  alike = alike or {}
  for problem in sorted({p for p, _, _ in shared}):
    layers = [b for p, lvl, b in shared if p == problem and lvl == "layer"]
    classes = sorted(
      {alike[problem, b] for b in layers if (problem, b) in alike}
    )
    if classes and all((problem, b) in alike for b in layers):
      notes.append(
        f"{problem}: layer blocks {', '.join(layers)} score the same in "
        "every approximation compared because each gets the same block "
        f"({', '.join(classes)}) under all of them: the same matrix, so "
        "these rows cannot tell the methods apart (column why_alike; see "
        "Registration)."
      )
      layers = []
    types = [b for p, lvl, b in shared if p == problem and lvl == "role"]
    if not layers and not types:
      continue
    named = ", ".join(
      filter(
        None,
        (
          f"layer blocks {', '.join(layers)}" if layers else "",
          f"block types {', '.join(types)}" if types else "",
        ),
      )
    )
    notes.append(
      f"{problem}: {named} score the same in every approximation "
      "compared: all of them give these layers the same block, so these "
      "rows cannot tell the methods apart (column same_in_every_method)."
    )
  return notes


def same_references(pairs: pd.DataFrame) -> list[str]:
  """A note per pair of exact references that coincide in every run."""
  notes = []
  for (problem, matrix, reference), group in pairs.groupby(
    ["problem", "matrix", "reference"]
  ):
    largest = group.relative_frobenius.max()
    if largest > SAME:
      continue
    why = WHY_SAME.get(
      frozenset({matrix, reference}), "they coincide on these runs"
    )
    distance = "0" if largest == 0 else f"at most {largest:.1g}"
    notes.append(
      f"{problem}: the exact {matrix} equals the exact {reference} here "
      f"(relative Frobenius distance {distance} in all {len(group)} "
      f"samples): {why}. Quality against {matrix} is the quality against "
      f"{reference}, so it is given once."
    )
  return notes


def findings(q: pd.DataFrame) -> list[str]:
  """Per problem and reference, at the first measured step: the method
  closest to the exact matrix in relative Frobenius error over the whole
  network, and the interval of its difference to the runner-up, paired
  by seed and data draw where both were measured alike."""
  out = []
  network = q[(q.level == "network") & (q.metric == "relative_frobenius")]
  for (problem, reference), part in network.groupby(["problem", "reference"]):
    part = part[part.step == part.step.min()]
    values = {
      label: g.set_index(["seed", "sample", "data"]).value
      for label, g in part.groupby("label")
    }
    # Ranked by the median, the statistic quoted and the one the
    # comparison's interval is about.
    ranked = sorted(values, key=lambda m: values[m].median())
    best = ranked[0]
    n = len(values[best])
    quoted = spread(*stats.quartiles(values[best]))
    where = f"{problem} vs exact {reference}" + (
      f" at step {part.step.min()}" if part.step.max() else ""
    )
    if len(ranked) == 1:
      out.append(
        f"{where}: {best} has relative Frobenius error {quoted} "
        f"(median [quartiles] of {n} samples)."
      )
      continue
    runner = ranked[1]
    both = values[best].index.intersection(values[runner].index)
    diff = (
      stats.paired_difference(values[best][both], values[runner][both])
      if len(both) == max(n, len(values[runner]))
      else stats.difference(values[best], values[runner])
    )
    other = spread(*stats.quartiles(values[runner]))
    verdict = {
      "tied": f"not told apart from {runner}'s {other}",
      "lower": f"lower than {runner}'s {other}",
      "higher": f"yet higher than {runner}'s {other} pair by pair",
      "unknown": f"too few samples to tell it from {runner}'s {other}",
    }[stats.ordering(diff)]
    out.append(
      f"{where}: {best} comes closest, relative Frobenius error "
      f"{quoted} (median [quartiles], n={n}), {verdict} "
      f"(difference {diff.words()})."
    )
  return out


# A claim's cell: one comparison, over that cell's paired samples.
CELL = ["problem", "mode", "reference", "level", "block", "step"]
VERDICTS = {
  "lower": "holds",
  "higher": "does not hold",
  "tied": "not settled",
  "unknown": "too few samples to tell",
}


def claims(q: pd.DataFrame) -> tuple[list[str], Table | None]:
  """Every published claim (`approximations.Nearer`) that an approximation
  of these runs declares about another one measured alike: per problem,
  estimation mode, reference, block type (and whole network) and step,
  the paired interval of the difference of their relative Frobenius
  errors, a verdict (holds, does not hold, not settled where the interval
  holds 0, too few samples to tell below 6 pairs), and each one's gap over
  the claim's floor; a line per claim counting the verdicts. Cells against a reference other than the matrix
  the estimation mode estimates, and cells where both score alike (the
  same block for both), are left out: they cannot bear on the claim."""
  if "curvature" not in q:  # records that do not say which approximation
    return [], None
  frob = _claimed_errors(q)
  names = set(frob.curvature.dropna())
  rows, lines = [], []
  for name in sorted(names & set(CURVATURES.names())):
    for claim in CURVATURES.get(name).claims:
      if claim.than not in names:
        continue
      judged = [
        _claim_cell(cell, name, claim)
        for _, cell in frob.groupby(CELL, dropna=False)
      ]
      cells = [c for c in judged if c is not None]
      if not cells:
        continue
      for c in cells:
        c.update(claim=f"{name} nearer than {claim.than}", source=claim.source)
      rows += cells
      lines.append(_claim_line(name, claim, cells))
  if not rows:
    return [], None
  return lines, _claims_table(pd.DataFrame(rows))


def _claimed_errors(q: pd.DataFrame) -> pd.DataFrame:
  """The relative Frobenius errors a claim is about: of the whole network
  and the block types, against the matrix each approximation's estimation
  mode estimates (a cell against another reference does not bear on
  it)."""
  frob = q[(q.metric == "relative_frobenius") & (q.level != "layer")]
  estimated = frob["mode"].map(  # a mode named after its matrix: itself
    lambda m: estimation_modes.matrix_type(m)
    if m in estimation_modes.ESTIMATION_MODES
    else m
  )
  return frob[estimated.isna() | (estimated == frob.reference)]


def _claim_line(name: str, claim, cells: list[dict]) -> str:
  """The line of a claim of `name`'s: its verdicts counted over `cells`,
  and the gaps over the claim's floor where it has one."""
  counts = pd.Series([c["verdict"] for c in cells]).value_counts()
  tally = ", ".join(
    f"{verdict} in {counts.get(verdict, 0)}" for verdict in VERDICTS.values()
  )
  floor = ""
  if claim.floor is not None and "gap_median" in cells[0]:
    gaps = pd.DataFrame(cells)
    floor = (
      f" Over {claim.floor}, {name}'s gap in relative Frobenius "
      f"error has median {number(gaps.gap_median.median())} over "
      f"the cells, {claim.than}'s "
      f"{number(gaps.than_gap_median.median())}."
    )
  return (
    f"Claim ({claim.source}): {name} is nearer the exact matrix than "
    f"{claim.than} (relative Frobenius error, per block type and whole "
    f"network). On these runs it {tally} of {len(cells)} (problem, "
    "reference, block type, step) cells, each the median of the "
    "paired differences with its exact 95 % sign-test interval (table "
    "claims; too few samples to tell below 6 pairs)." + floor
  )


def _claims_table(data: pd.DataFrame) -> Table:
  """The `claims` table of every judged cell, its intervals shown as
  median [low, high]."""
  view = data.assign(
    difference=[
      spread(m, lo, hi)
      for m, lo, hi in zip(
        data.diff_median, data.diff_ci_low, data.diff_ci_high
      )
    ]
  )
  shown = [
    "claim",
    "problem",
    "reference",
    "block",
    "step",
    "difference",
    "verdict",
    "n",
  ]
  for gap in ("gap", "than_gap"):
    if f"{gap}_median" in data:
      view[gap] = [
        spread(m, lo, hi)
        for m, lo, hi in zip(
          data[f"{gap}_median"], data[f"{gap}_ci_low"], data[f"{gap}_ci_high"]
        )
      ]
      shown.insert(-2, gap)
  return Table(
    "claims",
    "Published claims checked: the difference of relative "
    "Frobenius errors (claimed nearer minus the other; median [exact 95 % "
    "sign-test interval] over paired samples) and each one's gap over the "
    "claim's floor",
    data,
    view=view[shown],
  )


def _claim_cell(cell: pd.DataFrame, name: str, claim) -> dict | None:
  """One cell of a claim (see `claims`); None where it cannot bear on it."""
  values = {
    n: g.set_index(["seed", "sample", "data"]).value
    for n, g in cell.groupby("curvature")
  }
  if name not in values or claim.than not in values:
    return None
  both = values[name].index.intersection(values[claim.than].index)
  own, other = values[name][both], values[claim.than][both]
  if len(both) == 0 or np.allclose(own, other, rtol=1e-9, atol=0):
    return None
  diff = stats.paired_difference(own, other)
  row = dict(
    zip(CELL, cell[CELL].iloc[0]),
    n=len(both),
    diff_median=diff[0],
    diff_ci_low=diff[1],
    diff_ci_high=diff[2],
    verdict=VERDICTS[stats.ordering(diff)],
  )
  floor = values.get(claim.floor)
  if floor is not None and both.isin(floor.index).all():
    for key, series in (("gap", own), ("than_gap", other)):
      row.update(
        zip(
          (f"{key}_median", f"{key}_ci_low", f"{key}_ci_high"),
          stats.paired_difference(series, floor[both]),
        )
      )
  return row


def statistics_table(statistics: pd.DataFrame) -> Table:
  """Spectrum statistics of each exact matrix and approximation over the
  samples; a condition number known only as a bound in some samples
  (`condition_number_at_least`) counts with the others, and `bounds` says
  in how many."""
  index = ["problem", "label", "data", "step", "source", "matrix"]
  bound = statistics.statistic == "condition_number_at_least"
  rows = statistics.assign(
    statistic=statistics.statistic.where(~bound, "condition_number"),
    bound=bound,
  )
  data = _summarise(rows, [*index, "statistic"])
  data["bounds"] = (
    rows.groupby([*index, "statistic"], dropna=False, sort=True)
    .bound.sum()
    .to_numpy()
  )
  view = wide(
    data,
    [
      c
      for c in index
      if data[c].nunique() > 1 or c in ("problem", "source", "matrix")
    ],
    "statistic",
  )
  return Table(
    "statistics",
    "Spectrum statistics: median [quartiles] over "
    "the samples (a condition number whose spectrum runs into the "
    "relative floor is only a lower bound: bounds counts those "
    "samples)",
    data,
    view=view,
    detail=True,
  )


def cost_rows(cost: pd.DataFrame) -> pd.DataFrame:
  """The cost table long: one row per run, sample, phase and cost
  (`compile_s`, `run_s`, `program_mib`), a sample's repeated phases
  summed."""
  cost = cost.assign(
    program_mib=cost.program_bytes / 2**20, sample=cost.get("sample", 0)
  )
  index = ["problem", "label", "data", "step", "phase", "run_id", "sample"]
  summed = (
    cost.groupby(index, dropna=False)
    .agg(
      compile_s=("compile_s", "sum"),
      run_s=("run_s", "sum"),
      program_mib=("program_mib", "max"),
    )
    .reset_index()
  )
  return summed.melt(index, var_name="cost", value_name="value")


def cost_table(cost: pd.DataFrame) -> Table:
  """The report's table of what each measured phase cost: seconds to
  compile and to run, and memory, summarised over the samples."""
  data = _summarise(
    cost_rows(cost), ["problem", "label", "data", "step", "phase", "cost"]
  )
  return Table(
    "cost",
    "Cost of each measured phase: seconds (compile "
    "apart) and MiB, median [quartiles] over the samples",
    data,
    view=wide(data, ["problem", "label", "phase"], "cost"),
    detail=True,
  )
