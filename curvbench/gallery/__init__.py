"""The gallery: published findings about curvature, each reproduced by a
preset and judged by checks over its runs' records.

An entry is one module of this package holding one `Entry`: the paper, the
figures it reproduces, what differs from the paper, the sweep that
reproduces it at each size, its claims and, optionally, its own figure.

A `Claim` is of one of three kinds, counted apart:

- a *finding*: the paper's own claim, restated with its section and figure
  and the conditions it depends on (model, loss, data, optimizer, training
  length, matrix, batch or full data). Findings make the tally.
- an *extension*: a claim of ours in the paper's setting (e.g. K-FAC against
  Adam in the K-FAC paper's protocol).
- a *check*: true by construction (an optimality the method is built on);
  a correctness test of our code, shown as such and never in the tally.

A finding or an extension is *reproduced*, *contradicted*, *not reproduced
at this scale* or *inconclusive*; a check *passes* or *fails*. A claim gives
no verdict (*too few samples to tell*) where its samples are too few for an
exact interval at 95 % (`curvbench.core.stats.enough`), and none (*not judged*)
where the records lack what it reads. *Contradicted* is only possible where
the runs meet every condition the claim declares: `Claim.judge` turns any
other contradiction into *not reproduced at this scale*, naming each
condition that differs. A threshold of ours never decides alone: a claim
without the paper's own threshold states the range it was judged over and
where the verdict flips (`Threshold`, `against`).

`store` puts every entry in Hydra's ConfigStore as an experiment,
`+experiment=repro_<name>` (its CPU size) and `repro_<name>_<size>` for its
other sizes; `+experiment=gallery` runs every entry at its CPU size and
`+experiment=gallery_accelerator` at its accelerator size (all of them
within one 10-minute window on one GPU). Every run of an entry carries
`repro=<name>` and `repro_size=<size>`, which is how `curvbench report`
finds the runs of each entry and writes the gallery page.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import pkgutil
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np
import numpy.typing as npt
import pandas as pd

from curvbench.core import stats, tuning
from curvbench.core.sections import unreadable
from curvbench.measurements.training import comparison

# The kinds of claim.
FINDING, EXTENSION, CHECK = "finding", "extension", "check"
KINDS = (FINDING, EXTENSION, CHECK)

# Verdicts on a finding or an extension.
REPRODUCED = "reproduced"
CONTRADICTED = "contradicted"
NOT_AT_SCALE = "not reproduced at this scale"
INCONCLUSIVE = "inconclusive"
# A check's outcomes.
PASSES, FAILS = "passes", "fails"
# No verdict.
TOO_FEW = "too few samples to tell"
UNJUDGED = "not judged"
NO_VERDICT = (TOO_FEW, UNJUDGED)
# What each kind of claim can come to; a check function returns one of
# these but NOT_AT_SCALE, which only `Claim.judge` gives.
OUTCOMES = {
  FINDING: (REPRODUCED, CONTRADICTED, NOT_AT_SCALE, INCONCLUSIVE, *NO_VERDICT),
  EXTENSION: (
    REPRODUCED,
    CONTRADICTED,
    NOT_AT_SCALE,
    INCONCLUSIVE,
    *NO_VERDICT,
  ),
  CHECK: (PASSES, FAILS, *NO_VERDICT),
}

# The sizes every entry has: `cpu` is what `+experiment=gallery` runs (2 CPU
# cores, all entries together in 35 minutes), `accelerator` what
# `+experiment=gallery_accelerator` runs (all entries together in one
# 10-minute window on one GPU), `tiny` what the tests run.
CPU, ACCELERATOR, TINY = "cpu", "accelerator", "tiny"
SIZES = (CPU, ACCELERATOR, TINY)
# The fewest independent samples (runs) from which an exact 95 % interval
# of a median exists: below it a claim says too few samples to tell.
MIN_SAMPLES = next(n for n in range(1, 100) if stats.enough(n))


@dataclasses.dataclass
class Evidence:
  """An entry's records: its runs (`done`, one row per finished run with
  its `config:` columns) and the rows of each table from those runs."""

  done: pd.DataFrame
  tables: dict[str, pd.DataFrame]

  def table(self, name: str) -> pd.DataFrame:
    """The rows of table `name` (empty where no run wrote it)."""
    return self.tables.get(name, pd.DataFrame())

  def setting(self, key: str) -> set:
    """The values the entry's runs took for config `key`."""
    column = self.done.get(f"config:{key}")
    return set() if column is None else set(column.dropna().unique())

  def where(self, column: str, values: Iterable) -> Evidence:
    """The records of the runs whose rows' `column` (e.g. `loss`) takes
    one of `values`."""
    values = set(values)
    ids = {
      run_id
      for df in self.tables.values()
      if column in df and "run_id" in df
      for run_id in df.run_id[df[column].isin(values)]
    }
    return Evidence(
      self.done[self.done.run_id.isin(ids)]
      if "run_id" in self.done
      else self.done,
      {
        name: df[df.run_id.isin(ids)]
        for name, df in self.tables.items()
        if "run_id" in df
      },
    )

  def column(self, name: str) -> set:
    """The values column `name` (e.g. `num_train`, `loss`) takes in every
    table's rows."""
    return {
      v for df in self.tables.values() if name in df for v in df[name].dropna()
    }


