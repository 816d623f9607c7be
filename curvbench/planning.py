"""A sweep's plan, before anything launches: its points (the cartesian
product of the swept values, or the union of such products), each
optimizer's tuning grid added to the points that are tuned, a folder per
point named by the values that vary across the sweep, which points may
share a device, the checks every point passes first, and the progress and
summary lines while it runs.

The Hydra sweeper (`hydra_plugins/curvbench_sweeper`) and the Python API
(`curvbench.api`) both plan with it; the sweeper adds only what Hydra
needs (its plugin interface, its launcher, its job results).
"""

from __future__ import annotations

import itertools
import json
import os
from pathlib import Path
from typing import Any

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from omegaconf import DictConfig

from curvbench import config, measurements, runs
from curvbench.core import records

# `{folder: the point's full name}` of the folders a sweep named by the
# values that vary across it, so that a later sweep into the same
# directory reuses only its own.
FOLDERS = ".curvbench-folders.json"
# The setting that names a point's folder inside the sweep's directory.
SUBDIR = "hydra.sweep.subdir"


def product(overrides: list[str]) -> list[list[str]]:
  """The jobs of command-line overrides: the cartesian product of the
  swept values, each job a list of `key=value` overrides."""
  choices = {}
  for override in OverridesParser.create().parse_overrides(overrides):
    key = override.get_key_element()
    if not override.is_sweep_override():
      choices[key] = [f"{key}={override.get_value_element_as_str()}"]
    elif override.is_discrete_sweep():
      choices[key] = [f"{key}={v}" for v in override.sweep_string_iterator()]
    else:
      raise HydraException(
        f"{key}: the curvbench sweeper takes lists of values (a=1,2) and "
        "choice(...)/range(...), not intervals."
      )
  return [list(job) for job in itertools.product(*choices.values())]


def union(
  params: dict, sweeps: list | None, arguments: list[str]
) -> list[list[str]]:
  """The jobs of a sweep: the product of `params` and the command line's
  `arguments`, or, with `sweeps` (a list of mappings), the union of the
  products of each with `params` and `arguments` added (the command line
  wins where both give a key), a point listed twice run once."""

  def items(mapping):
    return [f"{k}={v}" for k, v in mapping.items()]

  if sweeps is None:
    return product(items(params) + list(arguments))
  if not sweeps or not all(isinstance(s, dict) for s in sweeps):
    raise HydraException(
      "hydra.sweeper.sweeps is a non-empty list of mappings of swept "
      f"values (e.g. [{{measure: spectra, curvature: 'kfac,ekfac'}}]), "
      f"not {sweeps!r}."
    )
  jobs: dict[tuple[str, ...], list[str]] = {}
  for sweep in sweeps:
    for job in product(items(params) + items(sweep) + list(arguments)):
      jobs.setdefault(tuple(sorted(job)), job)
  return list(jobs.values())


def expand(
  jobs: list[list[str]],
  grid: dict,
  default_optimizer: str,
  default_measure: str,
) -> list[list[str]]:
  """Each job of a tuned measurement (`jobs`: lists of `key=value`
  overrides) once per point of its optimizer's grid; other jobs
  unchanged."""

  def choice(job, group, default):
    for item in job:
      key, _, value = item.partition("=")
      if key.lstrip("+") == group:
        return value
    return default

  out = []
  for job in jobs:
    points = config.grid_points(grid).get(
      choice(job, "optimizer", default_optimizer), {}
    )
    measure = choice(job, "measure", default_measure)
    tuned = (
      measure in measurements.MEASUREMENTS
      and measurements.MEASUREMENTS.get(measure).tuned
    )
    if not tuned or not points:
      out.append(job)
      continue
    taken = {item.partition("=")[0] for item in job}
    clash = sorted(
      f"optimizer.{k}" for k in points if f"optimizer.{k}" in taken
    )
    if clash:
      raise ValueError(
        f"{', '.join(clash)} is both swept on the command line and in "
        "tuning.grid; give it in one place."
      )
    for values in itertools.product(*points.values()):
      out.append(job + [f"optimizer.{k}={v}" for k, v in zip(points, values)])
  return out


def _key(item: str) -> str:
  return item.partition("=")[0].lstrip("+~")


