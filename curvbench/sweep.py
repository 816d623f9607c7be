"""A sweep's records, read as the report needs them: every run directory
under a folder with its status (and, for a run not in the results, why),
its flattened config, its setting and label, and each table concatenated
over the runs that finished.

- Runs that differ in any config key are told apart. Within each problem,
  measurement and method, the keys whose values differ between runs (seeds
  aside) form the run's `setting` (e.g. `learning_rate=0.001`); its
  `label` is the method with that setting.
- Runs that are not in the results say why: failed (`ERROR.json`, or
  the space the run reserved for it where the disk filled), diverged,
  damaged (records that cannot be read or are missing: see
  `records.RunDir.damage`), killed (records but no completion marker),
  still running, skipped, or reached through a symbolic link (runs are
  read where they lie, never through links: a link to a folder inside
  the sweep would read it twice, and a link may loop). One bad run never
  stops the report.
"""

from __future__ import annotations

import collections
import dataclasses
import fnmatch
import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import cast

import numpy as np
import pandas as pd
from omegaconf import OmegaConf

from curvbench import plugins, provenance
from curvbench.core import records
from curvbench.measurements import MEASUREMENTS

# Any of these marks a run directory (`.hydra/config.yaml`: Hydra started
# the run, which may have been stopped before writing a record of its own).
RUN_FILES = (
  records.MARKER,
  records.OWNED,
  records.ERROR,
  "config.yaml",
  "metadata.json",
  "*.parquet",
  ".hydra/config.yaml",
)
# What `not_in_results` lists, one row per run; skipped runs are grouped.
NOT_IN_RESULTS = ("error", "diverged", "damaged", "killed", "running", "linked")
# How far below a symbolic link's target a run is looked for (`_run_dirs`).
LINK_DEPTH = 3
# What a run is, before its settings: rows with the same values here and the
# same setting are seeds of one configuration.
GROUP = ("problem", "measure", "method")
# What a run measured with besides its config (`provenance.inputs`): runs
# that differ here are told apart like runs of different settings.
INPUTS = ("code", "dataset", "plugins")


@dataclasses.dataclass
class Sweep:
  """A sweep's runs (one row per run directory) and its merged tables."""

  root: Path
  runs: pd.DataFrame
  tables: dict[str, pd.DataFrame]


def _run_config(run: records.RunDir) -> dict:
  """The run's flattened config from the first of its config records that
  can be read (`{}` when none can)."""
  readers = (
    (
      run.path / "config.parquet",
      lambda p: pd.read_parquet(p).iloc[0].to_dict(),
    ),
    (run.path / "config.yaml", lambda p: provenance.flatten(OmegaConf.load(p))),
    (
      run.path / ".hydra" / "config.yaml",
      lambda p: provenance.flatten(OmegaConf.load(p)),
    ),
  )
  for path, read in readers:
    if path.exists():
      try:
        return dict(read(path))
      except Exception:  # noqa: BLE001 - a damaged record: try the next one
        continue
  return {}


def _json_field(path: Path, key: str):
  """`key` of the JSON object in `path`, None when absent or unreadable."""
  try:
    return json.loads(path.read_text()).get(key)
  except (OSError, ValueError, AttributeError):
    return None


def _status(run: records.RunDir) -> tuple[str, str, dict | None]:
  """The run's status, the reason it is not in the results (or its
  marker's), and its marker (None unless it is intact)."""
  if run.has_marker:
    damage = run.damage()
    if damage:
      return "damaged", f"{damage}; a rerun of the sweep redoes it", None
    marker = cast(dict, run.marker())  # there, and intact
    return marker["status"], marker.get("reason", ""), marker
  error = run.path / records.ERROR
  if error.exists():
    trace = _json_field(error, "traceback")
    if not isinstance(trace, str):
      return "error", "the run failed; its ERROR.json is unreadable", None
    lines = trace.strip().splitlines()
    return "error", lines[-1] if lines else "see ERROR.json", None
  # The space a run keeps for its error (`records.RunDir.write_error`) is
  # empty where the disk filled before even that could be written, holds
  # the error where it could not be renamed, and is as it was made while
  # the run runs or after it was killed.
  reserve = run.path / records.RESERVE
  if reserve.is_file() and reserve.stat().st_size == 0:
    return (
      "error",
      (
        "the run failed and could not record why: the disk "
        "filled (No space left on device)"
      ),
      None,
    )
  trace = _json_field(reserve, "traceback") if reserve.is_file() else None
  if isinstance(trace, str):
    lines = trace.strip().splitlines()
    return "error", lines[-1] if lines else "see its error reserve", None
  holder = run.running()
  if holder is not None:
    return (
      "running",
      (
        f"no completion marker yet: running in process "
        f"{holder.get('pid')} on {holder.get('host')} since "
        f"{holder.get('since')}"
      ),
      None,
    )
  return (
    "killed",
    (
      "no completion marker: the run was stopped before it "
      "finished; a rerun of the sweep redoes it"
    ),
    None,
  )


