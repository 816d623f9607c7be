"""The gallery: published findings about curvature, each reproduced by a
preset and judged by checks over its runs' records.

An entry is one module of this package holding one `Entry`: the paper,
the figures it reproduces, what differs from the paper, the sweep that
reproduces it at each size, its claims and, optionally, its own figure.
Each `Claim` reads the entry's records (`Evidence`) and gives a `Verdict`:
it holds, it does not hold, or these runs do not settle it, with the
samples and the interval the verdict rests on.

`store` puts every entry in Hydra's ConfigStore as an experiment,
`+experiment=repro_<name>` (its CPU size) and `repro_<name>_<size>` for
its other sizes, and all of them at their CPU size as `+experiment=gallery`.
Every run of an entry carries `repro=<name>`, which is how `curvbench
report` finds the runs of each entry and writes the gallery page.
"""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import pandas as pd

from curvbench import stats

HOLDS, FAILS, UNSETTLED = "holds", "does not hold", "not settled"
OUTCOMES = (HOLDS, FAILS, UNSETTLED)
# The size every entry has: the one `+experiment=gallery` runs.
CPU = "cpu"


@dataclasses.dataclass(frozen=True)
class Verdict:
  """A claim's outcome (one of `OUTCOMES`) and the evidence for it: the
  samples, their spread and the interval it rests on, in words."""

  outcome: str
  evidence: str

  def __post_init__(self):
    if self.outcome not in OUTCOMES:
      raise ValueError(f"A verdict is one of {OUTCOMES}, not {self.outcome!r}.")


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


@dataclasses.dataclass(frozen=True)
class Claim:
  """A statement of the paper (`figure`: where the paper shows it) and
  the `check` that judges it from the entry's `Evidence`."""

  statement: str
  figure: str
  check: Callable[[Evidence], Verdict]

  def judge(self, evidence: Evidence) -> Verdict:
    """The check's verdict; not settled where the records lack what it
    reads (a run that failed, a table not written)."""
    try:
      return self.check(evidence)
    except MissingRecords as e:
      return Verdict(UNSETTLED, f"the records lack {e}")


class MissingRecords(LookupError):
  """What a claim's check needs is not in the records."""


