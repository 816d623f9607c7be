"""Small helpers KFAC-JAX's `utils` names: a finalizable mixin, sequence and
iterator helpers, name scopes, keyword filtering, and a memory-bounded
average of a function over a batch."""

from __future__ import annotations

import abc
import functools
import inspect
import itertools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from estimators.utils.tree_math import weighted_sum_of_objects


# An ABC, as KFAC-JAX's, though it declares no abstract method: subclasses'
# `abc.abstractmethod`s are enforced.
class Finalizable(abc.ABC):  # noqa: B024 - see above
  """A mixin whose attributes freeze once `finalize` has been called.

  Subclasses call `super().__init__()` and set their attributes before
  `finalize`; afterwards setting an attribute raises `AttributeError`
  (unless `forbid_setting_attributes_after_finalize=False`, the name is in
  `excluded_attribute_names`, or `unlock_attributes` was called), and
  creating a new one always does.
  """

  def __init__(
    self,
    forbid_setting_attributes_after_finalize: bool = True,
    excluded_attribute_names: Sequence[str] = (),
    **parent_kwargs: Any,
  ):
    self._finalized = False
    self._forbid_setting_attributes = forbid_setting_attributes_after_finalize
    self._excluded_attribute_names = frozenset(
      {*excluded_attribute_names, "_forbid_setting_attributes"}
    )
    super().__init__(**parent_kwargs)

  @property
  def finalized(self) -> bool:
    """Whether `finalize` has been called."""
    return self._finalized

  def finalize(self, *args: Any, **kwargs: Any) -> None:
    """Runs `_finalize`, then freezes the attributes.

    Raises:
      ValueError: if the object was finalized already.
    """
    if self.finalized:
      raise ValueError(f"This {type(self).__name__} is already finalized.")
    self._finalize(*args, **kwargs)
    self._finalized = True

  def _finalize(self, *args: Any, **kwargs: Any) -> None:  # noqa: B027 - a hook
    """A subclass's own finalization work (nothing by default)."""

  def unlock_attributes(self) -> None:
    """Allows setting existing attributes after finalization."""
    self._forbid_setting_attributes = False

  def lock_attributes(self) -> None:
    """Forbids setting attributes after finalization again."""
    self._forbid_setting_attributes = True

  def __setattr__(self, name: str, value: Any) -> None:
    # Read with defaults: `__init__` sets these through here too.
    finalized = getattr(self, "_finalized", False)
    if finalized and not hasattr(self, name):
      raise AttributeError(
        f"Cannot create attribute {name!r} of a finalized "
        f"{type(self).__name__}."
      )
    if (
      finalized
      and getattr(self, "_forbid_setting_attributes", True)
      and name not in getattr(self, "_excluded_attribute_names", ())
    ):
      raise AttributeError(
        f"Cannot set attribute {name!r} of a finalized "
        f"{type(self).__name__} (call unlock_attributes() first)."
      )
    super().__setattr__(name, value)


def fake_element_from_iterator(iterator: Iterator[Any]) -> tuple[Any, Iterator]:
  """A zeroed copy of an iterator's first element, and an iterator that
  still yields that element first (use it in place of the argument)."""
  first = next(iterator)
  return jax.tree.map(jnp.zeros_like, first), itertools.chain([first], iterator)


def filter_sequence(
  unfiltered_sequence: Sequence[Any], bool_sequence: Sequence[bool]
) -> Sequence[Any]:
  """The elements whose flag is true: a tuple for a tuple, else a list."""
  kept = itertools.compress(unfiltered_sequence, bool_sequence)
  return tuple(kept) if isinstance(unfiltered_sequence, tuple) else list(kept)


