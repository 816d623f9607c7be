"""`estimators` offers every public name and signature of KFAC-JAX 0.0.8.

The facts (names, parameter names, order and literal defaults) are in
kfac_jax_api.json, written by benchmarks/kfac_jax/api_facts.py from the
released package; nothing of its code is used here.
"""

import functools
import inspect
import json
import math
import pathlib

import pytest

import estimators

FACTS = json.loads(
  (pathlib.Path(__file__).with_name("kfac_jax_api.json")).read_text()
)
MODULES = FACTS["modules"]


def our_module(sub):
  return estimators if sub == "" else getattr(estimators, sub)


def parse(parameter):
  """`name=default` as (name, kind, default or a marker)."""
  name, _, default = parameter.partition("=")
  kind = "var" if name.startswith("*") else "named"
  return (
    name.lstrip("*"),
    kind,
    json.loads(default) if default else inspect.Parameter.empty,
  )


def literal(value):
  if value is None or isinstance(value, (bool, int, float, str)):
    return value
  if isinstance(value, tuple) and all(literal(v) == v for v in value):
    return list(value)
  return "<object>"


def same_default(a, b):
  nan = lambda v: isinstance(v, float) and math.isnan(v)
  return a == b or (nan(a) and nan(b))


def signature_differences(theirs, ours):
  """What code written for their signature would find different in ours."""
  try:
    params = list(inspect.signature(ours).parameters.values())
  except (TypeError, ValueError):
    return ["has no signature"]
  by_name = {p.name: p for p in params}
  takes_kwargs = any(p.kind is p.VAR_KEYWORD for p in params)
  differences = []
  positional = [
    p.name
    for p in params
    if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
  ]
  their_positional, keyword_only = [], False
  for row in theirs:
    if row == "*":
      keyword_only = True
      continue
    name, kind, default = parse(row)
    if kind == "var":
      star = "**" if row.startswith("**") else "*"
      want = (
        inspect.Parameter.VAR_KEYWORD
        if star == "**"
        else inspect.Parameter.VAR_POSITIONAL
      )
      if not any(p.kind is want for p in params):
        differences.append(f"takes no {row}")
      keyword_only = True
      continue
    if not keyword_only:
      their_positional.append(name)
    mine = by_name.get(name)
    if mine is None:
      if not takes_kwargs or default is inspect.Parameter.empty:
        differences.append(f"lacks `{name}`")
      else:
        differences.append(f"lacks `{name}` (swallowed by **kwargs)")
      continue
    ours_default = (
      inspect.Parameter.empty
      if mine.default is inspect.Parameter.empty
      else literal(mine.default)
    )
    # A default where 0.0.8 has none, or one that is not a literal there,
    # changes nothing for code that passes the argument.
    optional_here = ours_default is not inspect.Parameter.empty
    if not same_default(default, ours_default) and not (
      optional_here
      and (default is inspect.Parameter.empty or default == "<object>")
    ):
      differences.append(
        f"`{name}` defaults to {ours_default!r}, 0.0.8: {default!r}"
      )
  if positional[: len(their_positional)] != their_positional:
    differences.append(
      f"positional order {positional[: len(their_positional)]}, 0.0.8: {their_positional}"
    )
  for p in params:
    their_names = {parse(r)[0] for r in theirs if r != "*"}
    if (
      p.name not in their_names
      and p.default is inspect.Parameter.empty
      and p.kind
      in (
        p.POSITIONAL_OR_KEYWORD,
        p.KEYWORD_ONLY,
      )
    ):
      differences.append(f"requires `{p.name}`, which 0.0.8 does not take")
  return differences


def classes_with_a_place():
  """Each class of the release, with the first (module, name) offering it."""
  seen = {}
  for sub, rows in sorted(MODULES.items()):
    for name, facts in rows.items():
      if "class" in facts:
        seen.setdefault(facts["class"], (sub, name))
  return seen


