"""``ColumnParallelLinear``, ``RowParallelLinear`` (the Megatron pair), and the helpers the layers share."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn import dtypes

from substrax._base import scopes
from substrax._metrics.collectives import varying_axes
from substrax.mesh import current_mesh_with
from substrax.nn._declare import copy_to_model_axis, declare_backward, declare_forward

__all__ = ["ColumnParallelLinear", "RowParallelLinear"]

Initializer = Any  # flax's ``(key, shape, dtype) -> array``
KERNEL_INIT: Initializer = nnx.initializers.lecun_normal()  # nnx.Linear's defaults
BIAS_INIT: Initializer = nnx.initializers.zeros_init()


def sharded_param(value: jax.Array, spec: tuple[str | None, ...], axis: str) -> nnx.Param[jax.Array]:
    """``nnx.Param(value)`` declared split as ``spec`` (``out_sharding``), ``axis`` optional.

    Placed at creation only when the mesh set by ``jax.set_mesh`` has ``axis``; elsewhere
    only the metadata records the split, and the steps place it whole.
    """
    place = nnx.using_eager_sharding() and current_mesh_with(axis) is not None
    return nnx.Param(value, out_sharding=spec, eager_sharding=place, optional_axes=(axis,))


def split_over(value: jax.Array, axis: str, dim: int, whole: int, where: str) -> bool:
    """Whether ``value`` is this device's shard, split on ``dim`` over ``axis`` (typed varying there).

    Raises:
      ValueError: If it holds part of ``dim`` but is not typed varying over ``axis``
        (``check_vma=False``), or is varying but its part is not ``whole / axis size``.
    """
    have = value.shape[dim]
    if axis not in (varying_axes(value) or ()):
        if have != whole:
            raise ValueError(
                f"{where}: its parameter holds {have} of {whole} entries on dim {dim}, a shard, "
                f"but is not typed as varying over {axis!r}. Run it under "
                f"jax.shard_map(..., check_vma=True) with in_specs from nnx.get_partition_spec."
            )
        return False
    size = jax.lax.axis_size(axis)
    if have * size != whole:
        raise ValueError(
            f"{where}: its parameter varies over {axis!r} ({size} devices) but holds {have} of "
            f"{whole} entries on dim {dim}, not {whole} / {size}. Give it the in_specs "
            f"nnx.get_partition_spec reads from its metadata."
        )
    return True


def _sequence_dim(x: jax.Array, sequence_axis: int, where: str) -> int:
    """``sequence_axis`` as a non-negative dimension of ``x``; never its last (features)."""
    dim = sequence_axis + x.ndim if sequence_axis < 0 else sequence_axis
    if not 0 <= dim < x.ndim - 1:
        raise ValueError(
            f"{where}: sequence_axis={sequence_axis} is not a dimension of the input (shape "
            f"{x.shape}) other than its last, the features."
        )
    return dim


def matmul(x: jax.Array, kernel: jax.Array, precision: Any) -> jax.Array:
    """``x @ kernel`` over ``x``'s last dimension, as ``nnx.Linear`` computes it."""
    return jax.lax.dot_general(x, kernel, (((x.ndim - 1,), (0,)), ((), ())), precision=precision)


def add_bias(y: jax.Array, bias: jax.Array | None) -> jax.Array:
    return y if bias is None else y + jnp.reshape(bias, (1,) * (y.ndim - 1) + (-1,))


def gather_sequence(layer: nnx.Module, x: jax.Array, axis: str, dim: int) -> jax.Array:
    """``x``'s blocks on ``dim`` all-gathered (tiled) over ``axis``: the whole sequence, declared
    with its backward reduce-scatter."""
    with jax.named_scope(scopes.TENSOR_PARALLEL):
        whole = jax.lax.all_gather(x, axis, axis=dim, tiled=True)
    declare_forward(layer, "all-gather", axis, whole, "the sequence, gathered")
    return declare_backward(layer, "reduce-scatter", axis, whole, "its gradient, scattered back")


