"""What one run measures: each kind turns a problem and a curvature into tables.

A measurement is `fn(problem, curvature, params, batch, cfg, rng, run_dir)`
returning `{table name: rows}`, `cfg` the whole run config and `run_dir` the
`records.RunDir` (for checkpoints); `MEASUREMENTS` maps the config's
`measure.kind` to it. Adding a kind means adding one function here and one
file in conf/measure/. Each runs on the `devices` setting's devices
(`devices.mesh`), its batches split across them.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from omegaconf import DictConfig, OmegaConf

from curvbench import checkpoints, data, devices, spectra, timing, training
from curvbench.costs import Costs


def section(node) -> dict:
  """A config section as a plain dict (resolved)."""
  if isinstance(node, DictConfig):
    return OmegaConf.to_container(node, resolve=True)
  return dict(node)


def uses_curvature(cfg: DictConfig) -> bool:
  """Whether the run's measurement depends on the curvature config: training
  and timing only when the optimizer uses a curvature."""
  return (cfg.measure.kind not in ("training", "timing")
          or training.optimizer_kind(cfg.optimizer.name).uses_curvature)


def uses_optimizer(cfg: DictConfig) -> bool:
  """Whether the run uses the optimizer group: training runs, timing runs
  (they time its step), and spectra taken after step 0 of a training run
  (rather than from a checkpoint)."""
  if cfg.measure.kind in ("training", "timing"):
    return True
  spec = cfg.measure.spectra
  return (cfg.measure.kind == "spectra" and spec.checkpoint is None
          and spec.steps != [0])


def mesh(cfg: DictConfig) -> Mesh:
  """The mesh of the run's `device` and `devices` settings."""
  return devices.mesh(cfg.device, int(cfg.devices))


def _save_checkpoint(run_dir, problem, step, params):
  checkpoints.save(checkpoints.path_for(run_dir.path / "checkpoints", step),
                   params, step=step, problem=problem.name)


def _checkpoint_params(path, steps, problem, params):
  """`{step: params}` from a checkpoint file, or from a run directory's
  checkpoints at `steps`, checked against the problem's `params`."""
  path = Path(path)
  if path.is_dir():
    found = checkpoints.steps_in(path)
    missing = [s for s in steps if s not in found]
    if missing:
      raise ValueError(
          f"No checkpoint for steps {missing} in {path} (it has steps "
          f"{sorted(found)}): measure at those, or train further.")
    files = {s: found[s] for s in steps}
  else:
    files = {None: path}
  out = {}
  for step, file in files.items():
    loaded, info = checkpoints.load(file)
    checkpoints.check_matches(loaded, params, path=file,
                              problem=info["problem"],
                              expected_problem=problem.name)
    dtype = jax.tree.leaves(params)[0].dtype
    out[info["step"]] = jax.tree.map(lambda x: jnp.asarray(x, dtype), loaded)
  return out


def measure_spectra(problem, curvature, params, batch, cfg, rng, run_dir):
  """Spectra, quality, statistics and heatmaps at each chosen point: steps
  of a training run (trained here with the optimizer group, checkpoints
  saved) or saved checkpoints; a `cost` table says what each phase took."""
  del batch
  spec = section(cfg.measure.spectra)
  train_cfg = section(cfg.measure.training)
  # Not empty: `config.validate` refuses that.
  steps = training.measurement_steps(spec["steps"],
                                     int(train_cfg["num_steps"]))
  dtype = jax.tree.leaves(params)[0].dtype
  on = mesh(cfg)
  examples = data.select(problem, spec["data"], cfg.measure.batch_size,
                         spec["chunk_size"], dtype, seed=int(cfg.data_seed))
  examples = examples.split(on, "measure.spectra.chunk_size"
                            if data.parse_scope(spec["data"])[0] == "train"
                            else "measure.batch_size")
  scope = dict(data=spec["data"])
  tables = {name: [] for name in (*spectra.TABLES, "cost", "training")}

  def at(step, point):
    log = (lambda line: print(line, flush=True)) if cfg.progress else None
    costs = Costs(log=log, step=step, **scope)
    point = devices.replicate(point, on)
    for name, rows in spectra.measure(problem.loss_fn, curvature, point,
                                      examples, spec, rng, costs).items():
      tables[name] += [dict(step=step, **scope, **row) for row in rows]
    tables["cost"] += costs.rows
    if spec["save_checkpoints"]:
      _save_checkpoint(run_dir, problem, step, point)

  if spec["checkpoint"] is not None:
    for step, point in _checkpoint_params(spec["checkpoint"], steps, problem,
                                          params).items():
      at(step, point)
  elif steps == [0]:
    at(0, params)
  else:
    name = cfg.optimizer.name
    optimizer = training.make_optimizer(problem.loss_fn,
                                        section(cfg.optimizer), curvature, on)
    rows = training.run(problem, optimizer, params, train_cfg,
                        jax.random.fold_in(rng, 2), int(cfg.data_seed),
                        progress=cfg.progress,
                        at_steps=steps, on_step=at, mesh=on)
    # The loss curve is the optimizer's, labelled as a training run's.
    method = training.method_label(name, curvature)
    tables["training"] = [dict(row, method=method) for row in rows]
  return {name: rows for name, rows in tables.items() if rows}


def measure_timing(problem, curvature, params, batch, cfg, rng, run_dir):
  """Per-phase times of the curvature and of the optimizer's step, against
  an Adam step with the settings of `measure.timing.baseline`."""
  del run_dir
  rows = timing.measure(problem.loss_fn, curvature, params, batch,
                        section(cfg.measure.timing), section(cfg.optimizer),
                        section(cfg.measure.timing.baseline), rng,
                        progress=cfg.progress, mesh=mesh(cfg))
  return dict(timing=rows)  # the device is among every row's provenance


def measure_training(problem, curvature, params, batch, cfg, rng, run_dir):
  """The loss curve; checkpoints at `measure.training.checkpoint_steps`."""
  del batch
  train_cfg = section(cfg.measure.training)
  steps = training.measurement_steps(train_cfg["checkpoint_steps"],
                                     int(train_cfg["num_steps"]))

  on = mesh(cfg)
  optimizer = training.make_optimizer(problem.loss_fn, section(cfg.optimizer),
                                      curvature, on)
  rows = training.run(problem, optimizer, params, train_cfg, rng,
                      int(cfg.data_seed), progress=cfg.progress,
                      at_steps=steps,
                      on_step=lambda step, point: _save_checkpoint(
                          run_dir, problem, step, point), mesh=on)
  return dict(training=rows)


MEASUREMENTS: dict[str, Callable] = {"spectra": measure_spectra,
                                     "timing": measure_timing,
                                     "training": measure_training}