class MissingRecords(LookupError):
  """What a claim's check needs is not in the records."""


def lacking(error: Exception) -> str:
  """Why a claim or figure could not be computed from the records."""
  if isinstance(error, MissingRecords):
    return f"the records lack {error}"
  return unreadable(error)


@dataclasses.dataclass(frozen=True)
class Condition:
  """What a paper's claim depends on: `paper`, the condition as the paper
  has it (with where it says so), and `met(evidence)`, which reads from the
  records whether these runs meet it: `(met, what these runs had)`."""

  name: str
  paper: str
  met: Callable[[Evidence], tuple[bool, str]]

  def read(self, evidence: Evidence) -> Met:
    """Whether the runs meet it; not met where the records cannot say."""
    try:
      ok, had = self.met(evidence)
    except MissingRecords as e:
      ok, had = False, f"the records do not say ({e})"
    return Met(self, bool(ok), had)


@dataclasses.dataclass(frozen=True)
class Met:
  """A condition read off the records: `met`, and what the runs `had`."""

  condition: Condition
  met: bool
  had: str

  def words(self) -> str:
    """The condition's name, whether it was met, what the runs had and
    what the paper had, in one line."""
    c = self.condition
    return f"{c.name}: {'met' if self.met else 'differs'} ({self.had}; the paper: {c.paper})"


@dataclasses.dataclass(frozen=True)
class Verdict:
  """A claim's outcome and the evidence for it in words: the samples, their
  spread, the interval and the thresholds it rests on; with the claim's
  conditions as read off the records (`Claim.judge` adds them)."""

  outcome: str
  evidence: str
  conditions: tuple[Met, ...] = ()

  def __post_init__(self):
    known = {o for outcomes in OUTCOMES.values() for o in outcomes}
    if self.outcome not in known:
      raise ValueError(
        f"A verdict is one of {sorted(known)}, not {self.outcome!r}."
      )

  @property
  def differing(self) -> list[Met]:
    """The conditions the runs did not meet."""
    return [m for m in self.conditions if not m.met]


@dataclasses.dataclass(frozen=True)
class Claim:
  """One claim about a paper: its `kind` (`FINDING`, `EXTENSION` or
  `CHECK`), `statement` (the paper's, in our words, for a finding),
  `where` (the paper's section and figure or table; for an extension or a
  check, what it rests on), the `check` that judges it from the entry's
  `Evidence`, and the `conditions` the paper's claim depends on;
  `unverified` says what of the paper's text could not be checked, and
  `records` picks the entry's records the claim rests on (all of them
  where None), which its check and its conditions both read."""

  kind: str
  statement: str
  where: str
  check: Callable[[Evidence], Verdict]
  conditions: tuple[Condition, ...] = ()
  unverified: str = ""
  records: Callable[[Evidence], Evidence] | None = None

  def __post_init__(self):
    if self.kind not in KINDS:
      raise ValueError(f"A claim's kind is one of {KINDS}, not {self.kind!r}.")

  def judge(self, evidence: Evidence) -> Verdict:
    """The check's verdict with the conditions read off the records: a
    contradiction where any condition differs is *not reproduced at this
    scale*; not judged where the records lack what the check reads."""
    try:
      if self.records is not None:
        evidence = self.records(evidence)
      met = tuple(c.read(evidence) for c in self.conditions)
    except Exception as e:  # noqa: BLE001 - records not as expected: said
      return Verdict(UNJUDGED, lacking(e), ())
    try:
      found = self.check(evidence)
    except MissingRecords as e:
      return Verdict(UNJUDGED, f"the records lack {e}", met)
    except Exception as e:  # noqa: BLE001 - records not as expected: said
      return Verdict(UNJUDGED, lacking(e), met)
    allowed = [o for o in OUTCOMES[self.kind] if o != NOT_AT_SCALE]
    if found.outcome not in allowed:
      raise ValueError(
        f"The check of a {self.kind} returned {found.outcome!r}; it returns "
        f"one of {allowed}."
      )
    differing = [m.condition.name for m in met if not m.met]
    if found.outcome == CONTRADICTED and differing:
      return Verdict(
        NOT_AT_SCALE,
        f"{found.evidence}; not a contradiction: these runs differ from the "
        f"paper's conditions in {', '.join(differing)}",
        met,
      )
    return Verdict(found.outcome, found.evidence, met)


