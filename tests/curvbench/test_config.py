"""Configs: every option composes, the Python API and the command line build
the same config, bad values are refused when composed, and optimizer sections
follow their constructors' keyword arguments."""

import dataclasses
import inspect
import json
import subprocess
import sys
import textwrap

import optax
import pytest
from hydra import compose, initialize_config_dir
from hydra.core.utils import setup_globals
from omegaconf import OmegaConf

import estimators
import problems
from curvbench import app, approximations, config, measurements, planning, runs
from curvbench.optimizers import OPTIMIZERS
from curvbench.optimizers.preconditioned_sgd import precondition_by_curvature

GROUPS = ("problem", "problem/data", "curvature", "optimizer", "measure")


def cli_config(capsys, *overrides):
  """The config the `curvbench` command composes for `overrides`."""
  capsys.readouterr()
  app.cli([*overrides, "--cfg", "job", "--resolve"])
  return OmegaConf.create(capsys.readouterr().out)


def unchecked(*overrides):
  """The config Hydra composes for `overrides`, before curvbench checks it."""
  config.store()
  with initialize_config_dir(
    config_dir=str(config.CONF_DIR), version_base=None
  ):
    return compose("config", overrides=list(overrides))


def _a_problem_reading(group, name):
  """For a dataset the default problem cannot read (token sequences), the
  first problem that reads it; nothing otherwise."""
  if group != "problem/data":
    return ()
  tokens = problems.DATASETS.defaults(name).tokens
  if (
    tokens
    == problems.PROBLEMS.get(config.compose().problem.name).sequence_model
  ):
    return ()
  return (
    next(
      f"problem={n}"
      for n in problems.PROBLEMS
      if problems.PROBLEMS.get(n).sequence_model == tokens
    ),
  )


@pytest.mark.slow
def test_every_option_composes_and_equals_the_command_line(capsys):
  for group in GROUPS:
    assert config.options(group), group
    for name in config.options(group):
      overrides = (*_a_problem_reading(group, name), f"{group}={name}")
      cfg = config.compose(*overrides)
      assert cfg == cli_config(capsys, *overrides), (group, name)
  for launcher in ("basic", "joblib", "submitit_local", "submitit_slurm"):
    with initialize_config_dir(
      config_dir=str(config.CONF_DIR), version_base=None
    ):
      cfg = compose(
        "config", overrides=[f"launcher={launcher}"], return_hydra_config=True
      )
    assert launcher.split("_")[0] in cfg.hydra.launcher._target_.lower()
  for name in config.options("experiment"):
    with initialize_config_dir(
      config_dir=str(config.CONF_DIR), version_base=None
    ):
      cfg = compose(
        "config", overrides=[f"+experiment={name}"], return_hydra_config=True
      )
    sweeper = cfg.hydra.sweeper
    assert cfg.name == name and (sweeper.params or sweeper.get("sweeps"))
    # The first point of each of its sweeps is allowed.
    for part in sweeper.get("sweeps") or [{}]:
      config.compose(
        f"+experiment={name}",
        *planning.union(
          config.plain(sweeper.params or {}), [config.plain(part)], []
        )[0],
      )


def test_python_api_and_command_line_build_the_same_objects(capsys):
  overrides = (
    "problem=convnet",
    "curvature=diagonal",
    "curvature.mode=fisher_exact",
    "problem.channels=[2,3]",
  )
  built = []
  for cfg in (config.compose(*overrides), cli_config(capsys, *overrides)):
    problem = problems.make(cfg.problem)
    curvature = approximations.make(
      config.plain(cfg.curvature), problem.loss_fn
    )
    built.append(
      (
        problem.name,
        problem.batch_size,
        problem.num_params,
        type(curvature),
        curvature.label,
        curvature.block_type,
        curvature.cg_iters,
        curvature.max_dense_gib,
      )
    )
  assert built[0] == built[1]
  # 3x3 convs 1->2->3 channels, each then pooled (8x8 -> 2x2), then 12-16-10.
  assert built[0][:3] == ("convnet", 64, 20 + 57 + 208 + 170)


