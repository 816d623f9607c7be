"""The report's Registration section and registration.json's keys: an NNX
model with LayerNorms, its layers in forward order, named as NNX names
them, and the same-block note where every approximation agrees."""

import json
import re

import jax
import numpy as np
import pandas as pd
import pytest
from flax import nnx

import curvbench
import problems
from curvbench import config, report, runs
from curvbench.core import plots, registration_report
from curvbench.measurements.spectra import summary
from tests.conftest import ROOT, SHORT

DOCS = ROOT / "docs" / "reference" / "records.md"


class _Net(nnx.Module):
  """Dense, LayerNorm, dense, LayerNorm, dense: the forward order differs
  from the parameters' (alphabetical) order and from the graph matcher's
  (dense layers are claimed before norms)."""

  def __init__(self, rngs):
    self.layers = nnx.List(
      [nnx.Linear(4, 5, rngs=rngs), nnx.Linear(5, 5, rngs=rngs)]
    )
    self.norm1 = nnx.LayerNorm(5, rngs=rngs)
    self.norm2 = nnx.LayerNorm(5, rngs=rngs)
    self.out = nnx.Linear(5, 3, rngs=rngs)

  def __call__(self, x):
    x = self.norm1(jax.nn.tanh(self.layers[0](x)))
    x = self.norm2(jax.nn.tanh(self.layers[1](x)))
    return self.out(x)


FORWARD = ["layers.0", "norm1", "layers.1", "norm2", "out"]
APPROXIMATIONS = ("kfac", "ekfac")


@pytest.fixture(scope="module")
def nnx_problem():
  """The Flax NNX network registered as a problem for this module's tests,
  unregistered after them (tests elsewhere list the registered problems)."""
  graph, _ = nnx.split(_Net(nnx.Rngs(0)))
  rng = np.random.default_rng(0)
  model = curvbench.Model(
    apply=lambda p, x: nnx.merge(graph, p)(x),
    init=lambda key, x: nnx.split(_Net(nnx.Rngs(key)))[1],
  )
  data = curvbench.Data(rng.normal(size=(24, 4)), rng.integers(0, 3, 24))
  yield curvbench.register_model(
    "nnx_norms", model, data, loss="softmax_cross_entropy"
  )
  problems.PROBLEMS.unregister("nnx_norms")
  problems.DATASETS.unregister("nnx_norms_data")


def _registration(name, approximation):
  """A run's registration.json for `approximation`, as `runs.measure`
  writes it (tracing only, nothing estimated)."""
  run = config.load(
    config.compose(f"problem={name}", f"curvature={approximation}")
  )
  problem = problems.make(run.problem)
  params = problem.init_params(jax.random.PRNGKey(0), np.float32)
  batch = problem.fixed_batch(8, dtype=np.float32)
  curvature = run.curvature.make(problem.loss_fn)
  found = runs.registration(
    problem, curvature, params, batch, jax.random.PRNGKey(1)
  )
  return json.loads(json.dumps(found))  # as written to the file


@pytest.fixture(scope="module")
def registered(nnx_problem, tmp_path_factory):
  """A sweep folder holding one registration.json per approximation, and
  the `Report` over it."""
  root = tmp_path_factory.mktemp("registered")
  done = []
  for name in APPROXIMATIONS:
    (root / name).mkdir()
    (root / name / "registration.json").write_text(
      json.dumps(_registration(nnx_problem, name))
    )
    done.append(
      dict(
        run_dir=name,
        problem=nnx_problem,
        measure="spectra",
        label=f"{name}/ggn_exact",
        mode="ggn_exact",
      )
    )
  done = pd.DataFrame(done)
  return report.Report(root, done, done, {}, plots.colours(done.label))


def test_registration_names_nnx_modules_in_forward_order(registered):
  found = json.loads(
    (registered.root / "kfac" / "registration.json").read_text()
  )
  blocks = sorted(found["blocks"], key=lambda b: b["layer"])
  assert [b["module"] for b in blocks] == FORWARD
  assert [b["layer"] for b in blocks] == [0, 1, 2, 3, 4]
  norm = [p for p in found["parameters"] if p["module"] == "norm1"]
  assert sorted(p["name"] for p in norm) == ["bias", "scale"]
  assert {p["layer"] for p in norm} == {1}


