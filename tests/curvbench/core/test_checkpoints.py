"""Parameter checkpoints: round trips, plain-safetensors loading, errors."""

import functools
import os
import stat

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy

from curvbench.core import checkpoints
from curvbench.measurements.spectra import checkpoint_params


def mlp_params(dtype, widths=(5, 3)):
  """Initial params of a tiny haiku MLP, cast to `dtype` (fresh arrays)."""
  return jax.tree.map(lambda a: a.astype(dtype), _init_mlp(widths))


@functools.lru_cache
def _init_mlp(widths):
  # Cached: each haiku init compiles its ops, which dominates test time.
  def model(x):
    # Top-level layer names, as problems/ uses: {"dense_0": {"w", "b"}, ...}.
    for i, width in enumerate(widths):
      x = jax.nn.tanh(hk.Linear(width, name=f"dense_{i}")(x))
    return x

  net = hk.without_apply_rng(hk.transform(model))
  params = net.init(jax.random.PRNGKey(0), jnp.zeros((2, 4)))
  return jax.tree.map(np.asarray, params)


def assert_same(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    assert x.dtype == y.dtype and x.shape == y.shape
    np.testing.assert_array_equal(x, y)  # bit-exact


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_round_trip_is_exact_and_keeps_dtype(tmp_path, dtype):
  params = mlp_params(dtype)
  path = checkpoints.save(
    checkpoints.path_for(tmp_path, 12), params, step=12, problem="mlp"
  )
  assert path == tmp_path / "params_step0000012.safetensors"
  loaded, info = checkpoints.load(path)
  assert_same(loaded, jax.tree.map(np.asarray, params))


def test_jax_arrays_are_saved(tmp_path):
  params = {"lin": {"w": jnp.arange(6.0).reshape(2, 3)}}
  path = checkpoints.save(
    tmp_path / "p.safetensors", params, step=0, problem="mlp"
  )
  loaded, _ = checkpoints.load(path)
  np.testing.assert_array_equal(
    loaded["lin"]["w"], np.arange(6.0).reshape(2, 3)
  )


def test_plain_safetensors_reads_module_name_keys(tmp_path):
  params = mlp_params(np.float32)
  path = checkpoints.save(
    tmp_path / "p.safetensors", params, step=3, problem="mlp"
  )
  flat = safetensors.numpy.load_file(path)  # no curvbench involved
  assert set(flat) == {f"{m}/{n}" for m in params for n in params[m]}
  for m in params:
    for n in params[m]:
      np.testing.assert_array_equal(flat[f"{m}/{n}"], params[m][n])


def test_metadata_round_trip(tmp_path):
  extra = {"config": {"lr": 0.1, "widths": [5, 3]}, "seed": 7}
  path = checkpoints.save(
    tmp_path / "p.safetensors",
    mlp_params(np.float32),
    step=42,
    problem="mlp-mnist1d",
    metadata=extra,
  )
  _, info = checkpoints.load(path)
  assert info == {
    "step": 42,
    "problem": "mlp-mnist1d",
    "metadata": extra,
    "model_state": {},
  }


def test_deeper_nesting_round_trips(tmp_path):
  params = {"a": {"b": {"c": np.ones(2)}, "d": np.zeros((1, 2))}}
  path = checkpoints.save(
    tmp_path / "p.safetensors", params, step=1, problem="x"
  )
  assert_same(checkpoints.load(path)[0], params)


def test_key_with_separator_is_rejected(tmp_path):
  with pytest.raises(ValueError, match="'a/b'.*without '/'"):
    checkpoints.save(
      tmp_path / "p.safetensors",
      {"a/b": {"w": np.ones(1)}},
      step=0,
      problem="x",
    )


def test_nested_haiku_module_names_are_rejected_clearly(tmp_path):
  net = hk.without_apply_rng(hk.transform(lambda x: hk.nets.MLP([3])(x)))
  params = net.init(jax.random.PRNGKey(0), jnp.zeros((1, 2)))
  with pytest.raises(ValueError, match="'mlp/~/linear_0'.*top-level names"):
    checkpoints.save(tmp_path / "p.safetensors", params, step=0, problem="x")
  assert not list(tmp_path.iterdir())  # nothing half-written


def test_random_bytes_are_not_a_checkpoint(tmp_path):
  path = tmp_path / "junk.safetensors"
  path.write_bytes(np.random.default_rng(0).bytes(256))
  with pytest.raises(ValueError, match="junk.safetensors is not a safetensors"):
    checkpoints.load(path)


def test_missing_file(tmp_path):
  with pytest.raises(FileNotFoundError, match="nothere.safetensors"):
    checkpoints.load(tmp_path / "nothere.safetensors")


def test_safetensors_without_curvbench_metadata(tmp_path):
  path = tmp_path / "foreign.safetensors"
  safetensors.numpy.save_file({"w": np.ones(2)}, path)
  with pytest.raises(
    ValueError, match="foreign.safetensors.*without curvbench"
  ):
    checkpoints.load(path)


def test_check_matches_accepts_other_dtype(tmp_path):
  checkpoints.check_matches(
    mlp_params(np.float64),
    mlp_params(np.float32),
    path=tmp_path / "p",
    problem="mlp",
    expected_problem="mlp",
  )


def test_check_matches_names_leaf_and_shapes(tmp_path):
  path = tmp_path / "p.safetensors"
  with pytest.raises(ValueError) as e:
    checkpoints.check_matches(
      mlp_params(np.float32, (5, 3)), mlp_params(np.float32, (6, 3)), path=path
    )
  msg = str(e.value)
  assert str(path) in msg
  assert "dense_0/w: checkpoint (4, 5) vs problem (4, 6)" in msg
  assert "dense_1/w: checkpoint (5, 3) vs problem (6, 3)" in msg


def test_check_matches_different_structure(tmp_path):
  with pytest.raises(ValueError, match="different parameter tree.*dense_2"):
    checkpoints.check_matches(
      mlp_params(np.float32, (5, 3)),
      mlp_params(np.float32, (5, 3, 2)),
      path=tmp_path / "p",
    )


def test_check_matches_wrong_problem(tmp_path):
  params = mlp_params(np.float32)
  with pytest.raises(ValueError, match="'autoencoder'.*'mlp'"):
    checkpoints.check_matches(
      params,
      params,
      path=tmp_path / "p",
      problem="autoencoder",
      expected_problem="mlp",
    )


def test_check_matches_refuses_non_finite_parameters(tmp_path):
  params = mlp_params(np.float32)
  nan = jax.tree.map(lambda a: np.full_like(a, np.nan), params)
  with pytest.raises(
    ValueError, match="non-finite values .* in dense_0/b, dense_0/w"
  ):
    checkpoints.check_matches(nan, params, path=tmp_path / "p")


def test_a_checkpoint_named_for_another_step_is_refused(tmp_path):
  params = mlp_params(np.float32)
  checkpoints.save(
    checkpoints.path_for(tmp_path, 2), params, step=7, problem="mlp"
  )
  problem = type("Problem", (), {"name": "mlp"})()
  with pytest.raises(
    ValueError, match="named for step 2 but its header says step 7"
  ):
    checkpoint_params(tmp_path, [2], problem, params)


def test_atomic_write_leaves_no_temporary_files(tmp_path):
  checkpoints.save(
    checkpoints.path_for(tmp_path, 1),
    mlp_params(np.float32),
    step=1,
    problem="mlp",
  )
  assert [p.name for p in tmp_path.iterdir()] == [
    "params_step0000001.safetensors"
  ]


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_checkpoints_get_the_mode_of_the_umask(tmp_path, umask):
  old = os.umask(umask)
  try:
    path = checkpoints.save(
      checkpoints.path_for(tmp_path, 1),
      mlp_params(np.float32),
      step=1,
      problem="mlp",
    )
  finally:
    os.umask(old)
  assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~umask


def test_steps_in_finds_checkpoints_by_step(tmp_path):
  params = mlp_params(np.float32)
  for step in (100, 0, 20):
    checkpoints.save(
      checkpoints.path_for(tmp_path, step), params, step=step, problem="mlp"
    )
  (tmp_path / "losses.parquet").write_text("")
  found = checkpoints.steps_in(tmp_path)
  assert list(found) == [0, 20, 100]
  assert found[20] == tmp_path / "params_step0000020.safetensors"
  assert checkpoints.load(found[100])[1]["step"] == 100
