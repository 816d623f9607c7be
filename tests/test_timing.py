"""Per-phase timing records."""

import jax
import pandas as pd

from curvbench import config, curvatures, measurements, timing


def test_timing_record_schema(tiny):
  p, params, batch = tiny
  cfg = config.compose("curvature.mode=fisher_gradients",
                       "measure.timing.warmup=1", "measure.timing.repeats=3")
  cur = curvatures.make(measurements.section(cfg.curvature), p.loss_fn)
  rows = timing.measure(p.loss_fn, cur, params, batch,
                        measurements.section(cfg.measure.timing),
                        jax.random.PRNGKey(0))
  df = pd.DataFrame(rows)
  assert list(df.phase) == list(timing.PHASES)
  assert (df[["compile_s", "first_call_s", "median_s", "min_s"]] > 0).all().all()
  assert (df.repeats == 3).all()
  assert df.set_index("phase").ratio_to_grad_step["grad_step"] == 1.0
  env = timing.environment()
  assert env["jax_version"] == jax.__version__ and env["device_kind"]
