"""Problems: a model, its registered loss and offline data, built from config.

`problems.make(cfg)` takes the `problem` config group (a mapping with `name`,
`data`, `batch_size`, `seed` and the model's sizes) and returns a `Problem`.
"""

from problems import autoencoder, convnet, data, layers, mlp
from problems.base import LOSSES, TASKS, Problem
from problems.data import Dataset

BUILDERS = {"mlp": mlp.build, "autoencoder": autoencoder.build,
            "convnet": convnet.build}


def _plain(cfg) -> dict:
  """A plain dict from a dict or an OmegaConf config."""
  try:
    from omegaconf import DictConfig, OmegaConf
    if isinstance(cfg, DictConfig):
      return OmegaConf.to_container(cfg, resolve=True)
  except ImportError:
    pass
  return dict(cfg)


def make(cfg) -> Problem:
  """Builds the problem `cfg["name"]` (one of `BUILDERS`)."""
  cfg = _plain(cfg)
  name = cfg.get("name")
  if name not in BUILDERS:
    raise ValueError(f"Unknown problem {name!r}; choose one of "
                     f"{', '.join(BUILDERS)} (conf/problem/*.yaml).")
  if "batch_size" not in cfg:
    raise ValueError(f"Problem {name!r} needs a batch_size.")
  data_cfg = dict(cfg.get("data") or {})
  dataset = data.load(data_cfg.pop("name", "digits"), **data_cfg)
  return BUILDERS[name](dataset, cfg)


__all__ = ["BUILDERS", "Dataset", "LOSSES", "Problem", "TASKS", "autoencoder",
           "convnet", "data", "layers", "make", "mlp"]
