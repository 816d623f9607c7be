"""Quality per block type: every layer block of a tiny transformer and a
tiny normalised convnet gets the intended type; the quality of a type is
that of the sub-matrices over all its parameters, against brute force in
float64; the report has its table and figure."""

import dataclasses
from pathlib import Path

import jax
import jax.flatten_util
import jax.numpy as jnp
import numpy as np
import pandas as pd
import pytest

import estimators as kfac
import problems
from curvbench import approximations, config, report
from curvbench.core import curvatures, metrics, plots
from curvbench.measurements.spectra import Spectra
from curvbench.measurements.spectra import compute as spectra
from problems.base import loss

TRANSFORMER = (
  "problem=transformer",
  "problem.width=4",
  "problem.layers=1",
  "problem.heads=2",
  "problem.mlp_ratio=1",
  "problem/data=modular",
  "problem.data.modulus=5",
)  # vocabulary 7, 223 parameters
CONVNET = (
  "problem=convnet_norm",
  "problem.channels=[2,2]",
  "problem.dense=[4]",
)  # 152 parameters
ROLES = {
  "transformer": {
    "block0_attention_key": "attention",
    "block0_attention_out": "attention",
    "block0_attention_query": "attention",
    "block0_attention_value": "attention",
    "block0_mlp_in": "mlp",
    "block0_mlp_out": "mlp",
    "block0_norm1": "norm",
    "block0_norm2": "norm",
    "final_norm": "norm",
    "logits": "dense",
    "position_embed": "embedding",
    "token_embed": "embedding",
  },
  "convnet_norm": {
    "conv_0": "conv",
    "conv_1": "conv",
    "norm_0": "norm",
    "norm_1": "norm",
    "dense_0": "dense",
    "logits": "dense",
  },
}
PROBLEMS = {"transformer": TRANSFORMER, "convnet_norm": CONVNET}


@pytest.fixture(scope="module", params=list(PROBLEMS))
def tiny(request):
  """A tiny problem's name, the problem, float64 params and a batch of 3."""
  name = request.param
  problem = problems.make(
    config.plain(
      config.compose(*PROBLEMS[name], "problem.batch_size=3").problem
    )
  )
  params = problem.init_params(jax.random.PRNGKey(0), jnp.float64)
  return name, problem, params, problem.fixed_batch(3, dtype=np.float64)


def test_every_block_gets_its_type(tiny):
  name, problem, params, batch = tiny
  roles = curvatures.block_roles(
    problem.loss_fn, params, batch, problem.layer_roles
  )
  assert roles == ROLES[name]
  # Without the problem's roles, attention and MLP layers read as dense.
  plain = curvatures.block_roles(problem.loss_fn, params, batch)
  assert {r for n, r in plain.items() if "attention" in n or "mlp" in n} <= {
    "dense"
  }


def test_a_block_type_comes_from_the_first_matching_name_then_the_tag():
  roles = (("attn", "attention"), ("attn_out", "output"), ("mlp", "mlp"))
  assert (
    curvatures.block_role("b0_attn_out", kfac.tags.dense, roles) == "attention"
  )
  assert (
    curvatures.block_role("b0_mlp_in", kfac.tags.repeated_dense, roles) == "mlp"
  )
  for tag, role in (
    (kfac.tags.conv2d, "conv"),
    (kfac.tags.embedding, "embedding"),
    (kfac.tags.scale_and_shift, "norm"),
    (kfac.tags.dense, "dense"),
    (kfac.tags.repeated_dense, "dense"),
    (kfac.tags.generic, "other"),
  ):
    assert curvatures.block_role("layer", tag, roles) == role
  with pytest.raises(ValueError, match="pair of non-empty strings"):
    curvatures.block_role("layer", kfac.tags.dense, ("attention",))
  with pytest.raises(ValueError, match="role 'all'"):
    curvatures.block_role("layer", kfac.tags.dense, (("layer", "all"),))


def test_a_tied_token_table_is_other():
  """The tied output layer shares the token table under a generic tag."""
  problem = problems.make(
    config.plain(
      config.compose(
        *TRANSFORMER, "problem.tied=true", "problem.batch_size=3"
      ).problem
    )
  )
  params = problem.init_params(jax.random.PRNGKey(0), jnp.float64)
  roles = curvatures.block_roles(
    problem.loss_fn,
    params,
    problem.fixed_batch(3, dtype=np.float64),
    problem.layer_roles,
  )
  assert roles["token_embed"] == "other"


