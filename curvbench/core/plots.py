"""What every figure of a report shares: saving (PNG and PDF), panel grids,
titles, one legend below the panels, the location columns of older
tables, and one colour per method in every figure. Each measurement draws
its own figures (`curvbench.measurements.<name>.figures`) with these.

Colours: every line or bar stands for a label (a method and its setting).
A method's hue comes from what it approximates or optimizes with (`key`:
K-FAC's curvature and the K-FAC optimizer using it share one), the colour
that component declares (so a method has the same hue in every figure and
every report); several variants of one hue are shades of it (`colours`).

Tables written before curvature was measured along training lack `step`,
`data` and `block`; they read as step 0, data "batch" and block "all".
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import re
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from matplotlib import colors, layout_engine

from curvbench.core import palette

DEFAULTS = dict(step=0, data="batch", block="all")
LEGEND_FONTSIZE = 7


def save(fig, path: Path, data: pd.DataFrame | None = None) -> list[Path]:
  """Writes `fig` as PNG and PDF at `path` (suffix replaced) and the rows
  it drew as CSV beside them (same stem): `data` where given, else what
  its panels hold (`drawn`); closes it. Returns the PNG and PDF."""
  path.parent.mkdir(parents=True, exist_ok=True)
  _constrained(fig)
  # A stem may hold dots ("rho-0.001"): only a known suffix is replaced.
  if path.suffix in (".png", ".pdf", ".csv"):
    path = path.with_suffix("")
  at = lambda ext: path.with_name(path.name + ext)
  paths = [at(".png"), at(".pdf")]
  for p in paths:
    fig.savefig(p, dpi=120)
  rows = drawn(fig) if data is None else data
  rows.to_csv(at(".csv"), index=False)
  plt.close(fig)
  return paths


def _bar_category(ax, x: float) -> str:
  """The tick label nearest `x` on `ax`'s x axis (a bar's group)."""
  ticks = ax.get_xticks()
  labels = [t.get_text() for t in ax.get_xticklabels()]
  if not len(ticks) or not any(labels):
    return f"{x:g}"
  return labels[int(np.argmin(np.abs(np.asarray(ticks) - x)))].replace(
    "\n", " "
  )


def drawn(fig) -> pd.DataFrame:
  """The tidy rows `fig`'s panels show: a row per point of each labelled
  line and per bar (`panel` its title, `series` its legend label, `x`
  and `y` with the axes' labels as `x_label` and `y_label`; a bar's `x`
  its group's tick label)."""
  rows = []
  for ax in fig.axes:
    if not ax.get_visible():
      continue
    where = dict(
      panel=ax.get_title() or fig.get_suptitle(),
      x_label=ax.get_xlabel(),
      y_label=ax.get_ylabel(),
    )
    for line in ax.get_lines():
      label = line.get_label()
      if label.startswith("_"):
        continue
      xs, ys = line.get_xdata(), line.get_ydata()
      rows += [dict(where, series=label, x=x, y=y) for x, y in zip(xs, ys)]
    for container in ax.containers:
      label = container.get_label()
      if not hasattr(container, "patches") or str(label).startswith("_"):
        continue
      rows += [
        dict(
          where,
          series=label,
          x=_bar_category(ax, bar.get_x() + bar.get_width() / 2),
          y=bar.get_height(),
        )
        for bar in container.patches
      ]
  columns = ["panel", "series", "x", "y", "x_label", "y_label"]
  return pd.DataFrame(rows, columns=columns)


def _constrained(fig) -> layout_engine.ConstrainedLayoutEngine:
  """`fig`'s constrained layout engine, set where it has none."""
  if not isinstance(
    fig.get_layout_engine(), layout_engine.ConstrainedLayoutEngine
  ):
    fig.set_layout_engine("constrained")
  return fig.get_layout_engine()


def grid(n, width=4.0, height=3.0, cols=3, **kw):
  """A figure of `n` panels of `width` by `height` inches (on the screen;
  a paper style narrows them to its width, `figsize`) in rows of `cols`
  (at most the style's); its panels, flat."""
  cols = min(cols, n, _current.get().columns)
  rows = -(-n // cols)
  fig, axes = plt.subplots(
    rows,
    cols,
    figsize=figsize(width * cols, height * rows),
    squeeze=False,
    layout="constrained",
    **kw,
  )
  for ax in axes.flat[n:]:
    ax.set_visible(False)
  return fig, list(axes.flat)


def slug(*parts) -> str:
  """A file-name stem from labels such as "kfac/ggn_exact" or "batches:8"."""
  return "_".join(re.sub(r"[^A-Za-z0-9_.-]+", "-", str(p)) for p in parts)


def listed(rows: pd.DataFrame, column: str) -> str:
  """The values of `column` in `rows`, sorted, comma-separated."""
  return ", ".join(sorted({str(v) for v in rows[column].dropna()}))


def title(what: str, rows: pd.DataFrame) -> str:
  """`what` placed by the problem, exact reference, data and step of `rows`
  (those columns it has; several values listed), e.g. "mlp: quality vs
  exact ggn on batch at step 10"."""
  parts = [f"{listed(rows, 'problem')}: {what}"]
  if "reference" in rows and rows.reference.notna().any():
    parts.append(f"vs exact {listed(rows, 'reference')}")
  if "data" in rows and rows.data.notna().any():
    parts.append(f"on {listed(rows, 'data')}")
  if "step" in rows and rows.step.notna().any():
    steps = sorted({int(s) for s in rows.step.dropna()})
    parts.append(
      f"at step {steps[0]}"
      if len(steps) == 1
      else f"over steps {steps[0]}-{steps[-1]}"
    )
  return " ".join(parts)


def _figure_handles(fig) -> tuple[list, list[str]]:
  """The labelled artists of every panel of `fig`, once per label."""
  found: dict[str, Any] = {}
  for ax in fig.axes:
    for handle, label in zip(*ax.get_legend_handles_labels()):
      found.setdefault(label, handle)
  return list(found.values()), list(found)


def legend_below(fig, ax, handles=None, labels=None, title=None):
  """The figure's one legend, below its panels in as many columns as fit
  its width, the figure made taller to hold it; it is `ax`'s legend.
  `handles` default to the labelled artists of every panel."""
  if handles is None:
    handles, labels = _figure_handles(fig)
  if not handles:
    return None
  kw = {
    "loc": "upper center",
    "bbox_transform": fig.transFigure,
    "bbox_to_anchor": (0.5, 0),
    "fontsize": LEGEND_FONTSIZE,
    "frameon": False,
  }
  renderer = fig.canvas.get_renderer()
  column = (
    ax.legend(handles, labels, ncol=1, **kw).get_window_extent(renderer).width
    / fig.dpi
  )
  ncol = int(np.clip(0.95 * fig.get_figwidth() // column, 1, len(handles)))
  legend = ax.legend(
    handles,
    labels,
    ncol=ncol,
    title=title,
    title_fontsize=LEGEND_FONTSIZE,
    **kw,
  )
  legend.set_in_layout(False)
  height = legend.get_window_extent(renderer).height / fig.dpi + 0.1
  fig.set_figheight(fig.get_figheight() + height)
  below = height / fig.get_figheight()
  legend.set_bbox_to_anchor((0.5, below), transform=fig.transFigure)
  _constrained(fig).set(rect=(0, below, 1, 1 - below))
  return legend


def complete(df: pd.DataFrame, *columns: str) -> pd.DataFrame:
  """`df` with the named location columns filled in for older tables."""
  df = df.copy()
  for col in columns:
    df[col] = df[col].fillna(DEFAULTS[col]) if col in df else DEFAULTS[col]
  if "step" in columns:
    df["step"] = df["step"].astype(int)
  return df


def finite(df: pd.DataFrame, *columns: str) -> pd.DataFrame:
  """`df` with inf read as NaN in `columns`."""
  df = df.copy()
  for col in columns:
    df[col] = pd.to_numeric(df[col], errors="coerce").replace(
      [np.inf, -np.inf], np.nan
    )
  return df


def one_run(df: pd.DataFrame, keys: list[str]) -> pd.DataFrame:
  """Rows of one run per group of `keys` (runs may repeat a measurement)."""
  run = next((c for c in ("run", "run_dir") if c in df), None)
  if run is None or df.empty:
    return df
  first = df.groupby(keys, dropna=False)[run].transform("first")
  return df[df[run].astype(str) == first.astype(str)]


def series(df: pd.DataFrame) -> pd.Series:
  """What a line or bar stands for: the row's label (method and setting),
  else its method."""
  method = df["method"].astype(str)
  if "label" not in df:
    return method
  return (
    df["label"]
    .where(df["label"].notna() & (df["label"] != ""), method)
    .astype(str)
  )


# --- one colour per method ----------------------------------------------------


def key(label: str) -> str:
  """The name a label's hue comes from: the curvature of
  `optimizer[curvature/mode] (setting)` and of `curvature/mode
  (setting)`, else the optimizer (`adam (lr=0.1)` -> adam)."""
  method = str(label).split(" (")[0]
  inner = re.search(r"\[([^\]/]+)", method)
  return inner.group(1) if inner else method.split("/")[0]


def variant(label: str) -> str:
  """A label less its optimizer where it names a curvature: the K-FAC
  optimizer's curve and K-FAC's quality bars share one colour."""
  method, _, setting = str(label).partition(" (")
  inner = re.search(r"\[(.+)\]", method)
  return (inner.group(1) if inner else method) + (
    f" ({setting}" if setting else ""
  )


class Looks(dict):
  """A colour per label (the mapping itself, so `looks[label]` is a
  colour) and the marker that goes with it (`marker`): the second channel
  that tells methods apart where colours do not (greyscale, colour-blind
  readers, two methods sharing a hue)."""

  def __init__(self, colour=(), marker=None):
    super().__init__(colour)
    self.marker: dict[str, str] = dict(marker or {})


def marker(looks: dict[str, str], label: str) -> str:
  """`label`'s marker in `looks` (a `Looks`), else a circle."""
  return getattr(looks, "marker", {}).get(label, "o")


def hatch(looks: dict[str, str], label: str) -> str:
  """The hatch of `label`'s bars: its marker's (`palette.hatch`)."""
  return palette.hatch(marker(looks, label))


def shade(colour: str, i: int, n: int) -> str:
  """The `i`-th of `n` shades of `colour`, darker to lighter."""
  if n == 1:
    return colors.to_hex(colour)
  t = -0.45 + 0.9 * i / (n - 1)
  rgb = np.asarray(colors.to_rgb(colour))
  return colors.to_hex(tuple(rgb + abs(t) * (float(t > 0) - rgb)))


def _left_over(declared, pool) -> list:
  """`pool`'s members none of `declared` uses, then all of `pool` again
  (enough for any number of labels)."""
  free = [x for x in pool if x not in set(declared)]
  return free + list(pool) * 8


def colours(
  labels,
  fixed: dict[str, str] | None = None,
  markers: dict[str, str] | None = None,
) -> Looks:
  """A colour and marker per label: those of its `key`, declared by the
  component (`fixed` and `markers`, by key: the same in every report) or
  else the next hue and marker (`palette.HUES`, `palette.MARKERS`) no
  declared one uses, in sorted order of the keys; in shades where several
  variants share a key. A label keeps its look in every figure drawn with
  this mapping."""
  fixed = {k: colors.to_hex(c) for k, c in (fixed or {}).items()}
  markers = dict(markers or {})
  labels = sorted({str(label) for label in labels})
  keys = sorted({key(x) for x in labels})
  free_hue = iter(_left_over(fixed.values(), palette.HUES))
  free_marker = iter(_left_over(markers.values(), palette.MARKERS))
  hue = {k: fixed[k] if k in fixed else next(free_hue) for k in keys}
  mark = {k: markers[k] if k in markers else next(free_marker) for k in keys}
  out = Looks()
  for k in keys:
    variants = sorted({variant(x) for x in labels if key(x) == k})
    for x in labels:
      if key(x) == k:
        out[x] = shade(hue[k], variants.index(variant(x)), len(variants))
        out.marker[x] = mark[k]
  return out


def series_colours(
  df: pd.DataFrame, colour: dict[str, str] | None, column: str = "series"
) -> Looks:
  """A colour and marker for each value of `df[column]`: the report's
  (`colour`, a `Looks`), else one from `colours` over these values alone."""
  names = set(df[column].astype(str)) if len(df) else set()
  own = colours(names)
  return Looks(
    {name: (colour or {}).get(name, own[name]) for name in names},
    {
      name: getattr(colour, "marker", {}).get(name, own.marker[name])
      for name in names
    },
  )


# --- axes ---------------------------------------------------------------------


def log_if_decades(ax, values, axis="y", decades=2):
  """A log scale on `axis` where the finite `values` are positive and span
  `decades` decades or more."""
  v = np.asarray(values, np.float64)
  v = v[np.isfinite(v)]
  if v.size and v.min() > 0 and v.max() >= 10.0**decades * v.min():
    (ax.set_yscale if axis == "y" else ax.set_xscale)("log")


def no_values(ax, text="no finite values"):
  """Writes `text` in the middle of a panel that has nothing to draw."""
  ax.text(0.5, 0.5, text, ha="center", transform=ax.transAxes)


def step_axis(ax, steps):
  """x = training step; symlog when the steps span two decades or more."""
  positive = np.asarray([s for s in steps if s > 0])
  if positive.size and positive.max() >= 100 * positive.min():
    ax.set_xscale("symlog", linthresh=positive.min())
    ax.set_xlim(left=-0.2 * positive.min())
  ax.set_xlabel("Training step")


def step_panel(ax, text, steps):
  """Finishes a panel drawn against the training step."""
  ax.set_title(text, fontsize="medium", wrap=True)
  step_axis(ax, steps)


def band(ax, x, lo, hi, colour):
  """Shades between `lo` and `hi` along `x` in `colour`, faintly (a
  spread around a line of that colour)."""
  ax.fill_between(x, lo, hi, color=colour, alpha=0.2, lw=0)


# --- styles: the screen, and a paper's column widths -------------------------


@dataclasses.dataclass(frozen=True)
class Style:
  """How figures are sized: `width` the whole figure's, in inches (None:
  each figure's own, for the screen), at most `columns` panels a row,
  and the font sizes (`rc`) that go with that width."""

  width: float | None
  columns: int
  rc: dict


def _fonts(base: float, small: float) -> dict:
  return {
    "font.size": base,
    "axes.titlesize": base,
    "axes.labelsize": base,
    "figure.titlesize": base,
    "xtick.labelsize": small,
    "ytick.labelsize": small,
    "legend.fontsize": small,
    "legend.title_fontsize": small,
    # Hatches (a bar's second channel) thin enough not to hide its colour.
    "hatch.linewidth": 0.5,
  }


# Paper widths are ICML's (its formatting instructions, "Dimensions": two
# columns, 6.75 in overall with 0.25 in between, so a column is 3.25 in),
# which most two-column ML venues share; 8 pt text at print size sits
# just under the papers' 10 pt body text, as figure text should.
STYLES: dict[str, Style] = {
  "screen": Style(None, 3, {**_fonts(10, 8), "figure.dpi": 120}),
  "one-column": Style(3.25, 1, {**_fonts(8, 7), "figure.dpi": 120}),
  "two-column": Style(6.75, 3, {**_fonts(8, 7), "figure.dpi": 120}),
}
_current: contextvars.ContextVar[Style] = contextvars.ContextVar(
  "style", default=STYLES["screen"]
)


@contextlib.contextmanager
def style(name: str | None = None):
  """Figures drawn in this block take the style `name` (`STYLES`); None
  keeps the one already in force (the screen's outside any block)."""
  if name is not None and name not in STYLES:
    raise ValueError(
      f"style {name!r} is not one of {', '.join(STYLES)}: give one of those."
    )
  chosen = STYLES[name] if name is not None else _current.get()
  token = _current.set(chosen)
  try:
    with plt.rc_context(chosen.rc):
      yield chosen
  finally:
    _current.reset(token)


def figsize(width: float, height: float) -> tuple[float, float]:
  """The size of a figure drawn `width` by `height` inches for the screen,
  in the style in force: a paper style's width, the same shape."""
  fixed = _current.get().width
  if fixed is None:
    return width, height
  return fixed, height * fixed / width
