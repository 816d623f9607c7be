"""Configs: every option composes, the Python API and the command line build
the same config, bad values are refused when composed, and optimizer sections
are their constructors' keyword arguments."""

import inspect

import optax
import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import MissingConfigException
from omegaconf import OmegaConf

import estimators
import problems
from curvbench import app, config, curvatures, measurements, training

GROUPS = ("problem", "curvature", "optimizer", "measure")


def options(group):
  """The selectable options of a group (files starting with _ are shared
  bases, not choices)."""
  return sorted(p.stem for p in (config.CONF_DIR / group).glob("*.yaml")
                if not p.stem.startswith("_"))


def cli_config(capsys, *overrides):
  """The config the `curvbench` command composes for `overrides`."""
  capsys.readouterr()
  app.cli([*overrides, "--cfg", "job", "--resolve"])
  return OmegaConf.create(capsys.readouterr().out)


def test_every_option_composes_and_equals_the_command_line(capsys):
  for group in GROUPS:
    assert options(group), group
    for name in options(group):
      cfg = config.compose(f"{group}={name}")
      assert cfg == cli_config(capsys, f"{group}={name}"), (group, name)
  for launcher in ("basic", "joblib", "submitit_local", "submitit_slurm"):
    with initialize_config_dir(config_dir=str(config.CONF_DIR),
                               version_base=None):
      cfg = compose("config", overrides=[f"launcher={launcher}"],
                    return_hydra_config=True)
    assert launcher.split("_")[0] in cfg.hydra.launcher._target_.lower()
  for name in options("experiment"):
    with initialize_config_dir(config_dir=str(config.CONF_DIR),
                               version_base=None):
      cfg = compose("config", overrides=[f"+experiment={name}"],
                    return_hydra_config=True)
    assert cfg.name == name and cfg.hydra.sweeper.params


def test_python_api_and_command_line_build_the_same_objects(capsys):
  overrides = ("problem=convnet", "curvature=diagonal",
               "curvature.mode=fisher_exact", "problem.channels=[2,3]")
  built = []
  for cfg in (config.compose(*overrides), cli_config(capsys, *overrides)):
    problem = problems.make(cfg.problem)
    curvature = curvatures.make(measurements.section(cfg.curvature),
                                problem.loss_fn)
    built.append((problem.name, problem.batch_size, problem.num_params,
                  type(curvature), curvature.label, curvature.block_type,
                  curvature.cg_iters, curvature.max_dense_gib))
  assert built[0] == built[1]
  # 3x3 convs 1->2->3 channels, each then pooled (8x8 -> 2x2), then 12-16-10.
  assert built[0][:3] == ("convnet", 64, 20 + 57 + 208 + 170)


@pytest.mark.parametrize("override,message", [
    ("problem.name=resnet", "Unknown problem.name 'resnet'"),
    ("device=quantum", "Unknown device 'quantum'"),
    ("curvature.mode=fisher", "Unknown curvature.mode 'fisher'"),
    ("curvature.block_type=lowrank", "Unknown curvature.block_type 'lowrank'"),
    ("curvature.estimator=magic", "Unknown curvature.estimator 'magic'"),
    ("optimizer.name=lbfgs", "Unknown optimizer.name 'lbfgs'"),
    ("measure.kind=profile", "Unknown measure.kind 'profile'"),
    ("measure.spectra.precision=float16", "precision 'float16'"),
    ("measure.spectra.method=arnoldi", "Unknown measure.spectra.method"),
    ("measure.spectra.references=[gnn]", "references 'gnn'"),
    ("measure.timing.phases=[warmup]", "phases 'warmup'"),
])
def test_bad_values_are_refused_when_composed(tmp_path, override, message):
  with pytest.raises(ValueError, match=message):
    config.compose(override)
  with initialize_config_dir(config_dir=str(config.CONF_DIR),
                             version_base=None):
    unchecked = compose("config", overrides=[override])
  with pytest.raises(ValueError, match=message):  # the command line's check
    app.run(unchecked, tmp_path / "run")
  assert not (tmp_path / "run").exists()


def test_unknown_option_or_key_names_it():
  with pytest.raises(MissingConfigException, match="problem"):
    config.compose("problem=resnet")
  with pytest.raises(Exception, match="widht"):
    config.compose("problem.widht=3")


def accepts(fn, names):
  params = inspect.signature(fn).parameters
  return set(names) <= set(params), set(names) - set(params)


def test_optimizer_sections_are_keyword_arguments():
  kfac = measurements.section(config.compose("optimizer=kfac").optimizer)
  step = kfac.pop("step")
  del kfac["name"]
  assert accepts(estimators.Optimizer, kfac) == (True, set())
  assert accepts(estimators.Optimizer.step, step) == (True, set())
  for name, fn in (("sgd", optax.sgd), ("adam", optax.adam)):
    section = measurements.section(config.compose(f"optimizer={name}")
                                   .optimizer)
    del section["name"]
    assert accepts(fn, section) == (True, set())
  precond = measurements.section(
      config.compose("optimizer=preconditioned_sgd").optimizer)
  assert accepts(training.precondition_by_curvature,
                 set(precond) - {"name", "learning_rate", "momentum"}) == (
                     True, set())
