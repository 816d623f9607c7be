"""A sweeper that checks every point before it launches any, leaves out the
points that repeat another, and adds each optimizer's tuning grid to the
runs of the tuning protocol.

Like Hydra's basic sweeper it runs the cartesian product of the swept
values (`a=1,2 b=x,y`, and `hydra.sweeper.params`), or, where an
experiment measures different things over different axes, the union of
the products of `hydra.sweeper.sweeps` (a list of such mappings, each
with `params` and the command line's values added); it is written on
Hydra's public plugin API (`Sweeper`, `OverridesParser`, the launcher from
`Plugins`). A grid that differs per optimizer (learning rates for Adam,
learning rates and momenta for SGD, none for K-FAC) is not a product, so
`tuning.grid`,

    tuning:
      grid:
        adam: {learning_rate: [1.0e-4, 1.0e-3, 1.0e-2]}
        sgd: {learning_rate: [0.01, 0.1], momentum: [0.9, 0.99]}

multiplies each job of a measurement that is `tuned` (training) by the grid
of its optimizer, as `optimizer.KEY=VALUE` overrides, so every point has
its own run directory.

Before launching or writing anything, it composes and checks every job's
config and folder: one bad point stops the sweep, naming each bad point's
setting (or the folder that is not curvbench's, or the points that would
share one); a run that needs the device alone (timing) that the launcher
would run beside another job on the same machine is refused
(`device_sharing`). Then a point that repeats another
(`curvbench.runs.skip_reason`: e.g. a spectra run with an optimizer it
does not use; a canonical value no point takes is first replaced by the
sweep's own, `runs.swept_canonical`) is left out, named in one line, so a
cluster sees only jobs
that measure and the report only runs that count, and a point
that finished earlier with the same config, code and data (`runs.cached`)
is not launched either, so a restarted sweep goes straight to the runs it
has left.
"""

import dataclasses
import itertools
import json
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, cast

from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.plugins import Plugins
from hydra.errors import HydraException
from hydra.plugins.sweeper import Sweeper
from hydra.core.utils import JobReturn, JobStatus
from omegaconf import DictConfig, OmegaConf, open_dict, read_write

from curvbench import config, devices, measurements, records, runs

if TYPE_CHECKING:
  from hydra.plugins.launcher import Launcher
  from hydra.types import HydraContext

SWEEP_MARKER = records.SWEEP_MARKER  # see `records.claim`
# `{folder: the point's full name}` of the folders a sweep named by the
# values that vary across it, so that a later sweep into the same
# directory reuses only its own.
FOLDERS = ".curvbench-folders.json"
# The subdir the config gives a sweep's points (conf/config.yaml): where it
# is this, the sweeper names each point's folder (`folder_names`).
DEFAULT_SUBDIR = "${curvbench_run_dir:${hydra:job.override_dirname}}"
SUBDIR = "hydra.sweep.subdir"


def register() -> None:
  """Makes the sweeper known to Hydra where its plugin scan misses it.

  Hydra lists `hydra_plugins` modules with pkgutil, which cannot see
  through setuptools' editable-install finder; importing the package
  stores the config node, and this adds the class to Hydra's plugin
  table.
  """
  name = f"{TuningSweeper.__module__}.{TuningSweeper.__name__}"
  Plugins.instance().class_name_to_class.setdefault(name, TuningSweeper)


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


def ended(job: list[str], result: JobReturn) -> runs.Ending:
  """How a launched job ended: the `runs.Ending` its task returned, or an
  error for one that raised (its exception named)."""
  if result.status == JobStatus.COMPLETED and isinstance(
    result.return_value, runs.Ending
  ):
    return result.return_value
  folder = (
    shown(job)
    if result.hydra_cfg is None
    else OmegaConf.select(
      result.hydra_cfg, "hydra.runtime.output_dir", default=shown(job)
    )
  )
  if result.status == JobStatus.COMPLETED:  # another task's return
    return runs.Ending(str(folder), "complete", float("nan"))
  try:
    result.return_value  # noqa: B018 - raises the job's exception
  except Exception as e:  # noqa: BLE001 - named in the sweep's summary
    reason = f"{type(e).__name__}: {e}"
  return runs.Ending(str(folder), "error", float("nan"), reason=reason)


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
  launcher: DictConfig, max_batch_size: Optional[int]
) -> Optional[tuple]:
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


def batches(jobs: list, max_batch_size: Optional[int]) -> list[list]:
  """`jobs` in launches of at most `max_batch_size` (None or -1: one)."""
  size = len(jobs) if max_batch_size in (None, -1) else max_batch_size
  return [jobs[i : i + size] for i in range(0, len(jobs), max(size, 1))]


