"""Models whose apply returns more than the logits (a tuple, a dict, a
dataclass), with the `output` setting naming the loss's input: the same
loss, gradient and K-FAC curvature as the model returning the logits alone
(float64), a run end to end, and refusals, before any loss is registered,
that name what apply returned and the setting to give."""

import collections
import dataclasses

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import curvbench
import estimators as kfac
import problems
from problems import checks
from problems.data import Dataset
from problems.model_outputs import OutputError
from tests import groundtruth as gt
from tests.conftest import SHORT, two_layer_init


def _init(rng, x):
  return two_layer_init(rng, x, outputs=3)


def _forward(p, x):
  """The logits and the hidden features, which models often return too."""
  hidden = jnp.tanh(x @ p["w1"] + p["b1"])
  return hidden @ p["w2"] + p["b2"], hidden


@dataclasses.dataclass
class Plain:  # a dataclass that is no pytree: only its logits leave apply
  logits: jax.Array
  hidden: jax.Array


@flax.struct.dataclass
class Struct:  # Flax's dataclass, a pytree
  logits: jax.Array
  hidden: jax.Array


Named = collections.namedtuple("Named", ["hidden", "logits"])

# How frameworks' models return their logits, and the setting naming them.
RETURNS = {
  "tuple": (lambda p, x: _forward(p, x), 0),
  "list": (lambda p, x: list(_forward(p, x))[::-1], -1),
  "dict": (
    lambda p, x: dict(zip(("logits", "hidden"), _forward(p, x))),
    "logits",
  ),
  "dataclass": (lambda p, x: Plain(*_forward(p, x)), "logits"),
  "flax struct": (lambda p, x: Struct(*_forward(p, x)), "logits"),
  "named tuple": (lambda p, x: Named(*_forward(p, x)[::-1]), "logits"),
  "nested": (
    lambda p, x: ({"out": Plain(*_forward(p, x))}, {"state": 1}),
    (0, "out", "logits"),
  ),
}


def _data(n=60):
  rng = np.random.default_rng(0)
  return curvbench.Data(rng.normal(size=(n, 4)), rng.integers(0, 3, n))


def _problem(name, model, forget):
  forget.append(name)
  curvbench.register_model(name, model, _data())
  return problems.make({"name": name})


def _kfac_ggn(problem, params, batch):
  """K-FAC's dense matrix in ggn_exact mode on `batch`, and its blocks."""
  estimator = kfac.BlockDiagonalCurvature(problem.loss_fn)
  dense = gt.one_batch_dense(estimator, (params, batch), len(batch[0]))
  return np.asarray(dense), estimator.blocks


@pytest.mark.parametrize("kind", list(RETURNS))
def test_the_named_output_gives_the_curvature_of_the_logits_alone(kind, forget):
  apply, output = RETURNS[kind]
  plain = _problem(
    "logits_only",
    curvbench.Model(lambda p, x: _forward(p, x)[0], init=_init),
    forget,
  )
  framed = _problem(
    "framed", curvbench.Model(apply, init=_init, output=output), forget
  )
  params = plain.init_params(jax.random.PRNGKey(0), jnp.float64)
  batch = plain.fixed_batch(dtype=np.float64)
  assert batch[0].dtype == np.float64
  loss, grad = jax.value_and_grad(plain.loss_fn)(params, batch)
  got_loss, got_grad = jax.value_and_grad(framed.loss_fn)(params, batch)
  np.testing.assert_allclose(got_loss, loss, rtol=1e-13)
  for name in params:
    np.testing.assert_allclose(got_grad[name], grad[name], rtol=1e-12)
  want, blocks = _kfac_ggn(plain, params, batch)
  got, got_blocks = _kfac_ggn(framed, params, batch)
  assert [type(b) for b in got_blocks] == [type(b) for b in blocks]
  assert len(blocks) == 2 and all(
    isinstance(b, kfac.DenseTwoKroneckerFactored) for b in blocks
  )
  np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-15)
  assert np.abs(want).max() > 1e-3  # a curvature, not zeros


def test_a_model_returning_a_tuple_trains_and_is_measured(tmp_path, forget):
  forget.append("with_aux")
  apply, output = RETURNS["tuple"]
  results = curvbench.measure(
    curvbench.Model(apply, init=_init, output=output),
    _data(300),  # 60 held out, over the training measurement's eval_size
    name="with_aux",
    out=tmp_path / "sweep",
    approximations=["kfac"],
    measurements=["spectra", "training"],
    optimizers=["kfac"],
    batch_size=16,
    settings=SHORT,
  )
  assert set(results.runs.status) == {"complete"}, results.runs.status
  assert len(results.runs) == 2  # spectra and training
  quality = results.tables["quality"]
  assert set(quality.problem) == {"with_aux"}
  assert np.isfinite(quality.value).all() and len(quality)
  train = results.tables["training"]
  assert train.step.max() == 4  # SHORT's measure.training.num_steps
  losses = train.dropna(subset=["train_loss"]).sort_values("step").train_loss
  assert np.isfinite(losses).all() and losses.iloc[-1] < losses.iloc[0]


