"""Cost against model size: the exponent fit recovers known power laws, a
size measures every kind of work with its compile time apart and its
memory, and the report refuses a folder holding others' files."""

import numpy as np
import pandas as pd
import pytest

from curvbench.bench import record, scaling


def test_the_exponent_is_the_slope_of_a_power_law():
  params = np.array([1e3, 4e3, 1.6e4, 6.4e4])
  slope, se = scaling.exponent(params, 3e-6 * params**1.5)
  assert slope == pytest.approx(1.5) and se == pytest.approx(0, abs=1e-9)
  noisy = 3e-6 * params**1.5 * np.array([1.1, 0.9, 1.05, 0.97])
  slope, se = scaling.exponent(params, noisy)
  assert abs(slope - 1.5) < 3 * se and 0 < se < 0.1
  # Two sizes fit a line with no error left to estimate; one fits none.
  assert np.isnan(scaling.exponent(params[:2], params[:2])[1])
  assert np.isnan(scaling.exponent(params[:1], params[:1])[0])


def _rows(work_exponents: dict) -> pd.DataFrame:
  params = np.array([1e3, 1e4, 1e5, 1e6])
  rows = []
  for work, b in work_exponents.items():
    for i, p in enumerate(params):
      t = 1e-7 * p**b
      rows.append(
        dict(
          family="toy",
          scale="quick",
          size=i,
          overrides=f"s{i}",
          work=work,
          num_params=int(p),
          median_s=t,
          q25_s=0.9 * t,
          q75_s=1.1 * t,
          repeats=3,
          compile_s=1.0,
          program_bytes=4.0 * p,
          size_peak_bytes=np.nan,
          others_cpu_share=0.0,
          contended=False,
        )
      )
  return pd.DataFrame(rows)


def test_the_report_states_each_exponent_and_refuses_others_files(
  tmp_path, monkeypatch
):
  monkeypatch.setattr(
    scaling,
    "run",
    lambda *a, **k: _rows({"kfac_step": 1.0, "lanczos_top20": 1.25}),
  )
  table = scaling.write(tmp_path / "out", "quick")
  got = table.set_index("work")
  assert got.time_exponent.to_dict() == pytest.approx(
    {"kfac_step": 1.0, "lanczos_top20": 1.25}
  )
  assert got.memory_exponent.to_dict() == pytest.approx(
    {"kfac_step": 1.0, "lanczos_top20": 1.0}
  )
  summary = (tmp_path / "out" / "summary.md").read_text()
  assert "Growth exponents" in summary and "0 of 4 sizes contended" in summary
  assert (tmp_path / "out" / "scaling.png").stat().st_size > 0
  record = scaling.by_family(table)
  assert record["toy"]["lanczos_top20"]["time"] == pytest.approx(1.25)

  foreign = tmp_path / "theirs"
  foreign.mkdir()
  (foreign / "notes.txt").write_text("not ours")
  with pytest.raises(ValueError, match="holds files already"):
    scaling.write(foreign, "quick")
  assert (foreign / "notes.txt").read_text() == "not ours"


def test_unknown_scales_and_families_are_refused_by_name():
  with pytest.raises(ValueError, match="scale 'huge'"):
    scaling.run("huge")
  with pytest.raises(ValueError, match="no scaling family vgg"):
    scaling.run("quick", families=("vgg",))


@pytest.mark.slow
def test_a_size_measures_every_kind_of_work():
  [gpt] = [f for f in scaling.FAMILIES if f.name == "gpt"]
  rows = scaling.measure_size((*gpt.common, *gpt.sizes["quick"][0]), repeats=2)
  assert [r["work"] for r in rows] == list(scaling.WORK)
  for row in rows:
    assert row["median_s"] > 0 and row["compile_s"] > 0
    assert row["program_bytes"] > 0
    assert row["num_params"] == rows[0]["num_params"] > 0
  seconds = {r["work"]: r["median_s"] for r in rows}
  # Lanczos runs LANCZOS_ITERS products, the trace TRACE_PROBES.
  assert seconds["lanczos_top20"] > 5 * seconds["ggn_product"]
  assert seconds["hutchinson_trace"] > 2 * seconds["ggn_product"]


def test_the_record_keeps_its_exponents_until_new_ones_come(tmp_path):
  exponents = {"gpt": {"kfac_step": {"time": 1.1, "memory": 1.0}}}
  with pytest.raises(FileNotFoundError, match="run --save-record"):
    record.save_scaling("cpu-2-cores", {"exponents": exponents}, tmp_path)
  figures = {"kfac_step/adam_step": {"mlp": 2.5}}
  base = dict(key="cpu-2-cores", mode="full", figures=figures)
  record.save(base, tmp_path)
  path = record.save_scaling("cpu-2-cores", {"exponents": exponents}, tmp_path)
  record.save(
    dict(base, figures={"kfac_step/adam_step": {"mlp": 2.4}}), tmp_path
  )
  kept = record.load(path)
  assert kept["scaling"]["exponents"] == exponents
  assert kept["figures"]["kfac_step/adam_step"]["mlp"] == 2.4
