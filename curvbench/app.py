"""The `curvbench` command: one Hydra run per problem x curvature x measurement.

`curvbench [overrides]` runs (or with `-m`, sweeps) measurements into the run
directory; `curvbench report DIR` merges a sweep's runs into tables and
figures. A rerun of a sweep skips runs whose completion marker exists.
"""

from __future__ import annotations

import importlib.metadata
import sys
import traceback
from pathlib import Path

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"
KINDS = ("spectra", "timing", "training")
PRECISIONS = ("float32", "float64")


def run_dir_name(override_dirname: str, limit: int = 120) -> str:
  """A sweep run's directory name: its overrides, hashed when too long."""
  import hashlib
  if len(override_dirname) <= limit:
    return override_dirname or "default"
  digest = hashlib.sha1(override_dirname.encode()).hexdigest()[:12]
  return f"{override_dirname[:limit - 14]}..{digest}"


def _plain(node) -> dict:
  from omegaconf import DictConfig, OmegaConf
  if isinstance(node, DictConfig):
    return OmegaConf.to_container(node, resolve=True)
  return dict(node)


def validate(cfg) -> None:
  """Clear errors for bad choices, before anything expensive runs."""
  import estimators
  import problems
  from curvbench import curvatures, training
  checks = [
      ("problem.name", cfg.problem.get("name"), tuple(problems.BUILDERS)),
      ("curvature.estimator", cfg.curvature.get("estimator"),
       curvatures.ESTIMATORS),
      ("curvature.mode", cfg.curvature.get("mode"), estimators.ESTIMATION_MODES),
      ("optimizer.name", cfg.optimizer.get("name"), training.OPTIMIZERS),
      ("measure.kind", cfg.measure.get("kind"), KINDS),
  ]
  kind = cfg.measure.get("kind")
  if kind in KINDS:
    checks.append((f"measure.{kind}.precision",
                   cfg.measure[kind].get("precision"), PRECISIONS))
  if cfg.curvature.get("estimator") == "block_diagonal":
    checks.append(("curvature.block_type", cfg.curvature.get("block_type"),
                   tuple(curvatures.BLOCK_TYPES)))
  if cfg.curvature.get("estimator") == "implicit_exact":
    checks.append(("curvature.matrix", cfg.curvature.get("matrix"),
                   curvatures.IMPLICIT_MATRICES))
  for key, value, allowed in checks:
    if value not in allowed:
      raise ValueError(f"Unknown {key} {value!r}; choose one of "
                       f"{', '.join(map(str, allowed))}.")


def skip_reason(cfg) -> str | None:
  """Why this sweep point repeats another one (None when it does not)."""
  canon = cfg.canonical
  kind, opt = cfg.measure.kind, cfg.optimizer.name
  if kind in ("spectra", "timing") and opt != canon.optimizer:
    return (f"{kind} does not use the optimizer; it runs with "
            f"optimizer={canon.optimizer} only")
  uses_curvature = kind != "training" or opt == "kfac"
  if not uses_curvature and (cfg.curvature.name != canon.curvature or
                             cfg.curvature.mode != canon.mode):
    return (f"optimizer={opt} does not use the curvature; it runs with "
            f"curvature={canon.curvature}, mode={canon.mode} only")
  if (uses_curvature and cfg.curvature.estimator == "implicit_exact"
      and cfg.curvature.mode != canon.mode):
    return (f"implicit_exact ignores curvature.mode; it runs with "
            f"mode={canon.mode} only")
  return None


def environment() -> dict:
  from curvbench import timing
  versions = {}
  for pkg in ("jax", "jaxlib", "dm-haiku", "optax", "numpy", "pandas",
              "hydra-core", "matfree", "mnist1d", "scikit-learn"):
    try:
      versions[pkg] = importlib.metadata.version(pkg)
    except importlib.metadata.PackageNotFoundError:
      versions[pkg] = None
  return dict(timing.environment(), versions=versions,
              argv=list(sys.argv))


def _identity(cfg, curvature) -> dict:
  kind, opt = cfg.measure.kind, cfg.optimizer.name
  uses_curvature = kind != "training" or opt == "kfac"
  label = curvature.label if uses_curvature else None
  method = (label if kind != "training" else
            (f"kfac[{label}]" if opt == "kfac" else opt))
  return dict(problem=cfg.problem.get("label", cfg.problem.name),
              measure=kind, method=method,
              curvature=curvature.name if uses_curvature else None,
              estimator=curvature.estimator if uses_curvature else None,
              block_type=curvature.block_type if uses_curvature else None,
              mode=curvature.mode if uses_curvature else None,
              optimizer=opt if kind == "training" else None, seed=cfg.seed)