@pytest.mark.parametrize(
  "override,message",
  [
    (
      "problem.name=vit",
      "problem.name='vit' is not allowed: these are "
      "the settings of problem mlp",
    ),
    ("device=quantum", "Unknown device 'quantum'"),
    ("curvature.mode=fisher", "Unknown curvature.mode 'fisher'"),
    ("optimizer.name=lbfgs", "optimizer.name='lbfgs' is not allowed"),
    ("measure.kind=profile", "Unknown measure.kind 'profile'"),
    ("measure.spectra.precision=float16", "precision 'float16'"),
    ("measure.spectra.method=arnoldi", "Unknown measure.spectra.method"),
    ("measure.spectra.references=[gnn]", "references 'gnn'"),
    ("measure.timing.phases=[warmup]", "phases 'warmup'"),
  ],
)
def test_bad_values_are_refused_when_composed(tmp_path, override, message):
  with pytest.raises(config.ConfigError, match=message):
    config.compose(override)
  with pytest.raises(config.ConfigError, match=message):  # the run's check
    runs.run(unchecked(override), tmp_path / "run")
  assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
  "override,message",
  [
    ("problem=vit", "Unknown problem 'vit'; choose one of .*mlp.* plugins="),
    (
      "problem.widht=3",
      r"problem mlp has no setting 'widht' \(did you mean "
      r"width\?\)",
    ),
    (
      "curvature.block_type=diagonal",
      "curvature kfac has no setting 'block_type'",
    ),
    (
      "optimizer.learnig_rate=0.5",
      r"optimizer kfac has no setting "
      r"'learnig_rate' \(did you mean learning_rate or step.learning_rate",
    ),
  ],
)
def test_unknown_option_or_key_names_it(override, message):
  with pytest.raises(config.ConfigError, match=message):
    config.compose(override)


def accepts(fn, names):
  params = inspect.signature(fn).parameters
  return set(names) <= set(params), set(names) - set(params)


def settings_of(name) -> dict:
  section = config.plain(config.compose(f"optimizer={name}").optimizer)
  del section["name"]
  return section


def test_optimizer_settings_follow_their_constructors():
  """Each optimizer's settings are its constructor's keyword arguments (SGD
  adds its momentum schedule and its weight decay); of
  estimators.Optimizer every argument is a setting or said to be set by
  the run (with why), and `step` holds arguments of Optimizer.step."""
  kfac = settings_of("kfac")
  step = kfac.pop("step")
  assert accepts(estimators.Optimizer, kfac) == (True, set())
  assert accepts(estimators.Optimizer.step, step) == (True, set())
  arguments = set(inspect.signature(estimators.Optimizer).parameters)
  elsewhere = set(OPTIMIZERS.get("kfac").set_elsewhere)
  assert arguments - set(kfac) == elsewhere - {
    "learning_rate",
    "momentum",
    "damping",
  }
  for name, fn, extra in (
    ("sgd", optax.sgd, {"momentum_schedule", "weight_decay"}),
    ("adam", optax.adam, set()),
  ):
    section = settings_of(name)
    assert set(section) - extra == set(inspect.signature(fn).parameters), name
  precond = settings_of("preconditioned_sgd")
  assert accepts(
    precondition_by_curvature, set(precond) - {"learning_rate", "momentum"}
  ) == (True, set())


