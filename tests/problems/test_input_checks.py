"""Examples that do not fit their task, loss or model are refused before
any run starts, from the Python API and from a problem registered by user
code alike: the error names the array, what is wrong and the fix, and no
run directory is written."""

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import curvbench
import problems
from curvbench import config, runs
from curvbench.components import Whole, setting
from problems import DATASETS, PROBLEMS, checks
from problems.data import Dataset
from tests.conftest import SHORT


def _init(rng, x, outputs=2):
  return dict(
    w=jax.random.normal(rng, (x.shape[1], outputs)) / 2, b=jnp.zeros(outputs)
  )


def _apply(p, x):
  return x @ p["w"] + p["b"]


def _x(n=20, d=3, seed=0):
  return np.random.default_rng(seed).normal(size=(n, d))


def _labels(n=20, classes=2):
  return np.arange(n) % classes


def _with(a, index, value):
  a = np.array(a, dtype=np.result_type(a, type(value)))
  a[index] = value
  return a


MODEL = curvbench.Model(_apply, init=_init)
FIXED = curvbench.Model(_apply, params=_init(jax.random.PRNGKey(0), _x()))

# (model, data, task, loss, what the message says), one per kind of bad input.
BAD = {
  "negative label": (
    MODEL,
    curvbench.Data(_x(), _with(_labels(), 4, -1)),
    "classification",
    None,
    r"y_train holds labels in \[-1, 1\] \(1 outside 0..1, the first at "
    r"example 4\), but the model has 2 outputs: number the classes",
  ),
  "label equal to the outputs": (
    MODEL,
    curvbench.Data(_x(), _labels(), _x(5, seed=1), _with(_labels(5), 3, 2)),
    "classification",
    None,
    r"y_test holds labels in \[0, 2\] .* first at example 3\), but the "
    r"model has 2 outputs",
  ),
  "labels too large for a squared-error classifier": (
    MODEL,
    curvbench.Data(_x(), _labels(classes=3)),
    "classification",
    "one_hot_squared_error",
    r"y_train holds labels in \[0, 2\] .*model has 2 outputs",
  ),
  "fractional float labels": (
    MODEL,
    curvbench.Data(_x(), _with(_labels(), 2, 0.5)),
    "classification",
    None,
    r"y_train has dtype float64 and 1 values that are not class labels "
    r"\(the first at example 2\); give whole numbers 0..1",
  ),
  "NaN labels": (
    MODEL,
    curvbench.Data(_x(), _with(_labels(), 7, np.nan)),
    "classification",
    None,
    r"y_train .* not class labels \(the first at example 7\)",
  ),
  "labels of another shape": (
    MODEL,
    curvbench.Data(_x(), np.stack([_labels()] * 3, 1)),
    "classification",
    None,
    r"y_train has shape \(16, 3\); .* one class label per example, shape "
    r"\(16,\)",
  ),
  "NaN in the training inputs": (
    MODEL,
    curvbench.Data(_with(_x(), (3, 1), np.nan), _labels()),
    "classification",
    None,
    r"x_train holds 1 NaN or infinite value\(s\), the first in example 3",
  ),
  "inf in the test inputs": (
    MODEL,
    curvbench.Data(
      _x(), _labels(), _with(_x(5, seed=1), (2, 0), np.inf), _labels(5)
    ),
    "classification",
    None,
    r"x_test holds 1 NaN or infinite value\(s\), the first in example 2",
  ),
  "NaN regression targets": (
    MODEL,
    curvbench.Data(_x(), _with(_x(d=2, seed=2), (6, 1), np.nan)),
    "regression",
    None,
    r"y_train holds 1 NaN or infinite value\(s\), the first in example 6",
  ),
  "regression targets of another shape": (
    MODEL,
    curvbench.Data(_x(), _x(d=3, seed=2)),
    "regression",
    None,
    r"y_train has shape \(3,\) per example but the model's outputs \(2,\)",
  ),
  "training lengths differ": (
    MODEL,
    curvbench.Data(_x(), _labels(19)),
    "classification",
    None,
    r"x_train has 20 examples but y_train holds 19 targets",
  ),
  "test lengths differ": (
    MODEL,
    curvbench.Data(_x(), _labels(), _x(5, seed=1), _labels(4)),
    "classification",
    None,
    r"x_test has 5 examples but y_test holds 4 targets",
  ),
  "an empty test split": (
    MODEL,
    curvbench.Data(_x(), _labels(), _x(0), _labels(0)),
    "classification",
    None,
    r"x_test holds no examples \(shape \(0, 3\)\)",
  ),
  "one number per example": (
    MODEL,
    curvbench.Data(_x()[:, 0], _labels()),
    "classification",
    None,
    r"x_train has shape \(20,\); .* x_train.reshape\(len\(x_train\), -1\)",
  ),
  "splits of different example shapes": (
    MODEL,
    curvbench.Data(_x(), _labels(), _x(5, d=4), _labels(5)),
    "classification",
    None,
    r"each example of x_train has shape \(3,\) but each of x_test \(4,\)",
  ),
  "inputs the model cannot read": (
    FIXED,
    curvbench.Data(_x(d=5), _labels()),
    "classification",
    None,
    r"the model cannot be applied to one example of x_train \(shape \(5,\)",
  ),
  "inputs that are not numbers": (
    MODEL,
    curvbench.Data(np.full((20, 3), "a"), _labels()),
    "classification",
    None,
    r"x_train has dtype <U1; inputs must be numbers",
  ),
  "reconstruction targets outside [0, 1]": (
    curvbench.Model(
      lambda p, x: _apply(p, x), init=lambda r, x: _init(r, x, 3)
    ),
    curvbench.Data(np.abs(_x()) * 255),
    "reconstruction",
    "sigmoid_cross_entropy",
    r"x_train \(the targets of a reconstruction, flattened\) holds values in "
    r"\[.*\] .*targets in \[0, 1\]",
  ),
  "test targets without test inputs": (
    MODEL,
    curvbench.Data(_x(), _labels(), y_test=_labels(5)),
    "classification",
    None,
    r"y_test was given without x_test",
  ),
}


