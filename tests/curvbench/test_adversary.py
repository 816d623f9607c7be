"""An adversary's round on the surfaces that let code and data in: reading
a sweep folder, a run's identity, and records that are not what the report
expects. Each test tries a class of attack or fault, not one case, and
asserts what happens: nothing is imported that the reader did not trust
and that is not the code the runs recorded; any edit in code a run
executes is another run; a malformed record is named and the rest of the
report stands. (The Python API's input checks, the reference store's and
the MNIST files' content digests have their rounds beside their code:
tests/problems/test_input_checks.py, tests/curvbench/core/test_references.py,
tests/problems/test_fetch_mnist_data.py.)"""

import json
import shutil
import textwrap
from pathlib import Path

import pandas as pd
import pytest
from omegaconf import OmegaConf

from curvbench import config, plugins, provenance, report, runs
from curvbench import sweep as sweeps
from curvbench.core import records
from problems.datafiles import file_sha256
from tests.conftest import TINY

# A plugin that leaves a file behind when it is imported: its presence is
# the proof that reading ran it.
EVIL = """
from pathlib import Path
Path(__file__).with_name("IMPORTED").write_text("ran")
"""


def _write(path: Path, text: str) -> Path:
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(textwrap.dedent(text))
  return path


def _resign(run_dir: Path) -> None:
  """Rewrites the marker's sha256 of every file the run wrote, as someone
  editing the records on purpose (or other code writing them) would."""
  marker = json.loads((run_dir / records.MARKER).read_text())
  marker["files"] = {n: file_sha256(run_dir / n) for n in marker["files"]}
  (run_dir / records.MARKER).write_text(json.dumps(marker))


def _received(sweep_fixture, tmp_path, *names) -> Path:
  """A copy of some of the shared sweep's runs: a folder received."""
  root, _ = sweep_fixture
  out = tmp_path / "received"
  for name in names:
    shutil.copytree(root / name, out / name)
  return out


def _name_plugin(run_dir: Path, plugin: str, kind: str, recorded=None):
  """Edits a run's records to name `plugin` and measurement `kind`, with
  `recorded` as the hash of the plugin's code its marker carries."""
  table = pd.read_parquet(run_dir / "config.parquet")
  table["plugins"] = json.dumps([plugin])
  table["measure.kind"] = kind
  table.to_parquet(run_dir / "config.parquet", index=False)
  cfg = OmegaConf.load(run_dir / "config.yaml")
  cfg.plugins = [plugin]
  cfg.measure.kind = kind
  OmegaConf.save(cfg, run_dir / "config.yaml")
  marker = json.loads((run_dir / records.MARKER).read_text())
  marker["plugin_sources"] = (
    json.dumps({plugin: recorded}) if recorded is not None else None
  )
  (run_dir / records.MARKER).write_text(json.dumps(marker))
  _resign(run_dir)


# --- reading a folder runs no code it names -------------------------------------


@pytest.fixture(params=["file", "relative file", "module", "package"])
def evil(request, tmp_path, monkeypatch):
  """An evil plugin as each way of naming one: its name, and the file its
  import writes."""
  lab = tmp_path / "lab"
  monkeypatch.chdir(tmp_path)
  if request.param == "package":
    _write(lab / "evil_pkg" / "__init__.py", "")
    _write(lab / "evil_pkg" / "models.py", EVIL)
    monkeypatch.syspath_prepend(str(lab))
    return "evil_pkg.models", lab / "evil_pkg" / "IMPORTED"
  _write(lab / "evil_mod.py", EVIL)
  if request.param == "module":
    monkeypatch.syspath_prepend(str(lab))
    return "evil_mod", lab / "IMPORTED"
  name = "lab/evil_mod.py" if request.param == "relative file" else str(lab)
  if request.param == "file":
    name = str(lab / "evil_mod.py")
  return name, lab / "IMPORTED"


def test_a_report_imports_no_plugin_it_was_not_told_to_trust(
  sweep, tmp_path, evil
):
  name, imported = evil
  root = _received(sweep, tmp_path, "timing_kfac", "training_adam")
  # Recorded with its true hash: only trust is missing.
  _name_plugin(root / "timing_kfac", name, "evil", plugins.digest(name))
  _name_plugin(root / "training_adam", name, "training")
  written = report.write(root, tmp_path / "out")
  assert not imported.exists()
  (row,) = written["not_rendered"]
  assert "'evil'" in row["part"] and f"--trust {name}" in row["why"]
  text = (tmp_path / "out" / "report.md").read_text()
  assert "## Not rendered" in text and "was not imported" in text
  assert "## Training" in text  # the rest of the report stands


def test_trust_imports_only_the_code_the_runs_recorded(sweep, tmp_path, evil):
  name, imported = evil
  root = _received(sweep, tmp_path, "timing_kfac")
  run = root / "timing_kfac"
  for recorded, words in (
    (None, "recorded no hash"),  # nothing to check it against
    ("0123456789ab", "not the code its runs recorded"),  # another code's
  ):
    _name_plugin(run, name, "evil", recorded)
    written = report.write(root, tmp_path / "out", trust=[name])
    assert not imported.exists(), recorded
    assert words in written["not_rendered"][0]["why"]
  # Its code as recorded: the reader's trust imports it.
  _name_plugin(run, name, "evil", plugins.digest(name))
  report.write(root, tmp_path / "out", trust=[name])
  assert imported.exists()


