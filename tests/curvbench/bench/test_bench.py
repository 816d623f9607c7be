"""The benchmark of record (`python -m curvbench.bench`): the shortened run
writes its report with figures traceable to the harness's records, the
comparison names a figure more than 25 % worse than the record, the README's
table is the record files', and the side-by-side check times an earlier
commit beside the working tree."""

import json
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest

from curvbench.bench import against, cli, record
from curvbench.core import records

ROOT = record.ROOT


def _bench(*args, timeout=300):
  return subprocess.run(
    [sys.executable, "-m", "curvbench.bench", *args],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=timeout,
  )


def _record(figures, mode="full", key="cpu-2-cores"):
  return dict(
    key=key,
    mode=mode,
    device_kind="cpu",
    platform="cpu",
    platform_version="cpu",
    commit="0123456789abcdef",
    date="2026-01-01T00:00:00Z",
    versions={"jax": "0.0"},
    command="python -m curvbench.bench run",
    figures=figures,
  )


@pytest.mark.slow
def test_quick_run_writes_a_report_whose_figures_are_the_records(
  tmp_path, capsys
):
  out, folder = tmp_path / "report", tmp_path / "records"
  result = _bench(
    "run",
    "--quick",
    "--out",
    str(out),
    "--records",
    str(folder),
    "--compare",
    "--save-record",
  )
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
  assert "No performance record for this device kind" in result.stdout
  rec = json.loads((out / "record.json").read_text())
  assert rec["mode"] == "quick" and rec["device_kind"]
  assert rec["versions"]["jax"] and rec["commit"]
  assert (folder / f"{rec['key']}.json").exists()
  assert set(rec["figures"]) == set(record.FIGURES)
  for values in rec["figures"].values():
    assert list(values) == ["mlp"] and 0 < values["mlp"] < np.inf

  # Each figure is the harness's raw record, not a number made up here.
  [timing_run] = records.find_runs(out / "runs" / "timing")
  timing = timing_run.tables()["timing"].set_index("phase")
  # K-FAC timed in the mode people train it in, and every row says so.
  assert rec["estimation_mode"] == "ggn_curvature_prop"
  assert set(timing["mode"]) == {"ggn_curvature_prop"}
  assert (
    "K-FAC timed in estimation mode ggn_curvature_prop"
    in (out / "summary.md").read_text()
  )
  figures = rec["figures"]
  assert figures["kfac_step/adam_step"]["mlp"] == pytest.approx(
    timing.loc["optimizer_step", "ratio_to_baseline"]
  )
  assert figures["kfac_step/adam_step_flops"]["mlp"] == pytest.approx(
    timing.loc["optimizer_step", "flop_ratio_to_baseline"]
  )
  assert figures["refresh/gradient"]["mlp"] == pytest.approx(
    timing.loc["cache_update", "ratio_to_grad_step"]
  )
  [spectra_run] = records.find_runs(out / "runs" / "spectra")
  cost = spectra_run.tables()["cost"].set_index("phase")
  assert figures["exact_ggn_spectrum_s"]["mlp"] == pytest.approx(
    cost.loc["exact ggn", "run_s"] + cost.loc["eigh exact ggn", "run_s"]
  )
  products = pd.read_csv(out / "runs" / "products.csv").set_index("phase")
  assert figures["dataset_ggn_product/gradient"]["mlp"] == pytest.approx(
    products.loc["dataset ggn product", "ratio_to_gradient"]
  )
  assert (
    products.loc["dataset ggn product", "ratio_q25"]
    <= products.loc["dataset ggn product", "ratio_to_gradient"]
    <= products.loc["dataset ggn product", "ratio_q75"]
  )
  assert products.num_examples.iloc[0] == 1500  # the whole training split

  summary = (out / "summary.md").read_text()
  for words in (
    "K-FAC step / Adam step",
    "Per-phase costs",
    "device_peak_mib",
    "Exact GGN spectrum",
    "Dataset GGN-vector product",
    f"jax {rec['versions']['jax']}",
    rec["device_kind"],
  ):
    assert words in summary
  assert "## Failed" not in summary

  # The same figures against the record they were saved as: nothing worse.
  assert (
    cli.main(
      ["compare", str(out), "--record", str(folder / f"{rec['key']}.json")]
    )
    == 0
  )
  assert "None more than 25% worse" in capsys.readouterr().out