def ring_matmul(
    layer: nnx.Module, x: jax.Array, kernel: jax.Array, axis: str, dim: int, precision: Any
) -> jax.Array:
    """``all_gather(x, axis, axis=dim, tiled=True) @ kernel`` as a ring of ``ppermute``s.

    The collective matmul of the ``shard_map`` guide: each device multiplies the block
    of rows it holds, passes it to the next device, and writes the product into its
    place in the output, so each transfer can overlap a matmul. ``axis size - 1``
    transfers, no all-gather.
    """
    size = jax.lax.axis_size(axis)
    index = jax.lax.axis_index(axis)
    rows = x.shape[dim]
    shift = [(j, (j + 1) % size) for j in range(size)]
    out_shape = list(x.shape[:-1]) + [kernel.shape[1]]
    out_shape[dim] = rows * size
    y = jnp.zeros(out_shape, jnp.result_type(x, kernel))
    for step in range(size):
        if step:
            declare_forward(layer, "collective-permute", axis, x, "a block of the input, to the next device")
            x = declare_backward(
                layer,
                "collective-permute",
                axis,
                jax.lax.ppermute(x, axis, shift),
                "that block's gradient, back",
            )
        start: list[Any] = [0] * y.ndim
        start[dim] = ((index - step) % size) * rows  # the block came from device index - step
        y = jax.lax.dynamic_update_slice(y, matmul(x, kernel, precision), start)
    return y


class _Linear(nnx.Module):
    """``nnx.Linear``'s parameters, made by the same calls in the same order, declared split as
    ``_specs`` says (the kernel's spec, the bias's)."""

    def _specs(self, axis: str) -> tuple[tuple[str | None, ...], tuple[str | None, ...]]:
        raise NotImplementedError

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        use_bias: bool = True,
        dtype: Any = None,
        param_dtype: Any = jnp.float32,
        precision: Any = None,
        kernel_init: Initializer = KERNEL_INIT,
        bias_init: Initializer = BIAS_INIT,
        model_axis: str = "model",
        sequence_parallel: bool = False,
        sequence_axis: int = -2,
        rngs: nnx.Rngs,
    ) -> None:
        kernel_spec, bias_spec = self._specs(model_axis)
        kernel_key = rngs.params()
        self.kernel = sharded_param(
            kernel_init(kernel_key, (in_features, out_features), param_dtype), kernel_spec, model_axis
        )
        self.bias: nnx.Param[jax.Array] | None
        if use_bias:
            bias_key = rngs.params()
            self.bias = sharded_param(
                bias_init(bias_key, (out_features,), param_dtype), bias_spec, model_axis
            )
        else:
            self.bias = nnx.data(None)
        self.in_features = in_features
        self.out_features = out_features
        self.use_bias = use_bias
        self.dtype = dtype
        self.param_dtype = param_dtype
        self.precision = precision
        self.model_axis = model_axis
        self.sequence_parallel = sequence_parallel
        self.sequence_axis = sequence_axis

    def _promoted(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array | None]:
        bias = self.bias[...] if self.bias is not None else None
        return dtypes.promote_dtype((x, self.kernel[...], bias), dtype=self.dtype)  # type: ignore[no-any-return]


class ColumnParallelLinear(_Linear):
    """``nnx.Linear`` with its output features split over ``model_axis`` (kernel ``(None, model_axis)``).

    Bias ``(model_axis,)``. Inside ``jax.shard_map(check_vma=True)`` each device computes its
    ``out / size`` output columns, for a ``RowParallelLinear``; anywhere else it is
    ``nnx.Linear``. See the tensor-parallelism guide. Besides its own arguments (below) it
    takes ``nnx.Linear``'s, meaning what they mean there: the same ``rngs`` give the same parameters.

    Args:
      model_axis: The mesh axis the output features are split over.
      sequence_parallel: The input arrives split over ``model_axis`` on ``sequence_axis``
        and is all-gathered there; pair with ``RowParallelLinear(sequence_parallel=True)``.
      sequence_axis: That dimension, counted as numpy does (``-2``: the sequence of
        ``(batch, seq, features)``); never the last.
      collective_matmul: With ``sequence_parallel``: a ring of ``ppermute``s, each
        overlapping one block's matmul, in place of the all-gather; the same numbers.

    Raises:
      ValueError: If ``collective_matmul`` is set without ``sequence_parallel``.
    """

    def _specs(self, axis: str) -> tuple[tuple[str | None, ...], tuple[str | None, ...]]:
        return (None, axis), (axis,)

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        use_bias: bool = True,
        dtype: Any = None,
        param_dtype: Any = jnp.float32,
        precision: Any = None,
        kernel_init: Initializer = KERNEL_INIT,
        bias_init: Initializer = BIAS_INIT,
        model_axis: str = "model",
        sequence_parallel: bool = False,
        sequence_axis: int = -2,
        collective_matmul: bool = False,
        rngs: nnx.Rngs,
    ) -> None:
        if collective_matmul and not sequence_parallel:
            raise ValueError(
                "ColumnParallelLinear: collective_matmul=True replaces the all-gather of a "
                "sequence-parallel input; pass sequence_parallel=True with it."
            )
        super().__init__(
            in_features,
            out_features,
            use_bias=use_bias,
            dtype=dtype,
            param_dtype=param_dtype,
            precision=precision,
            kernel_init=kernel_init,
            bias_init=bias_init,
            model_axis=model_axis,
            sequence_parallel=sequence_parallel,
            sequence_axis=sequence_axis,
            rngs=rngs,
        )
        self.collective_matmul = collective_matmul

    def __call__(self, x: jax.Array) -> jax.Array:
        """``x @ kernel + bias``: this device's output columns inside ``shard_map``."""
        x, kernel, bias = self._promoted(x)
        axis = self.model_axis
        split = split_over(kernel, axis, 1, self.out_features, "ColumnParallelLinear")
        if not split:
            return add_bias(matmul(x, kernel, self.precision), bias)
        if not self.sequence_parallel:  # x's gradient is psum-ed over axis
            return add_bias(matmul(copy_to_model_axis(self, x, axis), kernel, self.precision), bias)
        dim = _sequence_dim(x, self.sequence_axis, "ColumnParallelLinear")
        if self.collective_matmul:
            with jax.named_scope(scopes.TENSOR_PARALLEL):
                y = ring_matmul(self, x, kernel, axis, dim, self.precision)
        else:
            y = matmul(gather_sequence(self, x, axis, dim), kernel, self.precision)
        return add_bias(y, bias)


