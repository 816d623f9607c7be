"""The `curvbench` command: one Hydra run per problem x curvature x measurement.

`curvbench [overrides]` runs (or with `-m`, sweeps) measurements into the run
directory; `curvbench report DIR` merges a sweep's runs into tables and
figures. A rerun of a sweep skips runs finished with the same config and
code, and redoes the others (unfinished, damaged, or written by other code
or config). One process at a time runs a run directory (its lock); the
command keeps JAX's compiled programs in the `compilation_cache` directory.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import sys
import traceback

import hydra
import jax
import numpy as np
import pandas as pd
from hydra.core.hydra_config import HydraConfig
from omegaconf import OmegaConf

import problems
from curvbench import config, curvatures, devices, measurements, provenance
from curvbench import records
from curvbench import report, training
from estimators import graph_matcher
from hydra_plugins.curvbench_sweeper import tuning_sweeper


def skip_reason(cfg) -> str | None:
  """Why this sweep point repeats another one (None when it does not)."""
  canon = cfg.canonical
  kind, opt = cfg.measure.kind, cfg.optimizer.name
  trains = measurements.uses_optimizer(cfg)
  if not trains and opt != canon.optimizer:
    return (f"this {kind} run does not use the optimizer; it runs with "
            f"optimizer={canon.optimizer} only")
  if not measurements.uses_curvature(cfg):
    if (cfg.curvature.name != canon.curvature
        or cfg.curvature.mode != canon.mode):
      return (f"optimizer={opt} does not use the curvature; it runs with "
              f"curvature={canon.curvature}, mode={canon.mode} only")
    return None
  family = curvatures.family(cfg.curvature)
  if not family.uses_estimation_mode and cfg.curvature.mode != canon.mode:
    return (f"{cfg.curvature.name} ignores curvature.mode; it runs with "
            f"mode={canon.mode} only")
  if trains and not training.optimizer_kind(opt).accepts(family):
    return (f"optimizer={opt} cannot train with curvature="
            f"{cfg.curvature.name}")
  return None


def _identity(cfg, curvature) -> dict:
  kind, opt = cfg.measure.kind, cfg.optimizer.name
  uses_curvature = measurements.uses_curvature(cfg)
  trains = measurements.uses_optimizer(cfg)
  label = curvature.label if uses_curvature else None
  method = (label if kind == "spectra" else training.method_label(
      opt, curvature if uses_curvature else None))
  return dict(problem=cfg.problem.label, measure=kind, method=method,
              curvature=curvature.name if uses_curvature else None,
              estimator=cfg.curvature.estimator if uses_curvature else None,
              block_type=curvature.block_type if uses_curvature else None,
              mode=curvature.mode if uses_curvature else None,
              optimizer=opt if trains else None, seed=cfg.seed)


def _precision(cfg) -> str:
  return cfg.measure[cfg.measure.kind].precision


def registration(problem, curvature, params, batch, rng) -> dict:
  """Which tag each parameter gets, and the curvature blocks built from them."""
  report = dict(parameters=graph_matcher.registration_report(
      problem.loss_fn, (params, batch)))
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


def measure(cfg, run_dir) -> dict:
  """Runs the configured measurement and writes its records into `run_dir`;
  returns the run's outcome for its completion marker (status 'complete',
  or 'diverged' with the step).

  64-bit precision and quiet loggers hold for the measurement only.
  """
  kind = cfg.measure.kind
  float64 = _precision(cfg) == "float64"
  with (devices.use(cfg.device, cfg.devices), jax.enable_x64(float64),
        quiet_logging()):
    dtype = np.float64 if float64 else np.float32
    problem = problems.make(cfg.problem)
    curvature = curvatures.make(measurements.section(cfg.curvature),
                                problem.loss_fn)
    rng = jax.random.PRNGKey(cfg.seed)
    params = problem.init_params(jax.random.PRNGKey(cfg.init_seed), dtype)
    batch = problem.fixed_batch(cfg.measure.batch_size, dtype=dtype,
                                seed=int(cfg.data_seed))
    ident = _identity(cfg, curvature)
    run_dir.write_json("metadata.json", dict(problem.metadata(), **ident))
    run_dir.write_json("environment.json", provenance.environment(
        cfg.device, cfg.devices))
    run_dir.write_json("registration.json", registration(
        problem, curvature if ident["curvature"] else None, params, batch,
        rng))
    ident.update(provenance.columns(cfg, _precision(cfg)),
                 run=run_dir.path.name, num_params=problem.num_params,
                 batch_size=len(batch[0]))
    tables = measurements.MEASUREMENTS[kind](
        problem, curvature, params, batch, cfg, jax.random.fold_in(rng, 1),
        run_dir)
    for name, rows in tables.items():
      run_dir.write_table(name, records.tidy(rows, **ident))
  training_rows = tables.get("training", [])
  if training_rows and training_rows[-1]["diverged"]:
    return dict(status="diverged", step=training_rows[-1]["step"],
                reason=f"non-finite loss at step {training_rows[-1]['step']}")
  return dict(status="complete")


def stale_reason(run_dir: records.RunDir, cfg) -> str | None:
  """Why a finished run's records do not answer `cfg` (None when they do):
  another config, or records written by other code."""
  marker = run_dir.marker()
  if marker.get("run_id") != provenance.run_id(cfg):
    old = {}
    if (run_dir.path / "config.yaml").exists():
      old = provenance.identity_config(
          OmegaConf.load(run_dir.path / "config.yaml"))
    changed = provenance.differences(old, provenance.identity_config(cfg))
    return f"its config differs ({changed or 'written before run ids'})"
  code = provenance.code_version()["code"]
  if marker.get("code") != code:
    return f"it was written by code {marker.get('code')}, this is {code}"
  return None


def cached(cfg, out_dir) -> bool:
  """Whether `out_dir` holds a run finished with `cfg` and this code, its
  records intact: what `run` answers 'cached' for without measuring
  (never with force=true). The sweeper asks it before launching."""
  run_dir = records.RunDir(out_dir)
  return (not cfg.force and run_dir.done
          and stale_reason(run_dir, cfg) is None)


def start(run_dir: records.RunDir, cfg) -> dict:
  """Clears `run_dir` and writes the run's config (`config.yaml` and the
  `config` table); returns the `run_id` and `code` its marker carries."""
  run_dir.clear()
  ident = dict(run_id=provenance.run_id(cfg),
               code=provenance.code_version()["code"])
  run_dir.write_text("config.yaml", OmegaConf.to_yaml(cfg, resolve=True))
  run_dir.write_table("config", pd.DataFrame(
      [dict(run_id=ident["run_id"], **provenance.flatten(cfg))]))
  return ident


def record_skip(cfg, out_dir) -> str | None:
  """Records `cfg` in `out_dir` as a skipped run (its config, and a marker
  with the reason) when it repeats another sweep point; returns the reason,
  or None, writing nothing, when the point is to be run.

  The sweeper calls it for every point before launching (taking the run
  directory's lock; one that another process holds is left to it); a run
  started without the sweeper (`curvbench` without -m) calls it itself.
  """
  reason = skip_reason(cfg)
  if reason and not cached(cfg, out_dir):  # else recorded by an earlier sweep
    run_dir = records.RunDir(out_dir)
    try:
      with run_dir.lock(wait_s=float(cfg.lock_wait_s)):
        _mark_skipped(run_dir, cfg, reason)
    except records.RunLocked:
      pass  # another sweep of these points is recording it
  return reason


def _mark_skipped(run_dir: records.RunDir, cfg, reason: str) -> None:
  run_dir.mark_done("skipped", reason=reason, **start(run_dir, cfg))


def run(cfg, out_dir) -> str:
  """One run into `out_dir`; returns its status: 'complete', 'diverged',
  'skipped', 'cached' (finished earlier with the same config and code),
  'locked' (another process is running it) or 'error'. A finished run
  whose config or code differs, or whose records are damaged, is redone.

  The config is checked first; the rest happens under the run directory's
  lock (`records.RunDir.lock`), waiting at most `lock_wait_s` for it, and
  whether the run is done is asked only once the lock is held, so a
  process that waited finds the run its holder finished.
  """
  config.validate(cfg)
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
      print(f"[curvbench] {run_dir.path}: finished earlier with this config "
            "and code, skipping (force=true redoes it).")
      return "cached"
    print(f"[curvbench] {run_dir.path}: redoing it, {stale}.")
  elif run_dir.has_marker and not cfg.force:
    print(f"[curvbench] {run_dir.path}: redoing it, its records are "
          f"damaged ({run_dir.damage()}).")
  reason = skip_reason(cfg)
  if reason:
    _mark_skipped(run_dir, cfg, reason)
    return "skipped"
  ident = start(run_dir, cfg)
  try:
    outcome = measure(cfg, run_dir)
  except Exception:  # noqa: BLE001 - recorded, then re-raised unless asked not to
    run_dir.write_json("ERROR.json", dict(traceback=traceback.format_exc(),
                                          **ident))
    if not cfg.continue_on_error:
      raise
    return "error"
  (run_dir.path / "ERROR.json").unlink(missing_ok=True)
  run_dir.mark_done(**outcome, **ident)
  return outcome["status"]


def use_compilation_cache(path: str | None) -> None:
  """Keeps JAX's compiled programs in `path` (the `compilation_cache`
  setting; None: no cache), so a restarted run loads what an earlier one
  compiled. Every program is kept, however quick its compilation: a run
  compiles many small ones. JAX fixes the directory at its first
  compilation, so this is for the `curvbench` command, before any run."""
  if path is None:
    return
  jax.config.update("jax_compilation_cache_dir",
                    os.path.abspath(os.path.expanduser(path)))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)


def _remove_if_only_hydra(out_dir) -> None:
  """Removes the directory Hydra made for a refused run, unless it holds
  more than Hydra's own files (then it is a run's, from before)."""
  path = records.RunDir(out_dir).path
  if all(p.name == ".hydra" or p.suffix == ".log" for p in path.iterdir()):
    shutil.rmtree(path, ignore_errors=True)


def _hydra_main():
  tuning_sweeper.register()
  config.register_resolvers()

  @hydra.main(version_base=None, config_path=str(config.CONF_DIR),
              config_name="config")
  def main(cfg):
    out_dir = HydraConfig.get().runtime.output_dir
    try:
      config.validate(cfg)
    except config.ConfigError as e:  # the message alone, no traceback
      _remove_if_only_hydra(out_dir)
      raise SystemExit(f"curvbench: {e}") from None
    use_compilation_cache(cfg.compilation_cache)
    return run(cfg, out_dir)

  return main()


def cli(argv=None):
  """Console entry point: `curvbench report DIR` or a Hydra run/sweep."""
  argv = sys.argv[1:] if argv is None else list(argv)
  if argv and argv[0] == "report":
    return report.main(argv[1:])
  if not argv:
    print("curvbench: no arguments, so running the default benchmark "
          "(-m +experiment=quick) and then its report.", flush=True)
    sys.argv = [sys.argv[0], "-m", "+experiment=quick"]
    try:
      _hydra_main()
    except SystemExit as exit_:
      if exit_.code not in (None, 0):
        raise
    return report.main(["reports/quick"])
  sys.argv = [sys.argv[0]] + argv
  return _hydra_main()


if __name__ == "__main__":
  cli()