def test_registration_section_for_an_nnx_model(registered):
  section = registration_report.section(registered)
  (table,) = section.tables
  data = table.data
  assert list(data.module) == FORWARD
  assert list(data.layer) == [0, 1, 2, 3, 4]
  norms = data[data.module.str.startswith("norm")]
  assert set(norms.kind) == {"normalization (scale and shift)"}
  assert set(norms.parameters) == {"bias (5,), scale (5,)"}
  # No graph-matcher pattern names: the model's own names and words.
  shown = data.astype(str).to_string()
  assert "haiku" not in shown and "dense_with_bias" not in shown
  assert set(data["kfac/ggn_exact"]) == {
    "DenseTwoKroneckerFactored",
    "ScaleAndShiftDiagonal",
  }
  assert list(data.note.astype(bool)) == [False, True, False, True, False]
  assert "ScaleAndShiftDiagonal" in norms.note.iloc[0]
  assert "identical by construction" in norms.note.iloc[0]
  assert any("norm1, norm2" in f for f in section.findings)


def test_same_block_needs_every_approximation_to_agree(registered):
  assert registration_report.same_blocks(registered) == {
    ("nnx_norms", "norm1"): "ScaleAndShiftDiagonal",
    ("nnx_norms", "norm2"): "ScaleAndShiftDiagonal",
  }
  # Under another estimation mode the same class is another matrix.
  done = registered.done.assign(mode=["ggn_exact", "fisher_empirical"])
  other = report.Report(registered.root, done, done, {}, registered.colour)
  assert registration_report.same_blocks(other) == {}


def test_per_layer_quality_rows_say_why_they_are_alike(registered):
  rows = [
    dict(
      problem="nnx_norms",
      data="batch",
      step=0,
      reference="ggn",
      level="layer",
      block=block,
      label=label,
      metric="relative_frobenius",
      relative_damping=np.nan,
      value=0.5 if block == "norm1" else 0.1 + (label == "kfac/ggn_exact"),
      run_id=label,
      sample=0,
      seed=0,
    )
    for block in ("layers.0", "norm1")
    for label in registered.done.label
  ]
  q = pd.DataFrame(rows)
  alike = registration_report.same_blocks(registered, "spectra")
  found = summary.with_reasons(summary.quality(q), alike)
  why = dict(zip(found.block, found.why_alike))
  assert why["layers.0"] == ""
  assert why["norm1"].startswith("same block (ScaleAndShiftDiagonal)")
  table = summary.quality_table("quality_blocks", "per layer", found, True)
  assert "why_alike" in table.shown
  (note,) = summary.shared_blocks(q, alike)
  assert "norm1" in note and "ScaleAndShiftDiagonal" in note


def _documented_keys() -> dict[str, set[str]]:
  """{part: keys} from the table of docs/reference/records.md's
  'registration.json' section."""
  text = DOCS.read_text().split("### registration.json", 1)[1]
  text = text.split("\n## ", 1)[0]
  keys: dict[str, set[str]] = {}
  for key, parts in re.findall(r"^\| `(\w+)` \| ([^|]+) \|", text, re.M):
    for part in re.findall(r"`(\w+)`", parts):
      keys.setdefault(part, set()).add(key)
  return keys


def test_registration_json_has_the_documented_keys(registered):
  documented = _documented_keys()
  found = json.loads(
    (registered.root / "kfac" / "registration.json").read_text()
  )
  assert set(found) == set(documented)
  for part, rows in found.items():
    for row in rows:
      assert set(row) == documented[part], part
  # A whole-network approximation's one row holds a subset of the keys.
  (whole,) = _registration("nnx_norms", "explicit_exact")["blocks"]
  assert set(whole) == {"block", "block_class", "dim"} <= documented["blocks"]
  assert whole["dim"] is None


@pytest.mark.slow
def test_report_of_an_nnx_model_explains_its_registration(
  nnx_problem, tmp_path
):
  results = curvbench.measure(
    nnx_problem,
    approximations=APPROXIMATIONS,
    measurements=["spectra"],  # what registration explains
    out=tmp_path,
    settings=[
      *SHORT,
      "measure.batch_size=8",
      "measure.training.eval_size=null",
    ],
  )
  results.report()
  text = (tmp_path / "report" / "report.md").read_text()
  section = text.split("## Registration", 1)[1].split("\n## ", 1)[0]
  lines = [line for line in section.splitlines() if line.startswith("| ")]
  assert [line.split(" | ")[1] for line in lines[1:]] == FORWARD
  assert "same block (ScaleAndShiftDiagonal)" in section
  blocks = pd.read_csv(tmp_path / "report" / "quality_blocks.csv")
  norms = blocks[blocks.block.isin(["norm1", "norm2"])]
  assert norms.why_alike.str.contains("identical by construction").all()
