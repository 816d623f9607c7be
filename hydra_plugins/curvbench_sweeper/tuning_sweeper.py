"""A sweeper that adds each optimizer's tuning grid to the training runs.

Hydra's basic sweeper runs the cartesian product of the swept values; a grid
that differs per optimizer (learning rates for Adam, learning rates and
momenta for SGD, none for K-FAC) is not a product. This sweeper takes the
basic sweeper's jobs and multiplies each training job by the grid that the
config's `tuning.grid` declares for its optimizer:

    tuning:
      grid:
        adam: {learning_rate: [1.0e-4, 1.0e-3, 1.0e-2]}
        sgd: {learning_rate: [0.01, 0.1], momentum: [0.9, 0.99]}

gives `optimizer.learning_rate=...` (and `optimizer.momentum=...`)
overrides, so every point has its own run directory. Jobs of other
measurements, and optimizers without a grid, run once.

Before launching, it composes and validates every job's config: one bad
point stops the sweep, naming each bad point's setting, before anything
is launched; a point that repeats another (`curvbench.app.skip_reason`)
gets its skipped-run record written here and is not launched, so a
cluster sees only jobs that measure; a point that finished earlier with
the same config and code (`curvbench.app.cached`) is not launched either,
so a restarted sweep goes straight to the runs it has left; and a timing
run that the launcher would run beside another job on the same machine is
refused (`device_sharing`).
"""

# No `from __future__ import annotations`: Hydra executes plugin modules
# outside sys.modules, where dataclasses cannot resolve string annotations.
import itertools
import os
from dataclasses import dataclass
from typing import Any, Optional

from hydra._internal.core_plugins import basic_sweeper
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from hydra.plugins.sweeper import Sweeper
from omegaconf import DictConfig, OmegaConf, open_dict, read_write


@dataclass
class TuningSweeperConf:
  _target_: str = (
      "hydra_plugins.curvbench_sweeper.tuning_sweeper.TuningSweeper")
  max_batch_size: Any = None
  params: Any = None


ConfigStore.instance().store(group="hydra/sweeper", name="tuning",
                             node=TuningSweeperConf, provider="curvbench")


def register() -> None:
  """Makes the sweeper known to Hydra where its plugin scan misses it.

  Hydra lists `hydra_plugins` modules with pkgutil, which cannot see
  through setuptools' editable-install finder; importing this module stores
  the config node, and this adds the class to Hydra's plugin table.
  """
  from hydra.core.plugins import Plugins  # pylint: disable=g-import-not-at-top
  name = f"{TuningSweeper.__module__}.{TuningSweeper.__name__}"
  Plugins.instance().class_name_to_class.setdefault(name, TuningSweeper)


def _flat(grid: dict, prefix: str = "") -> dict[str, list]:
  out = {}
  for key, values in grid.items():
    if isinstance(values, dict):
      out.update(_flat(values, f"{prefix}{key}."))
    elif isinstance(values, list) and values:
      out[f"{prefix}{key}"] = values
    else:
      raise ValueError(
          f"tuning.grid: {prefix}{key} must be a non-empty list of values, "
          f"got {values!r}.")
  return out


def expand(jobs: list[list[str]], grid: dict, default_optimizer: str,
           default_measure: str) -> list[list[str]]:
  """Each training job of `jobs` (lists of `key=value` overrides) once per
  point of its optimizer's grid; other jobs unchanged."""

  def choice(job, group, default):
    for item in job:
      key, _, value = item.partition("=")
      if key.lstrip("+") == group:
        return value
    return default

  out = []
  for job in jobs:
    points = _flat(grid.get(choice(job, "optimizer", default_optimizer), {}))
    if choice(job, "measure", default_measure) != "training" or not points:
      out.append(job)
      continue
    taken = {item.partition("=")[0] for item in job}
    clash = sorted(f"optimizer.{k}" for k in points
                   if f"optimizer.{k}" in taken)
    if clash:
      raise ValueError(
          f"{', '.join(clash)} is both swept on the command line and in "
          "tuning.grid; give it in one place.")
    for values in itertools.product(*points.values()):
      out.append(job + [f"optimizer.{k}={v}"
                        for k, v in zip(points, values)])
  return out


def device_sharing(launcher: DictConfig,
                   max_batch_size: Optional[int]) -> Optional[tuple]:
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
    return (f"launcher=joblib runs {workers} jobs at once "
            f"(hydra.launcher.n_jobs={n_jobs})", "hydra.launcher.n_jobs=1")
  if name == "LocalLauncher" and "submitit" in target:
    return ("launcher=submitit_local starts every job of a batch at once "
            f"(hydra.sweeper.max_batch_size={max_batch_size})", batch_fix)
  return (f"the launcher {target or 'in use'} may run jobs at once",
          batch_fix)


def check_timing_alone(timing: list[bool], launcher: DictConfig,
                       max_batch_size: Optional[int]) -> None:
  """Refuses a sweep whose timing runs (`timing[i]`: job i times) would run
  beside other jobs on one machine, naming the setting to change."""
  sharing = device_sharing(launcher, max_batch_size)
  if sharing is None:
    return
  size = len(timing) if max_batch_size in (None, -1) else max_batch_size
  batches = [timing[i:i + size] for i in range(0, len(timing), size or 1)]
  shared = sum(sum(batch) for batch in batches if len(batch) > 1)
  if shared:
    what, fix = sharing
    raise ValueError(
        f"Timing runs need the device to themselves, but {what}: {shared} "
        f"timing run(s) of this sweep would share it. Use launcher=basic, or "
        f"{fix} (on a cluster, launcher=submitit_slurm gives each job its "
        "own allocation).")


