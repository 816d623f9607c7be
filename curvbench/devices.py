"""Which device a run measures on, chosen by the `device` setting.

`auto` takes JAX's default backend (a GPU or TPU when one is installed and
visible, else the CPU); `cpu`, `gpu` and `tpu` require that platform and
fail with the fix when it is absent, rather than silently measuring
something else.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import jax

PLATFORMS = ("auto", "cpu", "gpu", "tpu")
_INSTALL = {
    "gpu": "install the CUDA build of jax (`make cuda`, or `pip install -c "
           "constraints.txt -e '.[cuda]'`) and check that `nvidia-smi` sees "
           "the GPU",
    "tpu": "install jax with TPU support (`pip install 'jax[tpu]'`) on a TPU "
           "host",
}


def select(platform: str) -> jax.Device:
  """The first device of `platform` (one of `PLATFORMS`).

  Raises:
    ValueError: for an unknown platform, or one JAX cannot find here.
  """
  if platform not in PLATFORMS:
    raise ValueError(f"Unknown device {platform!r}; choose one of "
                     f"{', '.join(PLATFORMS)}.")
  if platform == "auto":
    return jax.devices()[0]
  try:
    return jax.devices(platform)[0]
  except RuntimeError:
    found = sorted({d.platform for d in jax.devices()})
    raise ValueError(
        f"device={platform}, but JAX finds no {platform.upper()} here (it "
        f"finds: {', '.join(found)}). To use one, {_INSTALL[platform]}; or "
        "run with device=auto (the default backend) or device=cpu.") from None


@contextlib.contextmanager
def use(platform: str) -> Iterator[jax.Device]:
  """Runs the block with `platform`'s device as JAX's default device."""
  device = select(platform)
  with jax.default_device(device):
    yield device


def describe(device: jax.Device) -> dict:
  """The record columns of a device: its kind and platform, how many of
  its platform are local (the run uses one), and the runtime's version
  string (on GPUs, the CUDA and driver versions JAX reports)."""
  return dict(device_kind=device.device_kind, platform=device.platform,
              num_devices=len(jax.local_devices(backend=device.platform)),
              devices_used=1,
              platform_version=str(device.client.platform_version))
