"""Text helpers of the census's ``str()``: an aligned table, a list cut short."""

from __future__ import annotations

import re
from collections.abc import Sequence

__all__ = ["short_op", "shorten", "table"]


def table(rows: Sequence[Sequence[str]], right: set[int]) -> list[str]:
    """``rows`` as aligned lines, indented by two spaces; the columns in ``right`` aligned right."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return [
        "  "
        + "  ".join(
            c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))
        ).rstrip()
        for r in rows
    ]


def shorten(items: Sequence[str], keep: int) -> str:
    """The first ``keep`` items joined by commas, then how many more."""
    shown = ", ".join(items[:keep])
    return shown + (f", +{len(items) - keep} more" if len(items) > keep else "")


_WRAPPER = re.compile(r"^(jit|pjit|shard_map|xla_computation)(\(.*\))?$")


def short_op(op_name: str, keep: int = 3, width: int = 80) -> str:
    """A JAX operation's name as a difference shows it: the last ``keep`` steps, without jit wrappers.

    ``"jit(pure)/jit(main)/shard_map/transpose(jvp(substrax.loss))/substrax.grad_reduce/psum"``
    becomes ``"transpose(jvp(substrax.loss))/substrax.grad_reduce/psum"``; the whole name
    stays on ``Part.op_name``.
    """
    steps = [s for s in op_name.split("/") if not _WRAPPER.match(s)]
    text = "/".join(steps[-keep:])
    if len(steps) > keep:
        text = ".../" + text
    return text if len(text) <= width else text[: width // 2 - 2] + "..." + text[-(width // 2 - 1) :]