def folder_names(jobs: list[list[str]], excluded, sweep_dir: Path) -> list[str]:
  """Each job's run folder under `sweep_dir`: its overrides (less the
  `excluded` keys, sorted) that vary across the sweep, those every point
  shares left to the config (`seed=2,curvature=kfac`), hashed only where
  still too long. A name another point's run already holds (an earlier
  sweep into the same directory, as `FOLDERS` records them), or a folder
  named as before (every override: `config.run_dir_name`), keeps that full
  name, so no sweep takes another's folder and the same command lands in
  the same folders."""
  items = [[i for i in job if _key(i) not in excluded] for job in jobs]
  shared = set.intersection(*map(set, items)) if len(items) > 1 else set()
  known = recorded_folders(sweep_dir)
  names = []
  for job in items:
    full = config.run_dir_name(",".join(sorted(job)))
    varying = sorted(i.lstrip("+") for i in job if i not in shared)
    short = config.run_dir_name(",".join(varying)) if varying else full
    owner = known.get(short)
    new = not (sweep_dir / short).exists() and not (sweep_dir / full).exists()
    names.append(short if owner == full or (owner is None and new) else full)
  return names


def recorded_folders(sweep_dir: Path) -> dict[str, str]:
  """`{folder: full name}` of `FOLDERS` in `sweep_dir` (empty where none,
  or where it cannot be read: every name then counts as taken)."""
  try:
    known = json.loads((Path(sweep_dir) / FOLDERS).read_text())
  except (OSError, ValueError):
    return {}
  return known if isinstance(known, dict) else {}


def record_folders(sweep_dir: Path, jobs, names, excluded) -> None:
  """Adds each job's folder name and full name to `FOLDERS`."""
  known = recorded_folders(sweep_dir)
  for job, name in zip(jobs, names):
    kept = sorted(i for i in job if _key(i) not in excluded)
    known[name] = config.run_dir_name(",".join(kept))
  text = json.dumps(known, indent=1, sort_keys=True) + "\n"
  records.atomic_write(
    Path(sweep_dir) / FOLDERS, lambda tmp: Path(tmp).write_text(text)
  )


def shown(job: list[str]) -> str:
  """A job's overrides as the command line gave them."""
  return " ".join(i for i in job if not i.startswith(f"{SUBDIR}="))


def quoted(value: str) -> str:
  """`value` as a quoted override value (Hydra's grammar)."""
  return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def progress(done: int, total: int, elapsed: float) -> str:
  """`elapsed 2m10s, about 6m left (from 3 points)` after `done` of
  `total` points."""
  out = f"elapsed {runs.duration(elapsed)}"
  if 0 < done < total:
    left = elapsed / done * (total - done)
    points = "point" if done == 1 else "points"
    out += f", about {runs.duration(left)} left (from {done} {points})"
  return out


def summary(sweep_dir, endings: list[runs.Ending], seconds: float) -> str:
  """The sweep's last lines: how many points ran and how they ended, each
  failed one with its folder and why."""
  counts: dict[str, int] = {}
  for e in endings:
    what = (
      "diverged (tuning)" if e.status == "diverged" and e.tuning else e.status
    )
    counts[what] = counts.get(what, 0) + 1
  names = dict(complete="done", error="failed")
  told = ", ".join(f"{n} {names.get(k, k)}" for k, n in counts.items())
  failed = [e for e in endings if e.fails_sweep]
  head = (
    f"curvbench: sweep ended in {runs.duration(seconds)}: {sweep_dir}: "
    f"{len(endings)} points run: {told or 'none'}"
  )
  if failed:
    head += f"; {len(failed)} failed:"
  lines = [
    f"  {e.folder}: {e.status}"
    + (f" at step {e.step}" if e.step is not None else "")
    + f": {e.why()}"
    for e in failed
  ]
  return "\n".join([head, *lines])


