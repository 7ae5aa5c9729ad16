"""The communication a data-parallel step should compile to: ``expected_communication``."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax.numpy as jnp
import numpy as np

from substrax._layout import LAYOUTS
from substrax.census._hlo import KINDS
from substrax.census._text import shorten

__all__ = [
    "MODES",
    "REDUCTIONS",
    "SOURCES",
    "Expected",
    "ExpectedCollective",
    "expected_communication",
    "sources_of",
]

MODES = ("implicit", "explicit")
REDUCTIONS = ("all-reduce", "reduce-scatter")

SOURCES = ("gradients", "parameters", "loss", "metrics", "batch stats", "update", "model", "pipeline")
"""What an expected buffer is for, in the order ``str()`` lists them.

``"gradients"``: a gradient's reduction; ``"parameters"``: an FSDP parameter gathered
before use; ``"loss"``, ``"metrics"``: their reductions; ``"batch stats"``: the explicit
step's average of a BatchNorm statistic; ``"update"``: what the optimizer update (and the
step's non-finite guard) communicates; ``"model"``: a collective the model's own forward or
backward pass issues: expected per layer from what ``substrax.nn``'s layers say they
write (explicit mode), or attributed from the compiled program (``compare(...,
attribute_model=True)``); ``"pipeline"``: a pipelined step's permutes between stages and
its sums over the ``stage`` axis (census guide, "Pipelines").
"""


@dataclass(frozen=True)
class ExpectedCollective:
    """One buffer a step should communicate.

    Attributes:
      kind: the collective, e.g. ``"reduce-scatter"``.
      what: the parameter's path, ``"loss"``, ``"metrics"``, ``"metric 'x'"``, a statistic's
        path; for update and model buffers, ``"<source>: <operation>"``.
      bytes: its bytes per device per step (a parameter's full, unsplit size).
      source: one of ``SOURCES``; ``""`` reads it from ``what`` (loss, metrics, else gradients).
      scopes: the library scopes it may be compiled under; ``None``: under none; ``()``: anywhere.
      optional: the step is right with or without it (``why`` says when it is absent).
      buffer: its element type and shape (``"f32[4,16]"``), ``""`` when not known.
      why: for an optional buffer, why the compiler may leave it out.
      phase: ``"forward"`` or ``"backward"`` for a model buffer, else ``None``.
      axes: the mesh axes its device groups span (``("model",)``); ``()``: any.
      in_loop: it runs once per microbatch, inside the loop (``bytes`` counts every run).
      per_run: ``bytes`` is one run's; the program's loops say how often it runs.
      shift: for a collective-permute, the step each device sends along ``axes`` (``+1``:
        to the next stage, ``-1``: to the previous); ``None``: any.
    """

    kind: str
    what: str
    bytes: int
    source: str = ""
    scopes: tuple[str | None, ...] = ()
    optional: bool = False
    buffer: str = ""
    why: str = ""
    phase: str | None = None
    axes: tuple[str, ...] = ()
    in_loop: bool = False
    per_run: bool = False
    shift: int | None = None

    @property
    def category(self) -> str:
        """``source``, or the source ``what`` implies."""
        if self.source:
            return self.source
        if self.what == "loss":
            return "loss"
        return "metrics" if self.what.startswith("metric") else "gradients"

    def __str__(self) -> str:
        buffer = f" {self.buffer}" if self.buffer and self.buffer not in self.what else ""
        optional = ", optional" if self.optional else ""
        return f"{self.what}{buffer} ({self.kind}, {self.bytes:,} B{optional})"


@dataclass(frozen=True)
class Expected:
    """The communication a data-parallel step should compile to, per device and per step.

    Attributes:
      layout: ``"replicated"``, ``"zero1"``, ``"fsdp"`` or ``"hsdp"`` (as ``"fsdp"``; the
        cross-replica reduction is added by the step's check).
      mode: ``"implicit"`` or ``"explicit"``.
      microbatches: the gradient-accumulation steps (the library's collectives run once).
      items: the buffers (``ExpectedCollective``), by source (``SOURCES``).
    """

    layout: str
    mode: str
    microbatches: int
    items: tuple[ExpectedCollective, ...]

    def bytes(self, kind: str | None = None, *, optional: bool = False) -> int:
        """Bytes per step of ``kind`` (all kinds when ``None``); optional buffers only if ``optional``."""
        return sum(
            i.bytes for i in self.items if (kind is None or i.kind == kind) and (optional or not i.optional)
        )

    @property
    def kinds(self) -> tuple[str, ...]:
        """The kinds called for, in the order of ``KINDS``."""
        present = {i.kind for i in self.items}
        return tuple(k for k in KINDS if k in present)

    def with_items(self, items: Sequence[ExpectedCollective]) -> Expected:
        """The same expectation with ``items`` added."""
        return dataclasses.replace(self, items=self.items + tuple(items))

    def __str__(self) -> str:
        lines = [f"expected communication: {self.layout}, {self.mode}, {self.microbatches} microbatch(es)"]
        for source in sources_of(self.items):
            for kind in self.kinds:
                chosen = [i for i in self.items if i.kind == kind and i.category == source]
                if not chosen:
                    continue
                whats = [i.what + (" (optional)" if i.optional else "") for i in chosen]
                total = sum(i.bytes for i in chosen)
                lines.append(f"  {source:<11} {kind:<15} {total:>14,} B  ({shorten(whats, 6)})")
        return "\n".join(lines)


def sources_of(items: Sequence[ExpectedCollective]) -> list[str]:
    """The sources of ``items``, in the order of ``SOURCES`` (any other after them, sorted)."""
    present = {i.category for i in items}
    return [s for s in SOURCES if s in present] + sorted(present - set(SOURCES))


def expected_communication(
    leaves: Sequence[tuple[str, Sequence[int], Any, bool]],
    *,
    layout: str,
    mode: str,
    microbatches: int = 1,
    extra_reduce_bytes: int = 0,
    loss_bytes: int = 4,
    communicated_dtype: Any = None,
    update: Sequence[ExpectedCollective] | None = None,
    precision: Any = None,
) -> Expected:
    """The collectives a data-parallel step of ``layout`` should compile to (census guide, "The expectation").

    Args:
      leaves: one ``(path, shape, dtype, split)`` per trainable parameter; ``split`` says
        the parameter (``"fsdp"``) or its optimizer state (``"zero1"``) is split over the
        data axis. Ignored for ``"replicated"``.
      layout: one of ``LAYOUTS``.
      mode: ``"implicit"`` or ``"explicit"``; recorded for ``compare``.
      microbatches: the gradient-accumulation steps, at least 1.
      extra_reduce_bytes: the bytes of the metrics the step reduces.
      loss_bytes: the bytes of the reduced loss (a float32 scalar: 4; 0: none).
      communicated_dtype: optional; the floating type narrower leaves are moved in; pass
        ``"float32"`` to predict a CPU program (XLA CPU moves bfloat16 as float32).
      update: optional; the optimizer update's own communication (``update_items``),
        replacing the rule's guess (ZeRO-1's all-gather of each updated parameter).
      precision: optional; a ``substrax.MixedPrecision`` policy: parameters gathered in its
        ``param_dtype``, gradients reduced in its ``reduce_dtype`` (as the explicit step does).

    Returns:
      An ``Expected``.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"expected_communication: layout must be one of {LAYOUTS}, not {layout!r}")
    if mode not in MODES:
        raise ValueError(f"expected_communication: mode must be one of {MODES}, not {mode!r}")
    if microbatches < 1:
        raise ValueError(f"expected_communication: microbatches must be at least 1, not {microbatches}")
    items: list[ExpectedCollective] = []
    for path, shape, dtype, split in leaves:
        for kind in _leaf_kinds(layout, split):
            source = (
                "gradients"
                if kind in REDUCTIONS
                else "parameters"
                if layout in ("fsdp", "hsdp")
                else "update"
            )
            if source == "update" and update is not None:
                continue
            moved = dtype
            if precision is not None and jnp.issubdtype(np.dtype(dtype), jnp.floating):
                if source == "gradients":
                    moved = precision.reduce_dtype
                elif source == "parameters":
                    moved = precision.param_dtype
            itemsize = _itemsize(moved, communicated_dtype)
            size = math.prod(shape) * itemsize
            buffer = f"{_hlo_type(moved, itemsize)}[{','.join(str(d) for d in shape)}]"
            items.append(ExpectedCollective(kind, str(path), size, source, buffer=buffer))
    if loss_bytes:
        items.append(ExpectedCollective("all-reduce", "loss", loss_bytes, "loss"))
    if extra_reduce_bytes:
        items.append(ExpectedCollective("all-reduce", "metrics", extra_reduce_bytes, "metrics"))
    items.extend(update or ())
    return Expected(layout, mode, microbatches, tuple(items))


def _itemsize(dtype: Any, communicated: Any) -> int:
    leaf = np.dtype(dtype)
    if communicated is None or not jnp.issubdtype(leaf, jnp.floating):
        return leaf.itemsize
    return max(leaf.itemsize, np.dtype(communicated).itemsize)


def _hlo_type(dtype: Any, itemsize: int) -> str:
    """The HLO name of ``dtype`` moved in ``itemsize`` bytes (``"f32"``, ``"bf16"``, ``"s32"``)."""
    kind = np.dtype(dtype).kind
    if kind == "b":
        return "pred"
    letter = {"f": "f", "V": "bf", "i": "s", "u": "u", "c": "c"}.get(kind, "?")
    if np.dtype(dtype).name == "bfloat16" and itemsize == 2:
        letter = "bf"
    elif letter == "bf":
        letter = "f"
    return f"{letter}{itemsize * 8}"


def _leaf_kinds(layout: str, split: bool) -> tuple[str, ...]:
    if layout == "replicated" or not split:
        return ("all-reduce",)
    if layout == "zero1":
        return ("reduce-scatter", "all-gather")
    return ("all-gather", "reduce-scatter")
