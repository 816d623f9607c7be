"""The harness owns only what it writes: every path that writes, clears or
overwrites, run against a folder holding files it did not write, leaves
them byte-identical (and is refused, saying why, before it writes)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from curvbench import app, config, planning, report, runs
from curvbench.core import records
from tests.conftest import ROOT, TINY

ADAM = ("measure=training", "optimizer=adam", *TINY)


def foreign(folder: Path) -> dict:
  """Fills `folder` with a user's files (some named as curvbench names its
  own); returns their contents by path."""
  files = {
    "results.json": b'{"mine": 1}',
    "mydata.parquet": b"PAR1 mine",
    "config.yaml": b"lr: 3\n",
    "checkpoints/model.ckpt": b"\x00\x01",
    "DONE.json": b"not yours",
    "notes.log": b"a log",
  }
  for name, data in files.items():
    (folder / name).parent.mkdir(parents=True, exist_ok=True)
    (folder / name).write_bytes(data)
  return snapshot(folder)


def snapshot(folder: Path) -> dict:
  return {
    str(p.relative_to(folder)): p.read_bytes()
    for p in sorted(folder.rglob("*"))
    if p.is_file()
  }


def test_a_run_into_a_folder_of_foreign_files_is_refused(tmp_path):
  before = foreign(tmp_path)
  with pytest.raises(
    records.ForeignFolder,
    match=(f"{tmp_path} holds files curvbench did not write .*results.json"),
  ):
    runs.run(config.compose(*ADAM), tmp_path)
  with pytest.raises(records.ForeignFolder):
    runs.record_skip(
      config.compose("measure=spectra", "optimizer=adam", *TINY), tmp_path
    )
  assert snapshot(tmp_path) == before


def test_a_run_directory_clears_only_its_own_files(tmp_path):
  """A run redone clears what it wrote; a file a user put there since makes
  the folder no longer the run's, and the rerun is refused."""
  out = tmp_path / "run"
  cfg = config.compose(*ADAM, "measure.training.checkpoint_steps=[2]")
  assert runs.run(cfg, out) == "complete"
  written = set(records.RunDir(out).written())
  assert {
    "training.parquet",
    "DONE.json",
    "checkpoints/params_step0000002.safetensors",
  } <= written
  assert runs.run(config.compose(*ADAM, "seed=1"), out) == "complete"
  assert not (out / "checkpoints").exists()  # that run saved none
  (out / "mine.txt").write_text("keep me")
  with pytest.raises(records.ForeignFolder, match="mine.txt"):
    runs.run(cfg, out)
  assert (out / "mine.txt").read_text() == "keep me"
  (out / "mine.txt").unlink()
  assert runs.run(cfg, out) == "complete"


def test_the_command_refuses_a_foreign_folder_before_hydra_writes(tmp_path):
  """`hydra.run.dir=DIR` on a user's folder, and a refused setting on a
  folder of logs: both refused before Hydra writes `.hydra/` or a log, and
  nothing is removed."""
  before = foreign(tmp_path / "mine")
  logs = tmp_path / "logs"
  (logs / "old.log").mkdir(parents=True)  # a folder named like a log
  (logs / "run.log").write_text("yesterday")
  for argv, words in (
    (
      [f"hydra.run.dir={tmp_path / 'mine'}", *ADAM],
      "holds files curvbench did not write",
    ),
    ([f"hydra.run.dir={logs}", "seed=-1"], "seed=-1 is not allowed"),
  ):
    with pytest.raises(SystemExit, match=words):
      app.cli(argv)
  assert snapshot(tmp_path / "mine") == before
  assert (logs / "old.log").is_dir() and (logs / "run.log").read_text() == (
    "yesterday"
  )
  assert sorted(p.name for p in logs.iterdir()) == ["old.log", "run.log"]