def device_sharing(
  launcher: DictConfig, max_batch_size: int | None
) -> tuple | None:
  """How `launcher` (the `hydra.launcher` config) runs several jobs of one
  batch at the same time on one machine: `(what it does, the setting that
  stops it)`; None when each job has the device to itself.

  Every launcher runs its batches one after another, so batches of one job
  never overlap; the basic launcher runs a batch's jobs in turn, and SLURM
  gives each job an allocation of its own.
  """
  target = str(launcher.get("_target_", ""))
  name = target.rsplit(".", 1)[-1]
  if max_batch_size == 1 or name in ("BasicLauncher", "SlurmLauncher"):
    return None
  batch_fix = "hydra.sweeper.max_batch_size=1"
  if name == "JoblibLauncher":
    n_jobs = int(launcher.n_jobs)  # joblib: -1 is every core, -2 all but one
    workers = n_jobs if n_jobs > 0 else (os.cpu_count() or 1) + 1 + n_jobs
    if workers <= 1:
      return None
    return (
      f"launcher=joblib runs {workers} jobs at once "
      f"(hydra.launcher.n_jobs={n_jobs})",
      "hydra.launcher.n_jobs=1",
    )
  if name == "LocalLauncher" and "submitit" in target:
    return (
      "launcher=submitit_local starts every job of a batch at once "
      f"(hydra.sweeper.max_batch_size={max_batch_size})",
      batch_fix,
    )
  return (f"the launcher {target or 'in use'} may run jobs at once", batch_fix)


def runs_in_turn(launcher: DictConfig) -> bool:
  """Whether `launcher` runs a batch's jobs one after another on this
  machine (the basic launcher, joblib with one worker), so batches of one
  job cost nothing; SLURM's jobs run at once, each on its allocation."""
  target = str(launcher.get("_target_", ""))
  return device_sharing(launcher, None) is None and "Slurm" not in target


def batches(jobs: list, max_batch_size: int | None) -> list[list]:
  """`jobs` in launches of at most `max_batch_size` (None or -1: one)."""
  size = len(jobs) if max_batch_size in (None, -1) else max_batch_size
  return [jobs[i : i + size] for i in range(0, len(jobs), max(size, 1))]


def check_alone(
  alone: list[bool], launcher: DictConfig, max_batch_size: int | None
) -> None:
  """Refuses a sweep whose runs that need the device alone (`alone[i]`:
  job i does) would run beside other jobs on one machine, naming the
  setting to change."""
  sharing = device_sharing(launcher, max_batch_size)
  if sharing is None:
    return
  shared = sum(
    sum(batch) for batch in batches(alone, max_batch_size) if len(batch) > 1
  )
  if shared:
    what, fix = sharing
    raise ValueError(
      f"Timing runs need the device to themselves, but {what}: {shared} "
      f"timing run(s) of this sweep would share it. Use launcher=basic, or "
      f"{fix} (on a cluster, launcher=submitit_slurm gives each job its "
      "own allocation)."
    )


def refuse_bad_points(jobs: list[list[str]], messages: list) -> None:
  """Exits, with status 1 and a message that names each bad point (up to
  ten) and its first refusal (`messages[i]`, None for a good point), when
  any point of the sweep is bad; before anything is launched."""
  bad = [(job, m) for job, m in zip(jobs, messages) if m is not None]
  if not bad:
    return
  lines = [f"  {shown(job)}: {message}" for job, message in bad[:10]]
  more = f"\n  and {len(bad) - 10} more" if len(bad) > 10 else ""
  # The message alone, on stderr: a traceback through Hydra would hide it.
  raise SystemExit(
    f"curvbench: {len(bad)} of {len(jobs)} sweep points have a setting "
    "that is not allowed; nothing was launched:\n" + "\n".join(lines) + more
  )


def refuse_shared_folders(jobs: list[list[str]], out_dirs: list) -> None:
  """Exits, before anything is launched, when two points of the sweep would
  write into one folder (e.g. a fixed `hydra.sweep.subdir`), naming them."""
  first: dict[Any, list[str]] = {}
  shared = []
  for job, out_dir in zip(jobs, out_dirs):
    if out_dir in first:
      shared.append(f"  {shown(first[out_dir])} and {shown(job)}: {out_dir}")
    first.setdefault(out_dir, job)
  if shared:
    raise SystemExit(
      f"curvbench: {len(shared)} sweep point(s) would write into the "
      "folder of another (each point needs its own: keep ${hydra:job."
      "override_dirname} in hydra.sweep.subdir); nothing was launched:\n"
      + "\n".join(shared[:10])
    )