def _brute_force(problem, params, batch):
  """The exact GGN `J^T (d^2 loss / d logits^2) J` and the gradient, from
  `jax.jacobian` and `jax.hessian` of the loss in the logits."""
  flat, unravel = jax.flatten_util.ravel_pytree(params)
  x, y = batch
  logits_fn = lambda f: problem.net.apply(unravel(f), x)
  z = logits_fn(flat)
  jac = jax.jit(jax.jacfwd(logits_fn))(flat).reshape(z.size, -1)
  hz = jax.jit(
    jax.hessian(lambda v: loss(problem.loss_name)(v.reshape(z.shape), y))
  )(z.ravel())
  grad = jax.jit(jax.grad(lambda f: problem.loss_fn(unravel(f), batch)))(flat)
  return (
    np.asarray(jac.T @ hz @ jac, np.float64),
    np.asarray(grad, np.float64),
  )


def _by_hand(a, e, g, rho):
  """The quality metrics of `a` against `e`, straight from their
  definitions; the natural-gradient cosine with each matrix damped by `rho`
  times its own largest eigenvalue."""

  def direction(m):
    damping = rho * np.linalg.eigvalsh(m)[-1]
    return np.linalg.solve(m + damping * np.eye(len(m)), g)

  da, de = direction(a), direction(e)
  return dict(
    relative_frobenius=np.linalg.norm(a - e) / np.linalg.norm(e),
    trace_ratio=np.trace(a) / np.trace(e),
    top_eigenvalue_ratio=np.linalg.eigvalsh(a)[-1] / np.linalg.eigvalsh(e)[-1],
    natural_gradient_cosine=da @ de / np.linalg.norm(da) / np.linalg.norm(de),
    diagonal_relative_error=np.linalg.norm(np.diag(a) - np.diag(e))
    / np.linalg.norm(np.diag(e)),
  )


RHO = 1e-2  # the one relative damping of the natural-gradient cosine


def _spec(**overrides):
  """The spectra settings, small, with `overrides`."""
  cfg = config.load(config.compose()).measure.spectra
  return dataclasses.replace(
    cfg,
    **dict(
      dict(
        references=["ggn"], top_k=3, heatmap_blocks=0, relative_dampings=[RHO]
      ),
      **overrides,
    ),
  )


def _quality(tables, level):
  return {
    (r["block"], r["metric"]): r["value"]
    for r in tables["quality"]
    if r["level"] == level
  }


@pytest.mark.slow
def test_quality_of_a_type_is_that_of_its_sub_matrices(tiny):
  """K-FAC against the exact GGN over all parameters of each type (cross-
  layer entries included), not an average of its layers' numbers."""
  name, problem, params, batch = tiny
  cur = approximations.make(
    config.plain(config.compose("curvature=kfac").curvature), problem.loss_fn
  )
  cfg = _spec()
  tables = spectra.measure(
    problem.loss_fn,
    cur,
    params,
    batch,
    cfg,
    jax.random.PRNGKey(1),
    layer_roles=problem.layer_roles,
  )
  approx = np.asarray(
    cur.to_dense(
      curvatures.estimate(cur, jax.random.PRNGKey(1), params, batch)
    ),
    np.float64,
  )
  exact, grad = _brute_force(problem, params, batch)
  assert {r["reference"] for r in tables["quality"]} == {"ggn"}
  assert {
    r["relative_damping"]
    for r in tables["quality"]
    if r["metric"] == "natural_gradient_cosine"
  } == {RHO}
  roles, layers = _quality(tables, "role"), _quality(tables, "layer")
  assert {b for b, _ in roles} == set(ROLES[name].values())
  assert {b for b, _ in _quality(tables, "network")} == {"all"}
  blocks = dict(curvatures.layer_blocks(problem.loss_fn, params, batch))
  for role in set(ROLES[name].values()):
    mine = [n for n, r in ROLES[name].items() if r == role]
    idx = np.sort(np.concatenate([blocks[n] for n in mine]))
    expected = _by_hand(
      approx[np.ix_(idx, idx)], exact[np.ix_(idx, idx)], grad[idx], RHO
    )
    for metric, value in expected.items():
      assert roles[(role, metric)] == pytest.approx(
        value, rel=1e-7, abs=1e-12
      ), (role, metric)
    if len(mine) > 1:  # an average of the layers' numbers would differ
      mean = np.mean([layers[(n, "relative_frobenius")] for n in mine])
      assert abs(roles[(role, "relative_frobenius")] - mean) > 1e-3 * mean


