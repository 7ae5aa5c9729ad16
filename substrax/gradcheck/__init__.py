"""Check a data-parallel gradient against a one-device reference (see the gradient-checks guide)."""

from substrax.gradcheck._check import GradientReport, compare_gradients

__all__ = ["GradientReport", "compare_gradients"]
