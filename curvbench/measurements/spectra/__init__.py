"""Spectra: the curvature against the exact matrices it approximates, at
chosen points (steps of a training run, or saved checkpoints) over chosen
data (a batch, N batches, the training split), each point measured on
several samples of that data (`samples`); the computation is `compute`
(the settings read once into a `plan`, then the `dense` or the `lanczos`
method, their rows built by `rows`), the figures `figures`, the report's
tables `summary`."""

import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree

from curvbench.components import (
  Choice,
  Flag,
  ListOf,
  Number,
  OneOf,
  Parsed,
  Text,
  Whole,
  setting,
)
from curvbench.core import (
  checkpoints,
  curvatures,
  devices,
  metrics,
  plots,
  registration_report,
  stats,
  training,
)
from curvbench.core.costs import Costs
from curvbench.core.data import parse_scope, select
from curvbench.core.references import ReferenceStore, content_hash
from curvbench.core.sections import Section, spread
from curvbench.measurements import MEASUREMENTS, Measurement, Outcome
from curvbench.measurements.spectra import (
  class_means,
  compute,
  figures,
  summary,
)
from curvbench.measurements.training import save_checkpoint
from curvbench.optimizers import OPTIMIZERS

POSITIVE = Number(0, low_in=False)
COUNT = Whole(1)


def _measured_steps(value) -> None:
  if not training.measurement_steps(value, 2**62):
    raise ValueError(
      "measure.spectra.steps is empty: give at least one "
      "training step to measure at (0: initialisation)."
    )