@functools.cache
def differences() -> dict[str, tuple[str, ...]]:
  """What code written for 0.0.8 finds different, by place: `module.name`
  for a name and its signature, `module.Class.member` for a class's
  members (`module` is "" for the package)."""
  found: dict[str, list[str]] = {}
  for sub, rows in MODULES.items():
    module = our_module(sub)
    for name, facts in rows.items():
      place = f"{sub}.{name}"
      if not hasattr(module, name):
        found.setdefault(place, []).append("missing")
        continue
      theirs = facts.get("signature")
      if "class" in facts:
        theirs = FACTS["classes"][facts["class"]]["signature"]
      if theirs is not None:
        for text in signature_differences(theirs, getattr(module, name)):
          found.setdefault(place, []).append(text)
  for key, (sub, name) in classes_with_a_place().items():
    ours = getattr(our_module(sub), name, None)
    if ours is None:
      continue  # the class itself is reported missing
    for member, facts in FACTS["classes"][key]["members"].items():
      place = f"{sub}.{name}.{member}"
      if member == "__init__":
        continue
      if not hasattr(ours, member):
        found.setdefault(place, []).append(f"lacks {facts['kind']}")
      elif facts.get("signature") is not None:
        texts = signature_differences(facts["signature"], getattr(ours, member))
        if texts:
          found.setdefault(place, []).extend(texts)
  return {place: tuple(texts) for place, texts in found.items()}


@pytest.mark.parametrize(
  "sub", sorted(MODULES), ids=lambda s: s or "estimators"
)
def test_every_difference_from_the_release_is_a_known_gap(sub):
  """Every public name of the module exists with the release's arguments
  (names, positional order, literal defaults), or is a gap listed, with its
  reason, in KNOWN_GAPS."""
  unexpected = [
    f"{place}: {text}"
    for place, texts in differences().items()
    if place.split(".")[0] == sub and gap_reason(place) is None
    for text in texts
  ]
  assert not unexpected, "\n".join(unexpected)


def test_every_known_gap_is_still_one():
  """A gap closed is taken off the list."""
  closed = [
    key
    for key in KNOWN_GAPS
    if not any(place_matches(place, key) for place in differences())
  ]
  assert not closed, f"no longer different from 0.0.8: {closed}"


def place_matches(place, key):
  return place == key or place.startswith(key + ".")


def gap_reason(place):
  return next(
    (why for key, why in KNOWN_GAPS.items() if place_matches(place, key)), None
  )


