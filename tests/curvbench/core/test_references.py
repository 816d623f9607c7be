"""The reference store: exact matrices computed once per content and shared
by a sweep's runs, never confused, never written into a foreign folder."""

import jax
import numpy as np
import pandas as pd
import pytest

from curvbench.core import records
from curvbench.core.costs import Costs
from curvbench.core.references import ReferenceStore, content_hash
from curvbench.measurements.spectra import compute as spectra
from problems.datafiles import arrays_sha256
from tests.cases import tiny_curvature
from tests.curvbench.measurements.test_spectra import spec

KEY = dict(problem={"name": "tiny"})


def counted(value):
  calls = []

  def compute():
    calls.append(1)
    return dict(matrix=np.full((2, 2), value))

  return compute, calls


def test_an_entry_is_computed_once_and_read_back_for_the_same_key(tmp_path):
  store = ReferenceStore(tmp_path / "refs")
  compute, calls = counted(1.0)
  first, shared = store.get(KEY, compute)
  assert not shared and len(calls) == 1
  again, shared = store.get(KEY, compute)
  assert shared and len(calls) == 1
  np.testing.assert_array_equal(again["matrix"], first["matrix"])
  other, calls_other = counted(2.0)
  found, shared = store.get(dict(KEY, matrix="hessian"), other)
  assert not shared and found["matrix"][0, 0] == 2.0 and calls_other


def test_a_damaged_entry_is_computed_anew(tmp_path):
  store = ReferenceStore(tmp_path / "refs")
  compute, calls = counted(1.0)
  store.get(KEY, compute)
  [entry] = (tmp_path / "refs").glob("*.npz")
  entry.write_bytes(entry.read_bytes()[:40])  # truncated
  found, shared = store.get(KEY, compute)
  assert not shared and len(calls) == 2 and found["matrix"][0, 0] == 1.0


def _rewrite(entry, change):
  """Writes the entry again (a valid archive, its key kept) with the
  arrays and digest that `change` makes of them."""
  with np.load(entry) as f:
    found = {name: f[name] for name in f.files}
  found = change(found)
  with open(entry, "wb") as f:
    np.savez(f, **found)


TAMPERING = {
  "same shape, other values": lambda e: dict(e, matrix=e["matrix"] + 1),
  "another dtype": lambda e: dict(e, matrix=e["matrix"].astype(np.float32)),
  "another shape": lambda e: dict(e, matrix=e["matrix"].reshape(4)),
  "an extra array": lambda e: dict(e, extra=np.zeros(3)),
  "a missing array": lambda e: {k: v for k, v in e.items() if k != "matrix"},
  "an array renamed": lambda e: {
    ("other" if k == "matrix" else k): v for k, v in e.items()
  },
  "the digest edited": lambda e: dict(e, digest=np.array("0" * 64)),
  "the digest of other arrays": lambda e: dict(
    e,
    matrix=np.zeros((2, 2)),
    digest=np.array(arrays_sha256({"matrix": np.ones((2, 2))})),
  ),
  "no digest": lambda e: {k: v for k, v in e.items() if k != "digest"},
  "no key": lambda e: {k: v for k, v in e.items() if k != "key"},
}


@pytest.mark.parametrize("tampering", TAMPERING)
def test_an_entry_not_matching_its_digest_is_recomputed(
  tmp_path, capsys, tampering
):
  """Arrays replaced under a valid key, or a digest edited, missing or
  made for other arrays: the entry is not used but computed and written
  again, and one line names it and says why."""
  store = ReferenceStore(tmp_path / "refs")
  compute, calls = counted(1.0)
  key = dict(KEY, matrix="ggn")
  store.get(key, compute)
  [entry] = (tmp_path / "refs").glob("*.npz")
  _rewrite(entry, TAMPERING[tampering])
  capsys.readouterr()
  found, shared = store.get(key, compute)
  assert not shared and len(calls) == 2
  assert set(found) == {"matrix"} and found["matrix"].dtype == np.float64
  np.testing.assert_array_equal(found["matrix"], np.full((2, 2), 1.0))
  [line] = capsys.readouterr().out.splitlines()
  assert line.startswith("[curvbench] recomputing the reference store entry")
  assert str(entry) in line and "matrix=ggn" in line
  why = {
    "no digest": "holds no digest",
    "no key": "holds no key",
  }.get(tampering, "its arrays do not match the digest written with them")
  assert why in line
  # Written anew: read back, shared, silently.
  again, shared = store.get(key, compute)
  assert shared and len(calls) == 2 and not capsys.readouterr().out
  np.testing.assert_array_equal(again["matrix"], found["matrix"])


def test_an_unreadable_entry_is_recomputed_and_said_so(tmp_path, capsys):
  store = ReferenceStore(tmp_path / "refs")
  compute, calls = counted(1.0)
  store.get(KEY, compute)
  [entry] = (tmp_path / "refs").glob("*.npz")
  entry.write_bytes(b"not an archive")
  found, shared = store.get(KEY, compute)
  assert not shared and len(calls) == 2 and found["matrix"][0, 0] == 1.0
  out = capsys.readouterr().out
  assert str(entry) in out and "cannot be read" in out


def test_a_valid_entry_written_for_another_key_is_not_used(tmp_path, capsys):
  """Another key's whole entry copied under this key's file name."""
  store = ReferenceStore(tmp_path / "refs")
  store.get(dict(KEY, matrix="ggn"), counted(1.0)[0])
  [ggn] = (tmp_path / "refs").glob("*.npz")
  compute, calls = counted(2.0)
  store.get(dict(KEY, matrix="fisher"), compute)
  [fisher] = set((tmp_path / "refs").glob("*.npz")) - {ggn}
  fisher.write_bytes(ggn.read_bytes())
  capsys.readouterr()
  found, shared = store.get(dict(KEY, matrix="fisher"), compute)
  assert not shared and len(calls) == 2 and found["matrix"][0, 0] == 2.0
  assert "another key" in capsys.readouterr().out


