"""The toy measurement as a plugin, from outside the package:
`curvbench plugins=[tests.toy_measurement.plugin] measure=toy_gradient_norms`
(with the repository on PYTHONPATH)."""

from curvbench.measurements import MEASUREMENTS
from tests.toy_measurement import GradientNorms

MEASUREMENTS.register(GradientNorms)
