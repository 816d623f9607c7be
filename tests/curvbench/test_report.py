"""`curvbench report`: a sweep's records merged into tables and figures."""

import re
from pathlib import Path
from urllib.parse import unquote

import pandas as pd
import pytest

from curvbench import config, latex, report, runs, sweep
from curvbench.core import metrics, plots
from curvbench.core.sections import Section, Table
from curvbench.measurements.timing import memory
from tests.conftest import TINY
from tests.curvbench.test_latex import bare_specials, parsed


def test_report_merges_tables_and_figures(sweep, tmp_path, capsys):
  root, _ = sweep
  assert (
    report.main([str(root), "--out", str(tmp_path / "rep"), "--latex"]) == 0
  )
  out = tmp_path / "rep"
  for name in (
    "report.md",
    "quality.csv",
    "timing.csv",
    "training.csv",
    "spectra_all.csv",
    "timing_samples_all.csv",
  ):
    assert (out / name).stat().st_size > 0, name
  ratio = pd.read_csv(out / "step_ratio.csv")
  assert list(ratio.label) == ["kfac[kfac/ggn_curvature_prop]"]
  # Every timing row names the estimation mode K-FAC was timed in, and so
  # does the report's step table.
  timing = pd.read_csv(out / "timing.csv")
  assert set(timing["mode"]) == {"ggn_curvature_prop"}
  assert list(ratio["mode"]) == ["ggn_curvature_prop"]
  assert ratio["median"].item() > 0 and ratio.n.item() == 1
  # One run: the spread is over its rounds, each paired with an Adam step.
  assert ratio.samples.item() == 2 and set(ratio.baseline) == {"adam"}
  assert 0 < ratio.q25.item() <= ratio["median"].item() <= ratio.q75.item()
  memory = pd.read_csv(out / "timing_memory.csv").set_index("phase")
  assert set(memory.label) == {"kfac[kfac/ggn_curvature_prop]"}
  for phase in (
    "grad_step",
    "curvature_update",
    "optimizer_step",
    "baseline_step",
  ):
    assert memory["median"][phase] > 0, phase  # MiB of the phase's program
  figures = {p.name for p in (out / "figures").iterdir()}
  for kind in (
    "spectra_mlp_batch_ggn",
    "training_mlp",
    "timing_mlp",
    "quality_steps_mlp_batch_relative_frobenius",
    "statistics_mlp_trace",
  ):
    for ext in ("png", "pdf", "csv"):
      assert f"{kind}.{ext}" in figures, sorted(figures)
      assert (out / "figures" / f"{kind}.{ext}").stat().st_size > 1000
  assert any(name.startswith("heatmaps_mlp") for name in figures)
  text = (out / "report.md").read_text()
  assert "kfac[kfac/ggn_curvature_prop]" in text and "adam" in text
  # Answers first: the summary, then a section per measurement, the runs
  # last; the detailed tables are linked, not printed.
  headings = [line for line in text.splitlines() if line.startswith("## ")]
  assert headings == [
    "## Summary",
    "## Curvature",
    "## Timing",
    "## Training",
    "## Registration",
    "## Runs",
  ]
  assert "[timing_memory.csv](timing_memory.csv)" in text
  assert "| grad_step |" not in text
  assert "preconditioned_sgd[explicit_exact/ggn_exact]" in text
  # The page links its figures, which lie beside it, so it stays small.
  page = (out / "report.html").read_text()
  assert len(page.encode()) < 500_000
  linked = [unquote(s) for s in re.findall(r'<img src="([^"]*)"', page)]
  assert len(linked) == len(list((out / "figures").glob("*.png")))
  assert all((out / s).is_file() and not Path(s).is_absolute() for s in linked)
  # --latex: each summary table as booktabs, a row per method as on the
  # page, with its interval and n; every name escaped.
  assert f"LaTeX tables under {out / 'latex'}" in capsys.readouterr().out
  for name in ("quality", "step_ratio", "training", "timing_memory"):
    tex = (out / "latex" / f"{name}.tex").read_text()
    rows = parsed(tex)
    assert not [c for row in rows for cell in row for c in bare_specials(cell)]
    assert rf"\label{{tab:{name}}}" in tex
  training = parsed((out / "latex" / "training.tex").read_text())
  labels = pd.read_csv(out / "training.csv").label.unique()
  assert training[0][-1] == "$n$" and len(training) == 1 + len(labels)
  assert {r[1] for r in training[1:]} == {latex.escape(x) for x in labels}
  step = parsed((out / "latex" / "step_ratio.tex").read_text())
  assert step[1][2] == r"kfac[kfac/ggn\_curvature\_prop]"
  assert re.fullmatch(r"[\d.]+ \[[\d.]+, [\d.]+\]", step[1][5]), step[1]
  with pytest.raises(FileNotFoundError, match="No sweep directory at"):
    report.write(tmp_path / "missing")
  (tmp_path / "empty").mkdir()
  with pytest.raises(FileNotFoundError, match="No runs under"):
    report.write(tmp_path / "empty")


