"""Type names KFAC-JAX code annotates with (`kfac_jax.utils.Params`, ...).

They document intent; most are `Any` underneath, since parameters, batches
and states are arbitrary pytrees.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar, Union

import jax
import numpy as np

Array = jax.Array
# A PRNG key, as `jax.random.PRNGKey` or `jax.random.key` makes it.
PRNGKey = jax.Array
Shape = tuple[int, ...]
DType = np.dtype | type | str
# A Python number or a scalar array.
Scalar = float | int | jax.Array
# A Python number or an array of any shape.
Numeric = float | int | jax.Array
ScalarOrSequence = Scalar | Sequence[Scalar] | None

LeafType = TypeVar("LeafType")
# A pytree; `PyTree[X]` says its leaves are X (documentation, not checked).
# Union[] here, not |: mypy reads a TypeVar in it as a generic alias.
PyTree = Union[LeafType, Any]  # noqa: UP007
PyTreeDef = jax.tree_util.PyTreeDef

Params = Any
Batch = Any
FuncState = Any
FuncAux = Any
# The positional arguments of a model function, e.g. `(params, batch)`.
FuncArgs = Sequence[Any]
FuncOuts = Any
Func = Callable[..., FuncOuts]
# `value_func(*func_args) -> loss`, or `(loss, aux)` and the like.
ValueFunc = Callable[..., Any]
ValueAndGradFunc = Callable[..., Any]

# The state type of a generic curvature estimator or block.
StateType = TypeVar("StateType")

T = TypeVar("T")
# A pytree whose leaves are arrays.
ArrayTree = Any
# A type variable over array pytrees: a function returns what it was given.
TArrayTree = TypeVar("TArrayTree")
# What a model function may return: the loss, `(loss, aux)` or
# `(loss, (state, aux))`.
AssumedFuncOutput = jax.Array | tuple[jax.Array, Any]
# A schedule: `schedule(step)` or `schedule(step, data_seen)` -> a value.
ScheduleType = (
  Callable[[Numeric, Numeric | None], Numeric] | Callable[[Numeric], Numeric]
)
