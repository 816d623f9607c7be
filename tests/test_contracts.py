"""Every registered component through the shared contract, found by its
registry and listed nowhere: each problem builds, is fully registered and
trains; each optimizer trains and reaches the report; each measurement runs
and reports the tables it declares, and its report holds nothing
inconsistent (each curvature approximation's contract is in
tests/curvbench/core/test_curvatures.py: its products, spectrum and inverse against its
own dense matrix). And a toy problem and block type, declared in this
module, and a toy measurement, declared in its own folder
(tests/toy_measurement), go the whole way (compose, run, report) with
nothing else changed."""

import dataclasses
import json
from typing import ClassVar

import numpy as np
import pandas as pd
import pytest

import estimators
import problems
from curvbench import config, provenance, report, runs
from curvbench.approximations import CURVATURES, BlockDiagonal
from curvbench.core import records
from curvbench.measurements import MEASUREMENTS
from curvbench.optimizers import OPTIMIZERS
from problems import DATASETS, PROBLEMS, Problem, ProblemSettings, layers
from tests.conftest import TINY
from tests.toy_measurement import GradientNorms

SHORT = (
  "measure.training.num_steps=2",
  "measure.training.eval_every=1",
  "measure.training.eval_size=20",
  "measure.training.train_eval_size=20",
  "progress=false",
)


@pytest.fixture(scope="module")
def every_component(tmp_path_factory):
  """Runs of every registered optimizer (training) and measurement on the
  tiny problem, in one sweep directory, and its report."""
  root = tmp_path_factory.mktemp("contracts")
  points = {
    f"optimizer_{n}": ["measure=training", f"optimizer={n}"] for n in OPTIMIZERS
  }
  points.update({f"measure_{n}": [f"measure={n}"] for n in MEASUREMENTS})
  status, seen = {}, {}
  for name, overrides in points.items():
    cfg = config.compose(*TINY, *overrides)
    run_id = provenance.run_id(cfg)
    if run_id in seen:  # e.g. measure=training is optimizer=kfac's run
      status[name] = status[seen[run_id]]
      continue
    seen[run_id] = name
    status[name] = runs.run(cfg, root / name)
  written = report.write(root)
  return root, status, written


@pytest.mark.slow
@pytest.mark.parametrize("name", PROBLEMS.names())
def test_every_problem_builds_is_fully_registered_and_trains(name, tmp_path):
  # One kind of K-FAC step (refresh and damping every step): one program
  # to compile.
  cfg = config.compose(
    f"problem={name}",
    "problem.batch_size=8",
    "measure=training",
    "optimizer=kfac",
    "optimizer.inverse_update_period=1",
    "optimizer.damping_adaptation_interval=1",
    *SHORT,
  )
  assert runs.run(cfg, tmp_path / "run") == "complete"
  run = records.RunDir(tmp_path / "run")
  training = run.tables()["training"]
  assert np.isfinite(training.batch_loss.dropna()).all()
  blocks = json.loads((run.path / "registration.json").read_text())["blocks"]
  metadata = json.loads((run.path / "metadata.json").read_text())
  assert sum(b["dim"] for b in blocks) == metadata["num_params"]


@pytest.mark.parametrize("name", DATASETS.names())
def test_every_dataset_declares_its_settings_and_input_shape(name):
  settings = DATASETS.defaults(name)
  assert list(DATASETS.refusals(dataclasses.asdict(settings))) == []
  shape = settings.input_shape()
  assert shape and all(isinstance(d, int) and d > 0 for d in shape)
  for problem in PROBLEMS:  # composes, or is refused by name
    try:
      cfg = config.compose(f"problem={problem}", f"problem/data={name}")
    except config.ConfigError as e:
      assert "problem." in str(e), e
    else:
      assert cfg.problem.data.name == name


