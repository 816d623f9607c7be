"""Runs say how they ended: each prints its folder and its headline
numbers, a diverged or failed one why (the command exits non-zero); a
sweep tells the time left after each point, finishes its points before it
names the failed ones, and names its folders by the values that vary."""

import json

import pytest

from curvbench import config, measurements, planning, runs
from curvbench.core import records
from tests.conftest import ROOT, TINY, curvbench_cli

# SGD steps so long that the loss overflows float32 within a few steps.
DIVERGING = (
  "measure=training",
  "optimizer=sgd",
  "optimizer.learning_rate=1e38",
)
EXCLUDED = {"name", "progress"}


def test_sweep_folders_are_named_by_the_values_that_vary(tmp_path):
  jobs = [
    ["measure=training", "problem.width=3", f"seed={s}", f"curvature={c}"]
    for s in (0, 1)
    for c in ("kfac", "ekfac")
  ]
  jobs[0].append("progress=false")  # excluded: never part of a name
  names = planning.folder_names(jobs, EXCLUDED, tmp_path)
  assert names == [
    "curvature=kfac,seed=0",
    "curvature=ekfac,seed=0",
    "curvature=kfac,seed=1",
    "curvature=ekfac,seed=1",
  ]
  planning.record_folders(tmp_path, jobs, names, EXCLUDED)
  for name in names:
    (tmp_path / name).mkdir()
  # The same command again lands in the same folders.
  assert planning.folder_names(jobs, EXCLUDED, tmp_path) == names
  # Another sweep into the directory whose short names are taken by the
  # first one's points keeps every override in its names instead.
  other = [[*job[:1], "problem.width=5", *job[2:]] for job in jobs]
  renamed = planning.folder_names(other, EXCLUDED, tmp_path)
  assert renamed[0] == "curvature=kfac,measure=training,problem.width=5,seed=0"
  assert not set(renamed) & set(names)
  # A folder named as before (every override) is resumed under that name.
  legacy = tmp_path / "legacy"
  (legacy / "measure=training,problem.width=3,seed=0").mkdir(parents=True)
  assert planning.folder_names(
    [job[:3] for job in jobs[::2]], EXCLUDED, legacy
  ) == ["measure=training,problem.width=3,seed=0", "seed=1"]


def test_a_sweeps_progress_and_summary_say_time_left_and_failures():
  assert (
    planning.progress(3, 12, 130.0)
    == "elapsed 2m10s, about 6m30s left (from 3 points)"
  )
  assert planning.progress(12, 12, 600.0) == "elapsed 10m00s"
  ok = runs.Ending("sweep/seed=0", "complete", 41.0, "final loss 0.1")
  tuned = runs.Ending("sweep/lr=10", "diverged", 2.0, step=3, tuning=True)
  bad = runs.Ending("sweep/seed=1", "error", 1.0, reason="boom")
  told = planning.summary("sweep", [ok, tuned, bad], 50.0)
  head, *lines = told.splitlines()
  assert head == (
    "curvbench: sweep ended in 50 s: sweep: 3 points run: 1 done, "
    "1 diverged (tuning), 1 failed; 1 failed:"
  )
  assert lines == ["  sweep/seed=1: error: boom"]  # a tuning grid may diverge
  assert ok.line() == "curvbench: done in 41 s: sweep/seed=0: final loss 0.1"


def test_a_diverged_run_ends_with_its_folder_headline_and_advice(tmp_path):
  out = tmp_path / "run"
  cfg = config.compose(*TINY, *DIVERGING, "progress=false")
  assert runs.run(cfg, out) == "diverged"
  ended = runs.ending(cfg, out, "diverged", 1.0)
  assert ended.failed and ended.fails_sweep and ended.step is not None
  line = ended.line()
  assert line.startswith(f"curvbench: diverged at step {ended.step} after ")
  assert f": {out}: last finite training loss " in line
  assert "non-finite loss" in line and runs.DIVERGED_ADVICE in line


def test_every_measurement_has_a_headline_of_its_tables(sweep):
  """A finished run of each measurement the sweep fixture ran gives a
  headline of numbers, not the default list of tables."""
  root, _ = sweep
  for name in ("spectra_kfac", "training_kfac", "timing_kfac"):
    run = records.RunDir(root / name)
    measurement = measurements.MEASUREMENTS.get(name.split("_")[0])()
    line = measurement.headline(run.tables())
    assert not line.startswith("wrote "), (name, line)
    assert any(ch.isdigit() for ch in line), line


@pytest.mark.slow
def test_the_command_exits_non_zero_for_a_diverged_run_or_sweep_point(
  tmp_path,
):
  """A diverged single run exits 1 with its folder and why, its records
  kept; a sweep with one diverging point runs the other, then names the
  failed one and exits 1; its folders are named by the value that varies."""
  cache = f"compilation_cache={tmp_path / 'cache'}"
  single = tmp_path / "single"
  failed = curvbench_cli(
    f"hydra.run.dir={single}", *TINY, *DIVERGING, cache, cwd=ROOT
  )
  assert failed.returncode == 1, failed.stderr[-3000:]
  last = failed.stderr.strip().splitlines()[-1]
  assert last.startswith("curvbench: diverged at step "), last
  assert str(single) in last and "non-finite loss" in last
  assert records.RunDir(single).marker()["status"] == "diverged"
  root = tmp_path / "sweep"
  swept = curvbench_cli(
    "-m",
    f"hydra.sweep.dir={root}",
    *TINY,
    *DIVERGING[:2],
    "optimizer.learning_rate=0.1,1e38",
    cache,
    cwd=ROOT,
  )
  assert swept.returncode == 1, swept.stderr[-3000:]
  folders = sorted(p.name for p in root.iterdir() if not p.name[0] == ".")
  assert folders == [
    "multirun.yaml",
    "optimizer.learning_rate=0.1",
    "optimizer.learning_rate=1e+38",
  ]
  good = records.RunDir(root / "optimizer.learning_rate=0.1")
  assert good.marker()["status"] == "complete"  # run, though the other failed
  assert "curvbench: done in " in swept.stdout
  assert f"{root / 'optimizer.learning_rate=0.1'}: final training loss" in (
    swept.stdout
  )
  assert "[2/2] optimizer.learning_rate=1e+38: diverged; elapsed" in (
    swept.stdout
  )
  assert "2 points run: 1 done, 1 diverged; 1 failed:" in swept.stderr
  assert f"{root / 'optimizer.learning_rate=1e+38'}: diverged at step" in (
    swept.stderr
  )
  recorded = json.loads((root / planning.FOLDERS).read_text())
  assert set(recorded) == set(folders[1:])