def to_tuple_or_repeat(x: Any, length: int) -> tuple[Any, ...]:
  """`x` as a tuple of `length` values.

  An array of more than one element is split along its last axis, a list or
  tuple is converted, and a scalar (number or one-element array) repeated.

  Raises:
    ValueError: if the last axis or the sequence does not have `length`
      entries, or `x` is of another type.
  """
  if isinstance(x, (jax.Array, np.ndarray)) and x.size > 1:
    if x.shape[-1] != length:
      raise ValueError(
        f"Expected an array with {length} entries on its last axis, got "
        f"shape {x.shape}."
      )
    return tuple(x[..., i] for i in range(length))
  if isinstance(x, (list, tuple)):
    if len(x) != length:
      raise ValueError(f"Expected {length} values, got {len(x)}: {x!r}.")
    return tuple(x)
  if isinstance(x, (int, float, jax.Array, np.ndarray)):
    return (x,) * length
  raise ValueError(
    f"Expected a number, an array or a sequence, got {type(x).__name__}."
  )


def auto_scope_method(method: Callable[..., Any]) -> Callable[..., Any]:
  """Runs a method under the JAX name scope `"<Class>_<method>"` (a leading
  underscore of the method's name dropped)."""

  @functools.wraps(method)
  def wrapped(instance, *args, **kwargs):
    name = method.__name__.removeprefix("_")
    with jax.named_scope(f"{type(instance).__name__}_{name}"):
      return method(instance, *args, **kwargs)

  return wrapped


def auto_scope_function(func: Callable[..., Any]) -> Callable[..., Any]:
  """Runs a function under the JAX name scope of its name."""

  @functools.wraps(func)
  def wrapped(*args, **kwargs):
    with jax.named_scope(func.__name__):
      return func(*args, **kwargs)

  return wrapped


def replace_char(original: str, new_str: str, index: int) -> str:
  """`original` with its character at `index` replaced by `new_str`."""
  return original[:index] + new_str + original[index + 1 :]


def call_func_with_conditional_kwargs(
  func: Callable[..., Any], *func_args: Any, **kwargs: Any
) -> Any:
  """Calls `func(*func_args, **kwargs)`, passing only the keyword arguments
  its signature names."""
  names = inspect.signature(func).parameters
  return func(*func_args, **{k: v for k, v in kwargs.items() if k in names})


def loop_and_parallelize_average(
  func: Callable[..., Any], max_parallel_size: int | None
) -> Callable[..., Any]:
  """`func` averaged over the leading axis of its arguments, computing at
  most about `max_parallel_size` output elements at once.

  The result equals `jnp.mean(jax.vmap(func)(*args), axis=0)` (per leaf);
  larger batches are split into chunks that a `lax.scan` vmaps one at a
  time, plus a remainder chunk, to bound memory.

  Args:
    func: a function of single (unbatched) arguments returning a pytree.
    max_parallel_size: the largest number of output elements (summed over
      the chunk) computed in one `vmap`; None for no limit.

  Returns:
    The averaging function, taking batched arguments.
  """
  batched = jax.vmap(func)

  def mean(*args):
    return jax.tree.map(lambda x: jnp.mean(x, axis=0), batched(*args))

  @functools.wraps(func)
  def average(*args):
    sizes = {x.shape[0] for x in jax.tree.leaves(args)}
    if len(sizes) != 1:
      raise ValueError(
        "The arguments need one common leading axis size, got "
        f"{sorted(sizes) or 'no array arguments'}."
      )
    (size,) = sizes
    one = jax.eval_shape(func, *jax.tree.map(lambda x: x[0], args))
    per_item = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(one))
    if max_parallel_size is None or per_item * size <= max_parallel_size:
      return mean(*args)
    chunk = max(min(max_parallel_size // max(per_item, 1), size), 1)
    num_chunks, remainder = divmod(size, chunk)
    looped = jax.tree.map(
      lambda x: x[: num_chunks * chunk].reshape(
        (num_chunks, chunk) + x.shape[1:]
      ),
      args,
    )

    def step(total, chunk_args):
      return jax.tree.map(jnp.add, total, mean(*chunk_args)), None

    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), one)
    total, _ = jax.lax.scan(step, zeros, looped)
    average_of_chunks = jax.tree.map(lambda x: x / num_chunks, total)
    if remainder == 0:
      return average_of_chunks
    rest = mean(*jax.tree.map(lambda x: x[num_chunks * chunk :], args))
    return weighted_sum_of_objects(
      [average_of_chunks, rest],
      [num_chunks * chunk / size, remainder / size],
    )

  return average
