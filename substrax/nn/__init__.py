"""Tensor-parallel layers (Megatron-style): parameters split over a model axis.

A ``ColumnParallelLinear`` splits its kernel ``(in, out)`` on the output features, a
``RowParallelLinear`` on the input features. Paired, column then row, as a
transformer's MLP (up, activation, down) or attention (query/key/value per head, then
the output projection), each device of the model axis computes its own block of
hidden features from the whole input and multiplies that block by its own rows of
the second kernel; the blocks' partial products are summed once:

    x (whole) -> column: x @ W1[:, block] -> act -> row: h_block @ W2[block, :] -> psum -> y (whole)

Where each collective goes, inside ``jax.shard_map(check_vma=True)`` with ``in_specs``
from ``nnx.get_partition_spec`` (the layers declare their splits as flax's
``out_sharding`` metadata):

- **forward**: one ``psum`` over the model axis per row layer (``RowParallelLinear``,
  ``ParallelSelfAttention``'s output projection), none in the column layer.
- **backward**: the column layer's input gradient is ``psum``-ed over the model axis:
  the whole input is typed equal over the axis and the kernel varying, so the layer
  casts the input to varying (``pcast``, Megatron's *f*; ``ParallelSelfAttention`` once
  for its three projections) and AD transposes that cast into the ``psum``. The row
  layer's ``psum`` transposes to nothing.
- **sequence parallel** (``sequence_parallel=True`` on both): between the pair the
  activations stay split over the model axis on the sequence dimension. The column
  layer all-gathers its input there (or, with ``collective_matmul=True``, passes
  blocks around a ring of ``ppermute``s, overlapping each with a matmul), the row layer
  reduce-scatters its output there instead of ``psum``-ing it; the backward pass swaps
  the two. ``ParallelSelfAttention(sequence_parallel=True)`` gathers the sequence once
  for its three projections, and its output projection reduce-scatters.
- ``ParallelEmbedding``: ``psum`` of the devices' lookups (vocabulary split) or an
  all-gather of their features (features split).

Every collective these layers write runs under ``jax.named_scope("substrax.tensor_parallel")``,
and each layer declares, where it writes one, what it moves forward and what AD's
transpose of it moves backward (``declare_forward``, ``declare_backward``): the census
of a step (``TrainStep.check_communication``) expects exactly those, per layer and
phase. A layer of your own that communicates over the same axis declares its own. The layers decide by the parameter's
type, not by a flag: a kernel typed varying over the model axis is a shard, and the
layer communicates; anywhere else (one device, no mesh, ``jax.jit`` over arrays placed
with ``NamedSharding``, where XLA places the collectives) the layers compute exactly
what ``nnx.Linear``, ``nnx.Embed`` and plain attention compute. Under
``check_vma=False`` nothing is typed varying; a layer that sees a shard there raises a
ValueError rather than compute wrong gradients.

Creating a layer with no mesh set gives ``nnx.Linear``'s (``nnx.Embed``'s) parameters
for the same ``rngs``, made by the same calls, whole, with the split only in the
metadata. Under ``jax.set_mesh`` of a mesh with the model axis, flax places them
split at creation (its eager sharding, on by default).
"""

from substrax.nn._attention import ParallelSelfAttention
from substrax.nn._declared import Declared, declare_backward, declare_forward
from substrax.nn._embed import ParallelEmbedding
from substrax.nn._linear import ColumnParallelLinear, RowParallelLinear

__all__ = [
    "ColumnParallelLinear",
    "Declared",
    "ParallelEmbedding",
    "ParallelSelfAttention",
    "RowParallelLinear",
    "declare_backward",
    "declare_forward",
]