def test_a_slower_run_is_named_with_both_values(tmp_path):
  path = record.save(
    _record(
      {
        "kfac_step/adam_step": {"mlp": 4.0, "convnet": 10.0},
        "exact_ggn_spectrum_s": {"mlp": 0.02},
      }
    ),
    tmp_path,
  )
  slower = dict(
    mode="full",
    figures={
      "kfac_step/adam_step": {"mlp": 5.2, "convnet": 12.4},  # +30 %, +24 %
      "exact_ggn_spectrum_s": {"mlp": 0.01},
    },
  )
  result = record.compare(slower, path)
  assert not result.passed
  assert result.worse == [("kfac_step/adam_step", "mlp", 5.2, 4.0)]
  assert "kfac_step/adam_step [mlp]: 5.2 today, 4 in the record (+30%)" in (
    result.text()
  )
  assert "convnet" not in result.text()
  assert "python -m curvbench.bench against 0123456789" in result.text()

  for today in (
    {
      "kfac_step/adam_step": {"mlp": 4.0, "convnet": 10.0},
      "exact_ggn_spectrum_s": {"mlp": 0.02},
    },
    {
      "kfac_step/adam_step": {"mlp": 3.0, "convnet": 12.5},
      "exact_ggn_spectrum_s": {"mlp": 0.001},
    },
  ):
    result = record.compare(dict(mode="full", figures=today), path)
    assert result.passed and result.compared == 3, result.text()

  missing = record.compare(
    dict(mode="full", figures={"kfac_step/adam_step": {"mlp": 4.0}}), path
  )
  assert not missing.passed
  assert (
    "not measured today: exact_ggn_spectrum_s [mlp], "
    "kfac_step/adam_step [convnet]" in missing.text()
  )
  with pytest.raises(ValueError, match="made by a full run.*quick"):
    record.compare(dict(mode="quick", figures={}), path)


def test_the_command_exits_1_on_a_regression_and_0_without_a_record(
  tmp_path, capsys
):
  path = record.save(_record({"refresh/gradient": {"mlp": 2.0}}), tmp_path)
  today = tmp_path / "today.json"
  today.write_text(json.dumps(_record({"refresh/gradient": {"mlp": 3.0}})))
  assert cli.main(["compare", str(today), "--record", str(path)]) == 1
  assert "refresh/gradient [mlp]: 3 today, 2 in the record" in (
    capsys.readouterr().out
  )
  assert (
    cli.main(["compare", str(today), "--record", str(tmp_path / "none.json")])
    == 0
  )
  assert "No performance record for this device kind" in (
    capsys.readouterr().out
  )


def test_figures_come_from_the_rows_they_name():
  timing = pd.DataFrame(
    dict(
      problem=["mlp"] * 3 + ["convnet"] * 3,
      phase=["optimizer_step", "cache_update", "grad_step"] * 2,
      ratio_to_baseline=[3.0, 9.0, 0.5, 7.0, 9.0, 0.5],
      ratio_to_grad_step=[6.0, 2.0, 1.0, 14.0, 0.5, 1.0],
    )
  )
  cost = pd.DataFrame(
    dict(
      problem=["mlp"] * 7 + ["convnet"],
      run_id=[*"aaabbcc", "d"],
      phase=["exact ggn", "eigh exact ggn", "eigh approx"]
      + ["exact ggn", "eigh exact ggn"] * 2
      + ["eigh exact ggn"],
      run_s=[0.25, 1.0, 9.0, 0.5, 2.0, 0.25, 0.5, 4.0],
    )
  )
  products = pd.DataFrame(
    dict(
      problem=["mlp", "mlp"],
      phase=["dataset gradient", "dataset ggn product"],
      ratio_to_gradient=[1.0, 1.5],
    )
  )
  assert record.figures(timing, cost, products) == {
    "kfac_step/adam_step": {"mlp": 3.0, "convnet": 7.0},
    "refresh/gradient": {"mlp": 2.0, "convnet": 0.5},
    "dataset_ggn_product/gradient": {"mlp": 1.5},
    # The median over runs (1.25, 2.5, 0.75 s); convnet's exact GGN was
    # read from a store: no spectrum figure.
    "exact_ggn_spectrum_s": {"mlp": 1.25},
  }


