"""The matrix-free spectra method's probe estimates against the dense
method's exact metrics on a tiny network: each within 3 of its reported
standard errors; their errors and probes needed in the quality rows and
the report's tables (float64)."""

import functools
import math

import jax
import numpy as np
import pandas as pd
import pytest

from curvbench import approximations, config
from curvbench.core import metrics
from curvbench.measurements.spectra import compute as spectra
from curvbench.measurements.spectra import summary
from tests.cases import spectra_settings

ROLES = (("dense_0", "hidden"),)  # a block type per layer: roles differ
PROBES = dict(frobenius_probes=30, diagonal_probes=30, slq_probes=4)
PROBED = {
  "relative_frobenius": "frobenius_probes",
  "diagonal_relative_error": "diagonal_probes",
  "spectral_distance": "slq_probes",
  "log_wasserstein": "slq_probes",
}
# Compared with the dense method's exact values: the other two are SLQ's,
# whose Gauss quadrature has a bias of its own beside the probes' noise.
UNBIASED = ("relative_frobenius", "diagonal_relative_error")


# The shared small settings with many probes, and no heatmaps.
spec = functools.partial(
  spectra_settings, cg_iters=300, heatmap_blocks=0, **PROBES
)


@pytest.fixture(scope="module")
def both(tiny):
  """The quality rows of K-FAC by the dense and the lanczos method."""
  p, params, batch = tiny
  cfg = config.plain(config.compose("curvature=kfac").curvature)
  cur = approximations.make(cfg, p.loss_fn)
  return {
    method: pd.DataFrame(
      spectra.measure(
        p.loss_fn,
        cur,
        params,
        batch,
        spec(method=method),
        jax.random.PRNGKey(1),
        layer_roles=ROLES,
      )["quality"]
    )
    for method in ("dense", "lanczos")
  }


def test_probe_estimates_agree_with_the_dense_metrics_within_their_errors(both):
  dense, lanczos = both["dense"], both["lanczos"]
  key = ["reference", "level", "block", "metric", "relative_damping"]
  rows = lanczos.merge(dense, on=key, suffixes=("", "_dense"))
  assert len(rows) == len(lanczos)
  assert set(rows.level) == {"network", "layer", "role"}
  for metric in UNBIASED:
    part = rows[rows.metric == metric]
    assert len(part) == 5  # network, two layers, two block types
    for _, r in part.iterrows():
      where = (metric, r.level, r.block)
      assert r.stderr > 0, where
      assert abs(r.value - r.value_dense) <= 3 * r.stderr, where
  # The Frobenius errors are well resolved by 30 probes: not vacuous.
  frob = rows[rows.metric == "relative_frobenius"]
  assert (frob.stderr < 0.15 * frob.value).all()


def test_probe_estimates_carry_an_error_and_the_probes_a_precision_needs(both):
  dense, lanczos = both["dense"], both["lanczos"]
  assert dense.stderr.isna().all() and dense.probes_needed.isna().all()
  probed = lanczos.metric.isin(list(PROBED))
  others = lanczos[~probed]
  assert set(others.metric) == {
    "top_k_overlap",
    "top_eigenvalue_ratio",
    "natural_gradient_cosine",
  }
  assert others.stderr.isna().all() and others.probes_needed.isna().all()
  precision = spec().target_precision
  for _, r in lanczos[probed].iterrows():
    m = PROBES[PROBED[r.metric]]
    assert np.isfinite(r.stderr) and r.stderr > 0, r.metric
    assert r.probes_needed == max(
      1, math.ceil(m * (r.stderr / (precision * abs(r.value))) ** 2)
    ), r.metric
  slq = lanczos[lanczos.metric.isin(["spectral_distance", "log_wasserstein"])]
  assert set(slq.level) == {"network"} and len(slq) == 2


def _labelled(df, label):
  return df.assign(
    problem="mlp",
    data="batch",
    step=0,
    label=label,
    run_id=f"run-{label}",
    seed=0,
    sample=0,
  )


def test_the_report_shows_a_probe_estimate_with_its_error(both):
  q = pd.concat(
    [
      _labelled(both["dense"], "kfac dense"),
      _labelled(both["lanczos"], "kfac lanczos"),
    ]
  )
  out = summary.quality(q)
  frob = out[
    (out.metric == "relative_frobenius") & (out.level == "network")
  ].set_index("label")
  lanczos = both["lanczos"]
  own = lanczos[
    (lanczos.metric == "relative_frobenius") & (lanczos.level == "network")
  ].iloc[0]
  assert frob.loc["kfac lanczos", "stderr"] == own.stderr
  assert frob.loc["kfac lanczos", "probes_needed"] == own.probes_needed
  assert np.isnan(frob.loc["kfac dense", "stderr"])
  table = summary.quality_table(
    "quality", "Quality", out[out.level == "network"], detail=False
  )
  assert "standard error" in table.title
  cells = table.view.set_index("label").relative_frobenius
  assert cells["kfac lanczos"].endswith(f" ±{own.stderr:.2g}")
  assert "±" not in cells["kfac dense"]
  assert "±" not in table.view.set_index("label").top_k_overlap.sum()
  assert {"stderr", "probes_needed"} <= set(table.data.columns)
  # Records from before the errors were recorded read as they did.
  old = summary.quality(q.drop(columns=["stderr", "probes_needed"]))
  assert old.stderr.isna().all()
  table = summary.quality_table(
    "quality", "Quality", old[old.level == "network"], detail=False
  )
  assert "±" not in "".join(table.view.relative_frobenius)
  assert "standard error" not in table.title


@pytest.mark.slow
def test_probes_taken_a_few_at_a_time_give_the_same_rows(tiny, both):
  """measure.spectra.probe_batch bounds the memory, not the estimates."""
  p, params, batch = tiny
  cur = approximations.make(
    config.plain(config.compose("curvature=kfac").curvature), p.loss_fn
  )
  batched = pd.DataFrame(
    spectra.measure(
      p.loss_fn,
      cur,
      params,
      batch,
      spec(method="lanczos", probe_batch=3, per_block=False),
      jax.random.PRNGKey(1),
      layer_roles=ROLES,
    )["quality"]
  )
  whole = both["lanczos"]
  whole = whole[whole.level != "layer"]
  key = ["reference", "level", "block", "metric", "relative_damping"]
  rows = batched.merge(whole, on=key, suffixes=("", "_whole"))
  assert len(rows) == len(batched) == len(whole)
  np.testing.assert_allclose(rows.value, rows.value_whole, rtol=1e-9)
  np.testing.assert_allclose(rows.stderr, rows.stderr_whole, rtol=1e-7)


def test_the_jackknife_error_of_a_mean_is_its_standard_error():
  x = np.random.default_rng(0).normal(size=7)
  assert metrics.jackknife_stderr(lambda keep: x[keep].mean(), 7) == (
    pytest.approx(np.std(x, ddof=1) / np.sqrt(7), rel=1e-12)
  )
  assert np.isnan(metrics.jackknife_stderr(lambda keep: x[keep].mean(), 1))