def test_trust_in_one_plugin_is_not_trust_in_another(sweep, tmp_path):
  lab = tmp_path / "lab"
  evil = _write(lab / "other.py", EVIL)
  trusted = _write(lab / "trusted.py", "")
  root = _received(sweep, tmp_path, "timing_kfac")
  _name_plugin(
    root / "timing_kfac", str(evil), "evil", plugins.digest(str(evil))
  )
  report.write(root, tmp_path / "out", trust=[str(trusted), "other"])
  assert not (lab / "IMPORTED").exists()


def test_a_plugin_edited_after_its_runs_is_not_imported(sweep, tmp_path):
  """An edit in the plugin, or in a local module it imports, is not the
  code the runs recorded: trusted by name, it is still not imported."""
  lab = tmp_path / "lab"
  path = _write(lab / "lab_plugin.py", "import lab_helper\n")
  helper = _write(lab / "lab_helper.py", "X = 1\n")
  root = _received(sweep, tmp_path, "timing_kfac")
  _name_plugin(
    root / "timing_kfac", str(path), "evil", plugins.digest(str(path))
  )
  helper.write_text(EVIL)
  written = report.write(root, tmp_path / "out", trust=[str(path)])
  assert not (lab / "IMPORTED").exists()
  assert "not the code its runs recorded" in written["not_rendered"][0]["why"]


# --- a run's identity covers every line of code it runs ---------------------------


def _lab(folder: Path) -> dict[str, Path]:
  """A plugin file importing local modules every way Python can: at the
  top, inside a function, from a package, relatively within it; and a
  file beside them it does not import."""
  return dict(
    plugin=_write(
      folder / "lab_models.py",
      """
      import lab_top
      from lab_pkg import lab_sub
      from lab_pkg.deep import thing

      def late():
        import lab_late
        return lab_late
      """,
    ),
    top=_write(folder / "lab_top.py", "A = 1\n"),
    late=_write(folder / "lab_late.py", "B = 1\n"),
    init=_write(folder / "lab_pkg" / "__init__.py", ""),
    sub=_write(folder / "lab_pkg" / "lab_sub.py", "from . import lab_rel\n"),
    rel=_write(folder / "lab_pkg" / "lab_rel.py", "C = 1\n"),
    deep=_write(folder / "lab_pkg" / "deep.py", "thing = 1\n"),
  )


def test_an_edit_in_any_module_a_plugin_imports_changes_its_hash(tmp_path):
  files = _lab(tmp_path)
  unrelated = _write(tmp_path / "notes.py", "D = 1\n")
  name = str(files["plugin"])
  assert set(plugins.code_files(name)) == {p.resolve() for p in files.values()}
  before = plugins.digest(name)
  unrelated.write_text("D = 2\n")  # not imported: not its code
  assert plugins.digest(name) == before
  for which, path in files.items():
    path.write_text(path.read_text() + "\n# edited\n")
    after = plugins.digest(name)
    assert after != before, which
    before = after


def test_code_files_never_follow_curvbench_or_installed_libraries(tmp_path):
  path = _write(
    tmp_path / "lab_uses.py",
    "import numpy\nimport jax.numpy\nfrom curvbench import report\nimport os\n",
  )
  assert plugins.code_files(str(path)) == [path.resolve()]
  assert plugins.code_files("curvbench.report") == []
  assert plugins.code_files("no_such_module_anywhere") == []
  assert plugins.digest(str(tmp_path / "missing.py")) is None


def test_a_plugin_that_registers_nothing_is_in_the_run_id(tmp_path):
  path = _write(tmp_path / "lab_quiet.py", "import lab_quiet_helper\n")
  helper = _write(tmp_path / "lab_quiet_helper.py", "X = 1\n")
  cfg = config.compose(*TINY, "measure=timing", f"plugins=[{path}]")
  plain = config.compose(*TINY, "measure=timing")
  first = provenance.inputs(cfg)
  assert json.loads(first["plugin_sources"]) == {
    str(path): plugins.digest(str(path))
  }
  assert provenance.run_id(cfg) != provenance.run_id(plain)
  helper.write_text("X = 2\n")
  assert provenance.inputs(cfg)["plugins"] != first["plugins"]


@pytest.mark.slow
def test_a_finished_run_is_redone_when_a_module_its_plugin_imports_changes(
  tmp_path,
):
  path = _write(tmp_path / "lab_redo.py", "import lab_redo_helper\n")
  helper = _write(tmp_path / "lab_redo_helper.py", "X = 1\n")
  cfg = config.compose(*TINY, "measure=timing", f"plugins=[{path}]")
  out = tmp_path / "run"
  assert runs.run(cfg, out) == "complete"
  assert runs.run(cfg, out) == "cached"
  helper.write_text("X = 2\n")
  reason = runs.stale_reason(records.RunDir(out), cfg)
  assert "the code of its plugins changed" in reason and str(path) in reason
  assert runs.run(cfg, out) == "complete"


