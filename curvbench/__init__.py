"""curvbench's harness: the Hydra app, measurements, records and reports.

Its components, each one module found through its registry:
`curvbench.approximations` (the `curvature` group), `curvbench.optimizers`
(`optimizer`), `curvbench.measurements` (`measure`, one folder per
measurement: its computation, settings, figures and report section);
problems and datasets are in the `problems` package. `components` is how
each of them declares its settings and registry. `config` declares and
checks the run's settings, `runs` runs one, `app` is the `curvbench`
command and `api` the same from Python, over any JAX model (`measure`,
`Model`, `Data`, here at the top), `plugins` imports components declared
outside the package, `report` merges a sweep (`sweep` loads it, `stats` and
`sections` shape what it shows, `plots` holds the shared figure helpers).
`curvatures` is the one interface over the estimators that measurements
use.
"""

# The Python API (`curvbench.api`), imported when first used: the
# registries' modules import `curvbench.components` through this package.
_API = ("Data", "Model", "Results", "measure", "register_model")


def __getattr__(name):
  if name in _API:
    from curvbench import api  # noqa: PLC0415

    return getattr(api, name)
  raise AttributeError(f"module 'curvbench' has no attribute {name!r}")