@MEASUREMENTS.register
@dataclasses.dataclass
class Spectra(Measurement):
  """Eigenvalues of the exact matrices and the approximation, the
  approximation's quality per layer block, per block type (attention,
  MLP, embedding, norm, conv, other dense layers) and for the whole network,
  spectral statistics, exact-vs-approximate heatmaps, and what each phase
  cost."""

  name = "spectra"
  tables = (*compute.TABLES, "cost")
  # An approximation is compared with the exact matrix of its own kind, so
  # it is estimated exactly too, unless a sampled mode is asked for.
  default_mode = "ggn_exact"

  precision: str = setting(
    "float64",
    OneOf(("float32", "float64")),
    "the floating-point precision it runs in",
  )
  method: str = setting(
    "dense",
    OneOf(tuple(compute.METHODS)),
    "dense (small models) or lanczos (matrix-free)",
  )
  data: str = setting(
    "batch",
    Parsed(parse_scope, "batch, batches:N (N >= 1) or train"),
    "batch, batches:N (the first N) or train (the split)",
  )
  samples: int = setting(
    3,
    COUNT,
    "draws of that data measured apart at each step (batch: "
    "consecutive batches; batches:N: consecutive sets of N), each a "
    "sample of every table, so the report can give a spread; data=train "
    "has one",
  )
  chunk_size: int | None = setting(
    None,
    Whole(1, null=True),
    "examples per chunk with data=train (null: the batch size)",
  )
  steps: Any = setting(
    [0],
    Parsed(
      _measured_steps,
      "a non-empty list of whole numbers >= 0, or 'log:N' (N >= 2)",
    ),
    "training steps to measure at (0: the "
    "initialisation; later ones train with the optimizer "
    "group for measure.training.num_steps steps)",
  )
  trainer: Any = setting(
    None,
    Choice(OPTIMIZERS),
    "the optimizer that trains to the measured "
    "steps (measure/spectra/trainer=NAME, its settings "
    "measure.spectra.trainer.KEY), so that a sweep over the optimizer "
    "group measures every approximation at one training run's "
    "parameters; null: the run's optimizer group",
  )
  checkpoint: str | None = setting(
    None,
    Text(null=True),
    "measure saved parameters instead: a "
    ".safetensors file, or a run directory (its checkpoints at steps)",
  )
  save_checkpoints: bool = setting(
    False, Flag(), "save the parameters of each measured step"
  )
  references: list[str] = setting(
    ["ggn", "fisher", "empirical_fisher", "hessian"],
    ListOf(OneOf(curvatures.EXACT_MATRICES), 1),
    "the exact matrices measured (and the approximation's own), the "
    "approximation's quality against each",
  )
  relative_dampings: list[float] = setting(
    [1e-4, 1e-3, 1e-2],
    ListOf(POSITIVE, 1),
    "the natural-gradient "
    "cosine's dampings rho: each matrix damped by rho times its own "
    "largest eigenvalue, so matrices of different scale are compared at "
    "the same effective damping",
  )
  damping: float = setting(
    1e-3,
    POSITIVE,
    "the absolute damping of the "
    "heatmaps' inverses and the damped condition "
    "number",
  )
  top_k: int = setting(
    10, COUNT, "eigenspace overlap; outliers among the top k"
  )
  relative_floor: float = setting(
    1e-8,
    Number(0, 1),
    "|eigenvalue| below this times the largest counts "
    "as zero (at least 10 round-offs of the precision)",
  )
  num_samples: int = setting(
    1, COUNT, "draws averaged for sampled estimation modes"
  )
  lanczos_iters: int = setting(60, COUNT, "Lanczos steps (lanczos method)")
  slq_probes: int = setting(4, COUNT, "SLQ probes (lanczos method)")
  frobenius_probes: int = setting(8, COUNT, "probes of Frobenius errors")
  trace_probes: int = setting(30, COUNT, "Hutchinson and XTrace probes")
  diagonal_probes: int = setting(30, COUNT, "stochastic-diagonal probes")
  target_precision: float = setting(
    0.05,
    POSITIVE,
    "lanczos method: the relative standard error its "
    "probe-estimated quality metrics are to reach (0.05: 5 % of the "
    "value); each such quality row records its stderr and "
    "probes_needed, the probes that would reach it",
  )
  probe_batch: int | None = setting(
    None,
    Whole(1, null=True),
    "lanczos method: probes the SLQ, "
    "Frobenius and diagonal-error estimates evaluate at once (null: all "
    "of them); fewer bound the memory at that many probes' vectors",
  )
  per_block: bool = setting(
    True, Flag(), "lanczos method: quality per layer block too"
  )
  # On by default: a handful of types, each costing no more than a layer
  # block's quality (dense: eigendecompositions of sizes that sum to the
  # parameter count; lanczos: one masked top-k and Frobenius estimate).
  per_block_type: bool = setting(
    True,
    Flag(),
    "quality per block type too (attention, mlp, embedding, "
    "norm, conv, dense, other): the sub-matrices over all layers of a "
    "type (none where one type holds every layer)",
  )
  heatmap_blocks: int = setting(
    4, Whole(0), "middle layer blocks drawn as heatmaps (0: none)"
  )
  heatmap_units: int = setting(
    8, COUNT, "parameters subsampled per drawn block"
  )
  cg_iters: int = setting(100, COUNT, "conjugate-gradient steps")
  max_dense_gib: float = setting(
    2.0, POSITIVE, "refuse a dense matrix larger than this"
  )
  class_means: bool = setting(
    False,
    Flag(),
    "Papyan's class-mean test (ICML 2019, JMLR 2020), for a softmax "
    "cross-entropy classifier without batch norm: the eigenvalues of the "
    "class-mean matrix G1, one per class, to set beside the exact GGN's "
    "top ones (spectra rows of source class_means), and the overlap of "
    "the GGN's top-C eigenspace with the class means' span (statistic "
    "class_mean_overlap); costs C vector-Jacobian products over the data",
  )
  share_references: bool = setting(
    True,
    Flag(),
    "dense method in a sweep: keep each exact reference "
    "(matrix, eigendecompositions of the whole, its blocks and block "
    "types), the mean gradient and the training trajectory in the sweep "
    "folder's .references, keyed by the content they were computed "
    "from, so the sweep's other runs at the same point read them instead",
  )

  def trains(self) -> bool:
    """Whether it trains to its steps (rather than starting from the
    initialisation or a checkpoint)."""
    return self.checkpoint is None and self.steps != [0]

  def uses_optimizer(self, run):
    return self.trains() and self.trainer is None

  def inputs(self, run):
    if self.checkpoint is None:
      return {}
    return {"measure.spectra.checkpoint": self.checkpoint}

  def batches(self, run):
    out = []
    if self.trains():
      out.append(("problem.batch_size", run.problem.batch_size))
    if parse_scope(self.data)[0] == "train":
      out.append(("measure.spectra.chunk_size", self.chunk_size))
    elif run.measure.batch_size is not None:
      out.append(("measure.batch_size", run.measure.batch_size))
    else:
      out.append(("problem.batch_size", run.problem.batch_size))
    return out

  def run_disagreements(self, run, prefix):
    try:
      training.measurement_steps(self.steps, run.measure.training.num_steps)
    except ValueError as e:
      yield f"{prefix}.steps: {e}"
    kind, count = parse_scope(self.data)
    train = (run.problem.data.sizes() or (None,))[0]
    size = run.measure.batch_size or run.problem.batch_size
    if kind == "batches" and train is not None and count * size > train:
      yield (
        f"{prefix}.data={self.data!r} asks for {count} batches of "
        f"{size}, more than the {train} training examples of dataset "
        f"{run.problem.data.name!r}: ask for fewer, or use 'train' for "
        "the whole split."
      )

  def method_label(self, run, curvature):
    return curvature.label

  def ignored(self):
    if parse_scope(self.data)[0] == "train" and self.samples > 1:
      return {
        "samples": "data=train measures the whole training split, "
        "which is one sample (seeds give the spread)"
      }
    return {}

  def sample_count(self) -> int:
    """The samples measured at each step: one over the training split."""
    return 1 if parse_scope(self.data)[0] == "train" else self.samples

  def measure(self, ctx):
    num_steps = ctx.run.measure.training.num_steps
    steps = training.measurement_steps(self.steps, num_steps)
    dtype = jax.tree.leaves(ctx.params)[0].dtype
    if self.class_means:
      class_means.check_applies(ctx.problem)
    split = self.batches(ctx.run)[-1][0]
    samples = [
      select(
        ctx.problem,
        self.data,
        ctx.run.measure.batch_size,
        self.chunk_size,
        dtype,
        seed=ctx.run.data_seed,
        sample=j,
      ).split(ctx.mesh, split)
      for j in range(self.sample_count())
    ]
    store = (
      ReferenceStore.of_run(ctx.run_dir.path)
      if self.share_references
      else ReferenceStore(None)
    )
    measuring = _Measuring(
      self,
      ctx,
      samples,
      store,
      key=dict(problem=dataclasses.asdict(ctx.run.problem)),
      tables={name: [] for name in (*self.tables, "training")},
    )
    if self.checkpoint is not None:
      for step, point in checkpoint_params(
        self.checkpoint, steps, ctx.problem, ctx.params
      ).items():
        measuring.at(step, point)
    elif not self.trains():
      measuring.at(0, ctx.params)
    else:
      self._train(measuring, steps, dtype)
    tables = measuring.tables
    return Outcome({name: rows for name, rows in tables.items() if rows})

  def _train(self, measuring: "_Measuring", steps, dtype) -> None:
    """Trains to the last of `steps`, measuring at each of them, and
    records the loss curve as the `training` table."""
    ctx, store = measuring.ctx, measuring.store
    optimizer = self.trainer or ctx.run.optimizer
    # Training stops at the last step measured.
    until = dataclasses.replace(
      ctx.run.measure.training, num_steps=steps[-1], budget_s=None
    )

    def train(on_step):
      return training.run(
        ctx.problem,
        optimizer.make(ctx.problem.loss_fn, ctx.curvature, ctx.mesh),
        ctx.params,
        until,
        jax.random.fold_in(ctx.rng, 2),
        ctx.run.data_seed,
        progress=ctx.run.progress,
        at_steps=steps,
        on_step=on_step,
        mesh=ctx.mesh,
      )

    if store.keeps and self.method == "dense":
      # The sweep's other approximations trained the same way read the
      # trajectory instead of training again.
      trajectory = dict(
        measuring.key,
        trainer=dataclasses.asdict(optimizer),
        curvature=(
          dataclasses.asdict(ctx.run.curvature)
          if optimizer.uses_curvature
          else None
        ),
        training=dataclasses.asdict(until),
        steps=steps,
        start=content_hash(ctx.params, ctx.rng),
        data_seed=ctx.run.data_seed,
        devices=ctx.run.devices,
      )
      rows, points = shared_training(
        store, trajectory, train, ctx.params, ctx.problem, dtype
      )
      for step, (point, model_state) in points.items():
        measuring.at(step, point, model_state)
    else:
      rows = train(measuring.at)
    # The loss curve is the optimizer's, labelled as a training run's.
    method = optimizer.label(ctx.curvature)
    measuring.tables["training"] = [dict(row, method=method) for row in rows]

  # --- the report --------------------------------------------------------

  def headline(self, tables):
    quality = tables.get("quality")
    if quality is None or quality.empty:
      return super().headline(tables)
    whole = quality[
      (quality.level == "network") & (quality.step == quality.step.max())
    ]
    parts = [
      f"{metrics.described(metric).words} against {reference} "
      f"{spread(*stats.quartiles(rows.value))}, n={rows.value.notna().sum()}"
      for (reference, metric), rows in whole.groupby(
        ["reference", "metric"], sort=False
      )
      if metric in ("relative_frobenius", "cosine_similarity")
    ]
    step = int(whole.step.max()) if not whole.empty else 0
    where = f"whole network, step {step}, median [quartiles] over n samples"
    return (
      f"{'; '.join(parts)} ({where})" if parts else super().headline(tables)
    )

  def section(self, report, out):
    tables = completed(report.tables)
    if not any(name in tables for name in self.tables):
      return None
    found = Section(
      "Curvature",
      "How close is each approximation to the exact "
      "curvature, over the whole network, per layer and per block type, "
      "and how do their spectra compare?",
    )
    quality = tables.get("quality")
    pairs = tables.get("references")
    if quality is not None:
      alike = registration_report.same_blocks(report, self.name)
      q = summary.with_reasons(summary.quality(quality), alike)
      found.findings += summary.findings(quality)
      lines, table = summary.claims(quality)
      found.findings += lines
      for level, name, title in summary.LEVELS:
        part = q[q.level == level]
        if not part.empty:
          found.tables.append(
            summary.quality_table(name, title, part, detail=level != "network")
          )
      found.tables += [table] if table is not None else []
      found.notes += summary.shared_blocks(quality, alike)
      if (quality.reference == "empirical_fisher").any():
        found.notes.append(summary.EMPIRICAL_FISHER_SCALE)
    if pairs is not None:
      found.notes += summary.same_references(pairs)
    if "statistics" in tables:
      found.tables.append(summary.statistics_table(tables["statistics"]))
    if "cost" in tables:
      found.tables.append(summary.cost_table(tables["cost"]))
    found.figures += self.figures(tables, report.colour, out)
    return found

  @staticmethod
  def figures(tables, colour, out):
    """The spectra, heatmap and quality figures of `tables` drawn into
    `out`, each method in its `colour`; their paths."""
    paths = []
    if "spectra" in tables:
      paths += figures.spectra(tables["spectra"], out, colour=colour)
    if "heatmaps" in tables:
      paths += figures.heatmaps(tables["heatmaps"], out)
    if "quality" in tables:
      q = summary.named(tables["quality"])
      roles = q.level == "role"
      if roles.any():
        paths += figures.quality_per_block_type(q[roles], out, colour)
      q = q[~roles]
      along = q.groupby("problem").step.transform("nunique") > 1
      if along.any():
        paths += figures.quality_through_training(q[along], out, colour)
      if (~along).any():
        paths += figures.quality(q[~along], out, colour)
    if "statistics" in tables:
      paths += figures.statistics(tables["statistics"], out, colour)
    return paths