# Every setting out of its type or range, or disagreeing with another one:
# (overrides, the key the error must name, words it must say).
BAD_SETTINGS = [
  (["measure.training.num_steps=0"], "measure.training.num_steps", ">= 1"),
  (["measure.training.num_steps=-5"], "measure.training.num_steps", "-5"),
  (["measure.training.num_steps=abc"], "measure.training.num_steps", "'abc'"),
  (
    ["measure.training.num_steps=2.5"],
    "measure.training.num_steps",
    "whole number",
  ),
  (
    ["measure.training.num_steps=true"],
    "measure.training.num_steps",
    "whole number",
  ),
  (["measure.training.log_every=0"], "measure.training.log_every", ">= 1"),
  (["measure.training.eval_every=0"], "measure.training.eval_every", ">= 1"),
  (
    ["measure.training.train_eval_size=0"],
    "measure.training.train_eval_size",
    "null or a whole number",
  ),
  (["measure.training.eval_size=-1"], "measure.training.eval_size", "null"),
  (
    ["measure.training.checkpoint_steps=[-1]"],
    "measure.training.checkpoint_steps",
    "non-negative",
  ),
  (["measure.spectra.top_k=0"], "measure.spectra.top_k", ">= 1"),
  (["measure.spectra.top_k=10.0"], "measure.spectra.top_k", "whole number"),
  (["measure.spectra.damping=-1"], "measure.spectra.damping", "> 0"),
  (["measure.spectra.damping=nan"], "measure.spectra.damping", "> 0"),
  (
    ["measure.spectra.lanczos_iters=0"],
    "measure.spectra.lanczos_iters",
    ">= 1",
  ),
  (["measure.spectra.slq_probes=0"], "measure.spectra.slq_probes", ">= 1"),
  (["measure.spectra.trace_probes=0"], "measure.spectra.trace_probes", ">= 1"),
  (
    ["measure.spectra.diagonal_probes=-2"],
    "measure.spectra.diagonal_probes",
    ">= 1",
  ),
  (
    ["measure.spectra.frobenius_probes=0"],
    "measure.spectra.frobenius_probes",
    ">= 1",
  ),
  (["measure.spectra.num_samples=0"], "measure.spectra.num_samples", ">= 1"),
  (["measure.spectra.cg_iters=0"], "measure.spectra.cg_iters", ">= 1"),
  (["measure.spectra.max_dense_gib=0"], "measure.spectra.max_dense_gib", "> 0"),
  (
    ["measure.spectra.relative_floor=1.5"],
    "measure.spectra.relative_floor",
    "[0, 1)",
  ),
  (
    ["measure.spectra.heatmap_blocks=-1"],
    "measure.spectra.heatmap_blocks",
    ">= 0",
  ),
  (
    ["measure.spectra.heatmap_units=0"],
    "measure.spectra.heatmap_units",
    ">= 1",
  ),
  (["measure.spectra.chunk_size=0"], "measure.spectra.chunk_size", ">= 1"),
  (
    ["measure.spectra.references=[]"],
    "measure.spectra.references",
    "at least 1",
  ),
  (["measure.spectra.steps=[]"], "measure.spectra.steps", "is empty"),
  (
    ["measure.spectra.steps=[0,500]"],
    "measure.spectra.steps",
    "beyond the training run's length",
  ),
  (["measure.spectra.data=batches:0"], "measure.spectra.data", "batches:N"),
  (
    ["measure.spectra.per_block=yes"],
    "measure.spectra.per_block",
    "true or false",
  ),
  (["measure.batch_size=0"], "measure.batch_size", ">= 1"),
  (["measure.timing.repeats=0"], "measure.timing.repeats", ">= 1"),
  (["measure.timing.warmup=-1"], "measure.timing.warmup", ">= 0"),
  (["measure.timing.damping=0"], "measure.timing.damping", "> 0"),
  (
    ["measure.timing.learning_rate=-0.1"],
    "measure.timing.learning_rate",
    "> 0",
  ),
  (
    ["measure.timing.baseline.learning_rate=0"],
    "measure.timing.baseline.learning_rate",
    "> 0",
  ),
  (
    ["measure.timing.baseline.name=sgd"],
    "measure.timing.baseline.name",
    "these are the settings of optimizer adam",
  ),
  (
    ["+measure.timing.baseline.lerning_rate=1"],
    "measure.timing.baseline.lerning_rate",
    "did you mean learning_rate",
  ),
  (
    ["optimizer=sgd", "optimizer.learning_rate=-1"],
    "optimizer.learning_rate",
    "> 0",
  ),
  (["optimizer=sgd", "optimizer.momentum=1.5"], "optimizer.momentum", "[0, 1)"),
  (
    ["optimizer=sgd", "optimizer.nesterov=2"],
    "optimizer.nesterov",
    "true or false",
  ),
  (
    ["optimizer=adam", "optimizer.learning_rate=inf"],
    "optimizer.learning_rate",
    "> 0",
  ),
  (["optimizer=adam", "optimizer.b1=1.0"], "optimizer.b1", "[0, 1)"),
  (["optimizer=adam", "optimizer.eps=-1e-8"], "optimizer.eps", ">= 0"),
  (["optimizer.initial_damping=0"], "optimizer.initial_damping", "> 0"),
  (["optimizer.curvature_ema=1.0"], "optimizer.curvature_ema", "[0, 1)"),
  (
    ["optimizer.inverse_update_period=0"],
    "optimizer.inverse_update_period",
    ">= 1",
  ),
  (
    ["optimizer.damping_adaptation_interval=0"],
    "optimizer.damping_adaptation_interval",
    ">= 1",
  ),
  (["optimizer.num_burnin_steps=-1"], "optimizer.num_burnin_steps", ">= 0"),
  (["optimizer.l2_reg=-0.1"], "optimizer.l2_reg", ">= 0"),
  (["optimizer.step.learning_rate=0"], "optimizer.step.learning_rate", "> 0"),
  (["optimizer.step.damping=-1"], "optimizer.step.damping", "> 0"),
  (
    ["optimizer=preconditioned_sgd", "optimizer.damping=-1"],
    "optimizer.damping",
    "> 0",
  ),
  (
    ["optimizer=preconditioned_sgd", "optimizer.curvature_update_period=0"],
    "optimizer.curvature_update_period",
    ">= 1",
  ),
  (["curvature.cg_iters=0"], "curvature.cg_iters", ">= 1"),
  (["curvature.max_state_gib=-1"], "curvature.max_state_gib", "> 0"),
  (["curvature.max_dense_gib=abc"], "curvature.max_dense_gib", "a number"),
  (["seed=abc"], "seed", "'abc'"),
  (["seed=-1"], "seed", "between 0 and"),
  (["init_seed=1.5"], "init_seed", "whole number"),
  (["data_seed=-3"], "data_seed", "between 0 and"),
  (["devices=0"], "devices", "positive integer"),
  (
    ["devices=2", "problem.batch_size=63"],
    "problem.batch_size=63",
    "does not split evenly across devices=2",
  ),
  (["progress=maybe"], "progress", "true or false"),
  (["force=1"], "force", "true or false"),
  (["name="], "name", "non-empty"),
  (["lock_wait_s=-1"], "lock_wait_s", ">= 0"),
  (["problem.width=0"], "problem.width", ">= 1"),
  (["problem.depth=-1"], "problem.depth", ">= 0"),
  (["problem.batch_size=0"], "problem.batch_size", ">= 1"),
  (["problem.hidden=[16,0]"], "problem.hidden", "item 0"),
  (["problem=autoencoder", "problem.code=0"], "problem.code", ">= 1"),
  (
    ["problem=autoencoder", "problem.encoder=[16,-8]"],
    "problem.encoder",
    "item -8",
  ),
  (["problem=convnet", "problem.kernel=0"], "problem.kernel", ">= 1"),
  (
    ["problem=convnet", "problem.channels=[4,8,8,8]"],
    "problem.channels",
    "at most 3 blocks",
  ),
  (["problem.activation=swish"], "problem.activation", "tanh"),
  (["problem.data.num_test=0"], "problem.data.num_test", ">= 1"),
  (
    ["problem.data.num_test=5000"],
    "problem.data.num_test=5000",
    "leaves no training examples",
  ),
  (["problem.data.seed=-1"], "problem.data.seed", "between 0 and"),
  (
    ["problem=mlp_mnist1d", "problem.data.num_samples=1"],
    "problem.data.num_samples",
    ">= 2",
  ),
  (["tuning.metric=fastest"], "tuning.metric", "final_train_error"),
  (["+tuning.grid.adam={learning_rate:[]}"], "tuning.grid", "non-empty list"),
  (
    ["+tuning.grid.lbfgs={learning_rate:[0.1]}"],
    "tuning.grid.lbfgs",
    "optimizer names",
  ),
  (["canonical.optimizer=lbfgs"], "canonical.optimizer", "kfac"),
  (
    ["+measure.training.num_step=5"],
    "measure.training.num_step",
    "Unknown setting",
  ),
  # Optimizer keys misspelt, ignored, or set elsewhere.
  (
    ["optimizer=preconditioned_sgd", "+optimizer.learnig_rate=0.5"],
    "optimizer.learnig_rate",
    "did you mean learning_rate",
  ),
  (
    ["optimizer=adam", "optimizer.learnig_rate=0.5"],
    "optimizer.learnig_rate",
    "did you mean learning_rate",
  ),
  (
    ["+optimizer.inverse_update_priod=5"],
    "optimizer.inverse_update_priod",
    "did you mean inverse_update_period",
  ),
  (
    ["+optimizer.step.dampin=0.1"],
    "optimizer.step.dampin",
    "did you mean damping",
  ),
  (
    ["optimizer.step.learning_rate=0.1"],
    "optimizer.step.learning_rate",
    "is ignored: use_adaptive_learning_rate=true",
  ),
  (
    ["optimizer.use_adaptive_damping=false", "optimizer.initial_damping=1"],
    "optimizer.initial_damping",
    "is ignored: use_adaptive_damping=false",
  ),
  (
    ["+optimizer.estimation_mode=fisher_exact"],
    "optimizer.estimation_mode",
    "curvature.mode sets",
  ),
  (
    ["optimizer.norm_constraint=1"],
    "optimizer.norm_constraint",
    "cannot be used with optimizer.use_adaptive_learning_rate=true",
  ),
  (
    ["optimizer.damping_lower_threshold=0.8"],
    "optimizer.damping_lower_threshold",
    "must be below",
  ),
  (
    ["optimizer.patterns_to_skip=[dense]"],
    "optimizer.patterns_to_skip",
    "dense_with_bias",
  ),
  (
    ["+tuning.grid.adam={lerning_rate:[0.1]}"],
    "tuning.grid.adam.lerning_rate",
    "did you mean learning_rate",
  ),
  (
    ["+tuning.grid.kfac={step:{learning_rate:[0.1]}}"],
    "tuning.grid.kfac.step.learning_rate",
    "is ignored",
  ),
  (["+tuning.grid.sgd={momentum:[1.5]}"], "tuning.grid.sgd.momentum", "[0, 1)"),
  # Agreements with the data and values that were silently changed.
  (
    ["measure.batch_size=100000"],
    "measure.batch_size",
    "more than the 1500 training examples",
  ),
  (
    ["measure.spectra.data=batches:100000"],
    "measure.spectra.data",
    "asks for 100000 batches of 64",
  ),
  (
    ["problem.batch_size=5000"],
    "problem.batch_size",
    "more than the 1500 training examples",
  ),
  (
    ["measure.training.train_eval_size=100000"],
    "measure.training.train_eval_size",
    "more than the 1500 training",
  ),
  (
    ["measure.spectra.steps=[2.9]"],
    "measure.spectra.steps",
    "list of integers",
  ),
  (
    ["measure.spectra.steps=[true]"],
    "measure.spectra.steps",
    "list of integers",
  ),
  (
    ["measure.training.checkpoint_steps=[1.5]"],
    "measure.training.checkpoint_steps",
    "list of integers",
  ),
  (
    ["optimizer.damping_adaptation_decay=nan"],
    "optimizer.damping_adaptation_decay",
    "(0, 1)",
  ),
  (["name=../../escaped"], "name", "folder name"),
]


