"""The performance record: the benchmark's figures, one committed JSON file
per device kind under `benchmarks/record/`, today's figures compared with
them, and the documentation's table generated from them.

Every figure is a cost where lower is better:

- `kfac_step/adam_step`: a K-FAC optimizer step (refresh and damping
  updates in their cadence) over an Adam step, interleaved on the same
  parameters and batch (the timing measurement's `optimizer_step` row).
- `kfac_step/adam_step_flops`: the same ratio in XLA's operation counts
  (`costs.flops`; the step's averaged over its cycle): the arithmetic the
  time ratio can be held against, and a figure no load moves.
- `refresh/gradient`: K-FAC's inverse refresh (`cache_update`) over a
  gradient step on the same batch.
- `dataset_ggn_product/gradient`: one exact GGN-vector product over the
  training split over one gradient over it (`curvbench.bench.products`).
- `exact_ggn_spectrum_s`: seconds to form the exact GGN of a batch and
  eigendecompose it (the spectra measurement's `exact ggn` and
  `eigh exact ggn` phases, float64), the median over the spectra runs
  (each times them once).

The first three time K-FAC, whose cost depends on the estimation mode: a
record names the mode its plain figures were timed in (`estimation_mode`,
the timing measurement's default), and keeps those of another mode as
`FIGURE@MODE` (e.g. `kfac_step/adam_step@ggn_exact`). Records made before
modes were recorded timed K-FAC in `ggn_exact` (`UNNAMED_MODE`).

A record also keeps the growth exponents of cost in parameters
(`scaling`: per family and kind of work, time and memory with their
standard errors, and what made them; `python -m curvbench.bench scaling
--save-record`), not compared, and the side-by-side ratios (`curvbench.bench.against`)
of the run that made it, where one was run.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path

import numpy as np
import pandas as pd

ROOT = Path(__file__).resolve().parents[2]
RECORD_DIR = ROOT / "benchmarks" / "record"
# The page holding the records' table, between the START and END markers.
TABLE_PAGE = ROOT / "docs" / "howto" / "performance_record.md"
TOLERANCE = 0.25  # a figure more than this much worse is named

FIGURES = {  # name: what the table calls it
  "kfac_step/adam_step": "K-FAC step / Adam step",
  "kfac_step/adam_step_flops": "the same in XLA flops",
  "refresh/gradient": "K-FAC refresh / gradient step",
  "dataset_ggn_product/gradient": "GGN-vector product / gradient, "
  "training split",
  "exact_ggn_spectrum_s": "exact GGN + eigh of a batch (s)",
}
# The figures that time K-FAC in an estimation mode.
MODE_FIGURES = (
  "kfac_step/adam_step",
  "kfac_step/adam_step_flops",
  "refresh/gradient",
)
# The mode of a record's K-FAC figures where it names none: the harness's
# only default until 2026-12-07.
UNNAMED_MODE = "ggn_exact"
START = "<!-- performance-record:start (python -m curvbench.bench table) -->"
END = "<!-- performance-record:end -->"


def cpu_problems() -> tuple[str, ...]:
  """The problems the benchmark times and the record keeps figures of:
  every registered problem but those whose defaults are sized for an
  accelerator (`ProblemSettings.accelerator_sized`)."""
  # The registry imports JAX and every problem: the record's tables need
  # neither.
  import problems  # noqa: PLC0415 - see above

  return tuple(
    n
    for n in problems.PROBLEMS.names()
    if not problems.PROBLEMS.get(n).accelerator_sized
  )


def device_key(device_kind: str, platform: str, cpu_count: int) -> str:
  """The record's file name (no suffix) for a device: its kind in lower
  case with runs of other characters as '-'; on the CPU, where the kind
  says nothing of the machine, with the number of cores the process may
  use."""
  key = re.sub(r"[^a-z0-9]+", "-", device_kind.lower()).strip("-") or "device"
  if platform == "cpu":
    key += f"-{cpu_count}-cores"
  return key


def figure_name(figure: str, mode: str | None, record_mode: str) -> str:
  """The key of `figure` timed in `mode` in a record whose plain figures
  are in `record_mode`."""
  return figure if mode in (None, record_mode) else f"{figure}@{mode}"


def figure_mode(name: str, record: dict) -> tuple[str, str | None]:
  """`(figure, estimation mode)` of a record's key (mode None for a
  figure that times no K-FAC)."""
  figure, _, mode = name.partition("@")
  if mode or figure not in MODE_FIGURES:
    return figure, mode or None
  return figure, record.get("estimation_mode", UNNAMED_MODE)


def figures(
  timing: pd.DataFrame,
  spectra_cost: pd.DataFrame,
  products: pd.DataFrame,
  mode: str = UNNAMED_MODE,
) -> dict[str, dict[str, float]]:
  """`{figure: {problem: value}}` from the records of one benchmark run
  (the harness's `timing` and spectra `cost` tables, the product rows);
  K-FAC timed in another estimation mode than `mode` (the timing rows'
  `mode`) as `FIGURE@MODE`; problems without a row are left out."""
  out: dict[str, dict[str, float]] = {}

  def put(figure, row_mode, problem, value):
    key = figure_name(figure, row_mode, mode)
    out.setdefault(key, {})[problem] = float(value)

  def rows(table, phase):
    if table.empty:
      return table
    return table[table.phase == phase]

  for _, row in rows(timing, "optimizer_step").iterrows():
    row_mode = row.get("mode")
    put("kfac_step/adam_step", row_mode, row.problem, row.ratio_to_baseline)
    flops = row.get("flop_ratio_to_baseline", math.nan)
    if not math.isnan(flops):
      put("kfac_step/adam_step_flops", row_mode, row.problem, flops)
  for _, row in rows(timing, "cache_update").iterrows():
    put(
      "refresh/gradient", row.get("mode"), row.problem, row.ratio_to_grad_step
    )
  out.update({name: {} for name in FIGURES if name not in out})
  for _, row in rows(products, "dataset ggn product").iterrows():
    out["dataset_ggn_product/gradient"][row.problem] = float(
      row.ratio_to_gradient
    )
  if not spectra_cost.empty:
    exact = spectra_cost[
      spectra_cost.phase.isin(["exact ggn", "eigh exact ggn"])
    ]
    keys = ["run_id", *(["sample"] if "sample" in exact else [])]
    for problem, phases in exact.groupby("problem"):
      # One spectrum's seconds each (a run's, per sample of its data);
      # those read from a store (one phase only) left out.
      per_run = [
        run.run_s.sum() for _, run in phases.groupby(keys) if len(run) == 2
      ]
      if per_run:
        out["exact_ggn_spectrum_s"][problem] = float(np.median(per_run))
  return {name: values for name, values in out.items() if values}


def save(record: dict, folder: Path = RECORD_DIR) -> Path:
  """Writes `record` as `folder/<record['key']>.json`, keeping the growth
  exponents (`scaling`) of the file it replaces unless it has its own;
  returns the path."""
  folder.mkdir(parents=True, exist_ok=True)
  path = folder / f"{record['key']}.json"
  if path.exists() and "scaling" not in record:
    kept = json.loads(path.read_text()).get("scaling")
    record = record if kept is None else dict(record, scaling=kept)
  path.write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
  return path


def save_scaling(key: str, scaling: dict, folder: Path = RECORD_DIR) -> Path:
  """Puts `scaling` (the exponents, `curvbench.bench.scaling.by_family`,
  with what made them) into the record `folder/<key>.json`.

  Raises:
    FileNotFoundError: when the device kind has no record yet.
  """
  path = Path(folder) / f"{key}.json"
  if not path.exists():
    raise FileNotFoundError(
      f"no performance record {path} for this device kind: run `python -m "
      "curvbench.bench run --save-record` first, then save the scaling "
      "exponents into it."
    )
  record = json.loads(path.read_text())
  record["scaling"] = scaling
  path.write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
  return path


def load(path: Path) -> dict:
  """A record file, checked to hold `key`, `mode` and `figures`."""
  try:
    record = json.loads(Path(path).read_text())
  except (OSError, ValueError) as e:
    raise ValueError(f"cannot read the performance record {path}: {e}") from e
  missing = [k for k in ("key", "mode", "figures") if k not in record]
  if missing:
    raise ValueError(
      f"{path} is not a performance record: it lacks "
      f"{', '.join(missing)}; write one with `python -m "
      "curvbench.bench run --save-record`."
    )
  return record


def records(folder: Path = RECORD_DIR) -> list[dict]:
  """Every record in `folder`, by file name."""
  return [load(p) for p in sorted(Path(folder).glob("*.json"))]


@dataclasses.dataclass
class Comparison:
  """Today's figures against a record: `worse` lists (figure, problem,
  today, recorded) more than `tolerance` worse, `missing` what the record
  has and today lacks, `compared` how many figures were compared."""

  record_path: Path
  record: dict
  tolerance: float
  worse: list[tuple[str, str, float, float]]
  missing: list[tuple[str, str]]
  compared: int

  @property
  def passed(self) -> bool:
    """Whether no figure is worse than the tolerance allows and none is
    missing."""
    return not self.worse and not self.missing

  def text(self) -> str:
    """The comparison in words: the record it is against, each figure more
    than the tolerance worse (and how to tell a regression from load),
    and each figure missing today."""
    r = self.record
    lines = [
      f"Compared with {self.record_path} (device {r.get('device_kind')}"
      f", commit {str(r.get('commit'))[:10]}, {r.get('date')}): "
      f"{self.compared} figures."
    ]
    if self.worse:
      lines.append(
        f"{len(self.worse)} more than {self.tolerance:.0%} worse "
        "than the record:"
      )
      lines += [
        f"  {figure} [{problem}]: {today:.4g} today, {recorded:.4g} "
        f"in the record ({today / recorded - 1:+.0%})"
        for figure, problem, today, recorded in self.worse
      ]
      if r.get("commit"):
        lines.append(
          "Load on the machine moves these figures too: to tell a "
          "regression from it, time the record's commit side by "
          "side with the working tree, `python -m curvbench.bench "
          f"against {r['commit'][:10]}`."
        )
    if self.missing:
      lines.append(
        "In the record but not measured today: "
        + ", ".join(f"{figure} [{problem}]" for figure, problem in self.missing)
      )
    if self.passed:
      lines.append(
        f"None more than {self.tolerance:.0%} worse than the record."
      )
    return "\n".join(lines)


def compare(
  today: dict, record_path: Path, tolerance: float = TOLERANCE
) -> Comparison:
  """Today's run (`{'mode', 'figures'}`) against the record at
  `record_path`.

  Raises:
    ValueError: when the record was made in another mode (`--quick` or
      not): its figures measure other sizes and are not comparable.
  """
  record = load(record_path)
  if record["mode"] != today["mode"]:
    raise ValueError(
      f"{record_path} was made by a {record['mode']} run, this run is "
      f"{today['mode']}: their figures are not comparable; run the "
      f"benchmark in {record['mode']} mode to compare."
    )
  measured = {
    (*figure_mode(name, today), problem): value
    for name, values in today["figures"].items()
    for problem, value in values.items()
  }
  worse, missing, compared = [], [], 0
  for name, values in record["figures"].items():
    figure, mode = figure_mode(name, record)
    # Named as today's record would name it.
    shown = figure_name(
      figure, mode, today.get("estimation_mode", UNNAMED_MODE)
    )
    for problem, recorded in values.items():
      now = measured.get((figure, mode, problem))
      if now is None or math.isnan(now):
        missing.append((shown, problem))
        continue
      compared += 1
      if now > recorded * (1 + tolerance):
        worse.append((shown, problem, now, recorded))
  return Comparison(
    Path(record_path), record, tolerance, worse, missing, compared
  )


# --- the records' table ------------------------------------------------------


def _cell(value) -> str:
  return "" if value is None else f"{value:.3g}"


def record_table(folder: Path = RECORD_DIR) -> str:
  """The performance table: a row per figure and problem, a
  column per record file, then what made each record."""
  recs = records(folder)
  if not recs:
    return (
      "No performance record yet: `python -m curvbench.bench run "
      "--save-record` writes one.\n"
    )
  head = ["figure", "mode", "problem", *(f"`{r['key']}`" for r in recs)]
  lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  # Each record's values by (figure, estimation mode, problem).
  values = [
    {
      (*figure_mode(name, r), problem): value
      for name, per_problem in r["figures"].items()
      for problem, value in per_problem.items()
    }
    for r in recs
  ]
  keys = {key for v in values for key in v}
  order = list(FIGURES)
  for figure, mode, problem in sorted(
    keys, key=lambda k: (order.index(k[0]), k[1] or "", k[2])
  ):
    cells = [_cell(v.get((figure, mode, problem))) for v in values]
    lines.append(
      f"| {FIGURES[figure]} | {mode or ''} | {problem} | "
      + " | ".join(cells)
      + " |"
    )
  lines.append("")
  for r in recs:
    versions = ", ".join(
      f"{k} {v}"
      for k, v in sorted(r.get("versions", {}).items())
      if k in ("jax", "jaxlib")
    )
    dirty = " with local changes" if r.get("dirty") else ""
    lines.append(
      f"- `{r['key']}`: {r.get('device_kind')} "
      f"({r.get('platform_version')}), commit "
      f"`{str(r.get('commit'))[:10]}`{dirty}, {r.get('date')}, "
      f"{versions}; `{r.get('command')}`"
    )
    side = r.get("side_by_side")
    if side:
      ratios = ", ".join(
        f"{name} {ratio:.3g}" for name, ratio in side["ratios"].items()
      )
      lines.append(f"  (working tree / `{side['ref']}` side by side: {ratios})")
  return "\n".join(lines) + "\n"


def page_with_table(text: str, table: str) -> str:
  """`text` (a page) with the block between the markers replaced by
  `table`.

  Raises:
    ValueError: when the markers are missing.
  """
  start, end = text.find(START), text.find(END)
  if start < 0 or end < start:
    raise ValueError(
      f"the page has no performance-record block: put the "
      f"lines\n{START}\n{END}\nwhere the table goes."
    )
  return text[: start + len(START)] + "\n" + table + text[end:]