@dataclasses.dataclass
class _Measuring:
  """A spectra measurement under way: its settings (`spec`), the run's
  context, the data `samples` each point is measured on, the reference
  `store` (entries under `key` plus their content) and the `tables` the
  points add rows to; `programs`, compiled once per run, whatever the
  step and sample."""

  spec: Spectra
  ctx: Any
  samples: list
  store: ReferenceStore
  key: dict
  tables: dict[str, list[dict]]
  programs: dict = dataclasses.field(default_factory=dict)

  def at(self, step, point, model_state=None) -> None:
    """Measures every sample at `point`, the parameters at `step`, and
    adds the rows and the cost of each phase (and of the host work
    between them) to the tables."""
    spec, ctx = self.spec, self.ctx
    start = time.perf_counter()
    point = devices.replicate(point, ctx.mesh)
    # Heatmaps of the first sample only: they show structure, not spread.
    settings = [spec] + [dataclasses.replace(spec, heatmap_blocks=0)] * (
      len(self.samples) - 1
    )
    scope: dict[str, Any] = dict(data=spec.data)
    log = ctx.log if ctx.run.progress else None
    phases = []
    for j, (examples, each) in enumerate(zip(self.samples, settings)):
      costs = Costs(
        log=log, programs=self.programs, step=step, sample=j, **scope
      )
      for name, rows in compute.measure(
        ctx.problem.loss_fn,
        ctx.curvature,
        point,
        examples,
        each,
        jax.random.fold_in(ctx.rng, j),
        costs,
        self.store,
        self.key,
        ctx.problem.layer_roles,
        examples_interact=ctx.problem.has_state,
        outputs=ctx.problem.outputs if spec.class_means else None,
      ).items():
        self.tables[name] += [
          dict(step=step, sample=j, **scope, **row) for row in rows
        ]
      phases += costs.rows
    Costs(log=log, step=step, samples=len(self.samples), **scope).summary(
      phases
    )
    # What the phases leave out (host work between them), so that the
    # table adds up to the measurement's wall time.
    rest = Costs(step=step, sample=0, **scope)
    rest.record(
      "unaccounted",
      time.perf_counter()
      - start
      - sum(row["compile_s"] + row["run_s"] for row in phases),
    )
    self.tables["cost"] += phases + rest.rows
    if spec.save_checkpoints:
      save_checkpoint(ctx, step, point, model_state)