@pytest.mark.parametrize(
  "overrides,key,words",
  BAD_SETTINGS,
  ids=[" ".join(o) for o, _, _ in BAD_SETTINGS],
)
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
NOT_ECHOED = (
  "",
  "[]",
  "true",
  "-1e-8",
  "nan",
  "inf",
  "[0,500]",
  "{learning_rate:[]}",
  "{learning_rate:[0.1]}",
  "fisher_exact",
  "{lerning_rate:[0.1]}",
  "{step:{learning_rate:[0.1]}}",
  "{momentum:[1.5]}",
  "[dense]",
  "[true]",
  "batches:100000",
)


@pytest.mark.parametrize(
  "override",
  [
    "measure.training.num_steps=0",
    "seed=-1",
    "problem.width=0",
    "measure.spectra.top_k=0",
  ],
)
def test_a_run_refuses_before_building_anything(
  tmp_path, override, monkeypatch
):
  monkeypatch.setattr(problems, "make", pytest.fail)  # nothing is built
  with pytest.raises(config.ConfigError, match=override.split("=")[0]):
    runs.run(unchecked(override), tmp_path / "run")
  assert not (tmp_path / "run").exists()


REFUSED_COMMANDS = [
  ["+optimizer.learnig_rate=0.5"],
  ["measure.training.num_steps=abc"],
  ["optimizer.step.learning_rate=0.1"],
  ["force=1"],
  ["seed=-1"],
  ["-m", "seed=0,1", "+optimizer.learnig_rate=0.5"],
  ["-m", "optimizer=sgd,adam", "optimizer.momentum=0.5"],
  ["-m", "measure=training", "+tuning.grid.adam={lerning_rate:[0.1]}"],
  ["-m", "force=0,1"],
]


