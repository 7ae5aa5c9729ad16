"""The kinds as compared: implicit mode takes all-reduce and reduce-scatter as one."""

from __future__ import annotations

from substrax.census._expected import REDUCTIONS
from substrax.census._hlo import KINDS

__all__ = ["kind_key", "ordered_keys"]

_REDUCTION_KEY = "all-reduce + reduce-scatter"


def kind_key(kind: str, mode: str) -> str:
    """The kind as compared: implicit mode takes all-reduce and reduce-scatter as one."""
    return _REDUCTION_KEY if mode == "implicit" and kind in REDUCTIONS else kind


def ordered_keys(keys: set[str]) -> list[str]:
    """Kinds as ``kind_key`` gives them, in the order of ``KINDS`` (the joined reductions first)."""
    order = [_REDUCTION_KEY, *KINDS]
    return sorted(keys, key=lambda k: order.index(k) if k in order else len(order))