def completed(tables: dict) -> dict:
  """The spectra and quality tables with the location columns filled in
  where older records lack them (`plots.DEFAULTS`; `block` and `level` on
  quality rows only, see `figures.quality_levels`; `sample` 0 and no
  relative damping where a run measured one sample at one damping)."""
  out = dict(tables)
  for name in ("spectra", "quality", "statistics"):
    if name in out:
      df = out[name].copy()
      for column, value in {**plots.DEFAULTS, "sample": 0}.items():
        if column != "block" or name == "quality":
          df[column] = df.get(column, value)
          df[column] = df[column].fillna(value)
      if name == "quality":
        df["relative_damping"] = df.get("relative_damping", np.nan)
        df = figures.quality_levels(df)
      out[name] = df
  return out


def shared_training(store, key, train, params, problem, dtype):
  """`(rows, {step: (params, model state)})` of `train(on_step)` (a
  `training.run` that calls `on_step` at the measured steps), from the
  `store` where another run trained from the same content (`key`)."""

  def compute():
    points = {}
    rows = train(
      lambda step, point, model_state: points.update(
        {step: (point, model_state)}
      )
    )
    scalar = lambda x: x.item()  # numpy and JAX scalars
    found = dict(
      rows=np.array(json.dumps(rows, default=scalar)),
      steps=np.array(sorted(points), np.int64),
    )
    for step, (point, model_state) in points.items():
      found[f"params{step}"] = np.asarray(ravel_pytree(point)[0])
      found[f"state{step}"] = np.asarray(ravel_pytree(model_state)[0])
    return found

  found, _ = store.get(dict(key, quantity="training trajectory"), compute)
  unravel_params = ravel_pytree(params)[1]
  unravel_state = ravel_pytree(problem.init_model_state(dtype))[1]
  points = {
    int(step): (
      unravel_params(jnp.asarray(found[f"params{step}"])),
      unravel_state(jnp.asarray(found[f"state{step}"])),
    )
    for step in found["steps"]
  }
  return json.loads(str(found["rows"])), points