class RowParallelLinear(_Linear):
    """``nnx.Linear`` with its input features split over ``model_axis`` (kernel ``(model_axis, None)``).

    Inside ``jax.shard_map(check_vma=True)`` it takes this device's input features (a
    ``ColumnParallelLinear``'s output) and ``psum``s its partial product, then adds the
    replicated bias; anywhere else it is ``nnx.Linear``. See the tensor-parallelism guide.
    Besides its own arguments (below) it takes ``nnx.Linear``'s, meaning what they mean
    there: the same ``rngs`` give the same parameters.

    Args:
      model_axis: The mesh axis the input features are split over.
      sequence_parallel: Reduce-scatter the output on ``sequence_axis`` instead of
        all-reducing it, as ``ColumnParallelLinear(sequence_parallel=True)`` takes it.
      sequence_axis: That dimension, as ``ColumnParallelLinear``'s.
    """

    def _specs(self, axis: str) -> tuple[tuple[str | None, ...], tuple[str | None, ...]]:
        return (axis, None), (None,)

    def __call__(self, x: jax.Array) -> jax.Array:
        """``x @ kernel + bias``, the partial products summed over ``model_axis`` inside ``shard_map``.

        Raises:
          ValueError: If ``x``'s last dimension is not the kernel's (local) rows.
        """
        axis = self.model_axis
        split = split_over(self.kernel[...], axis, 0, self.in_features, "RowParallelLinear")
        rows = self.kernel[...].shape[0]
        if x.shape[-1] != rows:
            rows_are = (
                f"its kernel's rows on this device: in_features={self.in_features} split over "
                f"{axis!r} of size {jax.lax.axis_size(axis)}"
                if split
                else "in_features"
            )
            raise ValueError(
                f"RowParallelLinear takes inputs whose last dimension is {rows} ({rows_are}); got "
                f"shape {x.shape}. Feed it a ColumnParallelLinear's output, whose features are "
                f"split over {axis!r} as this layer's kernel rows are."
            )
        x, kernel, bias = self._promoted(x)
        y = matmul(x, kernel, self.precision)
        if split:
            with jax.named_scope(scopes.TENSOR_PARALLEL):
                if self.sequence_parallel:
                    dim = _sequence_dim(y, self.sequence_axis, "RowParallelLinear")
                    declare_forward(
                        self, "reduce-scatter", axis, y, "the partial products, summed and scattered"
                    )
                    whole = y.shape
                    y = jax.lax.psum_scatter(y, axis, scatter_dimension=dim, tiled=True)
                    y = declare_backward(
                        self, "all-gather", axis, y, "the output's gradient, gathered", shape=whole
                    )
                else:
                    declare_forward(self, "all-reduce", axis, y, "the partial products, summed")
                    y = jax.lax.psum(y, axis)
        return add_bias(y, bias)
