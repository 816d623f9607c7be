"""Numbers over runs, for the report's tables: each run counts once."""

import pandas as pd


def medians(df: pd.DataFrame, index, columns, values) -> pd.DataFrame:
  """A pivot of medians over runs with the number of runs, `n`."""
  table = df.pivot_table(index=index, columns=columns, values=values,
                         aggfunc="median", dropna=False).dropna(how="all")
  counts = df.groupby(index, dropna=False).run_id.nunique().rename("n")
  return table.join(counts).reset_index()