def _is_run_dir(folder: Path, names: list[str]) -> bool:
  """Whether `folder`, holding files `names`, is a run directory."""
  return (
    any(
      fnmatch.fnmatchcase(name, pattern)
      for pattern in RUN_FILES
      for name in names
    )
    or (folder / ".hydra" / "config.yaml").is_file()
  )


def _walk(root: Path, depth: int | None = None):
  """`(folder, subfolder names, file names)` under `root`, at most `depth`
  levels down, Hydra's `.hydra` folders left out. Symbolic links are
  listed among the subfolders but not followed, so a link that loops
  cannot hold the walk up."""
  for name, subfolders, files in os.walk(root):
    folder = Path(name)
    deep = depth is not None and len(folder.relative_to(root).parts) >= depth
    subfolders[:] = [] if deep else [n for n in subfolders if n != ".hydra"]
    yield folder, subfolders, files


def _run_dirs(root: Path) -> tuple[list[Path], list[tuple[Path, Path]]]:
  """Every run directory under `root` (see `RUN_FILES`), and each symbolic
  link under it to a folder outside it that is or holds one, with its
  target. A link to a folder inside `root` is left out: that folder is
  read where it lies."""
  found, links = [], []
  inside = Path(os.path.realpath(root))
  for folder, subfolders, files in _walk(root):
    if _is_run_dir(folder, files):
      found.append(folder)
    for link in (folder / name for name in subfolders):
      target = Path(os.path.realpath(link))
      if not link.is_symlink() or target.is_relative_to(inside):
        continue
      # Looked into a few levels down only: a run lies a level or two
      # below its sweep, and a link may lead to a whole disk.
      if any(
        _is_run_dir(path, names)
        for path, _, names in _walk(target, depth=LINK_DEPTH)
      ):
        links.append((link, target))
  return sorted(found), sorted(links)


def _linked(root: Path, link: Path, target: Path) -> dict:
  """The row of a link to run directories outside the sweep."""
  return dict(
    run_dir=str(link.relative_to(root)),
    run_id=None,
    status="linked",
    reason=(
      "reached through a symbolic link "
      f"({link.relative_to(root)} -> {target}); "
      "runs are read where they lie: report the sweep of "
      f"{target}, or copy the run here"
    ),
  )


def _plugins_named(cfg: dict, marker: dict | None) -> dict:
  """`{plugin: hash of its code}` of the plugins a run's config names, the
  hashes as its marker recorded them (None where it did not)."""
  try:
    names = json.loads(cfg.get("plugins") or "[]")
    recorded = json.loads((marker or {}).get("plugin_sources") or "{}")
  except (TypeError, ValueError):
    return {}  # a damaged config: the run's status says so
  if not isinstance(names, list) or not isinstance(recorded, dict):
    return {}
  return {str(name): recorded.get(str(name)) for name in names}


def _how(root: Path, name: str) -> str:
  return f"`curvbench report {root} --trust {name}`"


