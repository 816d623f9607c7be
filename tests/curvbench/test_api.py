"""The Python API: a model given as functions, on arrays, measured by
every measurement from any directory, into the records and report the
command line writes; bad input refused before anything runs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import curvbench
import problems
from curvbench import config, provenance
from tests.conftest import SHORT
from tests.conftest import two_layer_init as _init


def _apply(p, x):
  return jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]


def _regression(n=250):
  rng = np.random.default_rng(0)
  x = rng.normal(size=(n, 3))
  return curvbench.Data(x, np.stack([np.sin(x.sum(1)), x[:, 0] * x[:, 1]], 1))


@pytest.mark.slow
def test_a_regression_model_of_plain_jax_runs_every_measurement(
  tmp_path, monkeypatch, forget
):
  forget.append("sine")
  monkeypatch.chdir(tmp_path)  # nothing depends on the working directory

  def measure():
    return curvbench.measure(
      curvbench.Model(_apply, init=_init),
      _regression(),
      task="regression",
      name="sine",
      approximations=["kfac", "diagonal"],
      measurements=["spectra", "timing", "training"],
      optimizers=["kfac", "adam"],
      batch_size=16,
      settings=SHORT,
    )

  results = measure()
  assert results.path == tmp_path.joinpath("reports", "sine").relative_to(
    tmp_path
  )
  status = results.runs.status.value_counts().to_dict()
  assert status["complete"] >= 6, status
  # The seeds and runs shared compiled programs, as the command's do.
  cache = tmp_path / "reports" / ".jax_cache"
  assert jax.config.jax_compilation_cache_dir == str(cache)
  assert any(cache.iterdir())
  quality = results.tables["quality"]
  assert {"kfac/ggn_exact", "diagonal/ggn_exact"} <= set(quality.method)
  assert set(quality.problem) == {"sine"}
  assert results.tables["training"].optimizer.notna().any()
  assert results.tables["timing"].phase.notna().any()
  # The model's squared error is the regression loss, registered as such.
  problem = problems.make({"name": "sine"})
  assert problem.task == "regression" and problem.loss_name == "squared_error"
  assert problem.num_params == 3 * 6 + 6 + 6 * 2 + 2
  # Asked again, every run is found finished, none is redone.
  stamps = {p: p.stat().st_mtime for p in results.path.rglob("DONE.json")}
  again = measure()
  assert {p: p.stat().st_mtime for p in again.path.rglob("DONE.json")} == stamps
  written = results.report()
  assert written["self_check"] == []
  text = (results.path / "report" / "report.md").read_text()
  assert "## Timing" in text and "## Training" in text


def test_the_models_computation_and_data_are_its_identity(forget):
  forget.append("ident")
  data = _regression(40)
  curvbench.register_model(
    "ident", curvbench.Model(_apply, init=_init), data, task="regression"
  )
  cfg = config.compose("problem=ident")
  first = provenance.inputs(cfg)
  assert first["plugins"] and first["dataset"].startswith("arrays given")
  # Run again in a notebook: the new model replaces the old one.
  curvbench.register_model(
    "ident",
    curvbench.Model(lambda p, x: jnp.sin(_apply(p, x)), init=_init),
    data,
    task="regression",
  )
  second = provenance.inputs(config.compose("problem=ident"))
  assert second["plugins"] != first["plugins"]
  assert second["dataset"] == first["dataset"]
  moved = curvbench.Data(data.x_train + 1, data.y_train)
  curvbench.register_model(
    "ident", curvbench.Model(_apply, init=_init), moved, task="regression"
  )
  assert (
    provenance.inputs(config.compose("problem=ident"))["dataset"]
    != first["dataset"]
  )


def test_fixed_parameters_and_a_held_out_test_split(forget):
  forget.append("fixed")
  params = _init(jax.random.PRNGKey(3), np.zeros((1, 3)))
  curvbench.register_model(
    "fixed",
    curvbench.Model(_apply, params=params),
    _regression(50),
    task="regression",
  )
  problem = problems.make({"name": "fixed"})
  assert (len(problem.data.x_train), len(problem.data.x_test)) == (40, 10)
  got = problem.init_params(jax.random.PRNGKey(0), np.float64)
  assert got["w1"].dtype == np.float64
  np.testing.assert_allclose(got["w1"], params["w1"])


@pytest.mark.parametrize(
  "call, message",
  [
    (lambda: curvbench.Model(_apply), "exactly one of init="),
    (
      lambda: curvbench.register_model(
        "mlp",
        curvbench.Model(_apply, init=_init),
        _regression(),
        task="regression",
      ),
      "Two problems are registered as 'mlp': problems.models.mlp.MLP and ",
    ),
    (
      lambda: curvbench.register_model(
        "bad",
        curvbench.Model(_apply, init=_init),
        curvbench.Data(np.zeros((5, 3)), np.zeros(4)),
      ),
      "x_train has 5 examples but y_train holds 4 targets",
    ),
    (
      lambda: curvbench.register_model(
        "bad", curvbench.Model(_apply, init=_init), _regression(), loss="hinge"
      ),
      "Unknown loss 'hinge'",
    ),
    (
      lambda: curvbench.measure(curvbench.Model(_apply, init=_init)),
      "needs data=Data",
    ),
    (
      lambda: curvbench.measure("mlp", approximations=["kfca"]),
      "did you mean kfac",
    ),
  ],
)
def test_bad_input_is_refused_naming_what_to_fix(call, message, forget):
  forget.append("bad")
  with pytest.raises((ValueError, TypeError), match=message):
    call()