# --- records that are not what the report expects ---------------------------------


SPECTRA_RUNS = ("spectra_kfac", "spectra_diag", "spectra_steps")


def _edit_spectra(root: Path, names, change) -> None:
  for name in names:
    path = root / name / "spectra.parquet"
    change(pd.read_parquet(path)).to_parquet(path, index=False)
    _resign(root / name)


@pytest.mark.parametrize(
  "change",
  [
    lambda df: df.assign(eigenvalue=df.eigenvalue.astype(str)),
    lambda df: df.assign(eigenvalue=[[v] for v in df.eigenvalue]),
    lambda df: df.assign(eigenvalue=df.eigenvalue.astype(object)).assign(
      eigenvalue=lambda d: [None if i else "x" for i in range(len(d))]
    ),
  ],
)
def test_a_run_holding_other_than_numbers_where_the_rest_hold_numbers_is_left_out(
  sweep, tmp_path, change
):
  """One run's table rewritten (and signed anew) with other than numbers in
  a column the other runs hold numbers in: left out as damaged, naming the
  table and column, rather than read as numbers."""
  root = _received(sweep, tmp_path, *SPECTRA_RUNS)
  _edit_spectra(root, SPECTRA_RUNS[:1], change)
  loaded = sweeps.load_sweep(root)
  found = loaded.runs.set_index("run_dir")
  assert found.status[SPECTRA_RUNS[0]] == "damaged"
  assert "'spectra'" in found.reason[SPECTRA_RUNS[0]]
  assert "'eigenvalue'" in found.reason[SPECTRA_RUNS[0]]
  assert set(found.status[list(SPECTRA_RUNS[1:])]) == {"complete"}
  assert SPECTRA_RUNS[0] not in set(loaded.tables["spectra"].run_dir)


CHANGES = {
  "numbers as text": lambda df: df.assign(eigenvalue=df.eigenvalue.astype(str)),
  "emptied": lambda df: df.assign(eigenvalue=None),
  "a column gone": lambda df: df.drop(columns=["eigenvalue"]),
  "identity gone": lambda df: df.drop(columns=["run_id", "step"]),
  "no rows": lambda df: df.iloc[:0],
  "another table": lambda df: pd.DataFrame({"x": ["?"]}),
}


@pytest.mark.parametrize(
  "change",
  [
    pytest.param(c, marks=() if name == "a column gone" else pytest.mark.slow)
    for name, c in CHANGES.items()
  ],
  ids=list(CHANGES),
)
def test_the_report_stands_on_records_it_did_not_expect(
  sweep, tmp_path, change
):
  """Every run's table changed alike (signed anew, as other code writing it
  would): the report completes, naming each part it cannot compute and
  why, and its other sections stand."""
  root = _received(sweep, tmp_path, *SPECTRA_RUNS[:2], "timing_kfac")
  _edit_spectra(root, SPECTRA_RUNS[:2], change)
  written = report.write(root, tmp_path / "out")
  assert "## Timing" in (tmp_path / "out" / "report.md").read_text()
  assert all(row["why"] for row in written["not_rendered"])
  if change is CHANGES["a column gone"]:
    (row,) = written["not_rendered"]
    assert "'spectra'" in row["part"] and "'eigenvalue'" in row["why"]


@pytest.mark.parametrize(
  "plugins_value", ['{"not": "a list"}', "[", "5", json.dumps([None, 3])]
)
def test_a_malformed_plugins_record_is_no_traceback(
  sweep, tmp_path, plugins_value
):
  root = _received(sweep, tmp_path, "timing_kfac")
  path = root / "timing_kfac" / "config.parquet"
  table = pd.read_parquet(path)
  table["plugins"] = plugins_value
  table.to_parquet(path, index=False)
  report.write(root, tmp_path / "out")
  assert (tmp_path / "out" / "report.md").is_file()


def test_a_run_whose_measurement_is_unknown_is_listed_not_rendered(
  sweep, tmp_path
):
  root = _received(sweep, tmp_path, "timing_kfac")
  _name_plugin(root / "timing_kfac", "nowhere.py", "nothing_known")
  found = sweeps.load_sweep(root).runs
  assert found.plugins_not_imported.notna().all()
  written = report.write(root, tmp_path / "out")
  assert "'nothing_known'" in written["not_rendered"][0]["part"]
  assert found.status.iloc[0] in ("complete", "damaged")


@pytest.mark.parametrize("recorded", ["{", "[1, 2]", "5"])
def test_a_marker_with_a_malformed_plugin_record_is_redone_saying_why(
  sweep, tmp_path, recorded
):
  root = _received(sweep, tmp_path, "timing_kfac")
  run = root / "timing_kfac"
  marker = json.loads((run / records.MARKER).read_text())
  marker.update(run_id="0123456789ab", plugin_sources=recorded)
  (run / records.MARKER).write_text(json.dumps(marker))
  cfg = OmegaConf.load(run / "config.yaml")
  reason = runs.stale_reason(records.RunDir(run), cfg)
  assert reason == "its record of its plugins' code cannot be read"
