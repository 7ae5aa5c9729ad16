"""Walking a traced program: each equation of a jaxpr and of those nested in it."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from jax.extend import core as jcore

__all__ = ["equations"]


def equations(jaxpr: Any, runs: int = 1) -> Iterator[tuple[Any, int]]:
    """Each equation of ``jaxpr`` and those inside it, with how often it runs (a scan's trips counted)."""
    for e in jaxpr.eqns:
        yield e, runs
        inner = runs * (e.params["length"] if e.primitive.name == "scan" else 1)
        for sub in jcore.jaxprs_in_params(e.params):
            yield from equations(getattr(sub, "jaxpr", sub), inner)