@dataclasses.dataclass(frozen=True)
class Size:
  """One size of an entry: its sweep's parts (mappings of overrides, comma
  lists swept, as `hydra.sweeper.sweeps` takes them) and `runs`, what they
  run in words (models, data, steps, seeds), for the page of a report of
  that size."""

  parts: list[dict[str, Any]]
  runs: str


@dataclasses.dataclass(frozen=True)
class Entry:
  """A published finding reproduced: `name` (the presets' and the runs'
  `repro`), `title`, `paper` (the citation), `reproduces` (the paper's
  figures and tables), `differs` (how these runs differ from the paper's,
  at every size), `sizes` (one `Size` per name in `SIZES`), `claims`, and
  `draw(evidence, ax)`, which plots its own figure on one panel where the
  measurements' figures do not show the finding (the page adds the legend
  and saves it)."""

  name: str
  title: str
  paper: str
  reproduces: str
  differs: tuple[str, ...]
  sizes: Mapping[str, Size]
  claims: tuple[Claim, ...]
  draw: Callable[[Evidence, Any], None] | None = None

  def __post_init__(self):
    if set(self.sizes) != set(SIZES):
      raise ValueError(
        f"Gallery entry {self.name!r} has sizes {sorted(self.sizes)}; every "
        f"entry has exactly {', '.join(SIZES)} (2 CPU cores, one "
        "accelerator window, the tests)."
      )

  def parts(self, size: str = CPU) -> list[dict[str, Any]]:
    """The sweep's parts at `size`, each marked `repro=<name>` and
    `repro_size=<size>`."""
    if size not in self.sizes:
      raise ValueError(
        f"Gallery entry {self.name!r} has no size {size!r}; "
        f"it has {', '.join(self.sizes)}."
      )
    return [
      dict(part, repro=self.name, repro_size=size)
      for part in self.sizes[size].parts
    ]

  def experiments(self) -> dict[str, dict]:
    """`{experiment name: config}`: one per size."""
    return {
      f"repro_{self.name}" + ("" if size == CPU else f"_{size}"): _experiment(
        f"repro_{self.name}" + ("" if size == CPU else f"_{size}"),
        self.parts(size),
      )
      for size in self.sizes
    }

  def counted(self) -> tuple[Claim, ...]:
    """The claims the tally counts: the findings."""
    return tuple(c for c in self.claims if c.kind == FINDING)


def _experiment(name: str, parts: list[dict]) -> dict:
  return {"name": name, "hydra": {"sweeper": {"sweeps": parts}}}


def entries() -> dict[str, Entry]:
  """Every entry, by name: the `ENTRY` of each module of this package."""
  found = {}
  for module in pkgutil.iter_modules(__path__):
    entry = getattr(
      importlib.import_module(f"{__name__}.{module.name}"), "ENTRY", None
    )
    if entry is None:
      continue
    if entry.name in found:
      raise ValueError(f"Two gallery entries are named {entry.name!r}.")
    found[entry.name] = entry
  return dict(sorted(found.items()))


