"""The transformer problem and its token datasets: every parameter gets the
block meant for it by automatic registration; the harness's exact GGN and
Hessian products equal brute force; the embedding block's statistics equal
K-FAC's for a dense layer on one-hot inputs while storing O(vocab) numbers;
the datasets are fixed by their seed and say where a missing file goes."""

import re

import jax
import jax.flatten_util
import jax.numpy as jnp
import numpy as np
import pytest

import estimators as kfac
import problems
from curvbench import approximations, config
from problems import DATASETS
from problems.datasets import modular
from tests import groundtruth as gt

TINY = dict(
  name="transformer",
  width=8,
  layers=1,
  heads=2,
  mlp_ratio=2,
  batch_size=3,
  data=dict(name="modular", modulus=5),
)  # vocab 7


@pytest.fixture(scope="module")
def tiny():
  problem = problems.make(TINY)
  params = problem.init_params(jax.random.PRNGKey(0), jnp.float64)
  return problem, params, problem.fixed_batch(3, dtype=np.float64)


# Per block-diagonal family: the blocks of the (shared) dense layers, the
# embeddings and the layer norms.
BLOCKS = {
  "kfac": (
    "RepeatedDenseTwoKroneckerFactored",
    "EmbeddingKFAC",
    "ScaleAndShiftDiagonal",
  ),
  "kfac_reduce": (
    "RepeatedDenseKFACReduce",
    "EmbeddingKFAC",
    "ScaleAndShiftDiagonal",
  ),
  "kfac_tridiagonal": (
    "RepeatedDenseTwoKroneckerFactored",
    "EmbeddingKFAC",
    "ScaleAndShiftDiagonal",
  ),
  "ekfac": ("DenseEKFAC", "EmbeddingEKFAC", "ScaleAndShiftDiagonal"),
  "tnt": ("DenseTNT", "EmbeddingTNT", "ScaleAndShiftDiagonal"),
  "diagonal": ("DenseDiagonal", "EmbeddingDiagonal", "ScaleAndShiftDiagonal"),
  "full": ("DenseFull", "EmbeddingFull", "ScaleAndShiftFull"),
  "identity": ("ScaledIdentity",) * 3,
  "shampoo": ("DenseShampoo", "EmbeddingShampoo", "ScaleAndShiftDiagonal"),
  "shampoo2": ("DenseShampoo2", "EmbeddingShampoo2", "ScaleAndShiftDiagonal"),
  "soap": ("DenseSOAP", "EmbeddingSOAP", "ScaleAndShiftDiagonal"),
  "optimal_kronecker": (
    "DenseOptimalKronecker",
    "EmbeddingOptimalKronecker",
    "ScaleAndShiftDiagonal",
  ),
  "kl_shampoo": (
    "DenseKLShampoo",
    "EmbeddingKLShampoo",
    "ScaleAndShiftDiagonal",
  ),
}


def test_every_parameter_gets_the_block_meant_for_it(tiny):
  problem, params, batch = tiny
  report = kfac.registration_report(problem.loss_fn, (params, batch))
  tag = {r["path"]: (r["tag"], r["source"]) for r in report}
  assert len(tag) == len(jax.tree.leaves(params)) == 22
  for path, (name, source) in tag.items():
    if "embed" in path:  # a one-hot matmul or a gather
      assert name == "embedding_tag" and source.startswith("embedding"), path
    elif "norm" in path:
      assert name == "scale_and_shift_tag", path
    else:  # attention projections, MLP and output layers
      assert (name, source) == ("repeated_dense_tag", "dense_with_bias"), path
  rng = jax.random.PRNGKey(0)
  families = [
    n
    for n in approximations.CURVATURES.names()
    if approximations.CURVATURES.defaults(n).is_block_diagonal
  ]
  assert sorted(families) == sorted(BLOCKS)  # a new family says its blocks
  for name, (dense, embedding, norm) in BLOCKS.items():
    curvature = config.load(
      config.compose("problem=transformer", f"curvature={name}")
    ).curvature.make(problem.loss_fn)
    curvature.init(rng, params, batch)
    rows = curvature.registration()
    kinds = {"embed": embedding, "norm": norm}
    for row in rows:
      want = next((b for k, b in kinds.items() if k in row["block"]), dense)
      assert row["block_class"] == want, (name, row)
      first = row["block"].split(" [")[0].split(",")[0]  # a parameter's path
      assert row["source"] == tag[first][1], (name, row)
    assert sum(row["dim"] for row in rows) == problem.num_params