@pytest.mark.slow
def test_report_figures_for_a_paper(sweep, tmp_path, monkeypatch):
  """`--style two-column`: every figure a paper's width, titled and
  labelled in words (no metric's key), its rows as CSV beside it."""
  root, _ = sweep
  drawn = {}
  save = plots.save

  def capture(fig, path, **kw):
    drawn[path.name] = (
      fig.get_figwidth(),
      [fig.get_suptitle()]
      + [
        text
        for ax in fig.axes
        for text in (ax.get_title(), ax.get_xlabel(), ax.get_ylabel())
      ],
    )
    return save(fig, path, **kw)

  monkeypatch.setattr(plots, "save", capture)
  out = tmp_path / "rep"
  args = [str(root), "--out", str(out), "--style", "two-column"]
  assert report.main(args) == 0
  keys = {*metrics.QUALITY, *metrics.STATISTICS, *metrics.TRAINING}
  assert len(drawn) > 10
  for name, (width, texts) in drawn.items():
    assert width == pytest.approx(plots.STYLES["two-column"].width), name
    for text in texts:
      assert not any(key in text for key in keys), (name, text)
    assert (out / "figures" / f"{name}.csv").stat().st_size > 0, name
  titles = drawn["quality_steps_mlp_batch_relative_frobenius"][1]
  assert (
    "Relative Frobenius error ‖Ĉ − C‖ / ‖C‖ (lower is better)\nvs exact ggn"
    in titles
  )


def test_timing_memory_is_in_mib_per_phase_with_the_device_peak():
  """Medians over runs of each phase's program memory, in MiB; the device
  peak (the largest a run saw) only where a device measured one."""
  mib = 2**20
  rows = [
    dict(
      problem="mlp",
      device_kind="cpu",
      label="kfac",
      run_id=run,
      phase=phase,
      program_bytes=size * mib,
      device_peak_bytes=float("nan"),
    )
    for run, scale in (("a", 1), ("b", 3))
    for phase, size in (("grad_step", scale), ("optimizer_step", 10 * scale))
  ]
  timing = pd.DataFrame(rows)
  table = memory(timing).set_index("phase")
  assert table["median"].to_dict() == {"grad_step": 2.0, "optimizer_step": 20.0}
  assert table.q25.to_dict() == {"grad_step": 1.5, "optimizer_step": 15.0}
  assert set(table.n) == {2}
  assert "device peak" not in table.index  # the CPU measures no peak
  peaks = timing.assign(device_peak_bytes=[5 * mib, 7 * mib, 9 * mib, 11 * mib])
  table = memory(peaks).set_index("phase")
  assert table["median"]["device peak"] == 9.0  # median of 7 and 11


# --- a sweep designed as an experiment: settings, seeds, and runs that ----------
# --- did not finish ------------------------------------------------------------

ADAM = ("measure=training", "optimizer=adam", *TINY)
DESIGN = {
  **{
    f"adam_lr0.001_seed{s}": [
      *ADAM,
      "optimizer.learning_rate=0.001",
      f"seed={s}",
    ]
    for s in range(3)
  },
  "adam_lr0.01": [*ADAM, "optimizer.learning_rate=0.01"],
  "sgd_diverges": [
    "measure=training",
    "optimizer=sgd",
    *TINY,
    "optimizer.learning_rate=1e38",
    "measure.training.num_steps=20",
  ],
  "spectra_adam": ["measure=spectra", "optimizer=adam", *TINY],  # skipped
  "spectra_fails": [
    "measure=spectra",
    *TINY,
    "continue_on_error=true",
    "measure.spectra.checkpoint=/no/such/params.safetensors",
  ],
}


@pytest.fixture(scope="module")
def designed(tmp_path_factory):
  root = tmp_path_factory.mktemp("designed")
  status = {
    name: runs.run(config.compose(*o), root / name)
    for name, o in DESIGN.items()
  }
  killed = root / "killed"  # a run stopped before its completion marker
  killed.mkdir()
  (killed / "config.yaml").write_text(
    (root / "adam_lr0.01" / "config.yaml").read_text()
  )
  return root, status


