"""Cases several test files build: small settings and the curvature of the
tiny problem (conftest's `tiny`), defined once."""

import dataclasses

from curvbench import approximations, config

RHO = 1e-3  # the relative damping the spectra checks read


def spectra_settings(**overrides):
  """The spectra measurement's settings made small (the top 3 eigenvalues,
  40 Lanczos steps, few probes, one relative damping), with `overrides`."""
  cfg = config.load(config.compose()).measure.spectra
  small = dict(
    references=["ggn"],
    top_k=3,
    lanczos_iters=40,
    slq_probes=2,
    frobenius_probes=4,
    relative_dampings=[RHO],
  )
  return dataclasses.replace(cfg, **{**small, **overrides})


def tiny_curvature(tiny, name):
  """The curvature approximation `name`, at its preset, of the tiny
  problem's loss."""
  cfg = config.plain(config.compose(f"curvature={name}").curvature)
  return approximations.make(cfg, tiny[0].loss_fn)
