"""A reader of optimized HLO text: the collective instructions a program runs, and what each says.

It knows HLO, not substrax: its modules import one another (relatively) and nothing
else of substrax. One concept a module, each importing only ``_module``:

- ``_module``: ``parse_module`` reads the text of a compiled module
  (``compiled.as_text()``) into its computations and instructions; ``Operand`` is one
  array buffer, ``op_name`` the JAX operation an instruction came from;
- ``_sites``: ``collective_sites`` walks from ``ENTRY`` through every called computation
  (``while`` bodies with their trip counts, conditionals, calls, async wrappers) to each
  collective instruction, an asynchronous ``-start``/``-done`` pair counted once at its
  ``-start``;
- ``_buffers``: one instruction's buffers (``operand_buffers``, ``result_buffers``) and
  the JAX operation of each (``buffer_op_names``: XLA combines several collectives into
  one instruction, and the ``get-tuple-element`` that takes each result back out keeps
  its own operation's metadata);
- ``_groups``: its replica groups in any of HLO's three forms and the mesh axes they
  span (``replica_groups``, ``mesh_axes``), a collective-permute's pairs
  (``source_target_pairs``).
"""

from ._buffers import buffer_op_names, operand_buffers, result_buffers
from ._groups import Groups, mesh_axes, replica_groups, source_target_pairs
from ._module import KINDS, Computation, Instruction, Module, Operand, op_name, parse_module
from ._sites import Site, collective_sites

__all__ = [
    "KINDS",
    "Computation",
    "Groups",
    "Instruction",
    "Module",
    "Operand",
    "Site",
    "buffer_op_names",
    "collective_sites",
    "mesh_axes",
    "op_name",
    "operand_buffers",
    "parse_module",
    "replica_groups",
    "result_buffers",
    "source_target_pairs",
]
