"""Numbers over runs, for the report's tables: each run counts once, and
every figure comes with its spread and its count."""

import pandas as pd


def over_runs(df: pd.DataFrame, index, quantity: str, value: str
              ) -> pd.DataFrame:
  """Per `index` and `quantity` (a column naming what `value` holds): the
  `median` of `value` over runs, its quartiles `q25` and `q75` (equal to
  the median for one run) and the number of runs `n`. A run with several
  rows for one quantity counts once, by its median."""
  index = list(index)
  per_run = df.groupby([*index, quantity, "run_id"], dropna=False)[
      value].median().dropna()
  g = per_run.groupby(level=[*index, quantity], dropna=False)
  return pd.DataFrame(dict(
      median=g.median(), q25=g.quantile(0.25), q75=g.quantile(0.75),
      n=g.size())).reset_index()
