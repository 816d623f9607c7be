"""The `device` and `devices` settings: the platform and count asked for,
or a clear refusal."""

import os
import subprocess
import sys

import jax
import pytest

from curvbench import config, provenance
from curvbench.core import devices


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
  with pytest.raises(
    ValueError,
    match=rf"device={platform}, but JAX finds "
    rf"no {platform.upper()}.*device=auto",
  ):
    devices.select(platform)
  # A run asking for it fails before any record is written.
  cfg = config.compose(f"device={platform}")
  with pytest.raises(ValueError, match=f"device={platform}"):
    provenance.columns(cfg, "float32")


def test_unknown_platform_names_the_choices():
  with pytest.raises(ValueError, match="Unknown device 'npu'.*auto, cpu"):
    devices.select("npu")


def test_describe_records_the_devices_a_run_uses():
  cpu = devices.select("cpu")
  assert devices.describe(cpu, 2)["devices_used"] == 2
  if len(jax.devices("cpu")) >= 2:
    with devices.use("cpu", 2) as device:
      assert device == cpu
      assert devices.describe(cpu)["devices_used"] == 2
      assert devices.in_use() == jax.devices("cpu")[:2]
  assert devices.describe(cpu)["devices_used"] == 1
  assert devices.in_use() == jax.local_devices()[:1]
  with pytest.raises(ValueError, match="devices=0 must be a positive"):
    devices.describe(cpu, 0)


def test_a_fresh_process_gets_the_host_devices_it_asks_for():
  """Without XLA_FLAGS, `use` asks JAX for the CPU devices before its
  backends start."""
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env["JAX_PLATFORMS"] = "cpu"
  code = (
    "import jax\nfrom curvbench import devices\n"
    "with devices.use('cpu', 3):\n"
    "  print(len(devices.mesh('cpu', 3).devices))"
  )
  out = subprocess.run(
    [sys.executable, "-c", code],
    env=env,
    check=True,
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert out.stdout.split() == ["3"]


@pytest.mark.slow
def test_a_sweep_asking_for_devices_the_machine_lacks_launches_nothing(
  tmp_path,
):
  """With the host's CPU devices fixed at one, a sweep over devices=1,2 is
  refused before anything is launched or written, naming the fix."""
  env = dict(
    os.environ,
    JAX_PLATFORMS="cpu",
    XLA_FLAGS="--xla_force_host_platform_device_count=1",
  )
  result = subprocess.run(
    [
      sys.executable,
      "-m",
      "curvbench",
      "-m",
      "devices=1,2",
      "measure=training",
      "optimizer=adam",
      "problem.batch_size=8",
      f"hydra.sweep.dir={tmp_path / 'sweep'}",
      "progress=false",
    ],
    env=env,
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert result.returncode == 1, result.stderr[-2000:]
  assert "devices=2, but JAX finds 1 local CPU device" in result.stderr
  assert "nothing was launched" in result.stderr
  assert not (tmp_path / "sweep").exists()