@pytest.mark.slow
def test_settings_and_seeds_are_told_apart_and_aggregated(
  designed, tmp_path, monkeypatch
):
  root, status = designed
  assert status["sgd_diverges"] == "diverged"
  assert status["spectra_adam"] == "skipped"
  assert status["spectra_fails"] == "error"
  drawn = {}
  save = plots.save

  def capture(fig, path, **kw):
    drawn[path.name] = fig.axes[0]
    return save(fig, path, **kw)

  monkeypatch.setattr(plots, "save", capture)
  report.write(root, tmp_path)
  summary = pd.read_csv(tmp_path / "training.csv")
  per_label = summary.groupby("label")
  assert per_label.n.unique().map(list).to_dict() == {
    "adam (learning_rate=0.001)": [3],
    "adam (learning_rate=0.01)": [1],
    "sgd": [1],
  }
  assert per_label.diverged.unique()["sgd"] == [1]
  # Every statistic says what it is, with its spread.
  assert {
    "quantity",
    "mean",
    "ci_low",
    "ci_high",
    "median",
    "q25",
    "q75",
    "n",
  } <= set(summary.columns)
  three = summary[summary.label == "adam (learning_rate=0.001)"]
  assert (
    (three.ci_low <= three["mean"])
    & (three["mean"] <= three.ci_high)
    & (three.q25 <= three["median"])
    & (three["median"] <= three.q75)
  ).all()
  axes = drawn["training_mlp"]
  legend = [t.get_text() for t in axes.get_legend().get_texts()]
  assert legend == [
    "adam (learning_rate=0.001) (n=3)",
    "adam (learning_rate=0.01) (n=1)",
    "sgd (n=1)",
  ]
  assert len(axes.collections) == 1  # one band: the setting with 3 seeds
  runs = pd.read_csv(tmp_path / "runs.csv")
  assert len(runs) == len(DESIGN) + 1


@pytest.mark.slow
def test_runs_not_in_the_results_are_listed_with_reasons(
  designed, tmp_path, chromium_page
):
  root, _ = designed
  report.write(root, tmp_path)
  text = (tmp_path / "report.md").read_text()
  section = text.split("## Runs")[1].split("Runs not in the results")[1]
  for name, words in (
    ("sgd_diverges", "non-finite loss at step"),
    ("spectra_fails", "params.safetensors"),
    ("killed", "no completion marker"),
    ("spectra_adam", "does not use the optimizer"),
  ):
    line = next(row for row in section.splitlines() if name in row)
    assert words in line, line

  page = chromium_page.open(tmp_path / "report.html")
  body = page.inner_text("body")
  for name in (
    "sgd_diverges",
    "spectra_fails",
    "killed",
    "spectra_adam",
    "adam (learning_rate=0.001)",
  ):
    assert name in body, name
  images = page.eval_on_selector_all(
    "img", "imgs => imgs.map(i => i.complete && i.naturalWidth)"
  )
  assert images and all(images)  # every figure decoded
  assert page.locator("table").count() >= 3
  assert chromium_page.errors == []


def test_a_problem_without_a_label_is_known_by_its_kind(tmp_path):
  """Runs of default problems (no `problem.label`) are grouped by the
  problem's kind, so settings of one problem never label another's runs."""
  for name in ("mlp", "convnet"):
    (tmp_path / name).mkdir()
    (tmp_path / name / "config.yaml").write_text(
      f"problem:\n  name: {name}\n  label: null\nmeasure:\n  kind: timing\n"
    )
  runs = sweep.load_sweep(tmp_path).runs
  assert sorted(runs.problem) == ["convnet", "mlp"]


def test_self_check_counts_the_seeds_of_the_runs_a_row_speaks_of():
  """A sweep whose parts run different seeds (the gallery's timing runs one
  seed, its training six): a row of one sample is a defect only where its
  own runs ran several."""
  done = pd.DataFrame(
    dict(
      problem=["resnet"] + ["mlp"] * 6,
      measure=["timing"] + ["training"] * 6,
      method=["kfac"] * 7,
    )
  ).assign(**{"config:seed": [0, 0, 1, 2, 3, 4, 5]})
  rows = pd.DataFrame(
    dict(problem=["resnet", "mlp"], method=["kfac", "kfac"], n=[1, 1])
  )
  section = Section("Timing", "?", tables=[Table("timing", "t", rows)])
  assert report.self_check([section], done) == [
    "timing row 1: n=1 although its runs ran 6 seeds"
  ]
  # A row that counts its seeds (a statistic defined on one of them) says
  # so itself.
  said = Table("statistics", "s", rows.assign(seeds=[1, 6]))
  assert report.self_check([Section("S", "?", tables=[said])], done) == []
