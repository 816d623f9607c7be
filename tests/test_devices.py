"""The `device` setting: the platform asked for, or a clear refusal."""

import jax
import pytest

from curvbench import config, devices, provenance


def test_cpu_and_auto_select_a_device_and_describe_it():
  cpu = devices.select("cpu")
  assert cpu.platform == "cpu"
  assert devices.select("auto") == jax.devices()[0]
  described = devices.describe(cpu)
  assert described["device_kind"] == cpu.device_kind
  assert described["num_devices"] == len(jax.local_devices(backend="cpu"))
  assert described["devices_used"] == 1 and described["platform_version"]
  with devices.use("cpu") as device:
    assert jax.numpy.zeros(3).devices() == {device}


@pytest.mark.parametrize("platform", ["gpu", "tpu"])
def test_an_absent_platform_is_refused_with_the_fix(platform):
  if any(d.platform == platform for d in jax.devices()):
    pytest.skip(f"this machine has a {platform}")
  with pytest.raises(ValueError, match=rf"device={platform}, but JAX finds "
                     rf"no {platform.upper()}.*device=auto"):
    devices.select(platform)
  # A run asking for it fails before any record is written.
  cfg = config.compose(f"device={platform}")
  with pytest.raises(ValueError, match=f"device={platform}"):
    provenance.columns(cfg, "float32")


def test_unknown_platform_names_the_choices():
  with pytest.raises(ValueError, match="Unknown device 'npu'.*auto, cpu"):
    devices.select("npu")
