"""Mixed precision in the manner of PyTorch FSDP's ``MixedPrecision``: low-precision compute, float32 state.

See the precision guide.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from substrax._base.trees import PyTree

__all__ = ["MixedPrecision"]


def _floating(x: Any) -> bool:
    return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating)


@dataclasses.dataclass(frozen=True)
class MixedPrecision:
    """A mixed-precision policy for a training step (``make_train_step(..., precision=)``).

    Attributes:
      param_dtype: The dtype the forward and backward passes see the parameters (and
        the floating batch leaves) in; ``jnp.bfloat16`` by default.
      reduce_dtype: The dtype gradients are reduced and accumulated in.
      keep_batch: Names of batch keys (at any depth) whose leaves keep their dtype,
        such as ``("targets",)``.

    Raises:
      TypeError: If a dtype is not a floating dtype.
      ValueError: If a dtype is float16: without loss scaling its gradients underflow;
        use bfloat16.
    """

    param_dtype: Any = jnp.bfloat16
    reduce_dtype: Any = jnp.float32
    keep_batch: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype"):
            value = getattr(self, name)
            try:
                dtype = np.dtype(value)
            except TypeError:
                raise TypeError(f"MixedPrecision.{name} must be a floating dtype; got {value!r}.") from None
            if not jnp.issubdtype(dtype, jnp.floating):
                raise TypeError(f"MixedPrecision.{name} must be a floating dtype; got {dtype.name}.")
            if dtype == np.float16:
                raise ValueError(
                    f"MixedPrecision.{name}=float16 needs dynamic loss scaling, which substrax does not "
                    f"do (float16 gradients underflow without it). Use jnp.bfloat16: the same bytes, "
                    f"float32's range."
                )
            object.__setattr__(self, name, dtype)
        if isinstance(self.keep_batch, str) or not all(isinstance(k, str) for k in self.keep_batch):
            raise TypeError(
                f"MixedPrecision.keep_batch must be a tuple of key names; got {self.keep_batch!r}."
            )
        object.__setattr__(self, "keep_batch", tuple(self.keep_batch))

    def cast_params(self, tree: PyTree) -> PyTree:
        """Floating leaves of ``tree`` in ``param_dtype``."""
        return jax.tree.map(lambda x: x.astype(self.param_dtype) if _floating(x) else x, tree)

    def cast_batch(self, batch: PyTree) -> PyTree:
        """Floating batch leaves in ``param_dtype``, but those under a ``keep_batch`` key."""

        def cast(path: tuple[Any, ...], x: Any) -> Any:
            names = {getattr(k, "key", getattr(k, "name", None)) for k in path}
            if _floating(x) and not names & set(self.keep_batch):
                return jnp.asarray(x).astype(self.param_dtype)
            return x

        return jax.tree_util.tree_map_with_path(cast, batch)

    def loss_fn(self, loss_fn: Callable[..., Any], has_aux: bool) -> Callable[..., Any]:
        """``loss_fn`` on the cast batch, its loss (and floating metrics) in float32."""

        def wrapped(model: Any, batch: PyTree) -> Any:
            out = loss_fn(model, self.cast_batch(batch))
            return jax.tree.map(lambda x: x.astype(jnp.float32) if _floating(x) else x, out)

        return wrapped

    def value_and_grad(self, loss_fn: Callable[..., tuple[Any, Any]]) -> Callable[..., Any]:
        """``nnx.value_and_grad(loss_fn, has_aux=True)`` with the parameters seen in ``param_dtype``.

        The gradient is taken with respect to the parameters as stored (float32),
        through the cast; the model's other state (BatchNorm statistics) is updated.
        """

        def cast_in_place(model: nnx.Module, batch: PyTree) -> tuple[Any, Any]:
            # Inside nnx.value_and_grad: each parameter holds its float32 value (what the
            # gradient is taken with respect to); it is seen cast for the loss, then restored.
            params = [v for _, v in nnx.to_flat_state(nnx.state(model, nnx.Param))]
            held = [v.get_value() for v in params]
            for variable, value in zip(params, held, strict=True):
                variable.set_value(self.cast_params(value))
            try:
                return loss_fn(model, batch)
            finally:
                for variable, value in zip(params, held, strict=True):
                    variable.set_value(value)

        value_and_grad = nnx.value_and_grad(cast_in_place, has_aux=True)
        return value_and_grad
