"""A sweep with damaged, failed, killed, running and skipped runs: the report
lists each with its reason and reports the rest; a rerun redoes damage."""

import errno
import json
import os
import shutil
import socket

import pandas as pd
import pytest

from curvbench import config, report, runs, sweep
from curvbench.core import records
from tests.conftest import TINY, truncate

ADAM = (
  "measure=training",
  "optimizer=adam",
  *TINY,
  "measure.training.checkpoint_steps=[2]",
)
CHECKPOINT = "checkpoints/params_step0000002.safetensors"


def _fail(run):
  (run.path / records.MARKER).unlink()
  run.write_json(
    "ERROR.json",
    dict(
      traceback=(
        "Traceback (most recent call last):\nValueError: no such "
        "checkpoint /no/such/params.safetensors\n"
      )
    ),
  )


def _unmark(run):
  (run.path / records.MARKER).unlink()


def _stale_lock(run, holder):
  """A killed run whose lock file remains, naming `holder`; nobody holds
  the lock."""
  _unmark(run)
  (run.path / records.LOCK).write_text(holder)


def _marker_with(run, **fields):
  marker = json.loads((run.path / records.MARKER).read_text())
  (run.path / records.MARKER).write_text(json.dumps(dict(marker, **fields)))


HARM = {  # run directory -> what happens to a copy of a finished run
  "table_cut": lambda run: truncate(run.path / "training.parquet"),
  "marker_cut": lambda run: truncate(run.path / records.MARKER),
  "table_gone": lambda run: (run.path / "training.parquet").unlink(),
  "metadata_cut": lambda run: truncate(run.path / "metadata.json"),
  "failed": _fail,
  "failed_error_cut": lambda run: (
    _fail(run),
    truncate(run.path / "ERROR.json"),
  ),
  "killed": _unmark,
  "killed_early": lambda run: [
    p.unlink() for p in run.path.iterdir() if p.is_file()
  ],
  "checkpoint_cut": lambda run: truncate(run.path / CHECKPOINT),
  "config_garbled": lambda run: (run.path / "config.yaml").write_text(
    "problem: [unclosed\n"
  ),
  "tables_not_a_list": lambda run: _marker_with(run, tables=5),
  # A live process's pid (this one's), on this host, but no lock held.
  "stale_lock": lambda run: _stale_lock(
    run,
    json.dumps(dict(pid=os.getpid(), host=socket.gethostname(), since="then")),
  ),
  "empty_lock": lambda run: _stale_lock(run, ""),
}
EXPECTED = {  # run directory -> status and words of its reason
  "table_cut": ("damaged", "training.parquet is unreadable"),
  "marker_cut": ("damaged", "DONE.json is unreadable"),
  "table_gone": ("damaged", "tables training listed in DONE.json are missing"),
  "metadata_cut": ("damaged", "metadata.json is unreadable"),
  "failed": ("error", "params.safetensors"),
  "failed_error_cut": ("error", "ERROR.json is unreadable"),
  "killed": ("killed", "no completion marker"),
  "killed_early": ("killed", "no completion marker"),
  "checkpoint_cut": ("damaged", f"{CHECKPOINT} changed since the run wrote it"),
  "config_garbled": ("damaged", "config.yaml changed since the run wrote it"),
  "tables_not_a_list": ("damaged", "is not a completion marker"),
  "stale_lock": ("killed", "no completion marker"),
  "empty_lock": ("killed", "no completion marker"),
  "running": ("running", "running in process"),
  "skipped": ("skipped", "does not use the optimizer"),
}


@pytest.fixture(scope="module")
def good(tmp_path_factory):
  """One finished tiny training run, and its config."""
  cfg = config.compose(*ADAM)
  path = tmp_path_factory.mktemp("good") / "good"
  assert runs.run(cfg, path) == "complete"
  return records.RunDir(path), cfg


def _copy(good, path) -> records.RunDir:
  shutil.copytree(good.path, path)
  (path / ".hydra").mkdir()  # as Hydra leaves it: the resolved config
  shutil.copy(good.path / "config.yaml", path / ".hydra" / "config.yaml")
  return records.RunDir(path)


