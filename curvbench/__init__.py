"""curvbench's harness: measurements, records, reports and the Hydra app.

Modules: `curvatures` (one interface over the estimators), `spectra`,
`timing`, `training` (the three measurements), `metrics`, `records`,
`report` and `plots`, and `app` (the `curvbench` command).
"""
