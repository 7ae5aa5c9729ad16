"""The communication census: every collective of a compiled program, counted, sized, and checked.

See the census guide. This package is callable as its function ``census``:
``substrax.census(compiled)`` is ``substrax.census.census(compiled)``.
"""

import sys
import types
from typing import Any

from substrax.census._expected import SOURCES, Expected, ExpectedCollective, expected_communication

# the library's other packages' (the mode chooser, the plan, the timeline), not in __all__
from substrax.census._hlo import KINDS, Operand, arrays, operand_name, parse_module, trip_count
from substrax.census._platform import program_platform
from substrax.census._report import CensusReport, Comparison, KindTotal, census, compare
from substrax.census._rows import Collective, Part, library_scope, phase_of
from substrax.census._step import check_communication, expected_step

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


class _Census(types.ModuleType):
    """The census package, called as its ``census`` function."""

    def __call__(self, compiled: Any, *, mesh: Any = None) -> CensusReport:
        """``census(compiled, mesh=mesh)``: every collective of a compiled program."""
        return census(compiled, mesh=mesh)


sys.modules[__name__].__class__ = _Census
