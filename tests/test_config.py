"""Configs: every option composes, the Python API and the command line build
the same config, bad values are refused when composed, and optimizer sections
are their constructors' keyword arguments."""

import inspect

import optax
import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import MissingConfigException
from hydra.core.utils import setup_globals
from omegaconf import OmegaConf

import estimators
import problems
from curvbench import app, config, curvatures, measurements, provenance
from curvbench import training

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


# Every setting out of its type or range, or disagreeing with another one:
# (overrides, the key the error must name, words it must say).
BAD_SETTINGS = [
    (["measure.training.num_steps=0"], "measure.training.num_steps", ">= 1"),
    (["measure.training.num_steps=-5"], "measure.training.num_steps", "-5"),
    (["measure.training.num_steps=abc"], "measure.training.num_steps",
     "'abc'"),
    (["measure.training.num_steps=2.5"], "measure.training.num_steps",
     "whole number"),
    (["measure.training.num_steps=true"], "measure.training.num_steps",
     "whole number"),
    (["measure.training.log_every=0"], "measure.training.log_every", ">= 1"),
    (["measure.training.eval_every=0"], "measure.training.eval_every", ">= 1"),
    (["measure.training.train_eval_size=0"],
     "measure.training.train_eval_size", "null or a whole number"),
    (["measure.training.eval_size=-1"], "measure.training.eval_size", "null"),
    (["measure.training.checkpoint_steps=[-1]"],
     "measure.training.checkpoint_steps", "non-negative"),
    (["measure.spectra.top_k=0"], "measure.spectra.top_k", ">= 1"),
    (["measure.spectra.top_k=10.0"], "measure.spectra.top_k", "whole number"),
    (["measure.spectra.damping=-1"], "measure.spectra.damping", "> 0"),
    (["measure.spectra.damping=nan"], "measure.spectra.damping", "> 0"),
    (["measure.spectra.lanczos_iters=0"], "measure.spectra.lanczos_iters",
     ">= 1"),
    (["measure.spectra.slq_probes=0"], "measure.spectra.slq_probes", ">= 1"),
    (["measure.spectra.trace_probes=0"], "measure.spectra.trace_probes",
     ">= 1"),
    (["measure.spectra.diagonal_probes=-2"],
     "measure.spectra.diagonal_probes", ">= 1"),
    (["measure.spectra.frobenius_probes=0"],
     "measure.spectra.frobenius_probes", ">= 1"),
    (["measure.spectra.num_samples=0"], "measure.spectra.num_samples", ">= 1"),
    (["measure.spectra.cg_iters=0"], "measure.spectra.cg_iters", ">= 1"),
    (["measure.spectra.max_dense_gib=0"], "measure.spectra.max_dense_gib",
     "> 0"),
    (["measure.spectra.relative_floor=1.5"], "measure.spectra.relative_floor",
     "[0, 1)"),
    (["measure.spectra.heatmap_blocks=-1"], "measure.spectra.heatmap_blocks",
     ">= 0"),
    (["measure.spectra.heatmap_units=0"], "measure.spectra.heatmap_units",
     ">= 1"),
    (["measure.spectra.chunk_size=0"], "measure.spectra.chunk_size", ">= 1"),
    (["measure.spectra.references=[]"], "measure.spectra.references",
     "at least 1"),
    (["measure.spectra.steps=[]"], "measure.spectra.steps", "is empty"),
    (["measure.spectra.steps=[0,500]"], "measure.spectra.steps",
     "beyond the training run's length"),
    (["measure.spectra.data=batches:0"], "measure.spectra.data", "batches:N"),
    (["measure.spectra.per_block=yes"], "measure.spectra.per_block",
     "true or false"),
    (["measure.batch_size=0"], "measure.batch_size", ">= 1"),
    (["measure.timing.repeats=0"], "measure.timing.repeats", ">= 1"),
    (["measure.timing.warmup=-1"], "measure.timing.warmup", ">= 0"),
    (["measure.timing.damping=0"], "measure.timing.damping", "> 0"),
    (["measure.timing.learning_rate=-0.1"], "measure.timing.learning_rate",
     "> 0"),
    (["measure.timing.baseline.learning_rate=0"],
     "measure.timing.baseline.learning_rate", "> 0"),
    (["measure.timing.baseline.name=sgd"], "measure.timing.baseline",
     "times adam"),
    (["optimizer=sgd", "optimizer.learning_rate=-1"], "optimizer.learning_rate",
     "> 0"),
    (["optimizer=sgd", "optimizer.momentum=1.5"], "optimizer.momentum",
     "[0, 1)"),
    (["optimizer=sgd", "optimizer.nesterov=2"], "optimizer.nesterov",
     "true or false"),
    (["optimizer=adam", "optimizer.learning_rate=inf"],
     "optimizer.learning_rate", "> 0"),
    (["optimizer=adam", "optimizer.b1=1.0"], "optimizer.b1", "[0, 1)"),
    (["optimizer=adam", "optimizer.eps=-1e-8"], "optimizer.eps", ">= 0"),
    (["optimizer.initial_damping=0"], "optimizer.initial_damping", "> 0"),
    (["optimizer.curvature_ema=1.0"], "optimizer.curvature_ema", "[0, 1)"),
    (["optimizer.inverse_update_period=0"], "optimizer.inverse_update_period",
     ">= 1"),
    (["optimizer.damping_adaptation_interval=0"],
     "optimizer.damping_adaptation_interval", ">= 1"),
    (["optimizer.num_burnin_steps=-1"], "optimizer.num_burnin_steps", ">= 0"),
    (["optimizer.l2_reg=-0.1"], "optimizer.l2_reg", ">= 0"),
    (["optimizer.step.learning_rate=0"], "optimizer.step.learning_rate",
     "> 0"),
    (["optimizer.step.damping=-1"], "optimizer.step.damping", "> 0"),
    (["optimizer=preconditioned_sgd", "optimizer.damping=-1"],
     "optimizer.damping", "> 0"),
    (["optimizer=preconditioned_sgd", "optimizer.curvature_update_period=0"],
     "optimizer.curvature_update_period", ">= 1"),
    (["curvature.cg_iters=0"], "curvature.cg_iters", ">= 1"),
    (["curvature.max_state_gib=-1"], "curvature.max_state_gib", "> 0"),
    (["curvature.max_dense_gib=abc"], "curvature.max_dense_gib", "a number"),
    (["seed=abc"], "seed", "'abc'"),
    (["seed=-1"], "seed", "between 0 and"),
    (["init_seed=1.5"], "init_seed", "whole number"),
    (["data_seed=-3"], "data_seed", "between 0 and"),
    (["devices=0"], "devices", "positive integer"),
    (["devices=2", "problem.batch_size=63"], "problem.batch_size=63",
     "does not split evenly across devices=2"),
    (["progress=maybe"], "progress", "true or false"),
    (["force=1"], "force", "true or false"),
    (["name="], "name", "non-empty"),
    (["lock_wait_s=-1"], "lock_wait_s", ">= 0"),
    (["problem.width=0"], "problem.width", ">= 1"),
    (["problem.depth=-1"], "problem.depth", ">= 0"),
    (["problem.batch_size=0"], "problem.batch_size", ">= 1"),
    (["problem.hidden=[16,0]"], "problem.hidden", "item 0"),
    (["problem=autoencoder", "problem.code=0"], "problem.code", ">= 1"),
    (["problem=autoencoder", "problem.encoder=[16,-8]"], "problem.encoder",
     "item -8"),
    (["problem=convnet", "problem.kernel=0"], "problem.kernel", ">= 1"),
    (["problem=convnet", "problem.channels=[4,8,8,8]"], "problem.channels",
     "at most 3 blocks"),
    (["problem.activation=swish"], "problem.activation", "tanh"),
    (["problem.data.num_test=0"], "problem.data.num_test", ">= 1"),
    (["problem.data.num_test=5000"], "problem.data.num_test=5000",
     "leaves no training examples"),
    (["problem.data.seed=-1"], "problem.data.seed", "between 0 and"),
    (["problem=mlp_mnist1d", "problem.data.num_samples=1"],
     "problem.data.num_samples", ">= 2"),
    (["tuning.metric=fastest"], "tuning.metric", "final_train_error"),
    (["+tuning.grid.adam={learning_rate:[]}"], "tuning.grid",
     "non-empty list"),
    (["+tuning.grid.lbfgs={learning_rate:[0.1]}"], "tuning.grid.lbfgs",
     "optimizer names"),
    (["canonical.optimizer=lbfgs"], "canonical.optimizer", "kfac"),
    (["+measure.training.num_step=5"], "measure.training.num_step",
     "Unknown setting"),
]


