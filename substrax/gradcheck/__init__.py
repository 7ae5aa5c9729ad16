"""Check a data-parallel gradient against a one-device reference, leaf by leaf.

``compare_gradients`` runs the reference (one device), the implicit path, the explicit one
and, optionally, a candidate gradient function, and reports each parameter's relative
error, naming a constant factor (an axis size) when that is what went wrong. See the
gradient-checks guide.
"""

from substrax.gradcheck._check import GradientReport, compare_gradients

__all__ = ["GradientReport", "compare_gradients"]