def checkpoint_params(path, steps, problem, params) -> dict:
  """`{step: params}` from a checkpoint file, or from a run directory's
  checkpoints at `steps`, checked against the problem's `params`."""
  path = Path(path)
  if path.is_dir():
    found = checkpoints.steps_in(path)
    missing = [s for s in steps if s not in found]
    if missing:
      raise ValueError(
        f"No checkpoint for steps {missing} in {path} (it has steps "
        f"{sorted(found)}): measure at those, or train further."
      )
    files = {s: found[s] for s in steps}
  else:
    files = {None: path}
  dtype = jax.tree.leaves(params)[0].dtype
  out = {}
  for step, file in files.items():
    loaded, info = checkpoints.load(file)
    if step is not None and info["step"] != step:
      raise ValueError(
        f"checkpoint {file} is named for step {step} but its header says "
        f"step {info['step']}: it was renamed or damaged; measure from "
        "the run's own checkpoints."
      )
    checkpoints.check_matches(
      loaded,
      params,
      path=file,
      problem=info["problem"],
      expected_problem=problem.name,
    )
    out[info["step"]] = jax.tree.map(lambda x: jnp.asarray(x, dtype), loaded)
  return out


__all__ = ["Spectra", "checkpoint_params", "completed", "shared_training"]