def experiments() -> dict[str, dict]:
  """Every entry's experiments, `gallery` (every entry at its CPU size) and
  `gallery_accelerator` (every entry at its accelerator size)."""
  out = {
    name: _experiment(
      name, [part for entry in entries().values() for part in entry.parts(size)]
    )
    for name, size in (("gallery", CPU), ("gallery_accelerator", ACCELERATOR))
  }
  for entry in entries().values():
    out.update(entry.experiments())
  return out


def evidence(
  done: pd.DataFrame, tables: dict[str, pd.DataFrame], name: str
) -> Evidence:
  """The records of entry `name` among a sweep's (`done` with its config
  columns; `tables` by name, each row with its `run_id`)."""
  column = done.get("config:repro")
  mine = done[column == name] if column is not None else done.iloc[:0]
  ids = set(mine.run_id)
  return Evidence(
    mine,
    {t: df[df.run_id.isin(ids)] for t, df in tables.items() if "run_id" in df},
  )


# --- thresholds and the verdicts that rest on them -----------------------------


@dataclasses.dataclass(frozen=True)
class Threshold:
  """What a claim's measured quantity is held against. `paper`: the
  paper's own value, which alone decides; where the paper gives none, the
  verdict is given over the range `low`..`high` (ours: `source` says whose
  and why) and is a verdict only where it is the same over all of it."""

  low: float
  high: float
  source: str
  paper: float | None = None

  def __post_init__(self):
    if self.low > self.high:
      raise ValueError(
        f"A threshold range runs low to high, not {self.low} to {self.high}."
      )


def _at(low: float, high: float, t: float, above: bool) -> str:
  """The verdict of 'the quantity is above (below) t' from its interval."""
  if above:
    return REPRODUCED if low > t else CONTRADICTED if high < t else INCONCLUSIVE
  return REPRODUCED if high < t else CONTRADICTED if low > t else INCONCLUSIVE


def against(
  samples: npt.ArrayLike,
  threshold: Threshold,
  above: bool,
  what: str,
  baseline: str = "",
) -> Verdict:
  """Whether the median of `samples` (one per independent run) lies above
  (`above`) or below `threshold`: the exact sign-test interval of the
  median against the paper's value, or over the range where the paper has
  none, naming the thresholds where the verdict flips. `baseline` gives the
  quantity's meaning (chance level, the untrained network, ...)."""
  est = stats.median_interval(samples)
  side = "above" if above else "below"
  text = f"{what}: median {est.words()}" + (f"; {baseline}" if baseline else "")
  if est.too_few:
    return Verdict(TOO_FEW, text)
  _, low, high = est
  if threshold.paper is not None:
    outcome = _at(low, high, threshold.paper, above)
    return Verdict(
      outcome,
      f"{text}; against the paper's threshold {threshold.paper:.3g} "
      f"({threshold.source}): {outcome}",
    )
  ends = {_at(low, high, t, above) for t in (threshold.low, threshold.high)}
  outcome = ends.pop() if len(ends) == 1 else INCONCLUSIVE
  # 'Above t' is reproduced for t below the interval, contradicted above it.
  yes, no = (low, high) if above else (high, low)
  flips = (
    f"reproduced for t {'below' if above else 'above'} {yes:.3g}, "
    f"contradicted {'above' if above else 'below'} {no:.3g}"
  )
  judged = (
    f"{outcome} over the whole range"
    if not ends  # both ends agreed
    else "the verdict depends on t"
  )
  return Verdict(
    outcome,
    f"{text}; 'the median {side} t' for t from {threshold.low:.3g} to "
    f"{threshold.high:.3g} ({threshold.source}): {judged} ({flips})",
  )


def compare(
  a: npt.ArrayLike,
  b: npt.ArrayLike,
  names: tuple[str, str],
  what: str,
  lower: bool = True,
  paired: bool = False,
) -> Verdict:
  """Whether `a` is lower (`lower`) or higher than `b`, each one sample per
  run (seed): reproduced where the exact 95 % interval of the shift (the
  median paired difference where `paired`) lies on the claimed side of 0,
  contradicted where on the other, inconclusive where it holds 0. The
  claim's threshold, 0, is the claim's own."""
  diff = (stats.paired_difference if paired else stats.difference)(a, b)
  order = stats.ordering(diff)
  text = f"{what}, {names[0]} against {names[1]}: {diff.words()}"
  lost = {n: int(np.sum(np.isinf(x))) for n, x in zip(names, (a, b))}
  if any(lost.values()):
    text += (
      " (infinite, ranked last: "
      + ", ".join(f"{n} {k} of its runs" for n, k in lost.items() if k)
      + ")"
    )
  if order == "unknown":
    return Verdict(TOO_FEW, text)
  claimed = "lower" if lower else "higher"
  outcome = (
    REPRODUCED
    if order == claimed
    else INCONCLUSIVE
    if order == "tied"
    else CONTRADICTED
  )
  return Verdict(outcome, text)