@pytest.mark.slow
def test_report_lists_every_run_not_in_the_results(good, tmp_path):
  run, _ = good
  root = tmp_path / "sweep"
  _copy(run, root / "good")
  for name, harm in HARM.items():
    harm(_copy(run, root / name))
  assert runs.record_skip(
    config.compose("measure=spectra", "optimizer=adam", *TINY), root / "skipped"
  )
  running = _copy(run, root / "running")
  _unmark(running)
  with running.lock():
    assert report.main([str(root), "--out", str(tmp_path / "out")]) == 0

  statuses = pd.read_csv(tmp_path / "out" / "runs.csv").set_index("run_dir")
  assert statuses.status.to_dict() == dict(
    good="complete", **{k: v[0] for k, v in EXPECTED.items()}
  )
  text = (tmp_path / "out" / "report.md").read_text()
  # The runs section: its table of the runs not in the results, and a
  # finding in the summary that counts them.
  section = text.split("\n## Runs\n")[1].split(
    "Runs not in the results, with why"
  )[1]
  assert (
    f"{len(EXPECTED)} run folders are not in the results: 7 damaged, "
    "2 error, 4 killed, 1 running, 1 skipped (see Runs)"
  ) in text
  page = (tmp_path / "out" / "report.html").read_text()
  listed = pd.read_csv(tmp_path / "out" / "not_in_results.csv")
  for name, (status, words) in EXPECTED.items():
    line = next(row for row in section.splitlines() if f"| {name} |" in row)
    assert f"| {status} |" in line and words in line, line
    assert name in page
    assert words in listed[listed.run_dir == name].reason.item()
  training = pd.read_csv(tmp_path / "out" / "training_all.csv")
  assert set(training.run_dir) == {"good"}
  assert "\n## Training\n" in text
  assert "Training: each quantity over seeds" in text


@pytest.mark.slow
def test_report_names_the_runs_not_in_the_results(good, tmp_path, capsys):
  run, _ = good
  _copy(run, tmp_path / "good")
  HARM["table_cut"](_copy(run, tmp_path / "cut"))
  HARM["killed"](_copy(run, tmp_path / "killed"))
  assert report.main([str(tmp_path)]) == 0
  assert "not in the results: 1 damaged, 1 killed" in capsys.readouterr().out


@pytest.mark.slow
def test_a_rerun_redoes_damaged_runs_and_keeps_intact_ones(good, tmp_path):
  run, cfg = good
  intact = _copy(run, tmp_path / "intact")
  before = {
    p.name: p.read_bytes() for p in intact.path.iterdir() if p.is_file()
  }
  assert runs.run(cfg, intact.path) == "cached"
  assert {
    p.name: p.read_bytes() for p in intact.path.iterdir() if p.is_file()
  } == before
  for name in (
    "table_cut",
    "marker_cut",
    "table_gone",
    "checkpoint_cut",
    "config_garbled",
    "tables_not_a_list",
  ):
    damaged = _copy(run, tmp_path / name)
    HARM[name](damaged)
    assert not damaged.done
    assert runs.run(cfg, damaged.path) == "complete", name
    assert damaged.done and damaged.damage() is None
    assert json.loads((damaged.path / records.MARKER).read_text())[
      "tables"
    ] == ["config", "training"]
    redone, first = damaged.tables()["training"], run.tables()["training"]
    numbers = ["step"] + [c for c in first if c.endswith(("loss", "error"))]
    pd.testing.assert_frame_equal(redone[numbers], first[numbers])


def test_a_full_disk_is_the_runs_error_with_its_cause(tmp_path, monkeypatch):
  def full(run_dir, name, df):
    raise OSError(
      errno.ENOSPC,
      "No space left on device",
      str(run_dir.path / f"{name}.parquet"),
    )

  monkeypatch.setattr(records.RunDir, "write_table", full)
  with pytest.raises(OSError, match="No space left on device"):
    runs.run(config.compose(*ADAM), tmp_path / "sweep" / "full")
  monkeypatch.undo()
  (run,) = sweep.load_sweep(tmp_path / "sweep").runs.itertuples()
  assert run.status == "error" and "No space left on device" in run.reason
