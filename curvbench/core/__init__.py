"""The toolkit the components build on, one module each (imported by name,
`from curvbench.core import stats`; this package imports none of them, so
importing one does not import the rest):

- `checkpoints`: parameter checkpoints as safetensors files that load
  without curvbench.
- `costs`: what a measurement costs per phase: compile time, run time and
  memory.
- `curvatures`: the `Curvature` interface every approximation and exact
  matrix is measured through, and its families.
- `data`: the examples a curvature is measured on (`Data`: one batch, N
  batches or the whole training split, in equal chunks).
- `devices`: which devices a run measures on (the `device` and `devices`
  settings), and splitting batches over them.
- `environment`: what produced a number: the commit, library versions,
  device and machine.
- `html_page`: an HTML page of headings, text, tables and figures.
- `matrix_free`: matrix-free spectral estimates (Lanczos) of symmetric
  operators.
- `metrics`: approximation-quality metrics, in float64 numpy.
- `palette`: the colour-blind-safe colours and markers methods are drawn
  in.
- `plots`: what every figure shares: saving, panel grids, legends and one
  colour per method.
- `records`: measurements as tidy tables in a run directory that the
  harness owns.
- `references`: exact reference matrices computed once and shared by a
  sweep's runs.
- `registration_report`: the report's section on which block each layer
  gets.
- `sections`: what a measurement gives the report (`Section`, `Table`).
- `stats`: the medians, intervals and comparisons every report table
  uses.
- `training`: loss curves against steps and time for any trainer, and the
  trainer of optax transformations.
- `tuning`: picking each optimizer's best setting from a sweep's runs.
"""