def test_one_type_over_the_whole_network_adds_no_rows():
  blocks = [("dense_0", np.arange(3)), ("logits", np.arange(3, 5))]
  assert (
    spectra.role_indices(blocks, {"dense_0": "dense", "logits": "dense"}) == {}
  )
  found = spectra.role_indices(blocks, {"dense_0": "dense", "logits": "out"})
  np.testing.assert_array_equal(found["out"], [3, 4])


# --- the report -----------------------------------------------------------

METRICS = ("relative_frobenius", "natural_gradient_cosine", "trace_ratio")
COSINE = "natural_gradient_cosine (rho=0.001)"  # as the report names it


def _records():
  """Quality records of two methods, two runs each: whole network, two
  layers and two block types; values known."""
  rows = []
  for method in ("kfac/ggn_exact", "diagonal/ggn_exact"):
    for run in (0, 1):
      for level, block in (
        ("network", "all"),
        ("layer", "block0_mlp_in"),
        ("layer", "conv_0"),
        ("role", "mlp"),
        ("role", "conv"),
      ):
        for i, metric in enumerate(METRICS):
          rows.append(
            dict(
              problem="tiny",
              method=method,
              label=method,
              block_type=method.split("/")[0],
              step=0,
              data="batch",
              sample=0,
              seed=run,
              reference="ggn",
              level=level,
              block=block,
              metric=metric,
              relative_damping=1e-3 if metric == METRICS[1] else np.nan,
              run_id=f"{method}{run}",
              value=i + run + (level == "role"),
            )
          )
  return pd.DataFrame(rows)


def _section(table, out):
  rep = report.Report(
    Path("."),
    pd.DataFrame(),
    pd.DataFrame(),
    {"quality": table},
    plots.colours(table.method),
  )
  found = Spectra().section(rep, out)
  return found, {t.name: t.data for t in found.tables}


def test_report_table_per_block_type(tmp_path):
  _, tables = _section(_records(), tmp_path / "new")
  types = tables["quality_block_types"]
  assert set(types.block) == {"mlp", "conv"}
  assert set(types.metric) == {"relative_frobenius", COSINE, "trace_ratio"}
  assert len(types) == 2 * 2 * len(METRICS) and set(types.n) == {2}
  row = types[
    (types.block == "mlp")
    & (types.metric == "trace_ratio")
    & (types.label == "kfac/ggn_exact")
  ].iloc[0]
  # Metric 2 of a type row: 3 in run 0, 4 in run 1.
  assert (row["median"], row.q25, row.q75) == (3.5, 3.25, 3.75)
  assert set(tables["quality_blocks"].block) == {"block0_mlp_in", "conv_0"}
  assert set(tables["quality"].block) == {"all"}
  # Records from before block types: no level, no type rows.
  _, old = _section(
    _records().query("level != 'role'").drop(columns="level"), tmp_path / "old"
  )
  assert "quality_block_types" not in old
  assert set(old["quality_blocks"].block) == {"block0_mlp_in", "conv_0"}


def test_report_figure_per_block_type(tmp_path, monkeypatch):
  drawn = []
  save = plots.save

  def keep(fig, path, **kw):
    drawn.append((path.name, [ax for ax in fig.axes if ax.get_visible()]))
    return save(fig, path, **kw)

  monkeypatch.setattr(plots, "save", keep)
  found, _ = _section(_records(), tmp_path)
  paths = found.figures
  names = {p.name for p in paths}
  assert {
    "quality_block_types_tiny_relative_frobenius.png",
    "quality_block_types_tiny_relative_frobenius.pdf",
  } <= names
  assert all(p.stat().st_size > 1000 for p in paths)
  # A figure per metric, the headline ones first (summary.METRICS),
  # whatever their names.
  axes = [
    panels[0]
    for name, panels in drawn
    if name.startswith("quality_block_types")
  ]
  assert [ax.get_title() for ax in axes] == [
    metrics.title(m) for m in ["relative_frobenius", COSINE, "trace_ratio"]
  ]
  assert "lower is better" in axes[0].get_title()
  assert "higher is better" in axes[1].get_title()
  # The attention/MLP/... order, a bar per method in each group.
  assert [t.get_text() for t in axes[0].get_xticklabels()] == ["mlp", "conv"]
  assert len(axes[0].patches) == 2 * 2
  # The whole-network figure keeps to the whole network.
  bars = dict(drawn)["quality_tiny_relative_frobenius"][0].patches
  assert len(bars) == 2
