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
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, cast

from hydra.core.hydra_config import HydraConfig
from hydra.core.plugins import Plugins
from hydra.core.utils import JobReturn, JobStatus
from hydra.errors import HydraException
from hydra.plugins.sweeper import Sweeper
from omegaconf import DictConfig, OmegaConf, open_dict, read_write

from curvbench import config, runs
from curvbench.core import devices, records
from curvbench.planning import (
  SUBDIR,
  batches,
  check_alone,
  expand,
  folder_names,
  progress,
  quoted,
  record_folders,
  refuse_bad_points,
  refuse_shared_folders,
  runs_in_turn,
  shown,
  summary,
  union,
)

if TYPE_CHECKING:
  from hydra.plugins.launcher import Launcher
  from hydra.types import HydraContext

SWEEP_MARKER = records.SWEEP_MARKER  # see `records.claim`
# The subdir the config gives a sweep's points (conf/config.yaml): where it
# is this, the sweeper names each point's folder (`folder_names`).
DEFAULT_SUBDIR = "${curvbench_run_dir:${hydra:job.override_dirname}}"


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
    """Keeps Hydra's context and config, and builds the configured
    launcher."""
    self.hydra_context, self.config = hydra_context, config
    self.launcher = Plugins.instance().instantiate_launcher(
      hydra_context=hydra_context, task_function=task_function, config=config
    )

  def sweep(self, arguments):
    """Plans the sweep over `arguments` (the command line's overrides)
    and launches it: checks that the sweep directory is free and
    writable, expands each optimizer's tuning grid, names the run
    folders, records the config, then launches the jobs (`launched`);
    returns the launcher's results, a list per batch. A SystemExit
    explains a folder that cannot be used."""
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
