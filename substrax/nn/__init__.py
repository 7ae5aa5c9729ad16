"""Tensor-parallel layers (Megatron-style): parameters split over a model axis.

``ColumnParallelLinear`` splits its kernel on the output features, ``RowParallelLinear``
on the input features; paired, column then row, they communicate once per pass. Inside
``jax.shard_map(check_vma=True)`` the layers write their collectives (and declare them
for the census); anywhere else they compute what ``nnx.Linear``, ``nnx.Embed`` and plain
attention compute. See the tensor-parallelism guide. ``scan_layers`` runs a stack of
layers made by ``nnx.vmap`` (the layouts guide, "Units").
"""

from substrax._base.declared import Declared
from substrax.nn._attention import ParallelSelfAttention
from substrax.nn._declare import declare_backward, declare_forward
from substrax.nn._embed import ParallelEmbedding
from substrax.nn._linear import ColumnParallelLinear, RowParallelLinear
from substrax.nn._scan import scan_layers

__all__ = [
    "ColumnParallelLinear",
    "Declared",
    "ParallelEmbedding",
    "ParallelSelfAttention",
    "RowParallelLinear",
    "declare_backward",
    "declare_forward",
    "scan_layers",
]
