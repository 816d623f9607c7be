"""What a spectra measurement measures and how, fixed before it starts.

`make` reads the settings (the `Spectra` measurement's, or any object with
its fields) once into a frozen `Plan`: the exact references in the order
they are measured, the dampings, the sizes and the probe counts. `Subject`
gathers what it measures: the loss, the approximation, the point, the data
and where the phases and shared references go. The two methods, `dense`
and `lanczos`, take both and return the tables.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np

from curvbench.core import curvatures
from curvbench.core.costs import Costs
from curvbench.core.data import Data
from curvbench.core.references import ReferenceStore

METHODS = ("dense", "lanczos")
# Below this relative Frobenius distance two exact references are the
# same matrix (round-off of float64 products; matrix-free estimates
# of equal operators give exactly 0).
SAME = 1e-9


@dataclasses.dataclass(frozen=True)
class Probes:
  """The matrix-free method's Krylov depths and random-probe counts."""

  lanczos_iters: int
  slq: int
  frobenius: int
  trace: int
  diagonal: int
  # Probes evaluated at once (None: all of them).
  batch: int | None
  cg_iters: int
  # The relative standard error a probe estimate is to reach.
  target_precision: float


@dataclasses.dataclass(frozen=True)
class Plan:
  """The settings a measurement reads, resolved once.

  `references` are the exact matrices, the approximation's own first, each
  once. `precision`, `relative_floor`, `damping` and `top_k` keep the
  settings' names: `rows.floor` and `rows.spectrum_statistics` read them
  from either.
  """

  method: str
  references: tuple[str, ...]
  precision: str
  relative_floor: float
  damping: float
  relative_dampings: tuple[float, ...]
  top_k: int
  num_samples: int
  probes: Probes
  per_block: bool
  per_block_type: bool
  heatmap_blocks: int
  heatmap_units: int
  class_means: bool

  @property
  def same(self) -> float:
    """The relative Frobenius distance at or below which the matrix-free
    method takes two references for one matrix: `SAME`, or a hundred
    round-offs of the precision where that is larger."""
    return max(SAME, 100 * float(np.finfo(np.dtype(self.precision)).eps))


@dataclasses.dataclass(frozen=True)
class Subject:
  """What a measurement looks at: the approximation `curvature` of
  `loss_fn` at `params` over `data`, with the key `rng` they are estimated
  with; the phases go to `costs`, the dense references to and from `store`
  (under `key` plus their content); block types from the problem's
  `layer_roles`, batch-coupled losses by `examples_interact`, the class
  means from the network's `outputs`."""

  loss_fn: Callable
  curvature: Any
  params: Any
  data: Data
  rng: Any
  costs: Costs
  store: ReferenceStore
  key: dict | None = None
  layer_roles: Any = ()
  examples_interact: bool = False
  outputs: Callable | None = None


def make(cfg, curvature, params, outputs=None) -> Plan:
  """The plan of settings `cfg` for `curvature` at `params`; refuses a
  method it does not know, a dense matrix over `cfg.max_dense_gib`, and
  the class-mean test without what it needs (`check_class_means`)."""
  if cfg.method not in METHODS:
    raise ValueError(
      f"Unknown measure.spectra.method {cfg.method!r}; "
      f"choose one of {', '.join(METHODS)}."
    )
  if cfg.method == "dense":
    curvatures.check_dense_fits(
      curvatures.num_params(params),
      8,
      cfg.max_dense_gib,
      "The dense spectra method",
      "use measure.spectra.method=lanczos (matrix-free)",
    )
  references = tuple(dict.fromkeys([curvature.matrix, *cfg.references]))
  check_class_means(cfg.class_means, references, outputs)
  return Plan(
    method=cfg.method,
    references=references,
    precision=cfg.precision,
    relative_floor=cfg.relative_floor,
    damping=cfg.damping,
    relative_dampings=tuple(cfg.relative_dampings),
    top_k=cfg.top_k,
    num_samples=cfg.num_samples,
    probes=Probes(
      lanczos_iters=cfg.lanczos_iters,
      slq=cfg.slq_probes,
      frobenius=cfg.frobenius_probes,
      trace=cfg.trace_probes,
      diagonal=cfg.diagonal_probes,
      batch=cfg.probe_batch,
      cg_iters=cfg.cg_iters,
      target_precision=cfg.target_precision,
    ),
    per_block=cfg.per_block,
    per_block_type=cfg.per_block_type,
    heatmap_blocks=cfg.heatmap_blocks,
    heatmap_units=cfg.heatmap_units,
    class_means=cfg.class_means,
  )


def check_class_means(asked: bool, references, outputs) -> None:
  """Refuses the class-mean test (`asked`) without what it needs: the GGN
  among the `references`, and the network's `outputs(params, inputs)`."""
  if not asked:
    return
  if "ggn" not in references:
    raise ValueError(
      "measure.spectra.class_means=true compares the class means with the "
      f"exact GGN, which is not measured (references {list(references)}): "
      "add ggn to measure.spectra.references."
    )
  if outputs is None:
    raise ValueError(
      "measure.spectra.class_means=true needs the network's outputs: pass "
      "outputs=problem.outputs to compute.measure."
    )