def test_the_output_setting_is_part_of_the_models_identity():
  both = lambda p, x: (_forward(p, x)[0], _forward(p, x)[0] * 2)
  x = np.zeros((2, 4), np.float32)
  first = curvbench.Model(both, init=_init, output=0).fingerprint(x)
  second = curvbench.Model(both, init=_init, output=1).fingerprint(x)
  assert first != second


# What apply returns, the setting, and the message that refuses them.
REFUSED = {
  "a tuple, unnamed": (
    RETURNS["tuple"][0],
    None,
    r"apply returned a tuple of 2 \(float\d+\[1, 3\], float\d+\[1, 6\]\), "
    r"not one array: .*`output` setting: curvbench.Model\(apply, \.\.\., "
    r"output=\.\.\.\).*picked by output=0 \(float\d+\[1, 3\]\), output=1",
  ),
  "a dict, unnamed": (
    RETURNS["dict"][0],
    None,
    r"apply returned a dict \{'logits': float\d+\[1, 3\], 'hidden'.* "
    r"output='logits'",
  ),
  "a dataclass, unnamed": (
    RETURNS["dataclass"][0],
    None,
    r"apply returned a Plain\(logits=float\d+\[1, 3\], hidden=.* "
    r"output='logits'",
  ),
  "an index past the tuple": (
    RETURNS["tuple"][0],
    2,
    r"output=2: apply's outputs are a tuple of 2, which has no index 2: "
    r"give one of 0..1",
  ),
  "a key the dict lacks": (
    RETURNS["dict"][0],
    "logit",
    r"output='logit': apply's outputs are a dict without key 'logit'; "
    r"give one of its keys \('logits', 'hidden'\)",
  ),
  "a field the dataclass lacks": (
    RETURNS["dataclass"][0],
    "logit",
    r"no attribute 'logit': give one of its fields \('logits', 'hidden'\)",
  ),
  "a name into a tuple": (
    RETURNS["tuple"][0],
    "logits",
    r"no attribute 'logits': give an index, 0..1",
  ),
  "an index into a dataclass": (
    RETURNS["dataclass"][0],
    0,
    r"which an index does not pick from: give a name, one of 'logits'",
  ),
  "a part that is no array": (
    RETURNS["nested"][0],
    0,
    r"output=0 picks a dict \{'out': a Plain\(logits=.*not an array; its "
    r"arrays are picked by output=\(0, 'out', 'logits'\)",
  ),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_outputs_not_named_are_refused_before_registration(case, forget):
  apply, output, message = REFUSED[case]
  forget.append("refused")
  with pytest.raises(OutputError, match=message):
    curvbench.register_model(
      "refused", curvbench.Model(apply, init=_init, output=output), _data()
    )
  assert "refused" not in problems.PROBLEMS


@pytest.mark.parametrize("output", [1.5, True, (), ("logits", None)])
def test_an_output_setting_of_the_wrong_type_is_refused(output):
  with pytest.raises(OutputError, match=r"names no part of the model's"):
    curvbench.Model(RETURNS["tuple"][0], init=_init, output=output)


def test_a_problem_of_your_own_names_the_setting_of_its_network():
  """The plugin path that writes its own problem: `problems.Network`."""
  x = np.random.default_rng(0).normal(size=(8, 4)).astype(np.float32)
  y = np.arange(8, dtype=np.int32) % 3
  settings = dataclasses.replace(
    problems.PROBLEMS.defaults("mlp"), batch_size=4
  )
  data = Dataset("arrays", x, y, x, y, num_classes=3)

  def build(output):
    return problems.Problem.from_functions(
      problems.Network(_init, RETURNS["dict"][0], output),
      data,
      settings,
      task="classification",
      loss_name="softmax_cross_entropy",
    )

  with pytest.raises(OutputError, match=r"problems.Network\(init, apply, "):
    checks.check_problem(build(None))
  checks.check_problem(build("logits"))  # accepted
  params = build("logits").init_params(jax.random.PRNGKey(0))
  np.testing.assert_array_equal(
    build("logits").outputs(params, x), _forward(params, x)[0]
  )