def test_figures_name_the_estimation_mode_they_timed_kfac_in(tmp_path):
  timing = pd.DataFrame(
    dict(
      problem=["mlp"] * 4,
      mode=["ggn_curvature_prop"] * 2 + ["ggn_exact"] * 2,
      phase=["optimizer_step", "cache_update"] * 2,
      ratio_to_baseline=[1.5, 3.0, 4.0, 3.0],
      ratio_to_grad_step=[3.0, 2.0, 8.0, 2.5],
      flop_ratio_to_baseline=[1.4, 2.0, 3.9, 2.0],
    )
  )
  empty = pd.DataFrame()
  today = record.figures(timing, empty, empty, "ggn_curvature_prop")
  assert today == {
    "kfac_step/adam_step": {"mlp": 1.5},
    "kfac_step/adam_step@ggn_exact": {"mlp": 4.0},
    "kfac_step/adam_step_flops": {"mlp": 1.4},
    "kfac_step/adam_step_flops@ggn_exact": {"mlp": 3.9},
    "refresh/gradient": {"mlp": 2.0},
    "refresh/gradient@ggn_exact": {"mlp": 2.5},
  }
  # A record that names no mode timed K-FAC in ggn_exact: its figures are
  # held against today's ggn_exact ones, never the practical mode's.
  old = record.save(_record({"kfac_step/adam_step": {"mlp": 3.0}}), tmp_path)
  run = dict(mode="full", estimation_mode="ggn_curvature_prop", figures=today)
  result = record.compare(run, old)
  assert result.compared == 1
  assert result.worse == [("kfac_step/adam_step@ggn_exact", "mlp", 4.0, 3.0)]
  named = _record(dict(today), key="named")
  named["estimation_mode"] = "ggn_curvature_prop"
  assert record.compare(run, record.save(named, tmp_path)).passed


def test_device_keys():
  assert record.device_key("NVIDIA H100 80GB HBM3", "gpu", 16) == (
    "nvidia-h100-80gb-hbm3"
  )
  assert record.device_key("cpu", "cpu", 2) == "cpu-2-cores"
  assert record.device_key("TPU v5 lite", "tpu", 8) == "tpu-v5-lite"


def test_a_file_that_is_no_record_is_refused_clearly(tmp_path):
  (tmp_path / "x.json").write_text('{"figures": {}}')
  with pytest.raises(
    ValueError, match="not a performance record: it lacks key, mode"
  ):
    record.load(tmp_path / "x.json")


def test_the_documented_table_is_the_record_files():
  text = record.TABLE_PAGE.read_text()
  assert record.page_with_table(text, record.record_table()) == text, (
    "run `python -m curvbench.bench table`"
  )
  assert list(record.RECORD_DIR.glob("*.json")), "no record committed"


def test_the_table_has_a_column_per_record(tmp_path):
  record.save(
    _record(
      {
        "kfac_step/adam_step": {"mlp": 3.456, "convnet": 5.0},
        "exact_ggn_spectrum_s": {"mlp": 0.0123},
      }
    ),
    tmp_path,
  )
  record.save(
    _record({"kfac_step/adam_step": {"mlp": 6.1}}, key="nvidia-h100-80gb-hbm3"),
    tmp_path,
  )
  table = record.record_table(tmp_path)
  assert (
    "| figure | mode | problem | `cpu-2-cores` | `nvidia-h100-80gb-hbm3` |"
    in table
  )
  # Records that name no mode timed K-FAC in ggn_exact.
  assert "| K-FAC step / Adam step | ggn_exact | convnet | 5 |  |" in table
  assert "| K-FAC step / Adam step | ggn_exact | mlp | 3.46 | 6.1 |" in table
  assert "| exact GGN + eigh of a batch (s) |  | mlp | 0.0123 |  |" in table
  with pytest.raises(ValueError, match="no performance-record block"):
    record.page_with_table("# a page\n", table)


def test_interleaved_rounds_give_the_ratio_of_the_two_calls(monkeypatch):
  # A clock only the calls move, so load on the machine cannot move it.
  now = [0.0]
  monkeypatch.setattr(against.time, "perf_counter", lambda: now[0])

  def call(seconds):
    def fn():
      now[0] += seconds

    return fn

  slower = against.interleaved(call(0.006), call(0.002), rounds=5)
  assert slower["ratio"] == pytest.approx(3.0)
  assert slower["ratio_q25"] == pytest.approx(3.0)
  assert slower["new_s"] == pytest.approx(0.006)
  same = against.interleaved(call(0.003), call(0.003), rounds=5)
  assert same["ratio"] == pytest.approx(1.0)
  # Calls shorter than round_s are timed several to a round.
  batched = against.interleaved(
    call(0.001), call(0.002), rounds=3, round_s=0.01
  )
  assert batched["calls"] == 5 and batched["ratio"] == pytest.approx(0.5)


