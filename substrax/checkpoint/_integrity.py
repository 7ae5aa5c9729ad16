"""A saved step's integrity: its record of checksums (``checksum_record``), and ``read_step``."""

from __future__ import annotations

import json
import os
import re
import warnings
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath  # type: ignore[import-untyped]

from substrax.checkpoint._checksums import checksum_hex, everywhere, inspect_arrays
from substrax.checkpoint._errors import DamagedCheckpointError
from substrax.checkpoint._quiet import keep_dropping, leftovers_dropped, orbax_logs
from substrax.checkpoint._state import Key, Slot, check_tree, flatten, nest

__all__ = [
    "PACKAGE_DIR",
    "RECORD",
    "STEP_METADATA",
    "checksum_record",
    "read_record",
    "read_step",
    "reason",
    "saved_shapes",
    "unreadable",
]


RECORD = "substrax"  # the integrity record's key in a step's custom metadata
STEP_METADATA = "_CHECKPOINT_METADATA"  # orbax's file of a step's metadata, custom metadata included
PACKAGE_DIR = os.path.dirname(__file__)  # warnings point past it, at the caller's line


def reason(error: BaseException) -> str:
    """The first line of the innermost cause of ``error``: what went wrong, shortly."""
    while (error.__cause__ or error.__context__) is not None:
        error = error.__cause__ or error.__context__  # type: ignore[assignment]
    lines = str(error).strip().splitlines()
    line = lines[0].split(" [tensorstore_spec=")[0].strip() if lines else type(error).__name__
    return line if len(line) <= 300 else line[:297] + "..."


def unreadable(step: int, directory: str, slots: list[Slot], error: BaseException) -> DamagedCheckpointError:
    """The error for a step orbax could not read, naming the array when its error does."""
    names = {".".join(slot.key): slot.name for slot in slots}
    text = ""
    cause: BaseException | None = error
    while cause is not None:
        text += str(cause)
        cause = cause.__cause__ or cause.__context__
    found = [names[m] for m in re.findall(r"""['"]([^'"/]+)/""", text) if m in names]
    what = f"{found[0]} could not be read" if found else "its arrays could not be read"
    return DamagedCheckpointError(step, f"step {step} in {directory} is damaged: {what} ({reason(error)}).")


def checksum_record(slots: list[Slot], arrays: list[jax.Array], sums: np.ndarray) -> dict[str, Any]:
    """The record of checksums a step is saved with (under ``RECORD`` in its custom metadata)."""
    arrays_record = [
        {"key": list(slot.key), "shape": list(x.shape), "dtype": str(x.dtype), "checksum": checksum_hex(s)}
        for slot, x, s in zip(slots, arrays, sums)
    ]
    return {"version": 1, "arrays": arrays_record}


def read_step(
    orbax: ocp.CheckpointManager, directory: str, step: int, slots: list[Slot]
) -> tuple[list[jax.Array], list[dict[str, Any]] | None]:
    """The arrays of ``step`` (the slots' order and shardings) checked against its checksums, and its record.

    Orbax's noise goes to the ``substrax.checkpoint`` logger at DEBUG; orbax's error is the ``__cause__``.

    Raises:
      ValueError: If the step's arrays do not match the slots.
      DamagedCheckpointError: If the step cannot be read, or reads back altered.
    """
    where = f"step {step} in {directory}"
    record: list[dict[str, Any]] | None = None
    restored: dict[Key, jax.Array] = {}
    error: DamagedCheckpointError | None = None
    with orbax_logs() as logs, leftovers_dropped():
        try:
            record = read_record(directory, step)
            shapes = saved_shapes(orbax, directory, step, slots)
            if record is not None and {tuple(a["key"]): tuple(a["shape"]) for a in record} != shapes:
                raise DamagedCheckpointError(
                    step,
                    f"{where} is damaged: its index of arrays (default/_METADATA) disagrees with its "
                    f"checksums.",
                )
        except DamagedCheckpointError as e:
            error = e
        if error is None:
            check_tree(step, slots, shapes, directory)
            dtypes = {tuple(a["key"]): a["dtype"] for a in record} if record is not None else {}
            targets = nest({slot.key: slot.target(dtypes.get(slot.key)) for slot in slots})
            try:
                restored = dict(flatten(orbax.restore(step, args=ocp.args.StandardRestore(targets))))
            except Exception as e:  # noqa: BLE001  (orbax and TensorStore raise many kinds, at length)
                error = unreadable(step, directory, slots, e)
                error.__cause__ = e
        if error is not None:
            keep_dropping()  # the reads orbax abandoned end later
            logs.demote(f"reading the damaged step {step}")
    if not everywhere(error is None):
        raise error or DamagedCheckpointError(step, f"{where} is damaged: another process could not read it.")
    arrays = [restored[slot.key] for slot in slots]
    if record is None:
        warnings.warn(
            f"{where} has no checksums (saved by an earlier substrax): restored without checking them.",
            skip_file_prefixes=(PACKAGE_DIR,),
        )
        return arrays, None
    want = {tuple(a["key"]): a["checksum"] for a in record}
    _, sums = inspect_arrays(arrays)
    bad = [slot.name for slot, s in zip(slots, sums) if checksum_hex(s) != want[slot.key]]
    if bad:
        more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
        raise DamagedCheckpointError(
            step,
            f"{where} is damaged: {bad[0]}{more} does not match the checksum recorded when it was saved.",
        )
    return arrays, record


def read_record(directory: str, step: int) -> list[dict[str, Any]] | None:
    """The step's checksums as saved, or ``None`` for a step saved without them.

    Raises:
      DamagedCheckpointError: If the step's metadata file is missing or unreadable.
    """
    path = epath.Path(directory) / str(step) / STEP_METADATA
    damaged = f"step {step} in {directory} is damaged: its {STEP_METADATA}"
    try:
        metadata = json.loads(path.read_bytes())
    except FileNotFoundError as e:
        raise DamagedCheckpointError(step, f"{damaged} is missing.") from e
    except (OSError, ValueError) as e:
        raise DamagedCheckpointError(step, f"{damaged} cannot be read ({reason(e)}).") from e
    custom = metadata.get("custom_metadata") if isinstance(metadata, dict) else None
    record = custom.get(RECORD) if isinstance(custom, dict) else None
    if record is None:
        return None
    arrays = record.get("arrays") if isinstance(record, dict) else None
    fields = {"key", "shape", "dtype", "checksum"}
    if not isinstance(arrays, list) or not all(isinstance(a, dict) and fields <= a.keys() for a in arrays):
        raise DamagedCheckpointError(step, f"{damaged} holds a malformed record of checksums.")
    return arrays


def saved_shapes(
    orbax: ocp.CheckpointManager, directory: str, step: int, slots: list[Slot]
) -> dict[Key, tuple[int, ...]]:
    """The shapes of a step's arrays, as orbax's metadata of them says.

    Raises:
      DamagedCheckpointError: If the metadata is missing or unreadable.
    """
    if not (epath.Path(directory) / str(step) / "default").exists():
        raise DamagedCheckpointError(
            step,
            f"step {step} in {directory} is damaged: its arrays' directory (default/) is missing.",
        )
    try:
        metadata = orbax.item_metadata(step)
    except Exception as e:
        raise unreadable(step, directory, slots, e) from e
    tree = getattr(metadata, "tree", metadata)
    if not tree:
        raise DamagedCheckpointError(
            step,
            f"step {step} in {directory} is damaged: its index of arrays (default/_METADATA) is missing.",
        )
    return {key: tuple(getattr(value, "shape", ())) for key, value in flatten(tree)}
