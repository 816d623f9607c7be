"""curvbench from Python: your model, your data, the harness's
approximations and measurements, the same records and report as the
command line's::

    import curvbench
    results = curvbench.measure(
        curvbench.Model(apply=net.apply, init=net.init),
        curvbench.Data(x_train, y_train),
        loss="softmax_cross_entropy",
        approximations=["kfac", "ekfac"], measurements=["spectra"],
        seeds=[0, 1, 2])
    results.tables["quality"]          # one row per run, batch and method
    results.report()                   # report.md, figures, CSVs

The model is any JAX function of parameters and a batch of inputs:
Haiku's `transform`, a Flax module's `init`/`apply`, a Flax NNX or
Equinox model split into its arrays and the rest (see examples/). It is
registered as a problem (and the data as a dataset) under `name`, and the
points are the sweep the command line would run: `approximations x
measurements x optimizers x seeds`, with `settings` as further overrides,
the tuning grids expanded, the points that repeat another recorded as
skipped and those finished earlier with the same config, code, data and
model not run again. A registered problem (curvbench's own, or a
plugin's) is measured by its name instead.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, ClassVar

import jax
import numpy as np
import pandas as pd

import curvbench.plugins
import problems
from curvbench import config, planning, report, runs, sweep
from curvbench.components import Whole, setting
from curvbench.core import records
from problems import checks, model_outputs
from problems import data as datasets

# The loss of each task where none is given.
DEFAULT_LOSS = {
  "classification": "softmax_cross_entropy",
  "regression": "squared_error",
  "reconstruction": "sigmoid_cross_entropy",
}


@dataclasses.dataclass(frozen=True)
class Model:
  """Your model: `apply(params, inputs) -> outputs` on a batch, and either
  `init(rng, inputs) -> params` (each seed draws its own) or fixed
  `params`. The outputs are the registered loss's inputs (logits for the
  cross-entropies, predictions for the squared error).

  Where apply returns more than that array, `output` says which part it
  is: `output=0` for `(logits, aux)`, `output="logits"` for a dict or a
  dataclass holding them, `output=(0, "logits")` for a path into nested
  parts (passed on as `problems.Network.output`; `problems.model_outputs`
  says what each form picks). Without it, a model returning anything but
  one array is refused, naming what it returned: no part is guessed."""

  apply: Callable
  init: Callable | None = None
  params: Any = None
  output: model_outputs.Output = None

  def __post_init__(self):
    if (self.init is None) == (self.params is None):
      raise ValueError(
        "Model needs exactly one of init= (a function of a "
        "key and inputs giving parameters) and params= "
        "(fixed parameters)."
      )
    self.network()  # checks `output`

  def network(self) -> problems.Network:
    """The model as a `problems.Network`: its `init` (a function returning
    the fixed `params` where those were given), `apply` and `output`."""
    if self.init is not None:
      return problems.Network(self.init, self.apply, self.output)
    params = self.params
    return problems.Network(lambda rng, inputs: params, self.apply, self.output)

  def fingerprint(self, inputs) -> str:
    """A hash of the computation on `inputs` (the jaxpr of initialisation
    and forward pass) and of fixed parameters' values: the model's part
    of a run's identity."""
    net = self.network()
    jaxpr = jax.make_jaxpr(lambda rng, x: net.outputs(net.init(rng, x), x))(
      jax.random.PRNGKey(0), inputs
    )
    text = str(jaxpr)
    if self.output is not None:  # None keeps earlier records' identity
      text += f"output={self.output!r}"
    if self.params is not None:
      text += datasets.arrays_sha256(
        {
          str(i): np.asarray(leaf)
          for i, leaf in enumerate(jax.tree.leaves(self.params))
        }
      )
    return hashlib.sha256(text.encode()).hexdigest()[:12]


