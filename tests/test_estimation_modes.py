"""Which estimation mode a run's curvature is in: where `curvature.mode` is
not given, the measurement's (`Measurement.default_mode`), so that K-FAC
trains and is timed as people run it (KFAC-JAX 0.0.8's optimizer,
`ggn_curvature_prop`) and spectra compare with the exact matrix
(`ggn_exact`); any other mode is a labelled variant."""

import dataclasses

import pytest

import problems
from curvbench import approximations, config, provenance
from curvbench.measurements import MEASUREMENTS
from tests.conftest import TINY


@pytest.mark.parametrize(
  "kind, mode",
  [
    ("training", "ggn_curvature_prop"),
    ("timing", "ggn_curvature_prop"),
    ("spectra", "ggn_exact"),
  ],
)
def test_a_run_takes_its_measurements_mode(kind, mode):
  assert MEASUREMENTS.get(kind).default_mode == mode
  for curvature in approximations.CURVATURES.names():
    cfg = config.compose(f"measure={kind}", f"curvature={curvature}", *TINY)
    run = config.load(cfg)
    assert cfg.curvature.mode == run.curvature.mode == mode, curvature
    assert run.canonical.mode == mode
  # The mode is in the config itself, so a run's identity does not depend
  # on whether it was given.
  plain = config.compose(f"measure={kind}", *TINY)
  given = config.compose(f"measure={kind}", f"curvature.mode={mode}", *TINY)
  assert provenance.identity_config(plain) == provenance.identity_config(given)


def test_the_optimizer_trains_in_the_practical_mode_and_labels_others():
  problem = problems.make(config.load(config.compose(*TINY)).problem)
  labels = {}
  for extra in ((), ("curvature.mode=ggn_exact",)):
    run = config.load(config.compose("measure=training", *TINY, *extra))
    curvature = run.curvature.make(problem.loss_fn)
    assert curvature.estimator.default_estimation_mode == run.curvature.mode
    labels[extra] = run.measure.chosen.method_label(run, curvature)
  assert labels == {
    (): "kfac[kfac/ggn_curvature_prop]",
    ("curvature.mode=ggn_exact",): "kfac[kfac/ggn_exact]",
  }


def test_outside_a_run_a_curvature_without_a_mode_is_the_librarys_default():
  """As KFAC-JAX's estimators: `ggn_curvature_prop` where none is named,
  and the curvature says which it is in."""
  problem = problems.make(config.load(config.compose(*TINY)).problem)
  for name in ("kfac", "explicit_exact", "kfac_tridiagonal"):
    settings = approximations.CURVATURES.defaults(name)
    assert settings.mode is None
    curvature = approximations.make(settings, problem.loss_fn)
    assert curvature.mode == "ggn_curvature_prop", name
    exact = approximations.make(
      dataclasses.replace(settings, mode="ggn_exact"), problem.loss_fn
    )
    assert exact.mode == "ggn_exact" and exact.label == f"{name}/ggn_exact"
