"""What one run measures: each kind turns a problem and a curvature into tables.

A measurement is `fn(problem, curvature, params, batch, cfg, rng)` returning
`{table name: rows}`, `cfg` the whole run config; `MEASUREMENTS` maps the
config's `measure.kind` to it. Adding a kind means adding one function here
and one file in conf/measure/.
"""

from __future__ import annotations

from collections.abc import Callable

from omegaconf import DictConfig, OmegaConf

from curvbench import spectra, timing, training


def section(node) -> dict:
  """A config section as a plain dict (resolved)."""
  if isinstance(node, DictConfig):
    return OmegaConf.to_container(node, resolve=True)
  return dict(node)


def uses_curvature(cfg: DictConfig) -> bool:
  """Whether the run's measurement depends on the curvature config."""
  return (cfg.measure.kind != "training"
          or training.optimizer_kind(cfg.optimizer.name).uses_curvature)


def measure_spectra(problem, curvature, params, batch, cfg, rng):
  spectrum, quality = spectra.measure(problem.loss_fn, curvature, params,
                                      batch, section(cfg.measure.spectra), rng)
  return dict(spectra=spectrum, quality=quality)


def measure_timing(problem, curvature, params, batch, cfg, rng):
  rows = timing.measure(problem.loss_fn, curvature, params, batch,
                        section(cfg.measure.timing), rng,
                        progress=cfg.progress)
  env = timing.environment()
  device = dict(device_kind=env["device_kind"], platform=env["platform"],
                jax_version=env["jax_version"])
  return dict(timing=[dict(device, **row) for row in rows])


def measure_training(problem, curvature, params, batch, cfg, rng):
  del batch
  optimizer = training.make_optimizer(problem.loss_fn, section(cfg.optimizer),
                                      curvature)
  rows = training.run(problem, optimizer, params, section(
      cfg.measure.training), rng, progress=cfg.progress)
  return dict(training=rows)


MEASUREMENTS: dict[str, Callable] = {"spectra": measure_spectra,
                                     "timing": measure_timing,
                                     "training": measure_training}
