"""curvbench's Hydra sweeper: Hydra finds plugins in `hydra_plugins`.

The sweeper's config node is stored here, apart from the sweeper, so that
`curvbench.config` can compose `hydra/sweeper: tuning` from anywhere (an
editable install hides this package from Hydra's plugin scan) without
importing the sweeper, which imports `curvbench.config`.
"""

# No `from __future__ import annotations`: Hydra executes plugin modules
# outside sys.modules, where dataclasses cannot resolve string annotations.
from dataclasses import dataclass
from typing import Any

from hydra.core.config_store import ConfigStore


@dataclass
class TuningSweeperConf:
  _target_: str = "hydra_plugins.curvbench_sweeper.tuning_sweeper.TuningSweeper"
  max_batch_size: Any = None
  params: Any = None
  sweeps: Any = None  # a list of `params`-like mappings: their union


ConfigStore.instance().store(
  group="hydra/sweeper",
  name="tuning",
  node=TuningSweeperConf,
  provider="curvbench",
)
