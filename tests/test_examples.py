"""The examples people copy run as they are written: each framework's
model measured through the Python API (the script) and through the
command line (the script as a plugin), K-FAC and EKFAC against the exact
GGN; the plugin approximation beside the built-in ones."""

import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
QUICK = ("measure.spectra.samples=1",)


def _run(*args, cwd):
  result = subprocess.run(
    [str(a) for a in args], cwd=cwd, capture_output=True, text=True, timeout=600
  )
  assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
  return result.stdout


def _quality(sweep: Path) -> pd.DataFrame:
  return pd.concat(pd.read_parquet(p) for p in sweep.glob("*/quality.parquet"))


@pytest.mark.slow
@pytest.mark.parametrize(
  "example, problem",
  [
    ("haiku_model.py", "haiku_mlp"),
    ("flax_nnx_model.py", "nnx_mlp"),
    ("equinox_model.py", "equinox_mlp"),
  ],
)
def test_a_framework_model_through_the_api_and_the_command_line(
  example, problem, tmp_path
):
  script = EXAMPLES / example
  printed = _run(sys.executable, script, *QUICK, cwd=tmp_path)
  assert "kfac/ggn_exact" in printed and "ekfac/ggn_exact" in printed
  assert (tmp_path / "reports" / problem / "report" / "report.md").is_file()
  api = _quality(tmp_path / "reports" / problem)
  _run(
    sys.executable,
    "-m",
    "curvbench",
    "-m",
    f"plugins=[{script}]",
    f"problem={problem}",
    "curvature=kfac,ekfac",
    "measure=spectra",
    "measure.spectra.references=[ggn]",
    *QUICK,
    "name=cli",
    "progress=false",
    "compilation_cache=null",
    cwd=tmp_path,
  )
  cli = _quality(tmp_path / "reports" / "cli")
  for quality in (api, cli):
    assert {"kfac/ggn_exact", "ekfac/ggn_exact"} <= set(quality.method)
    assert set(quality.reference) == {"ggn"}
  # One computation, either way in: the same numbers.
  key = ["method", "reference", "level", "block", "metric", "relative_damping"]
  both = api.merge(cli, on=key, suffixes=("_api", "_cli"))
  assert len(both) == len(api)
  pd.testing.assert_series_equal(
    both.value_api, both.value_cli, check_names=False
  )


@pytest.mark.slow
def test_the_plugin_approximation_runs_beside_the_built_in_ones(tmp_path):
  printed = _run(
    sys.executable, EXAMPLES / "plugin_approximation.py", *QUICK, cwd=tmp_path
  )
  for method in (
    "kfac/ggn_exact",
    "kfac_dense/ggn_exact",
    "diagonal/ggn_exact",
  ):
    assert method in printed
  blocks = (tmp_path / "reports" / "kfac_dense").glob(
    "*kfac_dense*/registration.json"
  )
  text = next(blocks).read_text()
  assert "DenseTwoKroneckerFactored" in text and "Conv2DDiagonal" in text