def check_alone(
  alone: list[bool], launcher: DictConfig, max_batch_size: Optional[int]
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


def _devices(cfg) -> tuple | None:
  """The `(device, devices)` a composed config runs on."""
  return None if cfg is None else (cfg.device, int(cfg.devices))


def _earlier_sweep(folder: Path) -> bool:
  """Whether `folder` is a sweep directory of a curvbench from before the
  sweep marker: its `multirun.yaml` beside run directories."""
  return (folder / "multirun.yaml").exists() and any(
    (run / records.MARKER).exists() for run in folder.iterdir()
  )


class TuningSweeper(Sweeper):
  """The cartesian product of the swept values, checked, with each
  optimizer's `tuning.grid` expanded and the points that repeat another
  left out."""

  # Set by `setup`, which Hydra calls before `sweep`.
  hydra_context: "HydraContext"
  config: DictConfig
  launcher: "Launcher"

  def __init__(self, max_batch_size=None, params=None, sweeps=None):
    super().__init__()
    self.max_batch_size = max_batch_size
    self.params = dict(params or {})
    self.sweeps = (
      cast(list, OmegaConf.to_container(sweeps, resolve=True))
      if OmegaConf.is_config(sweeps)
      else sweeps
    )
    self.hydra_context = self.config = self.launcher = None  # type: ignore[assignment]

  def setup(self, *, hydra_context, task_function, config) -> None:
    self.hydra_context, self.config = hydra_context, config
    self.launcher = Plugins.instance().instantiate_launcher(
      hydra_context=hydra_context, task_function=task_function, config=config
    )

  def sweep(self, arguments):
    sweep_dir = Path(self.config.hydra.sweep.dir)
    claim = lambda check_only: records.claim(
      sweep_dir,
      SWEEP_MARKER,
      "a sweep directory",
      legacy=_earlier_sweep,
      check_only=check_only,
    )
    fix = "choose another folder with hydra.sweep.dir=..."
    try:  # before anything is written
      claim(check_only=True)
      records.check_writable(sweep_dir, fix)
    except (records.ForeignFolder, records.UnwritableFolder) as e:
      raise SystemExit(f"curvbench: {e}") from None
    except OSError as e:  # e.g. a folder that may not be listed
      raise SystemExit(
        f"curvbench: cannot use {sweep_dir} ({e.strerror or e}): {fix}"
      ) from None
    jobs = union(self.params, self.sweeps, arguments)
    grid = cast(
      dict, OmegaConf.to_container(self.config.tuning.grid, resolve=True)
    )
    jobs = expand(
      jobs, grid, self.config.optimizer.name, self.config.measure.kind
    )
    points, names = jobs, self.named(jobs, sweep_dir)
    if names is not None:
      jobs = [[*job, f"{SUBDIR}={quoted(n)}"] for job, n in zip(jobs, names)]
    jobs = self.planned(jobs)
    try:
      claim(check_only=False)
      OmegaConf.save(self.config, sweep_dir / "multirun.yaml")
      if names is not None:
        record_folders(sweep_dir, points, names, self.excluded)
    except OSError as e:  # the disk filled, or turned read-only, since
      raise SystemExit(
        f"curvbench: cannot write to {sweep_dir} ({e.strerror or e}): {fix}"
      ) from None
    return self.launched(jobs, sweep_dir)

  @property
  def excluded(self) -> set:
    """The keys Hydra's `override_dirname` leaves out."""
    return set(self.config.hydra.job.config.override_dirname.exclude_keys)

  def named(self, jobs: list[list[str]], sweep_dir: Path) -> list | None:
    """Each job's folder name (`folder_names`), or None where the config
    names them itself (a `hydra.sweep.subdir` of its own)."""
    subdir = OmegaConf.to_container(self.config.hydra.sweep, resolve=False)
    if cast(dict, subdir).get("subdir") != DEFAULT_SUBDIR:
      return None
    return folder_names(jobs, self.excluded, sweep_dir)

  def launched(self, jobs: list[list[str]], sweep_dir: Path) -> list:
    """Launches `jobs`, a batch at a time (one job at a time where the
    launcher runs them in turn anyway, so that each point's end is told as
    it comes), printing after each the points done, the time elapsed and
    an estimate of the time left; then how the sweep ended, exiting with
    status 1 (`runs.PointsFailed`) when any point failed."""
    size = self.max_batch_size
    if size is None and runs_in_turn(self.config.hydra.launcher):
      size = 1
    returns: list = []
    endings: list[runs.Ending] = []
    start = time.perf_counter()
    for batch in batches(jobs, size):
      results = self.launcher.launch(batch, initial_job_idx=len(endings))
      for job, result in zip(batch, results):
        end = ended(job, result)
        endings.append(end)
        print(
          f"[curvbench] [{len(endings)}/{len(jobs)}] "
          f"{Path(end.folder).name}: {end.status}; "
          + progress(len(endings), len(jobs), time.perf_counter() - start),
          flush=True,
        )
      returns.append(results)
    told = summary(sweep_dir, endings, time.perf_counter() - start)
    if any(e.fails_sweep for e in endings):
      raise runs.PointsFailed(told)
    print(told, flush=True)
    return returns

  def job_config(self, overrides: list[str], num: int) -> tuple:
    """The config a job's task gets (Hydra's node removed) and its output
    directory, composed as the launcher will compose them."""
    cfg = self.hydra_context.config_loader.load_sweep_config(
      self.config, list(overrides)
    )
    with open_dict(cfg):  # as the launchers do; a subdir may use them
      cfg.hydra.job.id = num
      cfg.hydra.job.num = num
    # The run directory interpolates `${hydra:...}`, which reads the
    # global Hydra config: point it at this job while resolving.
    hydra_config = HydraConfig.instance()
    saved = hydra_config.cfg
    hydra_config.set_config(cfg)
    try:
      out_dir = os.path.abspath(
        os.path.join(str(cfg.hydra.sweep.dir), str(cfg.hydra.sweep.subdir))
      )
    finally:
      hydra_config.cfg = saved
    with read_write(cfg), open_dict(cfg):  # a fresh copy per job
      del cfg["hydra"]
    return cfg, out_dir

  def missing_devices(self, configs) -> dict:
    """`{(device, devices): why}` for the device counts of `configs` that
    this machine lacks; asked only where the jobs run in this process (the
    basic launcher: others start processes, or run on other machines,
    which ask for themselves)."""
    launcher = str(self.config.hydra.launcher.get("_target_", ""))
    if not launcher.endswith("BasicLauncher"):
      return {}
    wanted = {d for d in map(_devices, configs) if d is not None}
    devices.request_host_devices(max((n for _, n in wanted), default=1))
    missing = {}
    for platform, count in wanted:
      try:
        devices.local(platform, count)
      except ValueError as e:
        missing[platform, count] = str(e)
    return missing

  def composed(self, job: list[str], num: int) -> tuple:
    """`(config, output directory, first refusal)` of a job; the config is
    None where it does not compose."""
    try:
      cfg, out_dir = self.job_config(job, num)
    except HydraException as e:
      return None, None, config.explain(e, job)
    refusal = next(config.coerced_flags(cfg, job), None)
    if refusal is None:
      try:
        runs.refuse(cfg, out_dir)
      except ValueError as e:  # a ConfigError or a ForeignFolder
        refusal = str(e)
    return cfg, out_dir, refusal

  def planned(self, jobs: list[list[str]]) -> list:
    """The jobs to launch: every job's config and folder checked, and the
    device of the runs that need it alone, before anything is written; the
    points that repeat another, or finished earlier, left out."""
    if len(jobs) >= 100:  # about 0.1 s each
      print(
        f"[curvbench] composing the configs of {len(jobs)} sweep points "
        "before launching.",
        flush=True,
      )
    composed = [self.composed(job, num) for num, job in enumerate(jobs)]
    missing = self.missing_devices([cfg for cfg, _, _ in composed])
    refuse_bad_points(
      jobs,
      [refusal or missing.get(_devices(cfg)) for cfg, _, refusal in composed],
    )
    refuse_shared_folders(jobs, [out_dir for _, out_dir, _ in composed])
    settings = [config.load(cfg) for cfg, _, _ in composed]
    canonical = runs.swept_canonical(settings)
    jobs = [
      [*job, *(f"canonical.{key}={value}" for key, value in chosen.items())]
      for job, chosen in zip(jobs, canonical)
    ]
    settings = [
      dataclasses.replace(
        run, canonical=dataclasses.replace(run.canonical, **chosen)
      )
      for run, chosen in zip(settings, canonical)
    ]
    reasons = [runs.skip_reason(run) for run in settings]
    skip = [reason is not None for reason in reasons]
    done = [
      not skipped and runs.cached(cfg, out_dir)
      for (cfg, out_dir, _), skipped in zip(composed, skip)
    ]
    keep = [
      (job, run.measure.chosen.needs_device_alone)
      for job, run, skipped, finished in zip(jobs, settings, skip, done)
      if not (skipped or finished)
    ]
    check_alone(
      [alone for _, alone in keep],
      self.config.hydra.launcher,
      self.max_batch_size,
    )
    if any(skip):
      print(
        f"[curvbench] {sum(skip)} of {len(jobs)} sweep points repeat "
        "another and are left out ("
        + "; ".join(sorted({r for r in reasons if r}))
        + ").",
        flush=True,
      )
    if any(done):
      # A restarted sweep goes straight to the runs it has left.
      print(
        f"[curvbench] {sum(done)} of {len(jobs)} sweep points finished "
        "earlier with this config, code and data and were not launched "
        "(force=true redoes them).",
        flush=True,
      )
    return [job for job, _ in keep]