def equivalent(
  a: npt.ArrayLike,
  b: npt.ArrayLike,
  names: tuple[str, str],
  what: str,
  margin: Threshold,
) -> Verdict:
  """Whether `a` and `b` are the same within a margin (a share of `b`'s
  median): reproduced where the exact 95 % interval of the shift lies
  within ±margin, contradicted where it lies wholly outside, inconclusive
  otherwise; over the margin's range where the paper gives none, naming
  the margins where the verdict flips."""
  diff = stats.difference(a, b)
  scale = abs(float(np.median(np.asarray(b, np.float64))))
  text = f"{what}, {names[0]} against {names[1]}: {diff.words()}"
  if diff.too_few:
    return Verdict(TOO_FEW, text)
  _, low, high = diff
  inside = max(abs(low), abs(high)) / scale  # within any margin above this
  outside = (  # beyond any margin below this
    min(abs(low), abs(high)) / scale if low * high > 0 else 0.0
  )

  def at(m: float) -> str:
    return (
      REPRODUCED
      if inside <= m
      else CONTRADICTED
      if outside > m
      else INCONCLUSIVE
    )

  if margin.paper is not None:
    outcome = at(margin.paper)
    judged = f"against the paper's margin {margin.paper:.0%}: {outcome}"
  else:
    ends = {at(margin.low), at(margin.high)}
    outcome = ends.pop() if len(ends) == 1 else INCONCLUSIVE
    judged = (
      f"for a margin from {margin.low:.0%} to {margin.high:.0%} of "
      f"{names[1]}'s median ({margin.source}): "
      + (
        f"{outcome} over the whole range"
        if not ends  # both ends agreed
        else "the verdict depends on the margin"
      )
    )
  apart = (
    f"told apart within any below {outside:.1%}"
    if outside > 0
    else "told apart within none: the interval holds no difference"
  )
  return Verdict(
    outcome,
    f"{text}; {judged} (the same within any margin of at least "
    f"{inside:.1%}, {apart})",
  )


def every(
  checks: Iterable[tuple[str, bool]], what: str, samples: int
) -> Verdict:
  """A check: passes where every one of `checks` (`(label, passed)`)
  passes over at least `MIN_SAMPLES` independent `samples` (runs), fails
  where one does not (naming those that fail out of how many); too few
  samples to tell below `MIN_SAMPLES`, whatever they show."""
  checks = list(checks)
  if not checks:
    raise MissingRecords(what)
  failed = [label for label, ok in checks if not ok]
  shown = "; ".join(failed[:4]) + ("; ..." if len(failed) > 4 else "")
  text = (
    f"{what}: all {len(checks)} hold over {samples} runs"
    if not failed
    else f"{what}: {len(failed)} of {len(checks)} do not ({shown})"
  )
  if samples < MIN_SAMPLES:
    return Verdict(
      TOO_FEW,
      f"{text}; {samples} runs, fewer than the {MIN_SAMPLES} a verdict needs",
    )
  return Verdict(FAILS if failed else PASSES, text)


# --- conditions the claims share ------------------------------------------------


def _only(
  name: str,
  paper: str,
  values: Iterable,
  found_in: Callable[[Evidence], set],
  missing: str,
  shown: str,
) -> Condition:
  """The condition that the values `found_in` the evidence are among
  `values`; none found raises `MissingRecords(missing)`, and the found
  ones are shown after `shown`."""
  allowed = set(values)

  def met(evidence: Evidence) -> tuple[bool, str]:
    found = found_in(evidence)
    if not found:
      raise MissingRecords(missing)
    return (
      found <= allowed,
      f"{shown}{', '.join(map(str, sorted(found, key=str)))}",
    )

  return Condition(name, paper, met)


