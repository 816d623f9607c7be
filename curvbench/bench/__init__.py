"""The benchmark of record: one command that measures what the suite's
timing claims rest on, a committed record of those figures per device
kind, and a side-by-side check against an earlier commit.

- `suite`: `python -m curvbench.bench run [--quick]` runs harness sweeps
  (timing on every problem, the MLP's exact GGN spectrum) as subprocesses,
  times the dataset GGN-vector product per gradient (`products`) and
  writes one report folder (`make bench-accelerator`, `make bench`).
- `record`: the figures as ratios, `benchmarks/record/<device>.json`, the
  comparison that names every figure more than 25 % worse, and the
  documentation's table (`python -m curvbench.bench table`).
- `against`: `python -m curvbench.bench against REF` times commit REF and
  the working tree in one process, interleaved (`make bench-against`).
"""

from curvbench.bench import against, products, record, suite

__all__ = ["against", "products", "record", "suite"]
