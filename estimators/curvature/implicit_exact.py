"""Exact curvature matrices through matrix-vector products only."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, cast

import jax
import jax.flatten_util
import jax.numpy as jnp

from estimators import tracer
from estimators.utils.tree_math import default_batch_size_extractor
from estimators.utils.types import FuncArgs, Params


class ImplicitExactCurvature:
  """Exact curvature matrices used only through matrix-vector products.

  All products are with the curvature of the registered losses averaged over
  the batch: the Hessian `H`, the GGN `G = mean_i J_iᵀ H_i J_i` and the
  Fisher `F`. The factor `B` of `G` (or `F`) stacks `J_iᵀ B_i / sqrt(batch)`
  over the examples, `B_i` the loss's factor, so that `B Bᵀ = G`. The batch
  is the last of `func`'s arguments.
  """

  def __init__(
    self,
    func: Callable,
    params_index: int = 0,
    batch_size_extractor: Callable[[Any], int] = default_batch_size_extractor,
  ):
    """Prepares the loss tags' Jacobian and Hessian products of `func`.

    Args:
      func: the model function, with at least one registered loss.
      params_index: which of `func`'s positional arguments are the
        parameters.
      batch_size_extractor: maps the batch (`func`'s last argument) to its
        number of examples.
    """
    self.func = func
    self.params_index = params_index
    self._batch_size_extractor = batch_size_extractor
    self._vjp = tracer.loss_tags_vjp(func, params_index)
    self._jvp = tracer.loss_tags_jvp(func, params_index)
    self._hvp = tracer.loss_tags_hvp(func, params_index)

  def batch_size(self, func_args: FuncArgs) -> int:
    """The number of examples in `func_args`' batch (its last argument)."""
    return self._batch_size_extractor(func_args[-1])

  def multiply_hessian(
    self, func_args: FuncArgs, parameter_structured_vector: Params
  ) -> Params:
    """`H v`, `H` the Hessian of the batch-averaged loss w.r.t. the params.

    Args:
      func_args: the arguments of `func` to evaluate at.
      parameter_structured_vector: `v`, shaped like the parameters.

    Returns:
      The product, shaped like the parameters.
    """
    hvp, _ = self._hvp(func_args, parameter_structured_vector)
    return jax.tree.map(lambda x: x / self.batch_size(func_args), hvp)

  def multiply_jacobian_transpose(
    self,
    func_args: FuncArgs,
    loss_input_vectors: Sequence[Sequence[jax.Array]],
    return_loss_objects: bool = False,
  ) -> Any:
    """`Jᵀ u`, `J` the Jacobian of the losses' inputs w.r.t. the params.

    Args:
      func_args: the arguments of `func` to evaluate at.
      loss_input_vectors: `u`: for each registered loss, one array per
        parameter-dependent input, shaped like it.
      return_loss_objects: also return the registered losses.

    Returns:
      The product (not divided by the batch size), shaped like the params;
      with `return_loss_objects`, `(product, losses)`.
    """
    losses, vjp = self._vjp(func_args)
    product = vjp(loss_input_vectors)
    return (product, losses) if return_loss_objects else product

  def multiply_jacobian(
    self,
    func_args: FuncArgs,
    parameter_structured_vector: Params,
    return_loss_objects: bool = False,
  ) -> Any:
    """`J v`, `J` the Jacobian of the losses' inputs w.r.t. the params.

    Args:
      func_args: the arguments of `func` to evaluate at.
      parameter_structured_vector: `v`, shaped like the parameters.
      return_loss_objects: also return the registered losses.

    Returns:
      For each loss, one array per parameter-dependent input; with
      `return_loss_objects`, `(products, losses)`.
    """
    losses, products = self._jvp(func_args, parameter_structured_vector)
    products = tuple(tuple(p) for p in products)
    return (products, losses) if return_loss_objects else products

  @staticmethod
  def _per_loss(losses, vectors, method):
    """`loss.<method>(vector)` for each loss and its vector."""
    losses, vectors = tuple(losses), tuple(vectors)
    if len(losses) != len(vectors):
      raise ValueError(
        f"Got {len(vectors)} vectors for {len(losses)} losses: give one "
        "per loss."
      )
    return tuple(getattr(f, method)(v) for f, v in zip(losses, vectors))

  def multiply_loss_fisher(self, losses, loss_vectors) -> tuple:
    """Each loss's Fisher (w.r.t. its inputs) times its vector.

    Args:
      losses: registered losses (e.g. from `multiply_jacobian(...,
        return_loss_objects=True)`).
      loss_vectors: per loss, a tuple of arrays shaped like its inputs.

    Returns:
      Per loss, the product, shaped like its inputs.
    """
    return self._per_loss(losses, loss_vectors, "multiply_fisher")

  def multiply_loss_ggn(self, losses, loss_vectors) -> tuple:
    """Each loss's GGN (its Hessian w.r.t. its inputs) times its vector;
    see `multiply_loss_fisher`."""
    return self._per_loss(losses, loss_vectors, "multiply_ggn")

  def multiply_loss_fisher_factor(self, losses, loss_inner_vectors) -> tuple:
    """Each loss's Fisher factor `B` (`B Bᵀ` = the Fisher) times its vector
    of the factor's inner shape; see `multiply_loss_fisher`."""
    return self._per_loss(losses, loss_inner_vectors, "multiply_fisher_factor")

  def multiply_loss_ggn_factor(self, losses, loss_inner_vectors) -> tuple:
    """The same with the GGN factors."""
    return self._per_loss(losses, loss_inner_vectors, "multiply_ggn_factor")

  def multiply_loss_fisher_factor_transpose(
    self, losses, loss_vectors
  ) -> tuple:
    """Each loss's `Bᵀ` (Fisher factor) times its vector shaped like its
    inputs; the results have the factor's inner shapes."""
    return self._per_loss(
      losses, loss_vectors, "multiply_fisher_factor_transpose"
    )

  def multiply_loss_ggn_factor_transpose(self, losses, loss_vectors) -> tuple:
    """The same with the GGN factors."""
    return self._per_loss(losses, loss_vectors, "multiply_ggn_factor_transpose")

  def _jacobian_products(self, func_args, vector):
    """The losses, `J v` and `u -> Jᵀ u`, from one forward pass.

    `J v` is the transpose of the VJP, so the two products share one set of
    activations (which matters where they are kept for many products).
    """
    losses, vjp = self._vjp(func_args)
    like = tuple(tuple(loss.parameter_dependants) for loss in losses)
    (tangents,) = jax.linear_transpose(vjp, like)(vector)
    return losses, tangents, vjp

  def _multiply(self, func_args, vector, kind):
    losses, tangents, vjp = self._jacobian_products(func_args, vector)
    products = tuple(
      loss.multiply_fisher(t) if kind == "fisher" else loss.multiply_ggn(t)
      for loss, t in zip(losses, tangents)
    )
    return jax.tree.map(lambda x: x / self.batch_size(func_args), vjp(products))

  def multiply_fisher(
    self, func_args: FuncArgs, parameter_structured_vector: Params
  ) -> Params:
    """`F v`, `F` the Fisher of the batch-averaged loss w.r.t. the params.

    Args:
      func_args: the arguments of `func` to evaluate at.
      parameter_structured_vector: `v`, shaped like the parameters.

    Returns:
      The product, shaped like the parameters.
    """
    return self._multiply(func_args, parameter_structured_vector, "fisher")

  def multiply_ggn(
    self, func_args: FuncArgs, parameter_structured_vector: Params
  ) -> Params:
    """`G v`, `G` the GGN of the batch-averaged loss w.r.t. the params.

    Args:
      func_args: the arguments of `func` to evaluate at.
      parameter_structured_vector: `v`, shaped like the parameters.

    Returns:
      The product, shaped like the parameters.
    """
    return self._multiply(func_args, parameter_structured_vector, "ggn")

  def multiply_empirical_fisher(
    self, func_args: FuncArgs, parameter_structured_vector: Params
  ) -> Params:
    """`E v`, `E` the empirical Fisher at the data targets.

    `E = mean_i d_i d_iᵀ`, where `d_i` is the parameter gradient of example
    i's loss (summed over the registered losses, weights included). With
    `g_li` the gradient of loss l w.r.t. its inputs for example i, one JVP
    gives `t_li = J_li v`, the per-example scalars `s_i = Σ_l g_liᵀ t_li`
    scale `g_li`, and one VJP maps them back: no per-example parameter
    gradient is formed. As `d_i` sums over the losses, the product holds
    the cross terms between them, not only each loss's own term.

    Args:
      func_args: the arguments of `func` to evaluate at; every registered
        loss must carry its targets.
      parameter_structured_vector: `v`, shaped like the parameters.

    Returns:
      The product, shaped like the parameters.

    Raises:
      ValueError: if a loss was registered without targets, or the losses'
        inputs do not share one leading (batch) axis.
    """
    losses, tangents, vjp = self._jacobian_products(
      func_args, parameter_structured_vector
    )
    grads = []
    for loss in losses:
      if loss.targets is None:
        raise ValueError(
          "The empirical Fisher needs the data targets, but a "
          f"{type(loss).__name__} was registered without them: pass "
          "targets= to its register_* call."
        )
      grads.append(loss.grad_of_evaluate(None, "regular"))
    leading = {x.shape[0] for gs in grads for x in gs}
    if len(leading) != 1:
      raise ValueError(
        "The empirical Fisher needs per-example gradients, but the "
        f"registered losses' inputs have leading axes {sorted(leading)}: "
        "give every loss input the batch as its leading axis."
      )
    # s_i: the directional derivative of example i's total loss along v
    # (an array: there is at least one gradient, checked above).
    per_example = cast(
      jax.Array,
      sum(
        jnp.sum(g * t, axis=tuple(range(1, g.ndim)))
        for gs, ts in zip(grads, tangents)
        for g, t in zip(gs, ts)
      ),
    )
    products = tuple(
      tuple(g * per_example.reshape((-1,) + (1,) * (g.ndim - 1)) for g in gs)
      for gs in grads
    )
    return jax.tree.map(lambda x: x / self.batch_size(func_args), vjp(products))

  def _factor_transpose(self, func_args, vector, kind):
    losses, tangents = self._jvp(func_args, vector)
    scale = 1 / jnp.sqrt(self.batch_size(func_args))
    return tuple(
      scale
      * (
        loss.multiply_fisher_factor_transpose(t)
        if kind == "fisher"
        else loss.multiply_ggn_factor_transpose(t)
      )
      for loss, t in zip(losses, tangents)
    )

  def multiply_fisher_factor_transpose(
    self, func_args: FuncArgs, parameter_structured_vector: Params
  ) -> tuple[jax.Array, ...]:
    """`Bᵀ v` for the factor `B` with `B Bᵀ = F`.

    Args:
      func_args: the arguments of `func` to evaluate at.
      parameter_structured_vector: `v`, shaped like the parameters.

    Returns:
      One array per registered loss, of its `fisher_factor_inner_shape`.
    """
    return self._factor_transpose(
      func_args, parameter_structured_vector, "fisher"
    )

  def multiply_ggn_factor_transpose(
    self, func_args: FuncArgs, parameter_structured_vector: Params
  ) -> tuple[jax.Array, ...]:
    """`Bᵀ v` for the factor `B` with `B Bᵀ = G`.

    Args:
      func_args: the arguments of `func` to evaluate at.
      parameter_structured_vector: `v`, shaped like the parameters.

    Returns:
      One array per registered loss, of its `ggn_factor_inner_shape`.
    """
    return self._factor_transpose(func_args, parameter_structured_vector, "ggn")

  def _factor(self, func_args, loss_inner_vectors, kind):
    losses, vjp = self._vjp(func_args)
    if len(loss_inner_vectors) != len(losses):
      raise ValueError(
        f"Got {len(loss_inner_vectors)} inner vectors for "
        f"{len(losses)} registered losses."
      )
    products = tuple(
      loss.multiply_fisher_factor(v)
      if kind == "fisher"
      else loss.multiply_ggn_factor(v)
      for loss, v in zip(losses, loss_inner_vectors)
    )
    scale = 1 / jnp.sqrt(self.batch_size(func_args))
    return jax.tree.map(lambda x: scale * x, vjp(products))

  def multiply_fisher_factor(
    self, func_args: FuncArgs, loss_inner_vectors: Sequence[jax.Array]
  ) -> Params:
    """`B u` for the factor `B` with `B Bᵀ = F`.

    Args:
      func_args: the arguments of `func` to evaluate at.
      loss_inner_vectors: `u`: one array per registered loss, of its
        `fisher_factor_inner_shape`.

    Returns:
      The product, shaped like the parameters.

    Raises:
      ValueError: if there is not one vector per loss.
    """
    return self._factor(func_args, loss_inner_vectors, "fisher")

  def multiply_ggn_factor(
    self, func_args: FuncArgs, loss_inner_vectors: Sequence[jax.Array]
  ) -> Params:
    """`B u` for the factor `B` with `B Bᵀ = G`.

    Args:
      func_args: the arguments of `func` to evaluate at.
      loss_inner_vectors: `u`: one array per registered loss, of its
        `ggn_factor_inner_shape`.

    Returns:
      The product, shaped like the parameters.

    Raises:
      ValueError: if there is not one vector per loss.
    """
    return self._factor(func_args, loss_inner_vectors, "ggn")

  def get_loss_inner_vector_shapes_and_batch_size(
    self, func_args: FuncArgs, mode: str
  ) -> tuple[tuple[tuple[int, ...], ...], int]:
    """The shapes the factor products take, and the batch size.

    Args:
      func_args: the arguments of `func`.
      mode: "fisher" or "ggn".

    Returns:
      Each registered loss's factor inner shape, and the batch size.

    Raises:
      ValueError: for another mode.
    """
    if mode not in ("fisher", "ggn"):
      raise ValueError(f"mode must be 'fisher' or 'ggn', got {mode!r}.")
    losses, _ = self._vjp(func_args)
    shapes = tuple(
      tuple(getattr(loss, f"{mode}_factor_inner_shape")) for loss in losses
    )
    return shapes, self.batch_size(func_args)

  def get_loss_input_shapes_and_batch_size(
    self, func_args: FuncArgs
  ) -> tuple[tuple[tuple[tuple[int, ...], ...], ...], int]:
    """The shapes of the losses' inputs, and the batch size.

    Args:
      func_args: the arguments of `func`.

    Returns:
      For each registered loss the shapes of its parameter-dependent
      inputs, and the batch size.
    """
    losses, _ = self._vjp(func_args)
    shapes = tuple(
      tuple(tuple(x.shape) for x in loss.parameter_dependants)
      for loss in losses
    )
    return shapes, self.batch_size(func_args)

  def to_dense_matrix(
    self, func_args: FuncArgs, mat_type: str = "ggn"
  ) -> jax.Array:
    """An exact curvature matrix formed column by column, for small models.

    Args:
      func_args: the arguments of `func` to evaluate at.
      mat_type: "hessian", "fisher", "ggn" or "empirical_fisher".

    Returns:
      A `(dim, dim)` array in `ravel_pytree` order.

    Raises:
      ValueError: for another matrix type.
    """
    products = dict(
      hessian=self.multiply_hessian,
      fisher=self.multiply_fisher,
      ggn=self.multiply_ggn,
      empirical_fisher=self.multiply_empirical_fisher,
    )
    if mat_type not in products:
      raise ValueError(
        f"mat_type must be one of {sorted(products)}, got {mat_type!r}."
      )
    params = func_args[self.params_index]
    flat, unravel = jax.flatten_util.ravel_pytree(params)

    def column(e):
      return jax.flatten_util.ravel_pytree(
        products[mat_type](func_args, unravel(e))
      )[0]

    return jax.vmap(column, out_axes=1)(jnp.eye(flat.size, dtype=flat.dtype))
