"""Run directories: atomic tables and the completion marker."""

import pandas as pd

from curvbench import records


def test_records_atomic_tables_and_marker(tmp_path):
  run = records.RunDir(tmp_path / "run")
  df = records.tidy([dict(a=1.0), dict(a=2.0)], problem="mlp", seed=0)
  assert list(df.columns) == ["problem", "seed", "a"]
  run.write_table("t", df)
  assert not run.done and records.find_runs(tmp_path) == []
  run.mark_done()
  assert run.done and run.marker()["status"] == "complete"
  pd.testing.assert_frame_equal(run.tables()["t"], df)
  assert [r.path for r in records.find_runs(tmp_path)] == [run.path]
  assert not list(run.path.glob("*.tmp"))