@dataclasses.dataclass(frozen=True)
class Data:
  """Your examples as arrays, one per split: inputs `x_*` (the first axis
  the examples; integer token ids for a sequence model) and targets `y_*`
  (class labels, regression targets; none where the task is the inputs'
  reconstruction). Without a test split, the last `test_fraction` of the
  training examples is held out as one."""

  x_train: Any
  y_train: Any = None
  x_test: Any = None
  y_test: Any = None
  test_fraction: float = 0.2

  def dataset(
    self, name: str, model: Model, task: str, loss: str
  ) -> datasets.Dataset:
    """The examples as dataset `name`, checked (`problems.checks`) against
    the `task`, the `loss` and `model`'s outputs, whose shape is evaluated
    abstractly on one example; raises `problems.checks.ExamplesError`
    naming the array that does not fit and the fix."""
    if self.x_test is None and self.y_test is not None:
      raise checks.ExamplesError(
        "Data: y_test was given without x_test; give both, or neither "
        "(the last test_fraction of the training examples is held out)."
      )
    arrays = dict(
      x_train=np.asarray(self.x_train),
      y_train=self._targets(self.y_train, task, "y_train"),
      x_test=None if self.x_test is None else np.asarray(self.x_test),
      y_test=None
      if self.x_test is None
      else self._targets(self.y_test, task, "y_test"),
    )
    checks.check_arrays(arrays, where="Data")
    if self.x_test is None:
      x, y = arrays["x_train"], arrays["y_train"]
      cut = len(x) - max(1, int(round(self.test_fraction * len(x))))
      if cut < 1:
        raise checks.ExamplesError(
          f"Data: {len(x)} training examples leave none to "
          "train on once a test split is held out; give "
          "more, or x_test and y_test."
        )
      arrays.update(x_train=x[:cut], x_test=x[cut:])
      if y is not None:
        arrays.update(y_train=y[:cut], y_test=y[cut:])
    for split in ("train", "test"):
      x = arrays[f"x_{split}"]
      if not np.issubdtype(x.dtype, np.integer):
        arrays[f"x_{split}"] = x.astype(np.float32)
      if arrays[f"y_{split}"] is None:
        arrays[f"y_{split}"] = np.zeros(len(x), np.int32)
    net = model.network()
    outputs = checks.output_shape(
      lambda rng, x: net.outputs(net.init(rng, x), x),
      arrays["x_train"],
      where="Data",
    )
    labels = task == "classification"
    for split in ("train", "test") if labels else ():
      y = arrays[f"y_{split}"]
      if y.shape[1:] == outputs[1:] and _one_hot(y):
        arrays[f"y_{split}"] = y.argmax(-1)  # one-hot rows: their labels
    checks.check_targets(
      arrays, task=task, loss_name=loss, outputs=outputs, where="Data"
    )
    for split in ("train", "test"):
      y = arrays[f"y_{split}"]
      arrays[f"y_{split}"] = y.astype(np.int32 if labels else np.float32)
    return datasets.Dataset(
      name,
      arrays["x_train"],
      arrays["y_train"],
      arrays["x_test"],
      arrays["y_test"],
      outputs[-1] if labels else 0,
    )

  def _targets(self, y, task, key):
    if task == "reconstruction":
      return None
    if y is None:
      raise checks.ExamplesError(
        f"Data: a {task} task needs targets (y_train, and y_test with "
        f"x_test); {key} is missing."
      )
    y = np.asarray(y)
    if task != "classification" and y.ndim == 1:
      return y[:, None]  # one row of outputs per example
    return y


def _one_hot(y: np.ndarray) -> bool:
  """Whether each row of `y` (over its last axis) is one-hot."""
  if not (np.issubdtype(y.dtype, np.number) or y.dtype == np.bool_):
    return False
  return bool(
    y.shape[-1] > 1 and np.all((y == 0) | (y == 1)) and np.all(y.sum(-1) == 1)
  )


