"""Which estimation mode a run's curvature is in: where `curvature.mode` is
not given, the measurement's (`Measurement.default_mode`), so that K-FAC
trains and is timed as people run it (KFAC-JAX 0.0.8's optimizer,
`ggn_curvature_prop`) and spectra compare with the exact matrix
(`ggn_exact`); any other mode is a labelled variant."""

import dataclasses

import pytest

import problems
from curvbench import approximations, config, planning, provenance, runs
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


def _points(*swept):
  """The runs of a sweep's points, as the sweeper loads them."""
  jobs = planning.product([*swept, *TINY])
  return [config.load(config.compose(*job)) for job in jobs]


def _skipped(points):
  chosen = runs.swept_canonical(points)
  settled = [
    dataclasses.replace(p, canonical=dataclasses.replace(p.canonical, **c))
    for p, c in zip(points, chosen)
  ]
  return {
    (p.optimizer.name, p.curvature.name, p.curvature.mode): runs.skip_reason(p)
    for p in settled
  }


def test_a_sweep_that_fixes_another_mode_still_trains_every_optimizer():
  """Every point at curvature.mode=ggn_exact: Adam and SGD, which use no
  curvature, run at that mode rather than at none (their canonical mode,
  the measurement's, is a value the sweep never takes)."""
  points = _points(
    "measure=training", "optimizer=kfac,adam,sgd", "curvature.mode=ggn_exact"
  )
  assert runs.swept_canonical(points) == [{"mode": "ggn_exact"}] * 3
  assert set(_skipped(points).values()) == {None}
  # Canonical values are not identity: the points keep their folders.
  excluded = config.compose(*TINY, with_hydra=True).hydra.job.config
  assert "canonical.mode" in excluded.override_dirname.exclude_keys


def test_a_sweep_over_modes_trains_an_optimizer_without_curvature_once():
  points = _points(
    "measure=training",
    "optimizer=adam",
    "curvature.mode=ggn_exact,ggn_curvature_prop",
  )
  assert not any("mode" in c for c in runs.swept_canonical(points))
  skipped = _skipped(points)
  assert skipped["adam", "kfac", "ggn_curvature_prop"] is None
  assert "mode=ggn_curvature_prop only" in skipped["adam", "kfac", "ggn_exact"]


def test_a_spectra_sweep_with_another_optimizer_runs_once():
  """Spectra do not use the optimizer: a sweep naming only Adam measures
  them with Adam's point rather than with none."""
  points = _points("measure=spectra", "optimizer=adam", "curvature=kfac,ekfac")
  assert runs.swept_canonical(points) == [{"optimizer": "adam"}] * 2
  assert set(_skipped(points).values()) == {None}


def test_a_null_mode_is_no_canonical_value():
  """`curvature.mode=null,ggn_exact` (the benchmark's timing sweep): the
  null point takes its library's mode, so the canonical mode follows the
  other value, never null."""
  points = _points(
    "measure=timing", "optimizer=kfac,adam", "curvature.mode=null,ggn_exact"
  )
  assert {c.get("mode") for c in runs.swept_canonical(points)} == {"ggn_exact"}
  assert runs.swept_canonical(
    _points("measure=timing", "curvature.mode=null")
  ) == [{}]