@pytest.mark.slow
def test_the_command_refuses_with_the_message_alone(tmp_path):
  """Refused on the command line, or for any point of a sweep, before
  Hydra writes a run or sweep directory: the message alone, exit status 1.
  (One process for all: Hydra's sweeps log to the streams it was started
  with, which pytest closes between tests.)"""
  script = textwrap.dedent(f"""
      import json, sys
      from curvbench import app
      out = []
      for i, argv in enumerate({REFUSED_COMMANDS!r}):
        where = "hydra.sweep.dir" if "-m" in argv else "hydra.run.dir"
        try:
          app.cli([*argv, f"{{where}}={tmp_path}/out{{i}}", "progress=false"])
          out.append(None)
        except SystemExit as e:
          out.append(str(e.code))
      print(json.dumps(out))""")
  result = subprocess.run(
    [sys.executable, "-c", script], capture_output=True, text=True, check=True
  )
  messages = json.loads(result.stdout.strip().splitlines()[-1])
  for argv, message in zip(REFUSED_COMMANDS, messages):
    assert message and message.startswith("curvbench: "), (argv, message)
  assert "Traceback" not in result.stderr, result.stderr
  assert not list(tmp_path.iterdir())  # no run or sweep directory


def test_every_setting_is_declared_with_a_check_and_a_doc():
  """Every field of the run's settings and of every registered component
  (nested settings included) says what it may hold and what it does."""
  classes = [config.RunSettings, measurements.schema()]
  classes += [r.get(n) for r in config.REGISTRIES for n in r]
  seen = set()
  while classes:
    cls = classes.pop()
    if cls in seen:
      continue
    seen.add(cls)
    nested = cls.nested()
    classes += list(nested.values())
    for f in dataclasses.fields(cls):
      if (
        f.name in nested
        or f.name == "name"
        or f.name in {m for m in measurements.MEASUREMENTS}
      ):
        continue
      assert f.metadata.get("check") is not None, (cls, f.name)
      assert f.metadata.get("doc"), (cls, f.name)