@dataclasses.dataclass(frozen=True)
class Results:
  """What `measure` recorded: the run directories under `path`, their
  status (`runs`) and every table they wrote, merged over the runs
  (`tables`, as `curvbench report` reads them), and how each point this
  call ran ended (`endings`: folder, status, headline, reason)."""

  path: Path
  runs: pd.DataFrame
  tables: dict[str, pd.DataFrame]
  # How each point run by this call ended, as it printed it.
  endings: tuple[runs.Ending, ...] = ()

  def report(
    self, out=None, latex: bool = False, style: str = "screen"
  ) -> dict:
    """Writes the report (`report.md`, `report.html`, figures and CSVs;
    with `latex`, the summary tables as LaTeX, as `--latex` does; figures
    sized by `style`, as `--style`) into `out` (default: `path/report`);
    returns what it wrote."""
    return report.write(self.path, out, latex_tables=latex, style=style)


def _task(task: str | None, loss: str | None) -> tuple[str, str]:
  if task is None:
    task = next(
      (t for t, name in DEFAULT_LOSS.items() if name == loss), "classification"
    )
  if task not in problems.TASKS:
    raise ValueError(
      f"Unknown task {task!r}; choose one of {', '.join(problems.TASKS)}."
    )
  loss = loss or DEFAULT_LOSS[task]
  problems.base.loss(loss)  # refuses an unknown one, naming the others
  return task, loss


def _register(registry, cls, name: str):
  """Registers `cls` as `name`, in place of an earlier `measure` call's
  component of that name (a notebook cell run again); a name a component
  of curvbench or of a plugin holds is refused, naming both."""
  if name in registry and getattr(registry.get(name), "from_python", False):
    registry.unregister(name)
  return registry.register(cls, name=name)


def register_model(
  name: str,
  model: Model,
  examples: Data,
  *,
  task: str | None = None,
  loss: str | None = None,
) -> str:
  """Registers `model` on `examples` as problem `name` (its data as dataset
  `name_data`), so that `problem=name` chooses it; returns the name."""
  task_name, loss_name = _task(task, loss)
  dataset = examples.dataset(f"{name}_data", model, task_name, loss_name)
  sequences = bool(np.issubdtype(dataset.x_train.dtype, np.integer))

  @dataclasses.dataclass
  class YourData(problems.DatasetSettings):
    from_python: ClassVar[bool] = True
    # Checked against the problem's `sequence_model`.
    tokens: ClassVar[bool] = sequences

    def input_shape(self):
      return dataset.input_shape

    def available(self):
      return len(dataset.x_train), len(dataset.x_test)

    def source(self):
      return "arrays given from Python"

    def fingerprint(self):
      return (
        datasets.fingerprint(self.source(), dataclasses.asdict(self))
        + ":"
        + datasets.arrays_sha256(
          dict(
            x_train=dataset.x_train,
            y_train=dataset.y_train,
            x_test=dataset.x_test,
            y_test=dataset.y_test,
          )
        )[:12]
      )

    def load(self):
      return dataclasses.replace(
        dataset,
        x_train=dataset.x_train[: self.num_train],
        y_train=dataset.y_train[: self.num_train],
        x_test=dataset.x_test[: self.num_test],
        y_test=dataset.y_test[: self.num_test],
      )

  @dataclasses.dataclass
  class YourProblem(problems.ProblemSettings):
    from_python: ClassVar[bool] = True
    default_data: ClassVar[str] = f"{name}_data"
    sequence_model: ClassVar[bool] = sequences
    batch_size: int = setting(
      min(64, len(dataset.x_train)), Whole(1), "training batch size"
    )

    def build(self, data):
      return problems.Problem.from_functions(
        model.network(), data, self, task=task_name, loss_name=loss_name
      )

    @classmethod
    @functools.cache
    def source_identity(cls) -> str:
      return f"{task_name}:{loss_name}:" + model.fingerprint(
        dataset.x_train[:2]
      )

  YourProblem.__qualname__ = YourProblem.__name__ = f"Problem_{name}"
  YourData.__qualname__ = YourData.__name__ = f"Dataset_{name}"
  _register(problems.PROBLEMS, YourProblem, name)  # a clash: nothing added
  _register(problems.DATASETS, YourData, f"{name}_data")
  return name


