"""The communication census: every collective of a compiled program, counted, sized, and checked.

See the census guide. ``substrax.census`` is the function, not this package
(``substrax/__init__.py`` rebinds it); take the package's names with ``from substrax.census import ...``.
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