def test_a_run_whose_input_lies_in_its_own_folder_is_refused(tmp_path):
  """Measuring a run's checkpoints into that run's folder would clear them
  before loading them."""
  trained = tmp_path / "trained"
  cfg = config.compose(*ADAM, "measure.training.checkpoint_steps=[2]")
  assert runs.run(cfg, trained) == "complete"
  before = snapshot(trained)
  spectra = config.compose(
    *TINY,
    "measure.spectra.steps=[2]",
    f"measure.spectra.checkpoint={trained}/checkpoints",
  )
  with pytest.raises(
    config.ConfigError,
    match=("measure.spectra.checkpoint=.* lies inside the run's own folder"),
  ):
    runs.run(spectra, trained)
  assert snapshot(trained) == before
  assert runs.run(spectra, tmp_path / "elsewhere") == "complete"


def test_a_report_is_not_written_over_foreign_files(tmp_path):
  root = tmp_path / "sweep"
  assert runs.run(config.compose(*ADAM), root / "adam") == "complete"
  before = foreign(tmp_path / "out")
  with pytest.raises(records.ForeignFolder, match="not a report folder"):
    report.write(root, tmp_path / "out")
  with pytest.raises(SystemExit, match="curvbench report: .*--out"):
    report.main([str(root), "--out", str(tmp_path / "out")])
  assert snapshot(tmp_path / "out") == before
  report.write(root, tmp_path / "fresh")
  report.write(root, tmp_path / "fresh")  # its own: written again


def test_a_folder_is_claimed_only_when_empty_marked_or_an_earlier_ones(
  tmp_path,
):
  marker = ".mark"
  assert records.claim(tmp_path / "new", marker, "x") == tmp_path / "new"
  records.claim(tmp_path / "new", marker, "x")  # marked: its own
  before = foreign(tmp_path / "theirs")
  with pytest.raises(records.ForeignFolder, match="is not x"):
    records.claim(tmp_path / "theirs", marker, "x")
  assert snapshot(tmp_path / "theirs") == before
  records.claim(tmp_path / "theirs", marker, "x", legacy=lambda f: True)


def test_names_and_sweep_folders_that_would_escape_or_collide(tmp_path):
  with pytest.raises(
    config.ConfigError, match="must be a non-empty folder name"
  ):
    config.compose("name=../../escaped")
  jobs = [["seed=0"], ["seed=1"], ["seed=2"]]
  with pytest.raises(
    SystemExit, match="2 sweep point.* would write into the folder of another"
  ):
    planning.refuse_shared_folders(jobs, [tmp_path / "shared"] * 3)
  planning.refuse_shared_folders(jobs, [tmp_path / str(i) for i in range(3)])


@pytest.mark.slow
def test_sweeps_refuse_foreign_and_shared_folders_before_launching(tmp_path):
  """Through the command: a sweep directory of a user's files, and points
  that would share one folder, are refused before anything is launched or
  written (one process for both: Hydra's sweeps log to the streams it was
  started with)."""
  before = foreign(tmp_path / "theirs")
  script = f"""
import json
from curvbench import app
out = []
for argv in ({[f"hydra.sweep.dir={tmp_path / 'theirs'}"]!r},
             ["hydra.sweep.dir={tmp_path / "shared"}",
              "hydra.sweep.subdir=same"]):
  try:
    app.cli(["-m", "seed=0,1", *{list(ADAM)!r}, *argv])
    out.append(None)
  except SystemExit as e:
    out.append(str(e.code))
print(json.dumps(out))"""
  result = subprocess.run(
    [sys.executable, "-c", script],
    capture_output=True,
    text=True,
    check=True,
    cwd=tmp_path,
    env=dict(os.environ, PYTHONPATH=str(ROOT)),
  )
  theirs, shared = json.loads(result.stdout.strip().splitlines()[-1])
  assert "holds files curvbench did not write" in theirs, theirs
  assert "would write into the folder of another" in shared, shared
  assert snapshot(tmp_path / "theirs") == before
  assert not (tmp_path / "shared" / "same").exists()