def load_sweep(root, trust: Iterable[str] = ()) -> Sweep:
  """Every run directory under `root`, and each table concatenated over the
  complete and diverged runs (with `run_id` and `run_dir` columns). Of the
  plugins the runs name, those in `trust` whose code is the code the runs
  recorded are imported, for the tables their measurements declare; the
  others are not (a run's `plugins_not_imported` says why:
  `plugins.load_recorded`)."""
  root = Path(root)
  trust = list(trust)
  plugins.load_installed()
  runs: list[dict] = []
  parts: dict[str, list[tuple[int, pd.DataFrame]]] = collections.defaultdict(
    list
  )
  found, links = _run_dirs(root)
  for path in found:
    run = records.RunDir(path)
    status, reason, marker = _status(run)
    cfg = _run_config(run)
    unread = [
      why
      for name, code in _plugins_named(cfg, marker).items()
      if (why := plugins.load_recorded(name, code, trust, _how(root, name)))
    ]
    run_dir = str(path.relative_to(root))
    run_id = cfg.pop("run_id", None) or (marker or {}).get("run_id", run_dir)
    row = dict(
      run_dir=run_dir,
      run_id=run_id,
      status=status,
      reason=reason,
      # A problem's name in the records: its label, else its kind.
      problem=cfg.get("problem.label") or cfg.get("problem.name"),
      measure=cfg.get("measure.kind"),
      **{key: (marker or {}).get(key) for key in INPUTS},
      plugins_not_imported="; ".join(unread) or None,
      **{f"config:{k}": v for k, v in cfg.items()},
    )
    run_tables = {}
    if status in ("complete", "diverged"):
      try:
        run_tables = run.tables()
      except records.DamagedRun as e:  # damaged since `damage` looked
        row.update(status="damaged", reason=str(e))
    for name, df in run_tables.items():
      df = df.assign(run_dir=run_dir)
      if "run_id" not in df:  # written before run ids
        df["run_id"] = run_id
      parts[name].append((len(runs), df))
      if "device_kind" in df and len(df):
        row["device_kind"] = df.device_kind.iloc[0]
    row["method"] = _json_field(path / "metadata.json", "method")
    runs.append(row)
  declared = {t for name in MEASUREMENTS for t in MEASUREMENTS.get(name).tables}
  parts = {name: found for name, found in parts.items() if name in declared}
  for i, why in _odd_columns(parts).items():
    runs[i].update(status="damaged", reason=why)
  tables = {
    name: pd.concat(dfs, ignore_index=True)
    for name, found in parts.items()
    if (dfs := [df for i, df in found if runs[i]["status"] != "damaged"])
  }
  runs += [_linked(root, link, target) for link, target in links]
  return Sweep(root, pd.DataFrame(runs), tables)


def _kind(column: pd.Series) -> str | None:
  """What a column holds: numbers, times or values other than numbers (text,
  lists; None where it is empty)."""
  values = column.dropna()
  if values.empty:
    return None
  if pd.api.types.is_numeric_dtype(column):
    return "numbers"
  if pd.api.types.is_datetime64_any_dtype(column):
    return "times"
  numbers = values.map(lambda v: isinstance(v, (int, float, np.number)))
  return "numbers" if numbers.all() else "values other than numbers"


def _odd_columns(parts: dict[str, list[tuple[int, pd.DataFrame]]]) -> dict:
  """`{run: why}` for the runs whose table holds values other than numbers in
  a column that most runs' same table hold numbers in (a table rewritten, or written by other
  code): their records are left out rather than read as numbers."""
  odd: dict[int, str] = {}
  for name, found in parts.items():
    kinds = [(i, {c: _kind(df[c]) for c in df.columns}) for i, df in found]
    columns = {c for _, k in kinds for c in k}
    for column in sorted(columns):
      held = [(i, k[column]) for i, k in kinds if k.get(column) is not None]
      numbers = sum(kind == "numbers" for _, kind in held)
      if 2 * numbers <= len(held):
        continue  # no majority to hold a run against
      for i, kind in held:
        if kind != "numbers" and i not in odd:
          odd[i] = (
            f"its table {name!r} holds {kind} in column {column!r}, where "
            f"{numbers} of the {len(held)} runs with that table hold "
            "numbers: written by other code, or edited; run it again"
          )
  return odd


def _short_names(keys: list[str]) -> dict[str, str]:
  """Each dotted key's last part, or more of it where two would collide."""
  names = {}
  for key in keys:
    parts = key.split(".")
    depth = 1
    while (
      depth < len(parts)
      and sum(k.split(".")[-depth:] == parts[-depth:] for k in keys) > 1
    ):
      depth += 1
    names[key] = ".".join(parts[-depth:])
  return names


def _value(v) -> str:
  return f"{v:.4g}" if isinstance(v, float) else str(v)


# Keys of what a run measured rather than of how it trained: a training
# curve recorded along a spectra run is labelled without them.
MEASURED = ("curvature.", "measure.spectra.", "measure.timing.")


def _follows_choice(column: str, varying: list[str], group) -> bool:
  """Whether `column` is a setting of a component (`optimizer.momentum`)
  whose choice varies too (`optimizer.name`) and which some runs lack: the
  choice says it (`name=sgd`), not forty `momentum=nan`s."""
  owner, _, field = column.rpartition(".")
  return (
    field != "name"
    and f"{owner}.name" in varying
    and bool(group[column].isna().any())
  )


