"""The communication census: every collective of a compiled program, counted, sized, and checked.

``census(compiled)`` returns a ``CensusReport``: one ``Collective`` row per collective
instruction XLA compiled in, with its buffers, replica groups (and mesh axes), bytes and
loops. ``expected_communication`` states what a data-parallel step of a layout should
communicate, and ``compare`` (or ``CensusReport.check``) holds a census against it,
giving a ``Comparison``. ``TrainStep.check_communication`` does all three for a step.

The package, one concept a module, each importing only those above it:

- ``_hlo``: the HLO reader (the module text, async pairs, loop trip counts, replica
  groups, operation names); it imports nothing of substrax;
- ``_report``: ``census``, ``CensusReport``, ``Collective``, ``Part``;
- ``_expected``: ``expected_communication``, ``Expected``, ``ExpectedCollective``;
- ``_compare``: ``compare``, ``Comparison``;
- ``_step``: a training step's expected communication and its check, from plain values
  (the lowered step, its state, its options).

``substrax.census`` is the function, not this package: ``substrax/__init__.py`` imports
``census`` from here, which rebinds the attribute after the package has loaded (a later
``import substrax.census`` leaves it so). Take the package's names with ``from
substrax.census import ...``; ``import substrax.census as m`` also gives the function.
"""

from substrax.census._compare import Comparison, compare
from substrax.census._expected import SOURCES, Expected, ExpectedCollective, expected_communication
from substrax.census._hlo import KINDS, Operand
from substrax.census._report import CensusReport, Collective, KindTotal, Part, census, library_scope, phase_of

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