def test_tied_output_layer_is_reported_as_shared():
  problem = problems.make(dict(TINY, tied=True))
  params = problem.init_params(jax.random.PRNGKey(0), jnp.float64)
  batch = problem.fixed_batch(3, dtype=np.float64)
  report = kfac.registration_report(problem.loss_fn, (params, batch))
  path = "['token_embed']['embeddings']"
  table = next(r for r in report if r["path"] == path)
  shared = (
    r"shared by 2 layers: embedding(_gather)? \(output \(3, 4, 8\)\) "
    r"and dot_general of its transpose \(output \(3, 4, 7\)\)"
  )
  assert table["tag"] == "generic_tag"
  assert re.fullmatch(shared, table["source"]), table["source"]
  assert "logits" not in str([r["path"] for r in report])
  # The curvature's report names the block the shared table got.
  for name, block in (("kfac", "NaiveDiagonal"), ("tnt", "NaiveTNT")):
    curvature = config.load(
      config.compose("problem=transformer", f"curvature={name}")
    ).curvature.make(problem.loss_fn)
    curvature.init(jax.random.PRNGKey(0), params, batch)
    (row,) = [r for r in curvature.registration() if path in r["block"]]
    assert row["block"] == f"{path} [generic_tag]"
    assert row["block_class"] == block
    assert re.fullmatch(shared, row["source"]), row["source"]


def _flat_loss_and_logits(problem, params, batch):
  flat, unravel = jax.flatten_util.ravel_pytree(params)
  x, y = batch
  return (
    flat,
    lambda f: problem.loss_fn(unravel(f), batch),
    lambda f: problem.net.apply(unravel(f), x),
    y,
    unravel,
  )


def test_exact_ggn_and_hessian_products_equal_brute_force(tiny):
  problem, params, batch = tiny
  flat, loss, logits, _, _ = _flat_loss_and_logits(problem, params, batch)
  hessian = jax.jit(jax.hessian(loss))(flat)
  out = logits(flat)  # (B, T, V)
  b, t, v = out.shape
  jac = jax.jit(jax.jacobian(logits))(flat).reshape(b * t, v, -1)
  ggn = gt.softmax_ggn(jac, out.reshape(b * t, v))
  gt.assert_exact_products_equal(
    problem.loss_fn, params, batch, {"ggn": ggn, "hessian": hessian}
  )


def _blocks(problem, params, batch, **kwargs):
  est = kfac.BlockDiagonalCurvature(problem.loss_fn, **kwargs)
  state = gt.one_batch_state(
    est, (params, batch), len(batch[0]), rngs=(2, 2), exact_powers_to_cache=None
  )
  return est, state