def setting_in(name: str, key: str, values: Iterable, paper: str) -> Condition:
  """The runs' config `key` takes only `values`."""
  return _only(
    name, paper, values, lambda e: e.setting(key), f"config {key}", f"{key}="
  )


def column_in(
  name: str, column: str, values: Iterable, paper: str
) -> Condition:
  """Every record's `column` (e.g. `loss`, `task`) takes only `values`."""
  return _only(
    name,
    paper,
    values,
    lambda e: e.column(column),
    f"the records' {column}",
    f"{column} ",
  )


def full_batch(paper: str) -> Condition:
  """Every step and measurement uses the whole training split."""

  def met(evidence: Evidence) -> tuple[bool, str]:
    sizes, train = evidence.column("batch_size"), evidence.column("num_train")
    if not sizes or not train:
      raise MissingRecords("the batch and training split sizes")
    return sizes == train, (
      f"batches of {', '.join(map(str, sorted(sizes)))} from "
      f"{', '.join(map(str, sorted(train)))} training examples"
    )

  return Condition("full batch", paper, met)


# --- what checks read ------------------------------------------------------------


def rows(evidence: Evidence, table: str, what: str, **where) -> pd.DataFrame:
  """The rows of `table` whose columns equal `where`'s values;
  `MissingRecords` (naming `what`) where there are none."""
  df = evidence.table(table)
  for column, value in where.items():
    if column not in df:
      raise MissingRecords(what)
    df = df[df[column] == value]
  if df.empty:
    raise MissingRecords(what)
  return df


def final(evidence: Evidence, column: str, what: str, **where) -> pd.Series:
  """Per run, the last logged value of the training table's `column`
  (among the rows whose columns equal `where`'s values)."""
  train = rows(evidence, "training", what, **where)
  if column not in train:
    raise MissingRecords(what)
  return (
    train.dropna(subset=[column])
    .sort_values("step", kind="stable")
    .groupby("run_id")[column]
    .last()
  )


# How near chance a run's last training error is to count as not trained.
CHANCE_SLACK = 0.05


def at_chance(evidence: Evidence, classes: int) -> dict:
  """The runs that did not train: their last training error is within
  `CHANCE_SLACK` of chance, 1 - 1/`classes` (what a network that gives every
  input the same class scores, as a collapsed one does). Per run id, that
  error; a claim about trained networks leaves these runs out and says so."""
  last = final(evidence, "train_error", "the runs' training errors")
  return last[last >= 1 - 1 / classes - CHANCE_SLACK].to_dict()


def trained(evidence: Evidence, df: pd.DataFrame, what: str) -> pd.DataFrame:
  """The rows of `df` measured at the last step each run was set to measure
  at (`measure.spectra.steps`), where that step follows training (> 0):
  a claim about trained networks is never judged on untrained ones.
  `MissingRecords` names a run whose rows stop short of it."""
  column = "config:measure.spectra.steps"
  if "step" not in df or column not in evidence.done:
    raise MissingRecords(f"{what} (no steps recorded)")
  out = []
  for run_id, part in df.groupby("run_id"):
    run = evidence.done[evidence.done.run_id == run_id]
    try:
      final = max(json.loads(run[column].iloc[0]))
    except (IndexError, TypeError, ValueError) as e:
      raise MissingRecords(f"{what} (run {run_id}: no steps set)") from e
    if final <= 0 or not (part.step == final).any():
      raise MissingRecords(
        f"{what} after training (run {run_id} was set to measure at step "
        f"{final}; its records stop at step {part.step.max()})"
        if final > 0
        else f"{what} after training (run {run_id} measured no trained step)"
      )
    out.append(part[part.step == final])
  if not out:
    raise MissingRecords(what)
  return pd.concat(out)


def trained_eigenvalues(
  evidence: Evidence, matrix: str, per: str = "run_id", source: str = "exact"
) -> dict:
  """`matrix`'s eigenvalues (descending) at the last measured step, on the
  first data draw where a run measured several, per value of column `per`
  (a run, or a seed)."""
  what = f"the trained {matrix}'s eigenvalues"
  spectra = rows(evidence, "spectra", what, source=source, matrix=matrix)
  last = trained(evidence, spectra, what)
  if "sample" in last:
    last = last[last["sample"] == last["sample"].min()]
  return {
    key: np.sort(s.eigenvalue.to_numpy())[::-1] for key, s in last.groupby(per)
  }