def refuse_bad_points(jobs: list[list[str]], configs: list,
                      refusals) -> None:
  """Exits, with status 1 and a message that names each bad point (up to
  ten) and its first setting that `refusals(config)` refuses, when any
  point of the sweep is bad; before anything is launched."""
  bad = [(job, message) for job, cfg in zip(jobs, configs)
         for message in itertools.islice(refusals(cfg), 1)]
  if not bad:
    return
  lines = [f"  {' '.join(job)}: {message}" for job, message in bad[:10]]
  more = f"\n  and {len(bad) - 10} more" if len(bad) > 10 else ""
  # The message alone, on stderr: a traceback through Hydra would hide it.
  raise SystemExit(
      f"curvbench: {len(bad)} of {len(jobs)} sweep points have a setting "
      "that is not allowed; nothing was launched:\n" + "\n".join(lines)
      + more)


class TuningSweeper(Sweeper):
  """The basic sweeper, with each optimizer's `tuning.grid` expanded, and
  with skipped points recorded instead of launched.

  It wraps a `BasicSweeper` rather than subclassing it, and looks the class
  up when it is needed: Hydra's plugin scan executes the basic sweeper's
  module again, replacing the class that an import would have bound.
  """

  def __init__(self, max_batch_size=None, params=None):
    super().__init__()
    self.basic = basic_sweeper.BasicSweeper(max_batch_size=max_batch_size,
                                            params=params)
    self.basic.split_arguments = self.split_arguments
    # `split_arguments` composes every job's config already; the basic
    # sweeper's own check would compose each one a second time.
    self.basic.validate_batch_is_legal = lambda batch: None

  def setup(self, *, hydra_context, task_function, config) -> None:
    self.basic.setup(hydra_context=hydra_context,
                     task_function=task_function, config=config)

  def sweep(self, arguments):
    return self.basic.sweep(arguments)

  def split_arguments(self, overrides, max_batch_size):
    config = self.basic.config
    basic = basic_sweeper.BasicSweeper
    batches = basic.split_arguments(overrides, None)
    jobs = [job for batch in batches for job in batch]
    grid = {}
    if "tuning" in config and config.tuning.grid:
      grid = OmegaConf.to_container(config.tuning.grid, resolve=True)
    jobs = expand(jobs, grid, config.optimizer.name, config.measure.kind)
    jobs = self.launched(jobs, max_batch_size)
    if not jobs:
      return []
    return list(basic.split_overrides_to_chunks(jobs, max_batch_size))

  def job_config(self, overrides: list[str], num: int) -> tuple:
    """The config a job's task gets (Hydra's node removed) and its output
    directory, composed as the launcher will compose them."""
    config = self.basic.hydra_context.config_loader.load_sweep_config(
        self.basic.config, list(overrides))
    with open_dict(config):  # as the launchers do; a subdir may use them
      config.hydra.job.id = num
      config.hydra.job.num = num
    # The run directory interpolates `${hydra:...}`, which reads the
    # global Hydra config: point it at this job while resolving.
    hydra_config = HydraConfig.instance()
    saved = hydra_config.cfg
    hydra_config.set_config(config)
    try:
      out_dir = os.path.abspath(os.path.join(
          str(config.hydra.sweep.dir), str(config.hydra.sweep.subdir)))
    finally:
      hydra_config.cfg = saved
    with read_write(config), open_dict(config):  # a fresh copy per job
      del config["hydra"]
    return config, out_dir

  def launched(self, jobs: list[list[str]],
               max_batch_size: Optional[int]) -> list[list[str]]:
    """The jobs to launch. Every job's config is composed and validated,
    and the timing runs' device checked, before anything is launched or
    recorded; then a point that repeats another is recorded as skipped
    and left out, as is one that finished earlier."""
    # Imported here, not above: curvbench.config imports this module.
    # pylint: disable-next=g-import-not-at-top
    from curvbench import app, config as curvbench_config
    if len(jobs) >= 100:  # about 0.1 s each
      print(f"[curvbench] composing the configs of {len(jobs)} sweep points "
            "before launching.", flush=True)
    composed = [self.job_config(job, num) for num, job in enumerate(jobs)]
    refuse_bad_points(jobs, [cfg for cfg, _ in composed],
                      curvbench_config.refusals)
    skip = [app.skip_reason(cfg) is not None for cfg, _ in composed]
    done = [not skipped and app.cached(cfg, out_dir)
            for (cfg, out_dir), skipped in zip(composed, skip)]
    keep = [(job, cfg.measure.kind == "timing")
            for job, (cfg, _), skipped, finished
            in zip(jobs, composed, skip, done) if not (skipped or finished)]
    check_timing_alone([timing for _, timing in keep],
                       self.basic.config.hydra.launcher, max_batch_size)
    for (cfg, out_dir), skipped in zip(composed, skip):
      if skipped:
        app.record_skip(cfg, out_dir)
    sweep_dir = self.basic.config.hydra.sweep.dir
    if any(skip):
      print(f"[curvbench] {sum(skip)} of {len(jobs)} sweep points repeat "
            "another and were not launched; their skip markers (with the "
            f"reason) are under {sweep_dir}.", flush=True)
    if any(done):
      # A restarted sweep goes straight to the runs it has left.
      print(f"[curvbench] {sum(done)} of {len(jobs)} sweep points finished "
            "earlier with this config and code and were not launched "
            "(force=true redoes them).", flush=True)
    return [job for job, _ in keep]