def test_embedding_block_equals_kfac_of_a_one_hot_dense_layer(tiny):
  problem, params, batch = tiny
  est, state = _blocks(problem, params, batch)
  dense_est, dense_state = _blocks(
    problem, params, batch, patterns_to_skip=("embedding",)
  )
  names = ("['token_embed']['embeddings']", "['position_embed']['embeddings']")
  for name in names:
    i = next(i for i, b in enumerate(est.blocks) if b.name.startswith(name))
    j = next(
      j for j, b in enumerate(dense_est.blocks) if b.name.startswith(name)
    )
    block, dense = est.blocks[i], dense_est.blocks[j]
    assert type(block) is kfac.EmbeddingKFAC
    assert type(dense) is kfac.RepeatedDenseTwoKroneckerFactored
    s, d = state.blocks_states[i], dense_state.blocks_states[j]
    vocab, width = block.parameters_shapes[0]
    assert s.inputs_factor.value.shape == (vocab,)  # O(vocab), not vocab^2
    np.testing.assert_allclose(
      jnp.diag(s.inputs_factor.value), d.inputs_factor.value, atol=1e-15
    )
    np.testing.assert_allclose(
      s.outputs_factor.value, d.outputs_factor.value, rtol=1e-10, atol=1e-15
    )
    assert block.fixed_scale() == dense.fixed_scale() == 4
    vec = (jnp.asarray(np.random.default_rng(0).normal(size=(vocab, width))),)
    for power, exact in ((1, True), (-1, True), (-0.5, True), (-1, False)):
      np.testing.assert_allclose(
        block.multiply_matpower(s, vec, 1e-2, power, exact, False)[0],
        dense.multiply_matpower(d, vec, 1e-2, power, exact, False)[0],
        rtol=1e-9,
        atol=1e-12,
      )
  # Brute force: A = the token frequencies over every position.
  x = batch[0].astype(int)
  i = next(i for i, b in enumerate(est.blocks) if b.name.startswith(names[0]))
  counts = np.bincount(x.ravel(), minlength=7) / x.size
  np.testing.assert_allclose(
    state.blocks_states[i].inputs_factor.value, counts, atol=1e-15
  )


def test_modular_data_is_fixed_by_its_seed():
  def load(**kw):
    return DATASETS.load(
      dict(name="modular", modulus=7, **kw), "problem.data"
    ).load()

  a, b, c = load(seed=3), load(seed=3), load(seed=4)
  np.testing.assert_array_equal(a.x_train, b.x_train)
  assert not np.array_equal(a.x_train, c.x_train)
  assert len(a.x_train) + len(a.x_test) == 49 and a.num_classes == 9
  x, y = a.x_train.astype(int), a.y_train
  np.testing.assert_array_equal(x[:, 1:], y[:, :-1])  # next tokens
  np.testing.assert_array_equal((x[:, 0] + x[:, 2]) % 7, y[:, -1])
  assert (x[:, 1] == 7).all() and (x[:, 3] == 8).all()
  abc = modular.equations(7, "/")
  np.testing.assert_array_equal(abc[:, 2] * abc[:, 1] % 7, abc[:, 0])


def test_text_data_and_the_missing_file_error(tmp_path, monkeypatch):
  monkeypatch.delenv("CURVBENCH_DATA", raising=False)
  path = tmp_path / "book.txt"
  path.write_text("héllo wörld, " * 20, encoding="utf-8")
  settings = DATASETS.load(
    dict(name="text", path=str(path), seq_len=5), "problem.data"
  )
  data = settings.load()
  assert data.num_classes == len(set("héllo wörld, "))
  assert data.x_train.shape[1:] == (5,)
  np.testing.assert_array_equal(data.x_train[:, 1:], data.y_train[:, :-1])
  before = settings.fingerprint()
  path.write_text("other text " * 30, encoding="utf-8")
  assert settings.fingerprint() != before  # the file's sha256 is its identity
  for given in (None, str(tmp_path / "missing.txt")):
    with pytest.raises(
      FileNotFoundError,
      match=r"problem\.data\.path.*plain text file.*set "
      r"problem\.data\.path=/path/to/file\.txt.*"
      r"when_missing=synthetic",
    ):
      DATASETS.load(dict(name="text", path=given), "problem.data").load()


def test_sequence_models_and_array_models_refuse_each_others_data():
  with pytest.raises(config.ConfigError, match="token sequences"):
    config.compose("problem=transformer", "problem/data=digits")
  with pytest.raises(config.ConfigError, match="numeric arrays"):
    config.compose("problem=mlp", "problem/data=modular")