@pytest.fixture
def forget_entries():
  """Unregisters what a test registers."""
  names = []
  yield names
  for registry, name in names:
    if name in registry:
      registry.unregister(name)


@pytest.mark.parametrize("case", list(BAD))
def test_the_api_refuses_bad_examples_before_any_run(
  case, tmp_path, forget_entries
):
  model, data, task, loss, message = BAD[case]
  forget_entries += [(PROBLEMS, "bad"), (DATASETS, "bad_data")]
  out = tmp_path / "sweep"
  with pytest.raises(checks.ExamplesError, match=f"^Data: {message}"):
    curvbench.measure(
      model, data, task=task, loss=loss, name="bad", out=out, settings=SHORT
    )
  assert not out.exists()
  assert "bad" not in PROBLEMS


def test_whole_float_labels_and_one_hot_rows_are_class_labels(forget_entries):
  forget_entries += [(PROBLEMS, "ok"), (DATASETS, "ok_data")]
  x, y = _x(), _labels()
  for labels in (y.astype(np.float32), np.eye(2)[y]):
    curvbench.register_model("ok", MODEL, curvbench.Data(x, labels))
    data = problems.make({"name": "ok"}).data
    assert data.y_train.dtype == np.int32 and data.num_classes == 2
    np.testing.assert_array_equal(data.y_train, y[:16])


# A problem and its dataset registered by user code (as a plugin would).
@dataclasses.dataclass
class LabData(problems.DatasetSettings):
  name: str = "lab_data"
  arrays: ClassVar[dict] = {}

  def input_shape(self):
    return (3,)

  def source(self):
    return "the test's arrays"

  def load(self):
    return Dataset("lab_data", num_classes=2, **self.arrays)


@dataclasses.dataclass
class LabProblem(problems.ProblemSettings):
  name: str = "lab"
  default_data: ClassVar[str] = "lab_data"
  batch_size: int = setting(4, Whole(1), "training batch size")
  task: ClassVar[str] = "classification"

  def build(self, data):
    loss = "softmax_cross_entropy" if self.task != "regression" else None
    return problems.Problem.from_functions(
      problems.Network(_init, _apply),
      data,
      self,
      task=self.task,
      loss_name=loss or "squared_error",
    )


def _splits(**changes):
  arrays = dict(
    x_train=_x().astype(np.float32),
    y_train=_labels().astype(np.int32),
    x_test=_x(5, seed=1).astype(np.float32),
    y_test=_labels(5).astype(np.int32),
  )
  return dict(arrays, **changes)


PLUGIN_BAD = {
  "label equal to the outputs": (
    _splits(y_train=_with(_labels(), 9, 2).astype(np.int32)),
    "classification",
    r"y_train holds labels in \[0, 2\] .* model has 2 outputs",
  ),
  "NaN in the test inputs": (
    _splits(x_test=_with(_x(5, seed=1), (4, 2), np.nan).astype(np.float32)),
    "classification",
    r"x_test holds 1 NaN or infinite value\(s\), the first in example 4",
  ),
  "test lengths differ": (
    _splits(y_test=_labels(4).astype(np.int32)),
    "classification",
    r"x_test has 5 examples but y_test holds 4 targets",
  ),
  "NaN regression targets": (
    _splits(
      y_train=_with(_x(d=2), (0, 0), np.inf),
      y_test=_x(5, d=2),
    ),
    "regression",
    r"y_train holds 1 NaN or infinite value\(s\), the first in example 0",
  ),
}


@pytest.fixture
def lab(forget_entries, monkeypatch):
  forget_entries += [(PROBLEMS, "lab"), (DATASETS, "lab_data")]
  DATASETS.register(LabData)
  PROBLEMS.register(LabProblem)
  return lambda arrays, task: (
    monkeypatch.setattr(LabData, "arrays", arrays),
    monkeypatch.setattr(LabProblem, "task", task),
  )


def test_a_registered_problem_on_good_data_builds(lab):
  lab(_splits(), "classification")
  assert problems.make({"name": "lab"}).data.num_classes == 2


@pytest.mark.parametrize("case", list(PLUGIN_BAD))
def test_a_registered_problems_bad_data_is_refused_before_any_run(
  case, lab, tmp_path
):
  arrays, task, message = PLUGIN_BAD[case]
  lab(arrays, task)
  where = r"^dataset 'lab_data' of problem 'lab': "
  with pytest.raises(checks.ExamplesError, match=where + message) as raised:
    problems.make({"name": "lab"})
  assert "Fix the arrays the dataset's load() returns" in str(raised.value)
  out = tmp_path / "sweep"
  with pytest.raises(checks.ExamplesError, match=where + message):
    curvbench.measure("lab", out=out, settings=SHORT)
  assert not out.exists()
  # The command line's route: the run refuses before it writes anything.
  cfg = config.compose("problem=lab", "measure=timing")
  with pytest.raises(checks.ExamplesError, match=where + message):
    runs.run(cfg, tmp_path / "run")
  assert not (tmp_path / "run").exists()


def test_a_sweeps_points_share_one_check_of_their_problem(lab, monkeypatch):
  lab(_splits(), "classification")
  built = []
  make = problems.make
  monkeypatch.setattr(problems, "make", lambda s: built.append(s) or make(s))
  for batch_size in (4, 4, 5):
    problems.check({"name": "lab", "batch_size": batch_size})
  assert len(built) == 2