def _cells(header: str, line: str) -> dict:
  names = [c.strip() for c in header.strip("|").split("|")]
  return dict(zip(names, (c.strip() for c in line.strip("|").split("|"))))


def _has_parent_commit() -> bool:
  try:
    against.resolve("HEAD~1")
  except ValueError:
    return False
  return True


@pytest.mark.slow
@pytest.mark.skipif(
  not _has_parent_commit(), reason="needs git and the commit before HEAD"
)
def test_side_by_side_against_the_previous_commit():
  result = _bench(
    "against",
    "HEAD~1",
    "--quick",
    "--rounds",
    "3",
    "--benchmarks",
    "kfac_update,dataset_gradient,kfac_step_mlp",
  )
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
  lines = result.stdout.splitlines()
  names = ("kfac_update", "dataset_gradient", "kfac_step_mlp")
  rows = {
    line.split("|")[1].strip(): line
    for line in lines
    if line.startswith(tuple(f"| {n} " for n in names))
  }
  assert set(rows) == set(names)
  [header] = [line for line in lines if line.startswith("| benchmark ")]
  for line in rows.values():
    cells = _cells(header, line)
    assert 0 < float(cells["ratio"]) < 100 and cells["ref"].startswith("HEAD~1")
    assert np.isfinite(float(cells["max_rel_diff"]))
  # Each version builds the problem itself: the same model and data.
  assert float(_cells(header, rows["kfac_step_mlp"])["max_rel_diff"]) < 1e-5
  source = lines[-1].split("imported from ")[1]
  assert "curvbench-against-" in source and str(ROOT) not in source


# The commit whose tree last had another layout: `components` at the top
# level, before 9e528f8 moved it inside curvbench.
BEFORE_LAYOUT_CHANGES = ("9e528f8~1",)


def _in_history(ref: str) -> bool:
  try:
    against.resolve(ref)
  except ValueError:
    return False
  return True


@pytest.mark.slow
@pytest.mark.parametrize("ref", BEFORE_LAYOUT_CHANGES)
def test_side_by_side_reaches_a_commit_of_another_layout(ref):
  """A commit from before a layout change is extracted whole (its own
  top-level packages) and timed beside the working tree."""
  if not _in_history(ref):
    pytest.skip(f"{ref} is not in this checkout's history")
  assert "components" in against.packages(against.resolve(ref))
  result = _bench(
    "against", ref, "--quick", "--rounds", "3", "--benchmarks", "kfac_step_mlp"
  )
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
  [row] = [
    line for line in result.stdout.splitlines() if line.startswith("| kfac_")
  ]
  [header] = [
    line for line in result.stdout.splitlines() if line.startswith("| bench")
  ]
  assert 0 < float(_cells(header, row)["ratio"]) < 100
  assert "curvbench-against-" in result.stdout.splitlines()[-1]


def test_an_unknown_commit_is_refused_by_name(capsys):
  with pytest.raises(SystemExit) as exit:
    cli.main(["against", "no-such-commit-xyz", "--quick"])
  assert exit.value.code == 2
  assert "'no-such-commit-xyz' names no commit here" in capsys.readouterr().err


def test_a_run_that_lost_figures_does_not_replace_the_record(
  tmp_path, monkeypatch, capsys
):
  """A failed sweep leaves figures out: `--save-record` then keeps the
  record it would have replaced, says why, and exits 1."""
  folder = tmp_path / "records"
  folder.mkdir()
  kept = folder / "cpu-2-cores.json"
  held = _record(
    {"kfac_step/adam_step": {"mlp": 3.0}, "refresh/gradient": {"mlp": 1.0}}
  )
  kept.write_text(json.dumps(held))
  today = _record({"refresh/gradient": {"mlp": 1.1}})
  monkeypatch.setattr(cli.suite, "run", lambda *args, **kwargs: today)
  argv = ["run", "--out", str(tmp_path / "out"), "--records", str(folder)]
  assert cli.main([*argv, "--save-record"]) == 1
  assert "record NOT written" in capsys.readouterr().out
  assert json.loads(kept.read_text()) == held
  # With every figure measured, it is replaced.
  today["figures"]["kfac_step/adam_step"] = {"mlp": 2.9}
  assert cli.main([*argv, "--save-record"]) == 0
  assert json.loads(kept.read_text())["figures"] == today["figures"]