def test_arrays_named_as_the_stores_own_entries_are_refused(tmp_path):
  store = ReferenceStore(tmp_path / "refs")
  with pytest.raises(ValueError, match="named digest.*rename them"):
    store.get(KEY, lambda: dict(digest=np.zeros(2)))


def test_the_digest_tells_apart_names_values_shapes_and_dtypes():
  a = {"w": np.zeros(3), "b": np.ones(2)}
  assert arrays_sha256(a) == arrays_sha256({"b": np.ones(2), "w": np.zeros(3)})
  for other in (
    {"w": np.zeros(3), "c": np.ones(2)},
    {"w": np.zeros(3), "b": np.ones(2) * 2},
    {"w": np.zeros((3, 1)), "b": np.ones(2)},
    {"w": np.zeros(3, np.float32), "b": np.ones(2)},
    {"w": np.zeros(3)},
    {"w": np.zeros(3), "b": np.ones(2), "x": np.zeros(0)},
  ):
    assert arrays_sha256(a) != arrays_sha256(other)


def test_the_store_keeps_the_newest_entries_within_its_size(
  tmp_path, monkeypatch
):
  """Past its size the oldest entries go; a pruned entry is computed
  again, never read wrong."""
  store = ReferenceStore(tmp_path / "refs")
  big = lambda value: lambda: dict(matrix=np.full((64, 64), value))
  store.get(dict(KEY, matrix="ggn"), big(1.0))
  [first] = (tmp_path / "refs").glob("*.npz")
  size = first.stat().st_size
  monkeypatch.setattr("curvbench.core.references.KEEP_BYTES", int(2.5 * size))
  store = ReferenceStore(tmp_path / "refs")
  for i, matrix in enumerate(("fisher", "hessian")):
    store.get(dict(KEY, matrix=matrix), big(2.0 + i))
  entries = list((tmp_path / "refs").glob("*.npz"))
  assert len(entries) == 2 and first not in entries
  compute, calls = counted(1.0)
  found, shared = store.get(dict(KEY, matrix="ggn"), compute)
  assert not shared and calls and found["matrix"][0, 0] == 1.0


def test_without_a_folder_nothing_is_kept(tmp_path):
  compute, calls = counted(1.0)
  store = ReferenceStore(None)
  store.get(KEY, compute)
  store.get(KEY, compute)
  assert len(calls) == 2


def test_the_store_never_writes_into_a_folder_it_did_not_make(tmp_path):
  folder = tmp_path / "refs"
  folder.mkdir()
  (folder / "mine.npz").write_bytes(b"a user's file")
  with pytest.raises(records.ForeignFolder, match="mine.npz"):
    ReferenceStore(folder).get(KEY, counted(1.0)[0])
  assert [p.name for p in folder.iterdir()] == ["mine.npz"]
  assert (folder / "mine.npz").read_bytes() == b"a user's file"


def test_a_run_in_a_sweep_folder_uses_the_sweeps_store(tmp_path):
  assert ReferenceStore.of_run(tmp_path / "run").folder is None
  (tmp_path / records.SWEEP_MARKER).touch()
  assert ReferenceStore.of_run(tmp_path / "run").folder == (
    tmp_path / ".references"
  )


def test_content_hash_tells_apart_values_shapes_and_dtypes():
  a = {"w": np.zeros(3)}
  assert content_hash(a) == content_hash({"w": np.zeros(3)})
  assert content_hash(a) != content_hash({"w": np.ones(3)})
  assert content_hash(a) != content_hash({"w": np.zeros((3, 1))})
  assert content_hash(a) != content_hash({"w": np.zeros(3, np.float32)})


def test_two_approximations_share_the_exact_reference_and_agree(tiny, tmp_path):
  """The second approximation reads the GGN the first computed, with the
  decompositions of its layer blocks and block types, and the mean
  gradient, and its records
  equal those computed without the store; other parameters make another
  entry."""
  p, params, batch = tiny
  store = ReferenceStore(tmp_path / "refs")
  key = jax.random.PRNGKey(1)

  def measure(name, at=params, with_store=store):
    costs = Costs()
    tables = spectra.measure(
      p.loss_fn,
      tiny_curvature(tiny, name),
      at,
      batch,
      spec(),
      key,
      costs,
      with_store,
      KEY,
    )
    return tables, {row["phase"] for row in costs.rows}

  _, phases = measure("kfac")
  assert "exact ggn" in phases and "eigh exact ggn" in phases
  assert any(phase.startswith("eigh exact ggn block") for phase in phases)
  shared, phases = measure("diagonal")
  assert not any(
    phase.startswith(("exact ggn", "eigh exact", "mean grad"))
    for phase in phases
    - {
      "exact ggn (read from the reference store)",
      "mean gradient (read from the reference store)",
    }
  )
  assert "exact ggn (read from the reference store)" in phases
  alone, _ = measure("diagonal", with_store=ReferenceStore(None))
  for table in ("spectra", "quality", "statistics"):
    pd.testing.assert_frame_equal(
      pd.DataFrame(shared[table]), pd.DataFrame(alone[table])
    )
  moved = jax.tree.map(lambda x: x * 1.01, params)
  _, phases = measure("diagonal", at=moved)
  assert "exact ggn" in phases
  assert len(list((tmp_path / "refs").glob("*.npz"))) == 4  # ggn, gradient
