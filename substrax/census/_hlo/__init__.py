"""A reader of optimized HLO text: the collective instructions a program runs, and what each says.

It knows HLO, not substrax: ``_module``, and ``_loops``, ``_buffers``, ``_groups``, ``_slices``,
which import only ``_module``; ``_sites`` imports ``_module`` and ``_loops``.
"""

from ._buffers import buffer_op_names, operand_buffers, result_buffers
from ._groups import Groups, mesh_axes, pair_shift, replica_groups, source_target_pairs
from ._loops import trip_count
from ._module import (
    KINDS,
    Computation,
    Instruction,
    Module,
    Operand,
    arrays,
    op_name,
    operand_name,
    parse_module,
)
from ._sites import Site, collective_sites
from ._slices import crossing, source_of, unpadded

__all__ = [
    "KINDS",
    "Computation",
    "Groups",
    "Instruction",
    "Module",
    "Operand",
    "Site",
    "arrays",
    "buffer_op_names",
    "collective_sites",
    "crossing",
    "mesh_axes",
    "op_name",
    "operand_name",
    "pair_shift",
    "operand_buffers",
    "parse_module",
    "replica_groups",
    "result_buffers",
    "source_of",
    "source_target_pairs",
    "trip_count",
    "unpadded",
]
