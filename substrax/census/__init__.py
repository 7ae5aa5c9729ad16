"""The communication census: every collective of a compiled program, counted, sized, and checked.

``census(compiled)`` returns a ``CensusReport``: one ``Collective`` row per collective
instruction XLA compiled in, with its buffers, replica groups (and mesh axes), bytes and
loops. ``expected_communication`` states what a data-parallel step of a layout should
communicate, and ``compare`` (or ``CensusReport.check``) holds a census against it,
giving a ``Comparison``. ``TrainStep.check_communication`` does all three for a step.

The package, one concept a module, each importing only those listed above it (and
``_text``, the tables of ``str()``):

- ``_hlo``: the HLO reader, a package of its own (the module text, async pairs, loop trip
  counts, replica groups, operation names); it imports nothing of substrax;
- ``_rows``: a ``Collective`` row per collective instruction, and its parts (``Part``:
  one per buffer, with its operation, library scope and phase);
- ``_expected``: ``expected_communication``, the layout's rule, as ``Expected``;
- ``_match``: the matching rule of ``compare`` and the sentences of its differences;
- ``_report``: ``census`` and ``compare``, and what they return: ``CensusReport`` and
  ``Comparison`` (``CensusReport.check`` compares, so both live here);
- ``_items``: a training step's expected communication, kind by kind (parameters,
  FSDP units, replicas, the layers' declarations, metrics, batch statistics);
- ``_step``: a training step's check, from plain values (the lowered step, its state,
  its options): ``_items``'s items and the update's own census, compared with its census.

``substrax.census`` is the function, not this package: ``substrax/__init__.py`` imports
``census`` from here, which rebinds the attribute after the package has loaded (a later
``import substrax.census`` leaves it so). Take the package's names with ``from
substrax.census import ...``; ``import substrax.census as m`` also gives the function.
"""

from substrax.census._expected import SOURCES, Expected, ExpectedCollective, expected_communication
from substrax.census._hlo import KINDS, Operand
from substrax.census._report import CensusReport, Comparison, KindTotal, census, compare
from substrax.census._rows import Collective, Part, library_scope, phase_of

__all__ = [
    "KINDS",
    "SOURCES",
    "CensusReport",
    "Collective",
    "Comparison",
    "Expected",
    "ExpectedCollective",
    "KindTotal",
    "Operand",
    "Part",
    "census",
    "compare",
    "expected_communication",
    "library_scope",
    "phase_of",
]