@pytest.mark.parametrize("overrides,key,words", BAD_SETTINGS,
                         ids=[" ".join(o) for o, _, _ in BAD_SETTINGS])
def test_every_bad_setting_is_refused_by_name(overrides, key, words):
  with pytest.raises(config.ConfigError) as refused:
    config.compose(*overrides)
  message = str(refused.value)
  assert key in message and words in message, message
  value = overrides[-1].partition("=")[2]
  if value not in NOT_ECHOED:  # as Hydra parsed it: 1e-8 comes back 1e-08
    assert value.replace(" ", "") in message.replace(" ", ""), message


# Values that come back parsed (true, nan, 1e-8 as 1e-08), or whose
# message names the offending part only.
NOT_ECHOED = ("", "[]", "true", "-1e-8", "nan", "inf", "[0,500]",
              "{learning_rate:[]}", "{learning_rate:[0.1]}")


@pytest.mark.parametrize("override", [
    "measure.training.num_steps=0", "seed=abc", "problem.width=0",
    "measure.spectra.top_k=0"])
def test_the_command_refuses_before_building_anything(tmp_path, override,
                                                      monkeypatch):
  with initialize_config_dir(config_dir=str(config.CONF_DIR),
                             version_base=None):
    unchecked = compose("config", overrides=[override])
  monkeypatch.setattr(problems, "make", pytest.fail)  # nothing is built
  with pytest.raises(config.ConfigError, match=override.split("=")[0]):
    app.run(unchecked, tmp_path / "run")
  assert not (tmp_path / "run").exists()


