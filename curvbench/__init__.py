"""curvbench's harness: the Hydra app, measurements, records and reports.

Its components, each one module found through its registry:
`curvbench.approximations` (the `curvature` group), `curvbench.optimizers`
(`optimizer`), `curvbench.measurements` (`measure`); problems and datasets
are in the `problems` package. `config` declares and checks the run's
settings, `runs` runs one, `app` is the `curvbench` command, `report` and
`plots` merge a sweep. `curvatures` is the one interface over the
estimators that measurements use; `spectra`, `timing` and `training` hold
the measurements' computations.
"""
