"""Problems: a model, its registered loss and offline data, built from config.

`problems.make(cfg)` takes the `problem` config group (a mapping with `name`,
`data`, `batch_size` and the model's sizes) and returns a `Problem`.
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
  """Builds the problem `cfg["name"]` (one of `BUILDERS`).

  `cfg` holds every key of the problem's config file (conf/problem/*.yaml);
  there are no defaults in code: `curvbench.config.compose("problem=mlp")`
  gives a complete one.
  """
  cfg = _plain(cfg)
  name = cfg.get("name")
  if name not in BUILDERS:
    raise ValueError(f"Unknown problem.name {name!r}; choose one of "
                     f"{', '.join(BUILDERS)} (conf/problem/*.yaml).")
  try:
    data_cfg = dict(cfg["data"])
    dataset = data.load(data_cfg.pop("name"), **data_cfg)
    return BUILDERS[name](dataset, cfg)
  except KeyError as missing:
    raise ValueError(
        f"The {name!r} problem config has no key {missing}: start from its "
        "config file, e.g. curvbench.config.compose('problem=...').problem, "
        "and override what differs.") from None


__all__ = ["BUILDERS", "Dataset", "LOSSES", "Problem", "TASKS", "autoencoder",
           "convnet", "data", "layers", "make", "mlp"]