def chosen(
  evidence: Evidence,
  keys: Iterable[str],
  group: str = "optimizer.name",
  metric: str = "final_train_error",
) -> pd.DataFrame:
  """The training rows of each problem's and method's best setting: the
  methods are the values of config `group`, their settings the values of
  the config `keys` (e.g. `optimizer.learning_rate`) their runs took, the
  best the lowest `metric` mean over seeds (`curvbench.core.tuning`, as
  DeepOBS picks). Added columns: `method`, `setting`, `tried` (the
  settings tried) and `edges` (the tuned values at an edge of their grid,
  where a better one may lie beyond)."""

  train = rows(evidence, "training", "the training runs", measure="training")
  done = evidence.done
  if f"config:{group}" not in done:
    raise MissingRecords(f"the runs' {group}")
  runs = done[done.run_id.isin(train.run_id.unique())].assign(
    method=lambda d: d[f"config:{group}"]
  )
  tuned = [f"config:{k}" for k in dict.fromkeys(keys) if f"config:{k}" in runs]
  runs = runs.assign(
    setting=[
      ", ".join(
        f"{key.rsplit('.', 1)[-1]}={value}"
        for key, value in row.items()
        if pd.notna(value)
      )
      for _, row in runs[tuned].iterrows()
    ]
  )
  table = tuning.select(
    runs, tuning.run_scores(train, metric), ["problem", "method"]
  )
  per_method = table.groupby(["problem", "method"]).setting
  table["tried"] = per_method.transform("count")
  table["edges"] = [
    "; ".join(
      comparison.grid_edges(
        table.setting[
          (table.problem == r.problem) & (table.method == r.method)
        ],
        r.setting,
      )
    )
    for r in table.itertuples()
  ]
  best = table[table.best].merge(runs, on=["problem", "method", "setting"])
  return train.merge(
    best[["run_id", "method", "setting", "tried", "edges"]],
    on="run_id",
    suffixes=("_row", ""),
  )


def tuned_words(r: pd.DataFrame) -> str:
  """'setting (best of N; at its grid's edge: ...)' of one method's rows
  from `chosen`."""
  first = r.iloc[0]
  edge = f"; at its grid's edge: {first.edges}" if first.edges else ""
  return (
    f"{first.setting or 'its one setting'} (best of {int(first.tried)}{edge})"
  )


def by(found: Mapping, names, what: str) -> list:
  """`found[name]` for each of `names`; `MissingRecords` (naming `what`)
  where one is absent."""
  if any(name not in found for name in names):
    raise MissingRecords(what)
  return [found[name] for name in names]


def load_note(rows: pd.DataFrame, what: str) -> str:
  """', others' CPU share at most X% while `what`' from the rows'
  `others_cpu_share` (the machine's load while they were timed); '' where
  they have none."""
  if "others_cpu_share" not in rows or rows.others_cpu_share.isna().all():
    return ""
  return f", others' CPU share at most {rows.others_cpu_share.max():.0%} while {what}"


__all__ = [
  "ACCELERATOR",
  "CHANCE_SLACK",
  "CHECK",
  "CONTRADICTED",
  "CPU",
  "Claim",
  "Condition",
  "Entry",
  "Evidence",
  "EXTENSION",
  "FAILS",
  "FINDING",
  "INCONCLUSIVE",
  "KINDS",
  "MIN_SAMPLES",
  "Met",
  "MissingRecords",
  "NOT_AT_SCALE",
  "NO_VERDICT",
  "OUTCOMES",
  "PASSES",
  "REPRODUCED",
  "SIZES",
  "Size",
  "TINY",
  "TOO_FEW",
  "Threshold",
  "UNJUDGED",
  "Verdict",
  "against",
  "at_chance",
  "by",
  "chosen",
  "column_in",
  "compare",
  "entries",
  "equivalent",
  "every",
  "evidence",
  "experiments",
  "final",
  "full_batch",
  "lacking",
  "load_note",
  "rows",
  "setting_in",
  "trained",
  "trained_eigenvalues",
  "tuned_words",
]