@dataclasses.dataclass(frozen=True)
class Entry:
  """A published finding reproduced: `name` (the presets' and the runs'
  `repro`), `title`, `paper` (the citation), `reproduces` (the paper's
  figures and tables), `differs` (how these runs differ from the
  paper's), `sweeps` (per size, the sweep's parts: mappings of overrides,
  comma lists swept, as `hydra.sweeper.sweeps` takes them; every entry has
  a `cpu` size), `claims`, and `draw(evidence, ax)`, which plots its own
  figure on one panel where the measurements' figures do not show the
  finding (the page adds the legend and saves it)."""

  name: str
  title: str
  paper: str
  reproduces: str
  differs: tuple[str, ...]
  sweeps: Mapping[str, list[dict[str, Any]]]
  claims: tuple[Claim, ...]
  draw: Callable[[Evidence, Any], None] | None = None

  def __post_init__(self):
    if CPU not in self.sweeps:
      raise ValueError(
        f"Gallery entry {self.name!r} has no {CPU!r} size: "
        "every entry runs on 2 CPU cores in the gallery."
      )

  def parts(self, size: str = CPU) -> list[dict[str, Any]]:
    """The sweep's parts at `size`, each marked `repro=<name>`."""
    if size not in self.sweeps:
      raise ValueError(
        f"Gallery entry {self.name!r} has no size {size!r}; "
        f"it has {', '.join(self.sweeps)}."
      )
    return [dict(part, repro=self.name) for part in self.sweeps[size]]

  def experiments(self) -> dict[str, dict]:
    """`{experiment name: config}`: one per size."""
    names = {
      size: f"repro_{self.name}" + ("" if size == CPU else f"_{size}")
      for size in self.sweeps
    }
    return {
      name: _experiment(name, self.parts(size)) for size, name in names.items()
    }


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
  """Every entry's experiments, and `gallery`: every entry at its CPU
  size."""
  out = {
    "gallery": _experiment(
      "gallery",
      [part for entry in entries().values() for part in entry.parts()],
    )
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


# --- what checks share ----------------------------------------------------------


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


def trained_eigenvalues(
  evidence: Evidence, matrix: str, per: str = "run_id"
) -> dict:
  """Exact `matrix`'s eigenvalues (descending) at the last measured step,
  on the first data draw where a run measured several, per value of
  column `per` (a run, or a seed)."""
  spectra = rows(
    evidence,
    "spectra",
    f"the trained {matrix}'s eigenvalues",
    source="exact",
    matrix=matrix,
  )
  last = spectra[spectra.step == spectra.step.max()]
  if "sample" in last:
    last = last[last["sample"] == last["sample"].min()]
  return {
    key: np.sort(s.eigenvalue.to_numpy())[::-1] for key, s in last.groupby(per)
  }


def by(found: Mapping, names, what: str) -> list:
  """`found[name]` for each of `names`; `MissingRecords` (naming `what`)
  where one is absent."""
  if any(name not in found for name in names):
    raise MissingRecords(what)
  return [found[name] for name in names]


def all_hold(
  checks: list[tuple[str, bool]], what: str, listed: bool = False
) -> Verdict:
  """Holds where every one of `checks` (`(label, passed)`) passes, does
  not hold otherwise, naming those that fail out of how many; `listed`:
  where all pass, name each one (its label carrying its figure)."""
  failed = [label for label, ok in checks if not ok]
  if not checks:
    raise MissingRecords(what)
  if not failed:
    return Verdict(
      HOLDS,
      f"{what}: all {len(checks)} hold"
      + (": " + "; ".join(label for label, _ in checks) if listed else ""),
    )
  shown = "; ".join(failed[:4]) + ("; ..." if len(failed) > 4 else "")
  return Verdict(
    FAILS, f"{what}: {len(failed)} of {len(checks)} do not ({shown})"
  )


def lower(a, b, what: str, names: tuple[str, str]) -> Verdict:
  """Whether `a`'s samples (one per seed) have a lower mean than `b`'s:
  holds where the 95 % interval of the difference lies below 0, does not
  hold where it lies above, not settled where it holds 0 or there is no
  interval (one seed)."""
  a, b = (np.asarray(x, np.float64) for x in (a, b))
  diff = stats.difference(a, b)
  order = stats.ordering(diff)
  text = mean_interval(
    f"{what}, {names[0]} minus {names[1]} over {len(a)} and {len(b)} seeds:",
    diff,
  )
  lost = {n: int(np.sum(~np.isfinite(x))) for n, x in zip(names, (a, b))}
  if any(lost.values()):
    text += (
      " (not finite: "
      + ", ".join(f"{n} {k} of its runs" for n, k in lost.items() if k)
      + ": diverged, or no value at that point)"
    )
  outcome = {"lower": HOLDS, "higher": FAILS}.get(order, UNSETTLED)
  return Verdict(outcome, text)


def load_note(rows: pd.DataFrame, what: str) -> str:
  """', others' CPU share at most X% while `what`' from the rows'
  `others_cpu_share` (the machine's load while they were timed); '' where
  they have none."""
  if "others_cpu_share" not in rows or rows.others_cpu_share.isna().all():
    return ""
  return f", others' CPU share at most {rows.others_cpu_share.max():.0%} while {what}"


def mean_interval(text: str, diff: tuple[float, float, float]) -> str:
  """`text` with `diff` (mean, low, high) as 'mean [low, high]'."""
  mean, low, high = diff
  if not np.isfinite(mean):
    return f"{text} none"
  if not np.isfinite([low, high]).all():
    return f"{text} {mean:.3g} (no interval: one sample)"
  return f"{text} {mean:.3g} [95 % interval {low:.3g}, {high:.3g}]"


__all__ = [
  "CPU",
  "Claim",
  "Entry",
  "Evidence",
  "FAILS",
  "HOLDS",
  "MissingRecords",
  "OUTCOMES",
  "UNSETTLED",
  "Verdict",
  "all_hold",
  "by",
  "trained_eigenvalues",
  "entries",
  "evidence",
  "experiments",
  "load_note",
  "lower",
  "mean_interval",
  "rows",
]