def test_single_runs_in_the_same_second_get_their_own_directories():
  config.register_resolvers()
  config.store()
  composed = []
  for _ in range(2):
    with initialize_config_dir(
      config_dir=str(config.CONF_DIR), version_base=None
    ):
      composed.append(compose("config", return_hydra_config=True))
  OmegaConf.register_new_resolver(
    "now", lambda pattern: "2026-01-01_00-00-00", use_cache=True, replace=True
  )
  try:
    dirs = [cfg.hydra.run.dir for cfg in composed]
    assert dirs[0] != dirs[1]
    assert all(
      d.startswith("reports/default/single/2026-01-01_00-00-00_") for d in dirs
    )
    assert [cfg.hydra.run.dir for cfg in composed] == dirs  # fixed once read
  finally:
    setup_globals()  # Hydra's own `now` again


@pytest.mark.slow
def test_the_python_api_composes_from_any_directory(tmp_path):
  """Outside the repository (its root not on the path, the package found
  through the install) `config.compose` knows the sweeper's config, as the
  README's Python example needs, with nothing registered by hand."""
  script = (
    "from curvbench import config; "
    "cfg = config.compose('+experiment=quick', with_hydra=True); "
    "print(cfg.hydra.sweeper._target_)"
  )
  result = subprocess.run(
    [sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True
  )
  assert result.returncode == 0, result.stderr[-2000:]
  assert result.stdout.split()[-1].endswith("tuning_sweeper.TuningSweeper")