def measure(
  model: Model | str,
  data: Data | None = None,
  *,
  loss: str | None = None,
  task: str | None = None,
  approximations: Sequence[str] = ("kfac",),
  measurements: Sequence[str] = ("spectra",),
  optimizers: Sequence[str] = ("kfac",),
  seeds: Sequence[int] = (0,),
  name: str | None = None,
  out: str | Path | None = None,
  batch_size: int | None = None,
  settings: Sequence[str] = (),
  plugins: Sequence[str] = (),
) -> Results:
  """Measures `model` (a `Model` on `data`, or the name of a registered
  problem) with each of `approximations` (curvature names), `measurements`
  and `optimizers` (where a measurement trains), once per seed, into `out`
  (default `reports/<name>`; `name`, the sweep's, defaults to the
  problem's, or `my_model`); returns the records.

  `loss` is one of `problems.LOSSES` and `task` one of `problems.TASKS`
  (each defaults from the other; classification without either);
  `settings` are further command-line overrides
  (`"measure.spectra.batch_size=128"`) and `plugins` modules or files
  declaring components to import first.

  Raises:
    curvbench.config.ConfigError: for a setting that is not allowed, at
      any point, before anything runs.
    problems.checks.ExamplesError: for examples that do not fit the task,
      the loss or the model (a label outside its outputs, a NaN input,
      splits of unequal length, ...), naming the array and the fix,
      before anything runs.
    problems.model_outputs.OutputError: for a model returning more than
      one array without `Model(output=...)` naming the loss's input, or
      an `output` that names none, before anything runs.
  """
  curvbench.plugins.load(list(plugins))
  name = name or (model if isinstance(model, str) else "my_model")
  if isinstance(model, Model):
    if data is None:
      raise ValueError(
        "measure(Model(...)) needs data=Data(...): the "
        "examples the model is measured on."
      )
    problem = register_model(name, model, data, task=task, loss=loss)
  elif isinstance(model, str):
    problem = model
  else:
    raise TypeError(
      f"model must be a curvbench.Model or the name of a "
      f"registered problem, not {type(model).__name__}."
    )
  out = Path(out or Path("reports") / name)
  swept = [
    f"problem={problem}",
    f"name={name}",
    f"curvature={','.join(approximations)}",
    f"measure={','.join(measurements)}",
    f"optimizer={','.join(optimizers)}",
    f"seed={','.join(str(s) for s in seeds)}",
  ]
  if batch_size is not None:
    swept.append(f"problem.batch_size={batch_size}")
  if plugins:
    swept.append(f"plugins=[{','.join(plugins)}]")
  jobs = planning.product(swept + list(settings))
  base = config.compose(*jobs[0], check=False, with_hydra=True)
  runs.use_compilation_cache(base.compilation_cache)
  excluded = set(base.hydra.job.config.override_dirname.exclude_keys)
  jobs = planning.expand(
    jobs, config.plain(base.tuning.grid), base.optimizer.name, base.measure.kind
  )
  claim = functools.partial(
    records.claim,
    out,
    records.SWEEP_MARKER,
    "a sweep directory (give another with out=)",
  )
  claim(check_only=True)
  names = planning.folder_names(jobs, excluded, out)
  points = [
    (config.compose(*job), out / name) for job, name in zip(jobs, names)
  ]  # every point checked before any runs
  point_settings = [config.load(cfg) for cfg, _ in points]
  for (cfg, _), chosen in zip(points, runs.swept_canonical(point_settings)):
    for key, value in chosen.items():
      cfg.canonical[key] = value
  for cfg, run_dir in points:
    runs.refuse(cfg, run_dir)
  claim()
  planning.record_folders(out, jobs, names, excluded)
  endings = []
  for cfg, run_dir in points:
    if runs.record_skip(cfg, run_dir) is None:
      start = time.perf_counter()
      status = runs.run(cfg, run_dir)
      ended = runs.ending(cfg, run_dir, status, time.perf_counter() - start)
      print(ended.line(), flush=True)  # as the command prints it
      endings.append(ended)
  loaded = sweep.load_sweep(out)
  return Results(out, loaded.runs, loaded.tables, tuple(endings))