def test_every_setting_in_conf_has_a_rule():
  """Each key of each option and experiment has a type and range; a new
  key without one fails here (optimizer keys would otherwise pass)."""
  overrides = [f"{group}={name}" for group in GROUPS for name in options(group)]
  overrides += [f"+experiment={name}" for name in options("experiment")]
  for override in overrides:
    keys = provenance.flatten(config.compose(override))
    missing = [k for k in keys if k not in config.SETTINGS
               and not k.startswith("tuning.grid.")]
    assert not missing, (override, missing)


def test_single_runs_in_the_same_second_get_their_own_directories():
  config.register_resolvers()
  runs = []
  for _ in range(2):
    with initialize_config_dir(config_dir=str(config.CONF_DIR),
                               version_base=None):
      runs.append(compose("config", return_hydra_config=True))
  OmegaConf.register_new_resolver("now", lambda pattern: "2026-01-01_00-00-00",
                                  use_cache=True, replace=True)
  try:
    dirs = [cfg.hydra.run.dir for cfg in runs]
    assert dirs[0] != dirs[1]
    assert all(d.startswith("reports/default/single/2026-01-01_00-00-00_")
               for d in dirs)
    assert [cfg.hydra.run.dir for cfg in runs] == dirs  # fixed once read
  finally:
    setup_globals()  # Hydra's own `now` again