# Where `estimators` still differs from 0.0.8, by place (a key covers a
# class's members too), with the reason; docs/reference/porting.md says the
# same.
_REASONS = {
  "matcher": (
    "a step of 0.0.8's own graph-matching algorithm; ours matches layers another way and offers the entry points (auto_register_tags, GraphPattern, DEFAULT_GRAPH_PATTERNS)"
  ),
  "tracer": (
    "0.0.8's tracer internals (its caching and type aliases); ours traces through TracedFunction"
  ),
  "name": (
    "ours takes the block's name second, as the documented API does; 0.0.8's options are keyword arguments here"
  ),
  "update": (
    "the documented API's order (batch_size after ema_new) is kept; identity_weight is a keyword argument here"
  ),
  "autoreg": (
    "ours takes allow_multiple_registrations before graph_matcher_rules (keywords work alike)"
  ),
}
KNOWN_GAPS: dict[str, str] = {
  ".BlockDiagonalCurvature.update_curvature_matrix_estimate": _REASONS[
    "update"
  ],
  ".Conv2DDiagonal": _REASONS["name"],
  ".Conv2DDiagonal.update_curvature_matrix_estimate": _REASONS["update"],
  ".Conv2DFull": _REASONS["name"],
  ".Conv2DFull.update_curvature_matrix_estimate": _REASONS["update"],
  ".Conv2DTNT": _REASONS["name"],
  ".Conv2DTNT.update_curvature_matrix_estimate": _REASONS["update"],
  ".Conv2DTwoKroneckerFactored": _REASONS["name"],
  ".Conv2DTwoKroneckerFactored.update_curvature_matrix_estimate": _REASONS[
    "update"
  ],
  ".CurvatureBlock.update_curvature_matrix_estimate": _REASONS["update"],
  ".CurvatureEstimator.update_curvature_matrix_estimate": _REASONS["update"],
  ".DenseDiagonal.update_curvature_matrix_estimate": _REASONS["update"],
  ".DenseFull": _REASONS["name"],
  ".DenseFull.update_curvature_matrix_estimate": _REASONS["update"],
  ".DenseTNT": _REASONS["name"],
  ".DenseTNT.update_curvature_matrix_estimate": _REASONS["update"],
  ".DenseTwoKroneckerFactored": _REASONS["name"],
  ".DenseTwoKroneckerFactored.update_curvature_matrix_estimate": _REASONS[
    "update"
  ],
  ".ExplicitExactCurvature.update_curvature_matrix_estimate": _REASONS[
    "update"
  ],
  ".Full": _REASONS["name"],
  ".KroneckerFactored": _REASONS["name"],
  ".NaiveDiagonal.update_curvature_matrix_estimate": _REASONS["update"],
  ".NaiveFull": _REASONS["name"],
  ".NaiveFull.update_curvature_matrix_estimate": _REASONS["update"],
  ".NaiveTNT": _REASONS["name"],
  ".NaiveTNT.update_curvature_matrix_estimate": _REASONS["update"],
  ".ProcessedJaxpr.log_registered_losses": _REASONS["tracer"],
  ".ProcessedJaxpr.reconstruct_losses": _REASONS["tracer"],
  ".RepeatedDenseKroneckerFactored": _REASONS["name"],
  ".RepeatedDenseKroneckerFactored.update_curvature_matrix_estimate": _REASONS[
    "update"
  ],
  ".ScaleAndShiftDiagonal.update_curvature_matrix_estimate": _REASONS["update"],
  ".ScaleAndShiftFull": _REASONS["name"],
  ".ScaleAndShiftFull.update_curvature_matrix_estimate": _REASONS["update"],
  ".ScaledIdentity": _REASONS["name"],
  ".ScaledIdentity.update_curvature_matrix_estimate": _REASONS["update"],
  ".auto_register_tags": _REASONS["autoreg"],
  "curvature_blocks.Conv2DDiagonal": _REASONS["name"],
  "curvature_blocks.Conv2DFull": _REASONS["name"],
  "curvature_blocks.Conv2DTNT": _REASONS["name"],
  "curvature_blocks.Conv2DTwoKroneckerFactored": _REASONS["name"],
  "curvature_blocks.DenseFull": _REASONS["name"],
  "curvature_blocks.DenseTNT": _REASONS["name"],
  "curvature_blocks.DenseTwoKroneckerFactored": _REASONS["name"],
  "curvature_blocks.Full": _REASONS["name"],
  "curvature_blocks.KroneckerFactored": _REASONS["name"],
  "curvature_blocks.NaiveFull": _REASONS["name"],
  "curvature_blocks.NaiveTNT": _REASONS["name"],
  "curvature_blocks.RepeatedDenseKroneckerFactored": _REASONS["name"],
  "curvature_blocks.ScaleAndShiftFull": _REASONS["name"],
  "curvature_blocks.ScaledIdentity": _REASONS["name"],
  "tag_graph_matcher.DEFAULT_SPECIAL_EQUIVALENCE_RULES": _REASONS["matcher"],
  "tag_graph_matcher.DENSE_GRAPH_PATTERNS": _REASONS["matcher"],
  "tag_graph_matcher.EquivalenceFunction": _REASONS["matcher"],
  "tag_graph_matcher.GraphMatch": _REASONS["matcher"],
  "tag_graph_matcher.GraphMatcherComparator": _REASONS["matcher"],
  "tag_graph_matcher.GraphMatcherComparator.add_commutative_op_name": _REASONS[
    "matcher"
  ],
  "tag_graph_matcher.GraphMatcherComparator.add_special_equivalence_rule": _REASONS[
    "matcher"
  ],
  "tag_graph_matcher.GraphMatcherComparator.are_equivalent": _REASONS[
    "matcher"
  ],
  "tag_graph_matcher.GraphMatcherComparator.commutative_ops_names": _REASONS[
    "matcher"
  ],
  "tag_graph_matcher.GraphMatcherComparator.special_eqn_equivalence_rules": _REASONS[
    "matcher"
  ],
  "tag_graph_matcher.GraphPattern.jaxpr": _REASONS["matcher"],
  "tag_graph_matcher.GraphPattern.param_vars": _REASONS["matcher"],
  "tag_graph_matcher.GraphPattern.tag_ctor": _REASONS["matcher"],
  "tag_graph_matcher.HIGHER_ORDER_NAMES": _REASONS["matcher"],
  "tag_graph_matcher.ITERATIVE_HIGHER_ORDER_NAMES": _REASONS["matcher"],
  "tag_graph_matcher.J": _REASONS["matcher"],
  "tag_graph_matcher.JaxprEqns": _REASONS["matcher"],
  "tag_graph_matcher.JaxprGraph": _REASONS["matcher"],
  "tag_graph_matcher.JaxprOrClosedJaxpr": _REASONS["matcher"],
  "tag_graph_matcher.MakeVarFunc": _REASONS["matcher"],
  "tag_graph_matcher.NORMALIZATION_GRAPH_PATTERNS": _REASONS["matcher"],
  "tag_graph_matcher.ParameterExtractorFunc": _REASONS["matcher"],
  "tag_graph_matcher.PatternComputeFunc": _REASONS["matcher"],
  "tag_graph_matcher.T": _REASONS["matcher"],
  "tag_graph_matcher.TagCtor": _REASONS["matcher"],
  "tag_graph_matcher.TagLocation": _REASONS["matcher"],
  "tag_graph_matcher.TaggedFunction": _REASONS["matcher"],
  "tag_graph_matcher.TaggedFunction.check_multiple_registrations": _REASONS[
    "matcher"
  ],
  "tag_graph_matcher.TaggedFunction.print_parameter_tags": _REASONS["matcher"],
  "tag_graph_matcher.VarProcessor": _REASONS["matcher"],
  "tag_graph_matcher.Vars": _REASONS["matcher"],
  "tag_graph_matcher.apply_to_higher_order_primitives": _REASONS["matcher"],
  "tag_graph_matcher.auto_register_tags": _REASONS["matcher"],
  "tag_graph_matcher.broadcast_in_dim_equivalent": _REASONS["matcher"],
  "tag_graph_matcher.clean_jaxpr": _REASONS["matcher"],
  "tag_graph_matcher.clean_layer_tags_jaxpr": _REASONS["matcher"],
  "tag_graph_matcher.conv_general_dilated_equivalent": _REASONS["matcher"],
  "tag_graph_matcher.dot_general_equivalent": _REASONS["matcher"],
  "tag_graph_matcher.eval_jaxpr_eqn": _REASONS["matcher"],
  "tag_graph_matcher.find_layer_tags_and_patterns": _REASONS["matcher"],
  "tag_graph_matcher.jax_version": _REASONS["matcher"],
  "tag_graph_matcher.make_jax_graph": _REASONS["matcher"],
  "tag_graph_matcher.match_equations": _REASONS["matcher"],
  "tag_graph_matcher.match_pattern": _REASONS["matcher"],
  "tag_graph_matcher.merge_broadcasts_jaxpr": _REASONS["matcher"],
  "tag_graph_matcher.num_unique_inputs": _REASONS["matcher"],
  "tag_graph_matcher.read_env": _REASONS["matcher"],
  "tag_graph_matcher.reshape_equivalent": _REASONS["matcher"],
  "tag_graph_matcher.to_closed_jaxpr": _REASONS["matcher"],
  "tag_graph_matcher.to_jaxpr_or_closed_jaxpr": _REASONS["matcher"],
  "tag_graph_matcher.write_env": _REASONS["matcher"],
  "tracer.Func": _REASONS["tracer"],
  "tracer.FunctionTransformation": _REASONS["tracer"],
  "tracer.JaxprExtractor": _REASONS["tracer"],
  "tracer.JaxprOrClosedJaxpr": _REASONS["tracer"],
  "tracer.LayerTagVjp": _REASONS["tracer"],
  "tracer.LossFunctionInputs": _REASONS["tracer"],
  "tracer.LossTagsJvp": _REASONS["tracer"],
  "tracer.LossTagsVjp": _REASONS["tracer"],
  "tracer.ProcJaxpr": _REASONS["tracer"],
  "tracer.TaggedFunction": _REASONS["tracer"],
  "tracer.VarMap": _REASONS["tracer"],
  "tracer.cached_transformation": _REASONS["tracer"],
  "tracer.compute_all_losses": _REASONS["tracer"],
  "tracer.construct_compute_losses_inputs": _REASONS["tracer"],
  "tracer.extract_tags": _REASONS["tracer"],
  "tracer.make_cache_key": _REASONS["tracer"],
  "tracer.name_layer_tags": _REASONS["tracer"],
  "tracer.order_layer_tags": _REASONS["tracer"],
  "tracer.shape_and_type": _REASONS["tracer"],
}
