"""Components from outside curvbench join its registries: a module or a
`.py` file named by the `plugins` setting, or an installed entry point;
a clashing name or a failing import is refused, and the plugin's code is
part of the run's identity."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from curvbench import config, plugins, provenance
from curvbench.core import records
from problems import PROBLEMS
from tests.conftest import ROOT, TINY, run_checked

PROBLEM_PLUGIN = """
import dataclasses
from curvbench.components import Whole, setting
from problems import PROBLEMS, Problem, ProblemSettings, layers

@PROBLEMS.register
@dataclasses.dataclass
class {cls}(ProblemSettings):
  name: str = "{name}"
  width: int = setting(4, Whole(1), "hidden units")

  def build(self, data):
    def model(x):
      x = x.reshape(len(x), -1)
      return layers.Dense(data.num_classes)(layers.Dense(self.width)(x))
    return Problem.from_model(model, data, self, task="classification",
                              loss_name="softmax_cross_entropy")
"""


def _plugin(folder: Path, name: str, text: str) -> Path:
  path = folder / f"{name}.py"
  path.write_text(textwrap.dedent(text))
  return path


@pytest.fixture
def forget():
  """Unregisters the problems a test's plugins register."""
  names = []
  yield names
  for name in names:
    if name in PROBLEMS:
      PROBLEMS.unregister(name)


def test_a_plugin_file_adds_a_problem_and_its_code_is_in_the_run_id(
  tmp_path, forget
):
  forget.append("lab_mlp")
  path = _plugin(
    tmp_path, "lab", PROBLEM_PLUGIN.format(cls="LabMLP", name="lab_mlp")
  )
  cfg = config.compose(
    f"plugins=[{path}]", "problem=lab_mlp", "problem.width=3"
  )
  assert cfg.problem.width == 3 and list(cfg.plugins) == [str(path)]
  assert "lab_mlp" in config.options("problem")
  before = provenance.inputs(cfg)["plugins"]
  assert before is not None
  assert provenance.inputs(config.compose("problem=mlp"))["plugins"] is None
  # Loaded once, however often it is named; its edited code is another run.
  assert plugins.load([str(path)]) == plugins.load([str(path)])
  path.write_text(path.read_text() + "\n# edited\n")
  assert provenance.inputs(cfg)["plugins"] != before


def test_a_name_a_builtin_holds_is_refused_naming_both(tmp_path):
  path = _plugin(
    tmp_path, "clash", PROBLEM_PLUGIN.format(cls="MyMLP", name="mlp")
  )
  with pytest.raises(
    plugins.PluginError,
    match=r"plugin .*clash.py.* Two problems are registered "
    r"as 'mlp': problems.models.mlp.MLP and .*\.MyMLP",
  ):
    config.compose(f"plugins=[{path}]")


@pytest.mark.parametrize(
  "name, error",
  [
    (
      "no_such_lab.models",
      "ModuleNotFoundError: No module named 'no_such_lab'",
    ),
    ("missing.py", "FileNotFoundError: no file"),
    ("broken.py", "ZeroDivisionError: division by zero"),
  ],
)
def test_a_plugin_that_fails_to_import_is_refused_with_its_error(
  tmp_path, monkeypatch, name, error
):
  monkeypatch.chdir(tmp_path)
  _plugin(tmp_path, "broken", "x = 1 / 0\n")
  with pytest.raises(
    plugins.PluginError, match=f"plugin '{name}' failed to import: {error}"
  ):
    config.compose(f"plugins=[{name}]")


def test_plugins_cannot_be_swept():
  with pytest.raises(config.ConfigError, match="plugins cannot be swept"):
    config.plugins_of(["plugins=a,b"])


def test_an_installed_entry_point_joins_the_registry_and_clashes_refuse(
  tmp_path,
):
  site = tmp_path / "site"
  (site / "lab_models").mkdir(parents=True)
  (site / "lab_models" / "__init__.py").write_text(
    PROBLEM_PLUGIN.format(cls="Installed", name="installed_mlp")
  )
  info = site / "lab_models-1.0.dist-info"
  info.mkdir()
  (info / "METADATA").write_text(
    "Metadata-Version: 2.1\nName: lab-models\nVersion: 1.0\n"
  )
  (info / "entry_points.txt").write_text(
    "[curvbench.plugins]\nlab = lab_models\n"
  )
  env = dict(os.environ, PYTHONPATH=f"{site}{os.pathsep}{ROOT}")
  out = run_checked(
    sys.executable,
    "-c",
    "from curvbench import config; "
    "print(config.compose('problem=installed_mlp').problem.width)",
    cwd=tmp_path,
    env=env,
  )
  assert out.strip() == "4"
  (site / "lab_models" / "__init__.py").write_text("import nothing_here\n")
  result = subprocess.run(
    [sys.executable, "-m", "curvbench", "problem=mlp"],
    cwd=tmp_path,
    env=env,
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert result.returncode != 0
  assert (
    "curvbench: entry point 'lab' (lab_models) failed to import: "
    "ModuleNotFoundError" in result.stderr
  ), result.stderr[-2000:]


@pytest.mark.slow
def test_a_plugin_measurement_is_run_and_reported_from_the_command_line(
  tmp_path,
):
  """Declared in a test folder, named on the command line; the report, a
  process of its own, renders its section where the reader trusts it and
  its code is the code the runs recorded."""
  env = dict(os.environ, PYTHONPATH=str(ROOT))
  sweep = tmp_path / "sweep"
  run_checked(
    sys.executable,
    "-m",
    "curvbench",
    "-m",
    "plugins=[tests.toy_measurement.plugin]",
    "measure=toy_gradient_norms",
    *TINY,
    f"hydra.sweep.dir={sweep}",
    "compilation_cache=null",
    cwd=tmp_path,
    env=env,
  )
  # Not trusted: nothing imported, its section listed as not rendered.
  run_checked(
    sys.executable, "-m", "curvbench", "report", sweep, cwd=tmp_path, env=env
  )
  text = (sweep / "report" / "report.md").read_text()
  assert "## Gradient norms" not in text and "## Not rendered" in text
  assert "--trust tests.toy_measurement.plugin" in text
  run_checked(
    sys.executable,
    "-m",
    "curvbench",
    "report",
    sweep,
    "--trust",
    "tests.toy_measurement.plugin",
    cwd=tmp_path,
    env=env,
  )
  text = (sweep / "report" / "report.md").read_text()
  assert "## Gradient norms" in text and "## Not rendered" not in text
  assert (sweep / "report" / "toy_gradient_norms.csv").is_file()
  assert (sweep / "report" / "figures" / "toy_gradient_norms.png").is_file()
  (run_dir,) = (p for p in sweep.iterdir() if (p / records.MARKER).is_file())
  marker = json.loads((run_dir / records.MARKER).read_text())
  assert marker["status"] == "complete" and marker["plugins"]