def settings(runs: pd.DataFrame) -> pd.DataFrame:
  """`runs` (complete and diverged) with the columns `setting` (the config
  keys that vary within the run's problem, measurement and method, seeds
  aside, as `key=value, ...`), `label` (method and setting) and
  `trained_setting` (the setting less the keys of what was measured)."""
  done = runs[runs.status.isin(["complete", "diverged"])].copy()
  if done.empty:
    return done.assign(setting="", label="", trained_setting="")
  config_keys = {
    c: c.removeprefix("config:")
    for c in done.columns
    if c.startswith("config:")
  }
  candidates = [
    c
    for c, key in config_keys.items()
    if key.split(".")[0] not in provenance.NOT_IDENTITY
    and key not in records.SEED_KEYS
  ]
  candidates += [c for c in ("device_kind", *INPUTS) if c in done]
  done["setting"], done["trained_setting"] = "", ""
  for _, group in done.groupby(list(GROUP), dropna=False):
    varying = [
      c for c in candidates if group[c].astype(str).nunique(dropna=False) > 1
    ]
    varying = [c for c in varying if not _follows_choice(c, varying, group)]
    keys = [c.removeprefix("config:") for c in varying]
    short = _short_names(keys)
    for index, run in group.iterrows():
      items = [
        (k, f"{short[k]}={_value(run[c])}") for k, c in zip(keys, varying)
      ]
      done.at[index, "setting"] = ", ".join(text for _, text in items)
      done.at[index, "trained_setting"] = ", ".join(
        text for k, text in items if not k.startswith(MEASURED)
      )
  done["label"] = [
    f"{m} ({s})" if s else str(m) for m, s in zip(done.method, done.setting)
  ]
  return done


def mixed_inputs(done: pd.DataFrame) -> list[str]:
  """Notes naming the code, dataset or plugin code versions that runs of
  one problem mix (their runs carry `code=`, `dataset=` or `plugins=` in
  their setting)."""
  notes = []
  for key, what in (
    ("code", "code versions"),
    ("dataset", "datasets"),
    ("plugins", "versions of plugin code"),
  ):
    if key not in done:
      continue
    for problem, runs in done.groupby("problem"):
      versions = sorted(runs[key].dropna().astype(str).unique())
      if len(versions) > 1:
        notes.append(
          f"The {problem} runs come from {len(versions)} {what} "
          f"({', '.join(versions)}); runs that differ in them are kept "
          f"apart ({key}= in their setting), never taken for seeds of one "
          "another."
        )
  return notes


def with_labels(df: pd.DataFrame, done: pd.DataFrame) -> pd.DataFrame:
  """`df` with each row's setting and label: its run's, or where the row
  records another method than its run (the optimizer's curve along a
  spectra run), that method with the run's trained setting."""
  labels = (
    done[["run_id", "method", "setting", "label", "trained_setting"]]
    .drop_duplicates("run_id")
    .rename(columns={"method": "run_method"})
  )
  out = df.drop(columns=["setting", "label"], errors="ignore").merge(
    labels, on="run_id", how="left"
  )
  if "method" in out:
    other = out.method.notna() & (out.method != out.run_method)
    out.loc[other, "setting"] = out.trained_setting[other]
    out.loc[other, "label"] = [
      f"{m} ({s})" if s else str(m)
      for m, s in zip(out.method[other], out.setting[other])
    ]
  return out.drop(columns=["run_method", "trained_setting"])


def not_in_results(runs: pd.DataFrame) -> pd.DataFrame:
  """Runs whose records are missing or partial, with the reason; skipped
  runs are counted per reason."""
  shown = runs[runs.status.isin(NOT_IN_RESULTS)]
  rows = [
    dict(status=r.status, runs=1, run_dir=r.run_dir, reason=r.reason)
    for r in shown.itertuples()
  ]
  skipped = runs[runs.status == "skipped"]
  for reason, group in skipped.groupby("reason"):
    dirs = sorted(group.run_dir)
    rows.append(
      dict(
        status="skipped",
        runs=len(dirs),
        run_dir=", ".join(dirs[:3]) + (", ..." if len(dirs) > 3 else ""),
        reason=reason,
      )
    )
  return pd.DataFrame(rows, columns=["status", "runs", "run_dir", "reason"])
