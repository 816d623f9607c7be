"""A measurement declared in one folder, as every measurement is: its
settings and computation here, its figure in `figures`, its part of the
report in `section`. The contract test registers it for one test."""

import dataclasses

import jax
import jax.numpy as jnp

from curvbench.components import Number, setting
from curvbench.core.sections import Section, Table
from curvbench.measurements import Measurement, Outcome
from tests.toy_measurement import figures


@dataclasses.dataclass
class GradientNorms(Measurement):
  """The norm of the loss's gradient per parameter array, at the start."""

  name = "toy_gradient_norms"
  tables = ("toy_gradient_norms",)
  scale: float = setting(1.0, Number(0, low_in=False), "multiplies the norms")

  def uses_curvature(self, run):
    return False

  def measure(self, ctx):
    grads = jax.grad(ctx.problem.loss_fn)(ctx.params, ctx.batch)
    return Outcome(
      {
        "toy_gradient_norms": [
          dict(
            leaf=jax.tree_util.keystr(path),
            norm=self.scale * float(jnp.linalg.norm(g)),
          )
          for path, g in jax.tree_util.tree_flatten_with_path(grads)[0]
        ]
      }
    )

  def section(self, report, out):
    rows = report.tables.get("toy_gradient_norms")
    if rows is None:
      return None
    norms = rows.groupby(["problem", "leaf"]).norm.median().reset_index()
    largest = norms.loc[norms.norm.idxmax()]
    return Section(
      "Gradient norms",
      "How large is the gradient at the start?",
      findings=[
        f"{largest.problem}: the largest gradient is "
        f"{largest.leaf}'s, norm {largest.norm:.3g}."
      ],
      tables=[
        Table("toy_gradient_norms", "Gradient norms at the start", norms)
      ],
      figures=figures.norms(rows, out),
    )