@pytest.mark.slow
def test_every_optimizer_and_measurement_runs_and_reports(every_component):
  root, status, written = every_component
  assert set(status.values()) == {"complete"}, status
  tables = {p.stem.removesuffix("_all") for p in written["tables"]}
  training = pd.read_csv(root / "report" / "training_all.csv")
  for name in OPTIMIZERS:
    assert status[f"optimizer_{name}"] == "complete", name
    assert training.optimizer.eq(name).any(), name
  text = (root / "report" / "report.md").read_text()
  for name in MEASUREMENTS:
    measurement = MEASUREMENTS.get(name)()
    assert set(measurement.tables) & tables, name
    rep = report.Report(root, pd.DataFrame(), pd.DataFrame(), {}, {})
    assert measurement.section(rep, root) is None  # no records, no section
  for heading in ("Summary", "Curvature", "Timing", "Training", "Runs"):
    assert f"## {heading}" in text
  assert written["self_check"] == []


# --- components declared here, in one place each ----------------------------


@dataclasses.dataclass
class Linear(ProblemSettings):
  """Softmax regression: one dense layer to the class logits."""

  name: str = "toy_linear"

  def build(self, data):
    def model(x):
      return layers.Dense(data.num_classes, name="logits")(
        x.reshape(x.shape[0], -1)
      )

    return Problem.from_model(
      model,
      data,
      self,
      task="classification",
      loss_name="softmax_cross_entropy",
    )


@dataclasses.dataclass
class ToyDiagonal(BlockDiagonal):
  """Diagonal blocks for dense layers, the library's default elsewhere."""

  name: str = "toy_diagonal"
  blocks: ClassVar = {"dense_tag": estimators.DenseDiagonal}


@pytest.fixture
def toys():
  """The toy components, registered for one test and then removed."""
  PROBLEMS.register(Linear)
  CURVATURES.register(ToyDiagonal)
  MEASUREMENTS.register(GradientNorms)
  try:
    yield
  finally:
    PROBLEMS.unregister("toy_linear")
    CURVATURES.unregister("toy_diagonal")
    MEASUREMENTS.unregister("toy_gradient_norms")


@pytest.mark.slow
def test_a_new_problem_block_type_and_measurement_are_one_file_each(
  toys, tmp_path
):
  toy = ("problem=toy_linear", "curvature=toy_diagonal", *TINY[2:])
  with pytest.raises(
    config.ConfigError,
    match=r"measure.toy_gradient_norms"
    r".scale=0.0 is not allowed: .* a number > 0",
  ):
    config.compose(*toy, "measure.toy_gradient_norms.scale=0")
  with pytest.raises(config.ConfigError, match="did you mean scale"):
    config.compose(*toy, "+measure.toy_gradient_norms.scal=2")
  assert config.options("curvature").count("toy_diagonal") == 1
  status = {
    "norms": runs.run(
      config.compose(  # at the canonical curvature: unused
        "problem=toy_linear",
        *TINY[2:],
        "measure=toy_gradient_norms",
        "measure.toy_gradient_norms.scale=2",
      ),
      tmp_path / "norms",
    ),
    "spectra": runs.run(
      config.compose(*toy, "measure=spectra"), tmp_path / "spectra"
    ),
  }
  assert status == {"norms": "complete", "spectra": "complete"}
  norms = records.RunDir(tmp_path / "norms").tables()["toy_gradient_norms"]
  assert set(norms.leaf) == {"['logits']['b']", "['logits']['w']"}
  assert (norms.norm > 0).all() and set(norms.problem) == {"toy_linear"}
  blocks = json.loads((tmp_path / "spectra" / "registration.json").read_text())[
    "blocks"
  ]
  assert [b["block_class"] for b in blocks] == ["DenseDiagonal"]
  written = report.write(tmp_path)
  text = (tmp_path / "report" / "report.md").read_text()
  summary = text.split("## Summary")[1].split("\n## ")[0]
  assert (
    "**Gradient norms**: How large is the gradient at the start?" in summary
  )
  assert "toy_linear: the largest gradient is ['logits']['w']'s" in summary
  assert "## Gradient norms" in text
  assert "Gradient norms at the start ([toy_gradient_norms.csv]" in text
  assert (tmp_path / "report" / "toy_gradient_norms.csv").exists()
  assert "![toy_gradient_norms](figures/toy_gradient_norms.png)" in text
  assert "toy_diagonal/ggn_exact" in text
  assert any(p.name == "toy_gradient_norms.png" for p in written["figures"])
  assert problems.make({"name": "toy_linear"}).num_params == 650
