"""One run: checked (its settings and its folder), skipped where it repeats
another sweep point, resumed where it finished earlier with the same
config, code and data, measured into its run directory under that
directory's lock.

A rerun of a sweep skips runs finished with the same config, code and data,
and redoes the others (unfinished, damaged, or measured with other config,
code or data). One process at a time runs a run directory (its lock).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import logging
import os
import traceback
from pathlib import Path
from typing import cast

import jax
import numpy as np
import pandas as pd
from jax.experimental.compilation_cache import compilation_cache
from omegaconf import OmegaConf

import problems
from curvbench import config, provenance
from curvbench.core import devices, environment, records
from curvbench.core.curvatures import parameter_module
from curvbench.measurements import Context
from estimators import graph_matcher


def use_compilation_cache(path: str | None) -> None:
  """Keeps JAX's compiled programs in `path` (the `compilation_cache`
  setting; None: no cache), so a restarted run, or the next seed, loads
  what an earlier one compiled. Every program is kept, however quick its
  compilation: a run compiles many small ones. JAX settles its cache at
  the process's first compilation; where the directory changes, the cache
  is reset so that it takes the new one even after something compiled
  (e.g. a notebook that ran a model before `curvbench.measure`)."""
  if path is None:
    return
  folder = os.path.abspath(os.path.expanduser(path))
  if jax.config.values.get("jax_compilation_cache_dir") != folder:
    jax.config.update("jax_compilation_cache_dir", folder)
    compilation_cache.reset_cache()
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)


def skip_reason(run: config.RunSettings) -> str | None:
  """Why this sweep point repeats another one (None when it does not)."""
  canon, measurement = run.canonical, run.measure.chosen
  kind, opt = measurement.name, run.optimizer.name
  problem = run.problem.label or run.problem.name
  if measurement.problems and problem not in measurement.problems:
    return (
      f"measure.{kind}.problems={measurement.problems} leaves out "
      f"problem={problem}"
    )
  trains = measurement.uses_optimizer(run)
  if not trains and opt != canon.optimizer:
    return (
      f"this {kind} run does not use the optimizer; it runs with "
      f"optimizer={canon.optimizer} only"
    )
  curvature = run.curvature
  if not measurement.uses_curvature(run):
    if curvature.name != canon.curvature or curvature.mode != canon.mode:
      return (
        f"optimizer={opt} does not use the curvature; it runs with "
        f"curvature={canon.curvature}, mode={canon.mode} only"
      )
    return None
  if not curvature.uses_estimation_mode and curvature.mode != canon.mode:
    return (
      f"{curvature.name} ignores curvature.mode; it runs with "
      f"mode={canon.mode} only"
    )
  if trains and not run.optimizer.accepts(curvature):
    return f"optimizer={opt} cannot train with curvature={curvature.name}"
  if (
    trains
    and not canon.train_every_curvature
    and curvature.name != canon.curvature
  ):
    return (
      f"canonical.train_every_curvature=false: optimizer={opt} runs "
      f"with curvature={canon.curvature} only"
    )
  return None


# The dimensions a measurement may leave unused (`config.Canonical`), each
# with a run's value of it.
_CANONICAL_DIMENSIONS = {
  "optimizer": lambda run: run.optimizer.name,
  "curvature": lambda run: run.curvature.name,
  "mode": lambda run: run.curvature.mode,
}


def swept_canonical(points: list[config.RunSettings]) -> list[dict]:
  """Per sweep point, the canonical values (`config.Canonical`) to set so
  that each is one the sweep takes. Where every point sets, e.g.,
  curvature.mode=ggn_exact, the optimizers that use no curvature would
  otherwise run at no point (their canonical mode is the measurement's);
  they run at the sweep's first value instead. Canonical values are not a
  run's identity, so the points keep their folders and run ids. (A null
  mode is a curvature taking its library's; no canonical mode follows it.)"""
  taken = {
    dimension: [v for v in dict.fromkeys(map(value, points)) if v is not None]
    for dimension, value in _CANONICAL_DIMENSIONS.items()
  }
  return [
    {
      dimension: values[0]
      for dimension, values in taken.items()
      if values and getattr(run.canonical, dimension) not in values
    }
    for run in points
  ]


def _identity(run: config.RunSettings, curvature) -> dict:
  """The columns that say what a run measured."""
  measurement = run.measure.chosen
  uses = measurement.uses_curvature(run)
  return dict(
    problem=run.problem.label or run.problem.name,
    measure=measurement.name,
    method=measurement.method_label(run, curvature),
    curvature=curvature.name if uses else None,
    estimator=type(curvature).__name__ if uses else None,
    block_type=getattr(curvature, "block_type", None) if uses else None,
    mode=curvature.mode if uses else None,
    optimizer=(run.optimizer.name if measurement.uses_optimizer(run) else None),
    seed=run.seed,
  )


def registration(problem, curvature, params, batch, rng) -> dict:
  """Which tag each parameter gets (`parameters`, with its `module` and
  `name` in the model's own terms: `curvatures.parameter_module`), and the
  curvature blocks built from them (`blocks`); docs/reference/records.md
  lists the keys."""
  paths = [p for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
  report = dict(
    parameters=[
      dict(row, **dict(zip(("module", "name"), parameter_module(path))))
      for row, path in zip(
        graph_matcher.registration_report(problem.loss_fn, (params, batch)),
        paths,
      )
    ]
  )
  if curvature is not None:
    curvature.init(rng, params, batch)  # traces the model
    report["blocks"] = curvature.registration()
  return report


@contextlib.contextmanager
def quiet_logging(names=("estimators.graph_matcher", "jax")):
  """Raises the named loggers to WARNING for the block, then restores them."""
  loggers = [logging.getLogger(name) for name in names]
  levels = [logger.level for logger in loggers]
  for logger in loggers:
    logger.setLevel(logging.WARNING)
  try:
    yield
  finally:
    for logger, level in zip(loggers, levels):
      logger.setLevel(level)


@contextlib.contextmanager
def released():
  """Releases, when the block ends, the programs JAX compiled in it. A
  sweep runs its points in one process, and each compiled CPU program
  holds memory maps (a transformer's timing run leaves about 2,000) that
  JAX's caches keep alive: past Linux's 65,530 maps per process, LLVM
  cannot compile and the process dies. Later runs load what they need
  from the compilation cache."""
  try:
    yield
  finally:
    jax.clear_caches()
    gc.collect()


def measure(cfg, run_dir) -> dict:
  """Runs the configured measurement and writes its records into `run_dir`;
  returns the fields of its completion marker (`Outcome.marker`: status
  'complete', or 'diverged' with the step and the reason).

  64-bit precision and quiet loggers hold for the measurement only, and
  the programs it compiled are released when it ends (`released`).
  """
  run = config.load(cfg)
  measurement = run.measure.chosen
  float64 = measurement.precision == "float64"
  with (
    devices.use(run.device, run.devices),
    jax.enable_x64(float64),
    quiet_logging(),
    released(),
  ):
    dtype = np.float64 if float64 else np.float32
    problem = problems.make(run.problem)
    curvature = run.curvature.make(problem.loss_fn)
    rng = jax.random.PRNGKey(run.seed)
    params = problem.init_params(jax.random.PRNGKey(run.init_seed), dtype)
    batch = problem.fixed_batch(
      run.measure.batch_size, dtype=dtype, seed=run.data_seed
    )
    ident = _identity(run, curvature)
    run_dir.write_json("metadata.json", dict(problem.metadata(), **ident))
    run_dir.write_json(
      "environment.json", environment.environment(run.device, run.devices)
    )
    run_dir.write_json(
      "registration.json",
      registration(
        problem, curvature if ident["curvature"] else None, params, batch, rng
      ),
    )
    ident.update(
      provenance.columns(cfg, measurement.precision),
      run=run_dir.path.name,
      num_params=problem.num_params,
      batch_size=len(batch[0]),
      num_train=len(problem.data.x_train),
      loss=problem.loss_name,
      task=problem.task,
    )
    ctx = Context(
      problem=problem,
      curvature=curvature,
      params=params,
      batch=batch,
      run=run,
      rng=jax.random.fold_in(rng, 1),
      run_dir=run_dir,
      mesh=devices.mesh(run.device, run.devices),
    )
    outcome = measurement.measure(ctx)
    for name, rows in outcome.tables.items():
      run_dir.write_table(name, records.tidy(rows, **ident))
  return outcome.marker


def stale_reason(run_dir: records.RunDir, cfg) -> str | None:
  """Why a finished run's records do not answer `cfg` (None when they do):
  another config, other code, or other data (see `provenance.run_id`)."""
  marker = cast(dict, run_dir.marker())  # a finished run has one
  if marker.get("run_id") == provenance.run_id(cfg):
    return None
  now = provenance.inputs(cfg)
  try:
    old_plugins, now_plugins = (
      dict(json.loads(m.get("plugin_sources") or "{}")) for m in (marker, now)
    )
  except (TypeError, ValueError):
    return "its record of its plugins' code cannot be read"
  if old_plugins != now_plugins:
    changed = provenance.differences(old_plugins, now_plugins)
    return f"the code of its plugins changed ({changed})"
  for key, what in (
    ("code", "code"),
    ("dataset", "data"),
    ("plugins", "code from outside curvbench"),
  ):
    if marker.get(key) != now[key]:
      return (
        f"it was measured with {what} {marker.get(key)}, this is {now[key]}"
      )
  try:
    old = provenance.identity_config(
      OmegaConf.load(run_dir.path / "config.yaml")
    )
  except Exception:  # noqa: BLE001 - missing or damaged: nothing to compare
    return "its config differs (its config.yaml cannot be read)"
  changed = provenance.differences(old, provenance.identity_config(cfg))
  return f"its config differs ({changed or 'written before run ids'})"


def cached(cfg, out_dir) -> bool:
  """Whether `out_dir` holds a run finished with `cfg` and this code, its
  records intact: what `run` answers 'cached' for without measuring
  (never with force=true). The sweeper asks it before launching."""
  run_dir = records.RunDir(out_dir)
  return not cfg.force and run_dir.done and stale_reason(run_dir, cfg) is None


def identity(cfg) -> dict:
  """The `run_id`, `code` and `data` a run's marker carries."""
  return dict(run_id=provenance.run_id(cfg), **provenance.inputs(cfg))


def start(run_dir: records.RunDir, cfg, ident: dict) -> None:
  """Clears `run_dir`, sets space aside for the run's error record (so a
  full disk cannot erase why the run failed: `records.RunDir.reserve`) and
  writes the run's config (`config.yaml` and the `config` table, under the
  run's id)."""
  run_dir.clear()
  run_dir.reserve()
  run_dir.write_text("config.yaml", OmegaConf.to_yaml(cfg, resolve=True))
  run_dir.write_table(
    "config",
    pd.DataFrame([dict(run_id=ident["run_id"], **provenance.flatten(cfg))]),
  )


def record_skip(cfg, out_dir) -> str | None:
  """Records `cfg` in `out_dir` as a skipped run (its config, and a marker
  with the reason) when it repeats another sweep point; returns the reason,
  or None, writing nothing, when the point is to be run.

  The sweeper calls it for every point before launching (taking the run
  directory's lock; one that another process holds is left to it); a run
  started without the sweeper (`curvbench` without -m) calls it itself.
  """
  reason = skip_reason(config.load(cfg))
  if reason and not cached(cfg, out_dir):  # else recorded by an earlier sweep
    run_dir = records.RunDir(out_dir)
    run_dir.check_ours()
    try:
      with run_dir.lock(wait_s=float(cfg.lock_wait_s)):
        _mark_skipped(run_dir, cfg, reason)
    except records.RunLocked:
      pass  # another sweep of these points is recording it
  return reason


def _mark_skipped(run_dir: records.RunDir, cfg, reason: str) -> None:
  ident = identity(cfg)
  start(run_dir, cfg, ident)
  run_dir.mark_done("skipped", reason=reason, **ident)


def refuse(cfg, out_dir) -> None:
  """Raises a `ValueError` where `cfg` may not run into `out_dir`: a
  setting the config refuses (`config.ConfigError`), a folder holding files
  the harness did not write (`records.ForeignFolder`) or one it cannot
  write into (`records.UnwritableFolder`), examples that do not fit the
  problem (`problems.checks.ExamplesError`), or a file the run reads inside
  the folder it would clear."""
  run = config.load(cfg)
  try:  # the examples, against the problem's task, loss and model
    problems.check(run.problem)
  except problems.checks.ExamplesError:
    raise
  except Exception:  # noqa: BLE001 - data that cannot load: the run records why
    pass
  records.RunDir(out_dir).check_ours()
  records.check_writable(
    out_dir,
    "choose another folder (hydra.run.dir=..., "
    "or hydra.sweep.dir=... for a sweep)",
  )
  folder = Path(out_dir).resolve()
  for key, path in run.measure.chosen.inputs(run).items():
    if Path(path).expanduser().resolve().is_relative_to(folder):
      raise config.ConfigError(
        f"{key}={path} lies inside the run's own folder {out_dir}, which "
        "the run clears before it starts: measure it from a run in "
        "another folder (hydra.run.dir=...)."
      )


# The statuses of a run that did not measure what it was asked to.
FAILED = ("diverged", "error")
# Said to a diverged run whose reason names no setting to change.
DIVERGED_ADVICE = (
  "Lower the optimizer's learning rate (optimizer.learning_rate), or raise "
  "its damping where it has one, and run it again."
)


class PointsFailed(SystemExit):
  """Ends a sweep (status 1) whose launched points all ran, some of which
  failed: its message names them and why."""


def duration(seconds: float) -> str:
  """`seconds` as a person reads them: 41 s, 2m10s, 1h05m."""
  seconds = max(0.0, float(seconds))
  if seconds < 60:
    return f"{seconds:.2g} s" if seconds < 10 else f"{seconds:.0f} s"
  minutes, secs = divmod(round(seconds), 60)
  if minutes < 60:
    return f"{minutes}m{secs:02d}s"
  hours, minutes = divmod(minutes, 60)
  return f"{hours}h{minutes:02d}m"


@dataclasses.dataclass(frozen=True)
class Ending:
  """How a run ended, as the command prints it: its folder, status,
  seconds, headline numbers (its measurement's `headline`) and, for one
  that did not finish its measurement, why. `tuning`: a point of a tuning
  grid, whose divergence is an outcome the protocol scores (+inf), not a
  failure of its sweep."""

  folder: str
  status: str
  seconds: float
  headline: str = ""
  reason: str = ""
  step: int | None = None
  tuning: bool = False

  @property
  def failed(self) -> bool:
    """Whether the run did not measure what it was asked to."""
    return self.status in FAILED

  @property
  def fails_sweep(self) -> bool:
    """Whether its sweep counts it as a failed point."""
    return self.failed and not (self.status == "diverged" and self.tuning)

  def why(self) -> str:
    """The reason, with what to do where it names nothing."""
    if self.status == "diverged" and "Try:" not in self.reason:
      return f"{self.reason} {DIVERGED_ADVICE}".strip()
    return self.reason

  def line(self) -> str:
    """The end line: `curvbench: done in 41 s: FOLDER: headline`."""
    took = duration(self.seconds)
    what = {
      "complete": f"done in {took}",
      "cached": "finished earlier with this config, code and data",
      "skipped": "skipped",
      "locked": "left to the process running it",
      "diverged": f"diverged at step {self.step} after {took}"
      if self.step is not None
      else f"diverged after {took}",
      "error": f"failed after {took}",
    }.get(self.status, f"{self.status} after {took}")
    parts = [f"curvbench: {what}", self.folder]
    parts += [self.headline] if self.headline else []
    parts += [self.why()] if self.failed or self.status == "skipped" else []
    return ": ".join(p for p in parts if p)


def ending(
  cfg, out_dir, status: str, seconds: float, reason: str = ""
) -> Ending:
  """How the run into `out_dir` ended (`status`, as `run` returned it), read
  from its records: the completion marker's reason and step, and its
  measurement's headline of the tables it wrote. `reason`: the error of a
  run that raised one."""
  run_dir = records.RunDir(out_dir)
  run = config.load(cfg)
  measurement = run.measure.chosen
  try:
    marker = run_dir.marker() or {}
  except records.DamagedRun:
    marker = {}
  headline = ""
  if status in ("complete", "cached", "diverged"):
    try:
      headline = measurement.headline(run_dir.tables())
    except Exception as e:  # noqa: BLE001 - the run is recorded; say so only
      headline = f"(its headline could not be read: {type(e).__name__}: {e})"
  if status == "error" and not reason:
    reason = error_message(run_dir)
  grid = config.grid_points(config.plain(cfg.tuning.grid))
  return Ending(
    folder=str(out_dir),
    status=status,
    seconds=seconds,
    headline=headline,
    reason=reason or str(marker.get("reason", "")),
    step=marker.get("step") if status == "diverged" else None,
    tuning=measurement.tuned and bool(grid.get(run.optimizer.name)),
  )


def error_message(run_dir: records.RunDir) -> str:
  """The last line of the traceback in the run's `ERROR.json` (the error
  itself), or where to look."""
  path = run_dir.path / records.ERROR
  try:
    lines = json.loads(path.read_text())["traceback"].strip().splitlines()
    return f"{lines[-1]} (its traceback is in {path})"
  except (OSError, ValueError, KeyError, IndexError, TypeError):
    return f"see {path}"


def run(cfg, out_dir) -> str:
  """One run into `out_dir`; returns its status: 'complete', 'diverged',
  'skipped', 'cached' (finished earlier with the same config, code and
  data),
  'locked' (another process is running it) or 'error'. A finished run
  whose config or code differs, or whose records are damaged, is redone.

  The config and the folder are checked first (`refuse`); the rest happens
  under the run directory's lock (`records.RunDir.lock`), waiting at most
  `lock_wait_s` for it, and whether the run is done is asked only once the
  lock is held, so a process that waited finds the run its holder
  finished.
  """
  refuse(cfg, out_dir)
  run_dir = records.RunDir(out_dir)
  with contextlib.ExitStack() as held:
    try:
      held.enter_context(run_dir.lock(wait_s=float(cfg.lock_wait_s)))
    except records.RunLocked as e:
      print(f"[curvbench] skipping the run: {e}", flush=True)
      return "locked"
    return _run_locked(cfg, run_dir)


def _run_locked(cfg, run_dir: records.RunDir) -> str:
  if run_dir.done and not cfg.force:
    stale = stale_reason(run_dir, cfg)
    if stale is None:
      print(
        f"[curvbench] {run_dir.path}: finished earlier with this config, "
        "code and data, skipping (force=true redoes it)."
      )
      return "cached"
    print(f"[curvbench] {run_dir.path}: redoing it, {stale}.")
  elif run_dir.has_marker and not cfg.force:
    print(
      f"[curvbench] {run_dir.path}: redoing it, its records are "
      f"damaged ({run_dir.damage()})."
    )
  reason = skip_reason(config.load(cfg))
  if reason:
    _mark_skipped(run_dir, cfg, reason)
    return "skipped"
  ident = identity(cfg)
  try:
    start(run_dir, cfg, ident)
    outcome = measure(cfg, run_dir)
    (run_dir.path / records.ERROR).unlink(missing_ok=True)
    run_dir.mark_done(**outcome, **ident)  # a full disk may fail it too
  except Exception:
    # Into the space reserved at the start where the disk has filled;
    # nowhere on a read-only disk, where the error itself says so.
    run_dir.write_error(dict(traceback=traceback.format_exc(), **ident))
    if not cfg.continue_on_error:
      raise
    return "error"
  return outcome["status"]
