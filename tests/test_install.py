"""A non-editable install (a wheel in a fresh virtual environment) finds its
configs and runs the command, with the source tree nowhere on its path."""

import os
import sys
import sysconfig
import tomllib
import zipfile
from pathlib import Path

import pytest

from tests.conftest import run_checked

REPO = Path(__file__).resolve().parents[1]


# The packages a type checker reads the annotations of (PEP 561).
TYPED = ("curvbench", "estimators", "problems")


def test_the_wheel_lists_every_package_and_marks_the_typed_ones():
  config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]
  listed = set(config["setuptools"]["packages"])
  found = {
    ".".join(init.parent.relative_to(REPO).parts)
    for top in ("curvbench", "estimators", "problems", "hydra_plugins")
    for init in (REPO / top).rglob("__init__.py")
  }
  assert found - listed == set(), "not in [tool.setuptools] packages"
  assert "py.typed" in config["setuptools"]["package-data"]["*"]
  for package in TYPED:
    assert (REPO / package / "py.typed").is_file(), package


@pytest.mark.slow
def test_wheel_in_a_fresh_environment_runs_and_reports(tmp_path):
  run_checked(
    sys.executable,
    "-m",
    "pip",
    "wheel",
    "--no-deps",
    "--no-build-isolation",
    "-q",
    "-w",
    tmp_path / "wheel",
    REPO,
    cwd=tmp_path,
  )
  venv = tmp_path / "venv"
  run_checked(sys.executable, "-m", "venv", "--without-pip", venv, cwd=tmp_path)
  site = Path(
    run_checked(
      venv / "bin/python",
      "-c",
      "import sysconfig; print(sysconfig.get_path('purelib'))",
      cwd=tmp_path,
    ).strip()
  )
  # The dependencies come from this environment's site-packages, added as a
  # plain path: its .pth files (the editable install of curvbench among
  # them) are not read.
  (site / "dependencies.pth").write_text(sysconfig.get_path("purelib") + "\n")
  (wheel,) = (tmp_path / "wheel").glob("curvbench-*.whl")
  with zipfile.ZipFile(wheel) as archive:
    packed = set(archive.namelist())
  assert "curvbench/core/stats.py" in packed
  assert {f"{p}/py.typed" for p in TYPED} <= packed
  run_checked(
    sys.executable,
    "-m",
    "pip",
    "--python",
    venv / "bin/python",
    "install",
    "-q",
    "--no-deps",
    "--no-index",
    wheel,
    cwd=tmp_path,
  )
  env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
  work = tmp_path / "work"
  work.mkdir()
  where = run_checked(
    venv / "bin/python",
    "-c",
    "import curvbench; print(curvbench.__file__)",
    cwd=work,
    env=env,
  )
  assert Path(where).resolve().is_relative_to(venv), where
  # The wheel installs the project's own names at the top level, no
  # generic one (`components` lives inside curvbench).
  tops = {
    p.name
    for p in site.iterdir()
    if p.is_dir() and not p.name.endswith((".dist-info", "__pycache__"))
  }
  assert tops == {"curvbench", "estimators", "problems", "hydra_plugins"}
  missing = run_checked(
    venv / "bin/python",
    "-c",
    "import importlib.util; print(importlib.util.find_spec('components'))",
    cwd=work,
    env=env,
  )
  assert missing.strip() == "None"
  run_checked(
    venv / "bin/curvbench",
    "-m",
    "name=installed",
    "measure=spectra,timing",
    "problem.width=3",
    "problem.depth=1",
    "problem.batch_size=8",
    "measure.spectra.references=[ggn]",
    "measure.spectra.samples=1",
    "measure.timing.repeats=2",
    "progress=false",
    cwd=work,
    env=env,
  )
  run_checked(
    venv / "bin/curvbench", "report", "reports/installed", cwd=work, env=env
  )
  text = (work / "reports/installed/report/report.md").read_text()
  assert "kfac/ggn_exact" in text and "## Timing" in text
  assert (work / "reports/installed/report/report.html").stat().st_size
  # Models in files outside the repository, one per framework: plugins of
  # the command, and measured by the Python API.
  models = {
    "haiku_model.py": "haiku_mlp",
    "flax_nnx_model.py": "nnx_mlp",
    "equinox_model.py": "equinox_mlp",
  }
  for example in models:
    (work / example).write_text((REPO / "examples" / example).read_text())
  quick = [
    "measure=spectra",
    "measure.spectra.references=[ggn]",
    "measure.spectra.samples=1",
    "progress=false",
  ]
  run_checked(
    venv / "bin/curvbench",
    "-m",
    f"plugins=[{','.join(models)}]",
    f"problem={','.join(models.values())}",
    "curvature=kfac,ekfac",
    "name=models",
    *quick,
    cwd=work,
    env=env,
  )
  run_checked(
    venv / "bin/python",
    "-c",
    "import curvbench\n"
    f"for file, name in {models!r}.items():\n"
    "  curvbench.measure(name, approximations=['kfac', 'ekfac'], "
    f"name='api', plugins=[file], settings={quick[1:]!r})",
    cwd=work,
    env=env,
  )
  for sweep in ("models", "api"):
    run_checked(
      venv / "bin/curvbench", "report", f"reports/{sweep}", cwd=work, env=env
    )
    quality = (work / f"reports/{sweep}/report/quality_all.csv").read_text()
    for name in models.values():
      for method in ("kfac/ggn_exact", "ekfac/ggn_exact"):
        assert f"{name},spectra,{method}" in quality, (sweep, name, method)