def registration(problem, curvature, params, batch, rng) -> dict:
  """Which tag each parameter gets, and the curvature blocks built from them."""
  import logging
  for name in ("estimators.graph_matcher", "jax"):
    logging.getLogger(name).setLevel(logging.WARNING)
  try:
    from estimators import graph_matcher
    report = dict(parameters=graph_matcher.registration_report(
        problem.loss_fn, (params, batch)))
  except ImportError:  # automatic registration not available
    report = dict(parameters=None)
  if curvature is not None:
    curvature.init(rng, params, batch)  # traces the model
    report["blocks"] = curvature.registration()
  return report


def measure(cfg, run_dir) -> None:
  """Runs the configured measurement and writes its records into `run_dir`.

  The precision is set for the run and restored afterwards.
  """
  import jax
  previous = jax.config.jax_enable_x64
  try:
    _measure(cfg, run_dir)
  finally:
    jax.config.update("jax_enable_x64", previous)


def _measure(cfg, run_dir) -> None:
  import logging

  import jax
  import numpy as np

  import problems
  from curvbench import curvatures, records, spectra, timing, training
  m = _plain(cfg.measure[cfg.measure.kind])
  logging.getLogger("jax").setLevel(logging.WARNING)
  jax.config.update("jax_enable_x64", m.get("precision") == "float64")
  dtype = np.float64 if m.get("precision") == "float64" else np.float32
  problem = problems.make(cfg.problem)
  curvature = curvatures.make(_plain(cfg.curvature), problem.loss_fn)
  rng = jax.random.PRNGKey(cfg.seed)
  params = problem.init_params(jax.random.fold_in(rng, 0), dtype)
  batch = problem.fixed_batch(cfg.measure.get("batch_size"), dtype=dtype)
  ident = _identity(cfg, curvature)
  run_dir.write_json("metadata.json", dict(problem.metadata(), **ident))
  run_dir.write_json("environment.json", environment())
  run_dir.write_json("registration.json", registration(
      problem, curvature if ident["curvature"] else None, params, batch, rng))
  ident.update(run=run_dir.path.name, num_params=problem.num_params,
               batch_size=len(batch[0]))

  kind = cfg.measure.kind
  if kind == "spectra":
    spec, quality = spectra.measure(problem.loss_fn, curvature, params, batch,
                                    m, jax.random.fold_in(rng, 1))
    run_dir.write_table("spectra", records.tidy(spec, **ident))
    run_dir.write_table("quality", records.tidy(quality, **ident))
  elif kind == "timing":
    rows = timing.measure(problem.loss_fn, curvature, params, batch, m,
                          jax.random.fold_in(rng, 1), progress=cfg.progress)
    env = timing.environment()
    run_dir.write_table("timing", records.tidy(
        rows, **ident, device_kind=env["device_kind"],
        platform=env["platform"], jax_version=env["jax_version"]))
  else:
    opt = training.make_optimizer(problem.loss_fn, _plain(cfg.optimizer),
                                  curvature)
    rows = training.run(problem, opt, params, m, jax.random.fold_in(rng, 1),
                        progress=cfg.progress)
    run_dir.write_table("training", records.tidy(rows, **ident))


def run(cfg, out_dir) -> str:
  """One run into `out_dir`; returns 'complete', 'skipped', 'cached' or 'error'."""
  from omegaconf import OmegaConf

  from curvbench import records
  run_dir = records.RunDir(out_dir)
  if run_dir.done and not cfg.force:
    print(f"[curvbench] {out_dir}: finished earlier, skipping (force=true "
          "redoes it).")
    return "cached"
  validate(cfg)
  reason = skip_reason(cfg)
  if reason:
    run_dir.mark_done("skipped", reason=reason)
    return "skipped"
  run_dir.write_text("config.yaml", OmegaConf.to_yaml(cfg, resolve=True))
  try:
    measure(cfg, run_dir)
  except Exception:  # noqa: BLE001 - recorded, then re-raised unless asked not to
    run_dir.write_json("ERROR.json", dict(traceback=traceback.format_exc()))
    if not cfg.continue_on_error:
      raise
    return "error"
  (run_dir.path / "ERROR.json").unlink(missing_ok=True)
  run_dir.mark_done("complete")
  return "complete"


def _hydra_main():
  import hydra
  from hydra.core.hydra_config import HydraConfig
  from omegaconf import OmegaConf
  if not OmegaConf.has_resolver("curvbench_run_dir"):
    OmegaConf.register_new_resolver("curvbench_run_dir", run_dir_name)

  @hydra.main(version_base=None, config_path=str(CONF_DIR),
              config_name="config")
  def main(cfg):
    return run(cfg, HydraConfig.get().runtime.output_dir)

  return main()


def cli(argv=None):
  """Console entry point: `curvbench report DIR` or a Hydra run/sweep."""
  argv = sys.argv[1:] if argv is None else list(argv)
  if argv and argv[0] == "report":
    from curvbench import report
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
    from curvbench import report
    return report.main(["reports/quick"])
  sys.argv = [sys.argv[0]] + argv
  return _hydra_main()


if __name__ == "__main__":
  cli()
