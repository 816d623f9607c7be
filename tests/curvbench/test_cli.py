"""The command's help: read off the sources without JAX, and in step with
the registries and presets it describes."""

import dataclasses
import re
import subprocess
import sys

import pytest

from curvbench import cli, config


def test_help_lists_every_option_the_config_groups_have():
  listed = cli.options()
  assert set(listed) == set(cli.GROUPS)
  for group, options in listed.items():
    known = set(config.options(group))
    if group == "experiment":  # other sizes: under --help experiment
      assert set(options) <= known
      assert all(
        re.fullmatch(r"repro_\w+_[a-z]+", name) for name in known - set(options)
      ), known - set(options)
    else:
      assert set(options) == known, group
    assert all(text for text in options.values()), group  # a line each


def test_help_prints_without_importing_jax_or_hydra():
  code = (
    "import sys; from curvbench import cli; cli.main(['--help']); "
    "heavy = {'jax', 'hydra', 'haiku', 'pandas'} & set(sys.modules); "
    "assert not heavy, heavy"
  )
  done = subprocess.run(
    [sys.executable, "-c", code], capture_output=True, text=True, check=False
  )
  assert done.returncode == 0, done.stderr
  assert "curvbench report SWEEP_DIR" in done.stdout
  assert "curvbench --help GROUP" in done.stdout
  assert "repro_martens2015_kfac" in done.stdout


def test_help_piped_into_a_reader_that_stops_early_is_no_error():
  code = "from curvbench import cli; cli.main(['--help', 'optimizer'])"
  done = subprocess.run(
    f'{sys.executable} -c "{code}" | head -1',
    shell=True,
    capture_output=True,
    text=True,
    check=False,
  )
  assert done.stdout.startswith("optimizer"), done.stdout
  assert "Traceback" not in done.stderr, done.stderr


def test_group_help_shows_every_setting_with_its_default_and_doc():
  text = cli.group_help("optimizer")
  for name in config.options("optimizer"):
    cls = config.OPTIMIZERS.get(name)
    assert f"\n{name}: " in text
    for field in dataclasses.fields(cls):
      if "check" in field.metadata:
        assert f"{field.name} = " in text, (name, field.name)
        assert field.metadata["doc"] in text, (name, field.name)
  assert "a preset, conf/problem/autoencoder_curves.yaml" in cli.group_help(
    "problem"
  )
  with pytest.raises(SystemExit, match="no config group 'optimiser'"):
    cli.group_help("optimiser")
