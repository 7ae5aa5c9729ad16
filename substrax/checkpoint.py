"""Checkpoints of a model and its optimizer in any layout, written and read by orbax.

A checkpoint holds every array of ``nnx.state(model)`` and ``nnx.state(optimizer)``
(parameters, optimizer state, batch statistics, random-stream keys), each written by the
processes that hold its shards. ``restore`` reads it back into the model and optimizer
**in the layout they have now** (replicated, ZeRO-1 or FSDP, on this mesh or on one
device), whatever layout the checkpoint was saved from: each array is read straight into
the sharding of the array it replaces.

Orbax writes a step into a temporary directory and renames it when every process has
finished, so a save cut short (a killed process, a lost machine) leaves the earlier
checkpoints as they were, and the half-written one is never read. Beyond that, nothing
saved is lost to a fault:

- ``save`` refuses a state with a NaN or an infinity in a floating array
  (``NonFiniteStateError``), so a diverged state never rotates the finite steps out.
- Each step records a checksum of every array's values (in its ``_CHECKPOINT_METADATA``),
  and ``restore`` checks them: a step with a file altered, cut short or missing is
  refused with one line naming the step and the damage (``DamagedCheckpointError``);
  asked for the latest step, ``restore`` falls back to the newest step that is whole,
  with a warning.
- A ``CheckpointManager`` claims its directory for its run (the file ``substrax.lock``)
  until ``close``; another run's manager is refused (``DirectoryInUseError``).
- A step that ``max_to_keep`` rotates out is renamed out of the listing before it is
  deleted, so a kill during the deletion never leaves a half-deleted step listed.
- After a SIGTERM (to any process of a run), the next ``save`` saves its step and ends
  the processes with code 143.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import re
import shlex
import shutil
import signal
import socket
import sys
import threading
import time
import uuid
import warnings
import weakref
from collections.abc import Iterator, Mapping, Sequence
from types import FrameType, TracebackType
from typing import Any, Self

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from etils import epath  # type: ignore[import-untyped]
from flax import nnx
from jax.experimental import multihost_utils

from substrax._train_step import BoundTrainStep
from substrax._tree import path_str
from substrax.launch._env import launch_env

__all__ = [
    "CheckpointManager",
    "DamagedCheckpointError",
    "DirectoryInUseError",
    "NonFiniteStateError",
    "restore",
    "save",
]

Key = tuple[str, ...]
_ROOTS = ("model", "optimizer")
_LOCK_FILE = "substrax.lock"  # a run's claim on its checkpoint directory
_RECORD = "substrax"  # the integrity record's key in a step's custom metadata
_STEP_METADATA = "_CHECKPOINT_METADATA"  # orbax's file of a step's metadata, custom metadata included
_TRASH = ".substrax-trash"  # where orbax moves a step rotated out; the manager deletes it from there
_DAMAGED = ".substrax-damaged"  # where a writing manager moves the damaged steps a restore skipped
_SIGTERM_EXIT = 128 + signal.SIGTERM  # 143: the exit status a SIGTERM would have given


class NonFiniteStateError(ValueError):
    """``save`` was given a state with a NaN or an infinity in a floating array; nothing was saved."""


class DamagedCheckpointError(ValueError):
    """A saved step does not read back as it was saved: a file is missing, cut short or altered.

    Attributes:
      step: The damaged step.
    """

    def __init__(self, step: int, message: str) -> None:
        super().__init__(message)
        self.step = step

    def __reduce__(self) -> tuple[type, tuple[int, str]]:
        return type(self), (self.step, str(self))


class DirectoryInUseError(RuntimeError):
    """The checkpoint directory is claimed by another run, or by another manager of this process."""


class _Slot:
    """One variable of the state: where it lives, and its array as orbax reads and writes it."""

    def __init__(self, root: str, path: tuple[Any, ...], variable: nnx.Variable[Any]) -> None:
        self.key: Key = (root, *map(str, path))
        self.name = path_str(path, root)  # as the user reads it: model['hidden']['kernel']
        self.variable = variable
        self.value = variable.get_raw_value()

    @property
    def is_key(self) -> bool:
        """Whether the value is a typed PRNG key array (stored as its raw ``uint32`` data)."""
        return isinstance(self.value, jax.Array) and jnp.issubdtype(self.value.dtype, jax.dtypes.prng_key)

    def saved(self) -> jax.Array:
        """The array to write."""
        value = self.value
        if isinstance(value, jax.Array) and value.is_deleted():
            raise ValueError(
                f"{self.name} has been deleted (donated to a step): a model bound by "
                f"make_train_step(...).bind holds no state until the bound step's sync(); call "
                f"fast.sync() first, or pass the bound step to save in place of the model and optimizer."
            )
        return jax.random.key_data(value) if self.is_key else jnp.asarray(value)

    def target(self, dtype: Any = None) -> jax.ShapeDtypeStruct:
        """What to read: the shape and sharding of the array held now, in ``dtype`` or its own."""
        if isinstance(self.value, jax.Array) and self.value.is_deleted():
            raise ValueError(
                f"{self.name} has been deleted (donated to a step): its model is bound by "
                f"make_train_step(...).bind, whose step would not see restored values. Restore "
                f"before binding, or bind again after restoring."
            )
        value = jax.random.key_data(self.value) if self.is_key else jnp.asarray(self.value)
        return jax.ShapeDtypeStruct(value.shape, dtype or value.dtype, sharding=value.sharding)

    def fill(self, array: jax.Array) -> None:
        """Put the restored ``array`` in the variable, with the current value's dtype and key type.

        A value not committed to a device (an unplaced model's: jit may move it to the
        step's mesh) is replaced by one that is not committed either.
        """
        dtype = self.target().dtype
        if array.dtype != dtype:
            array = array.astype(dtype)
        if not getattr(self.value, "committed", False):
            array = jax.device_put(np.asarray(array))
        if self.is_key:
            array = jax.random.wrap_key_data(array, impl=jax.random.key_impl(self.value))
        self.variable.set_raw_value(array)


def _slots(model: nnx.Module, optimizer: nnx.Optimizer) -> list[_Slot]:
    """Every variable of ``model`` and ``optimizer``, keyed ``("model", *path)`` or ``("optimizer", *path)``.

    Path entries are strings (an optax state's tuple index ``0`` becomes ``"0"``), so the
    keys are those of the nested dict orbax writes.
    """
    out = []
    for root, obj in zip(_ROOTS, (model, optimizer), strict=True):
        for path, variable in nnx.to_flat_state(nnx.state(obj)):
            out.append(_Slot(root, tuple(path), variable))
    return out


def _nest(flat: Mapping[Key, Any]) -> dict[str, Any]:
    """A nested dict of string keys from a flat mapping of key tuples."""
    tree: dict[str, Any] = {}
    for key, value in flat.items():
        node = tree
        for part in key[:-1]:
            node = node.setdefault(part, {})
        node[key[-1]] = value
    return tree


def _flatten(tree: Any, prefix: Key = ()) -> Iterator[tuple[Key, Any]]:
    """The leaves of a nested mapping with their key tuples, in insertion order."""
    if isinstance(tree, Mapping):
        for k, v in tree.items():
            yield from _flatten(v, (*prefix, str(k)))
    else:
        yield prefix, tree


def _check_args(model: Any, optimizer: Any) -> None:
    """Refuse a bound step given with an optimizer, or a model without one."""
    if isinstance(model, BoundTrainStep) and optimizer is not None:
        raise TypeError("pass a bound step alone, in place of the model and optimizer.")
    if not isinstance(model, BoundTrainStep) and optimizer is None:
        raise TypeError("save needs the optimizer too (or a bound step in place of both).")


def _unpack(model: Any, optimizer: Any) -> tuple[nnx.Module, nnx.Optimizer]:
    """``(model, optimizer)``, from a bound step (synced first) or as given."""
    if isinstance(model, BoundTrainStep):
        model.sync()
        return model.model, model.optimizer
    return model, optimizer


def _directory(directory: str | os.PathLike[str]) -> str:
    """``directory`` as orbax wants it: an absolute local path, or a URL as given."""
    text = os.fspath(directory)
    return text if "://" in text else os.path.abspath(text)


def _check_tree(step: int, slots: list[_Slot], saved: Mapping[Key, tuple[int, ...]], directory: str) -> None:
    """Refuse a checkpoint whose arrays (``saved``: their shapes) do not match the state's, naming the first."""
    where = f"the checkpoint at step {step} in {directory}"
    have = {slot.key: slot for slot in slots}
    for slot in slots:
        if slot.key not in saved:
            raise ValueError(f"{slot.name} is in the model or optimizer but not in {where}.")
    for key in saved:
        if key not in have:
            raise ValueError(
                f"{path_str(key[1:], key[0])} is in {where} but not in the model or optimizer "
                f"(a parameter the model lacks, or an optimizer of another kind)."
            )
    for slot in slots:
        want, got = tuple(slot.target().shape), tuple(saved[slot.key])
        if want != got:
            raise ValueError(
                f"{slot.name} has shape {want}, but {where} holds it with shape {got}; a model "
                f"of another size, or a checkpoint of another model."
            )


# --- finiteness and checksums --------------------------------------------------------------

_U32 = np.uint32
_UNSIGNED = {2: jnp.uint2, 4: jnp.uint4, 8: jnp.uint8, 16: jnp.uint16, 32: jnp.uint32}
_ON_HOST = 1 << 16  # elements: a smaller array held by this process alone is checked by NumPy


def _mix(h: Any) -> Any:
    """murmur3's 32-bit finalizer (of a NumPy or a JAX ``uint32`` array): each input bit flips
    each output bit with probability 1/2."""
    h = h ^ (h >> 16)
    h = h * _U32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * _U32(0xC2B2AE35)
    return h ^ (h >> 16)


def _hashed(words: Any, index: Any) -> tuple[Any, Any]:
    """Two hashes of each word with its position, whose sums are the checksum."""
    where = _mix(index * _U32(0x9E3779B1) + _U32(0x7F4A7C15))
    return _mix(words ^ where), _mix(words + _mix(where ^ _U32(0x27D4EB2F)))


def _bits(dtype: Any) -> int:
    if jnp.issubdtype(dtype, jnp.integer):
        return int(jnp.iinfo(dtype).bits)
    if jnp.issubdtype(dtype, jnp.floating):
        return int(jnp.finfo(dtype).bits)
    return 8 * np.dtype(dtype).itemsize


def _words(x: jax.Array) -> jax.Array:
    """The bits of ``x`` as ``uint32`` words: one per element (two, on a last axis, for 64 bits)."""
    if jnp.issubdtype(x.dtype, jnp.complexfloating):
        return _words(jnp.stack([jnp.real(x), jnp.imag(x)], axis=-1))
    if x.dtype == jnp.bool_:
        return x.astype(_U32)
    bits = _bits(x.dtype)
    if bits == 64:
        return jax.lax.bitcast_convert_type(x, jnp.uint32)
    if bits not in _UNSIGNED:
        return _words(x.astype(jnp.float32))
    return jax.lax.bitcast_convert_type(x, _UNSIGNED[bits]).astype(_U32)


@jax.jit
def _inspect_on_device(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Whether ``x`` is finite, and its checksum, read where its shards live."""
    w = _words(x)
    index = jnp.zeros(w.shape, _U32)
    stride = 1
    for axis in reversed(range(w.ndim)):
        index = index + jax.lax.broadcasted_iota(_U32, w.shape, axis) * _U32(stride % 2**32)
        stride *= w.shape[axis]
    first, second = _hashed(w, index)
    finite = jnp.all(jnp.isfinite(x)) if jnp.issubdtype(x.dtype, jnp.inexact) else jnp.array(True)
    return finite, jnp.stack([jnp.sum(first, dtype=_U32), jnp.sum(second, dtype=_U32)])


def _on_host(x: jax.Array) -> bool:
    """Whether NumPy checks ``x``: small, held by this process alone, of 8, 16 or 32 bits."""
    dtype = x.dtype
    return (
        x.size <= _ON_HOST
        and x.is_fully_addressable
        and not jnp.issubdtype(dtype, jnp.complexfloating)
        and (dtype == jnp.bool_ or _bits(dtype) in (8, 16, 32))
    )


def _inspect_on_host(x: jax.Array) -> tuple[bool, np.ndarray]:
    """``_inspect_on_device``'s answer, from a host copy (a small array: no compile)."""
    a = np.asarray(x).reshape(-1)
    if a.dtype == np.bool_:
        words = a.astype(_U32)
    else:
        words = a.view(np.dtype(f"uint{_bits(a.dtype)}")).astype(_U32)
    first, second = _hashed(words, np.arange(a.size, dtype=_U32))
    finite = not jnp.issubdtype(a.dtype, jnp.inexact) or bool(np.isfinite(a).all())
    return finite, np.array([first.sum(dtype=_U32), second.sum(dtype=_U32)], _U32)


def _to_host(x: jax.Array) -> np.ndarray:
    """A small result of a jitted reduction, on the host of every process."""
    if x.is_fully_addressable or x.is_fully_replicated:
        return np.asarray(x)
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def _inspect(arrays: Sequence[jax.Array]) -> tuple[np.ndarray, np.ndarray]:
    """Whether each array is finite (a floating one), and its checksum: ``bool[n]``, ``uint32[n, 2]``.

    The checksum is two 32-bit sums of each element's bits hashed with its position:
    integer sums wrap exactly in any order, so the same values give the same checksum
    in every layout and on any number of processes. A large or multi-process array is
    read where its shards live, by one jitted reduction (compiled once per shape, dtype
    and sharding: the layers of a deep model share a few); a small one of this process
    alone is copied to the host and read by NumPy, the same sums without a compile.
    """
    finite, sums = np.ones(len(arrays), bool), np.zeros((len(arrays), 2), _U32)
    pending = {}
    for i, x in enumerate(arrays):
        if _on_host(x):
            finite[i], sums[i] = _inspect_on_host(x)
        else:
            pending[i] = _inspect_on_device(x)
    for i, (got_finite, got_sums) in pending.items():
        finite[i], sums[i] = bool(_to_host(got_finite)), _to_host(got_sums)
    return finite, sums


def _hex(checksum: np.ndarray) -> str:
    return "".join(f"{int(word):08x}" for word in checksum)


def _jax_preemption_service() -> bool:
    """Whether JAX's preemption service is on (it catches SIGTERM on a multi-process run)."""
    return bool(getattr(jax.config, "jax_enable_preemption_service", False))


def _everywhere(ok: bool) -> bool:
    """Whether ``ok`` holds on every process (a collective on a multi-process run)."""
    if jax.process_count() == 1:
        return ok
    return bool(np.all(multihost_utils.process_allgather(np.array([ok]))))


# --- what a damaged step says ---------------------------------------------------------------


def _reason(error: BaseException) -> str:
    """The first line of the innermost cause of ``error``: what went wrong, shortly."""
    while (error.__cause__ or error.__context__) is not None:
        error = error.__cause__ or error.__context__  # type: ignore[assignment]
    lines = str(error).strip().splitlines()
    line = lines[0].split(" [tensorstore_spec=")[0].strip() if lines else type(error).__name__
    return line if len(line) <= 300 else line[:297] + "..."


def _unreadable(
    step: int, directory: str, slots: list[_Slot], error: BaseException
) -> DamagedCheckpointError:
    """The error for a step orbax could not read, naming the array when its error does."""
    names = {".".join(slot.key): slot.name for slot in slots}
    text = ""
    cause: BaseException | None = error
    while cause is not None:
        text += str(cause)
        cause = cause.__cause__ or cause.__context__
    found = [names[m] for m in re.findall(r"""['"]([^'"/]+)/""", text) if m in names]
    what = f"{found[0]} could not be read" if found else "its arrays could not be read"
    return DamagedCheckpointError(step, f"step {step} in {directory} is damaged: {what} ({_reason(error)}).")


# --- the claim on a directory ---------------------------------------------------------------


def _process_state(pid: int) -> tuple[bool, int | None] | None:
    """``(alive, start)`` of process ``pid`` on this host, or ``None`` when it is gone.

    ``alive`` is false for a zombie (dead, not yet reaped). ``start`` is when it started,
    in clock ticks after boot, where ``/proc`` tells it: a later process given the same
    pid has another.
    """
    if os.path.exists("/proc/self/stat"):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            return fields[0] not in ("Z", "X"), int(fields[19])
        except FileNotFoundError:
            return None
        except (OSError, ValueError, IndexError):
            pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        pass
    return True, None


def _run_identity() -> str:
    """The run this process belongs to, as each of its processes names it."""
    with contextlib.suppress(RuntimeError):
        env = launch_env()
        if env is not None:
            return (
                f"substrax.launch run of {env.num_processes} processes, launcher pid "
                f"{env.launcher_pid}, coordinator {env.coordinator_address}"
            )
    if "SLURM_JOB_ID" in os.environ:
        return f"SLURM job {os.environ['SLURM_JOB_ID']}"
    if "JAX_COORDINATOR_ADDRESS" in os.environ:
        return f"jax.distributed run, coordinator {os.environ['JAX_COORDINATOR_ADDRESS']}"
    return f"process {os.getpid()} on {socket.gethostname()}"


def _new_claim() -> dict[str, Any]:
    pid = os.getpid()
    state = _process_state(pid)
    return {
        "host": socket.gethostname(),
        "pid": pid,
        "started": state[1] if state else None,
        "run": _run_identity(),
        "command": shlex.join(sys.argv)[:300],
        "since": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "token": uuid.uuid4().hex,
    }


def _read_claim(path: str) -> dict[str, Any] | None:
    """The claim in the file ``path``: ``None`` when there is none, ``{}`` when it cannot be read."""
    for _ in range(20):
        try:
            with open(path) as f:
                text = f.read()
        except FileNotFoundError:
            return None
        except OSError:
            return {}
        if text:
            try:
                claim = json.loads(text)
            except ValueError:
                return {}
            return claim if isinstance(claim, dict) else {}
        time.sleep(0.05)  # created an instant ago, not yet written
    return {}


def _write_claim(path: str, claim: dict[str, Any]) -> bool:
    """Create ``path`` holding ``claim``; ``False`` if it exists."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(claim))
        f.flush()
        os.fsync(f.fileno())
    return True


def _is_stale(claim: dict[str, Any]) -> bool:
    """Whether ``claim`` was made by a process of this host that is gone."""
    if claim.get("host") != socket.gethostname() or not isinstance(claim.get("pid"), int):
        return False
    state = _process_state(claim["pid"])
    if state is None or not state[0]:
        return True
    started = claim.get("started")
    return started is not None and state[1] is not None and started != state[1]


def _owner(claim: dict[str, Any]) -> str:
    return (
        f"pid {claim.get('pid')} on {claim.get('host')} since {claim.get('since')} "
        f"({claim.get('run')}: {claim.get('command')})"
    )


def _in_use(directory: str, path: str, claim: dict[str, Any]) -> str:
    if not claim:
        return (
            f"{directory} is claimed by a run whose claim {path} cannot be read; if no run "
            f"uses the directory, delete that file."
        )
    if claim.get("host") == socket.gethostname() and claim.get("pid") == os.getpid():
        return (
            f"{directory} is already open in this process (since {claim.get('since')}): a "
            f"checkpoint directory belongs to one CheckpointManager at a time; close the other first."
        )
    return (
        f"{directory} is in use by another run: {_owner(claim)}. A checkpoint directory "
        f"belongs to one run at a time: wait for that run to end, or give this one another "
        f"directory; if that run is gone (its host lost), delete {path}."
    )


def _claim(directory: str) -> dict[str, Any]:
    """Claim ``directory`` for this process: take the lock file, or a stale one (with a warning).

    Raises:
      DirectoryInUseError: If a live process holds it, or one on another host.
    """
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, _LOCK_FILE)
    mine = _new_claim()
    for _ in range(10):
        if _write_claim(path, mine):
            return mine
        held = _read_claim(path)
        if held is None:
            continue  # released meanwhile
        if not held or not _is_stale(held):
            raise DirectoryInUseError(_in_use(directory, path, held))
        aside = f"{path}.stale-{mine['token']}"
        try:
            os.rename(path, aside)
        except FileNotFoundError:
            continue
        moved = _read_claim(aside)
        if moved and moved.get("token") != held.get("token"):
            with contextlib.suppress(OSError):
                os.link(aside, path)  # a live claim made since we read: put it back
        else:
            warnings.warn(
                f"took over {directory} from a run that is gone: {_owner(held)}; that process "
                f"no longer runs.",
                stacklevel=4,
            )
        with contextlib.suppress(OSError):
            os.unlink(aside)
    raise DirectoryInUseError(f"could not claim {directory}: its claim file {path} kept changing.")


def _release(path: str | None, token: str | None) -> None:
    """Delete the claim file ``path`` if it still holds the claim ``token``."""
    if path is None:
        return
    held = _read_claim(path)
    if held and held.get("token") == token:
        with contextlib.suppress(OSError):
            os.unlink(path)


# --- SIGTERM --------------------------------------------------------------------------------


class _Sigterm:
    """One SIGTERM handler for every manager that listens: it only notes the signal."""

    pending = False
    listeners = 0
    previous: Any = signal.SIG_DFL

    @classmethod
    def listen(cls) -> bool:
        """Listen, if this is the main thread (the only one that may set handlers)."""
        if threading.current_thread() is not threading.main_thread():
            return False
        if cls.listeners == 0:
            previous = signal.signal(signal.SIGTERM, _note_sigterm)
            if previous is not _note_sigterm:  # not left behind by a manager collected in another thread
                cls.previous = signal.SIG_DFL if previous is None else previous
        cls.listeners += 1
        return True

    @classmethod
    def stop(cls) -> None:
        cls.listeners -= 1
        if cls.listeners == 0 and signal.getsignal(signal.SIGTERM) is _note_sigterm:
            with contextlib.suppress(ValueError):  # not the main thread (a finalizer): leave it
                signal.signal(signal.SIGTERM, cls.previous)


def _note_sigterm(signum: int, frame: FrameType | None) -> None:
    if _Sigterm.pending:  # the second: what SIGTERM did before, now
        signal.signal(signal.SIGTERM, _Sigterm.previous)
        os.kill(os.getpid(), signal.SIGTERM)
    _Sigterm.pending = True


def _let_go(lock: str | None, token: str | None, listening: bool) -> None:
    """Release a manager's claim and stop it listening for SIGTERM (at close, or when collected)."""
    try:
        _release(lock, token)
    finally:
        if listening:
            _Sigterm.stop()


def _remove_trash(directory: str) -> None:
    for name in os.listdir(directory):
        if name.startswith(f"{_TRASH}-"):
            shutil.rmtree(os.path.join(directory, name), ignore_errors=True)


class CheckpointManager:
    """The checkpoints of one training run in ``directory``: keep the last few, save every n steps.

    A layer over ``orbax.checkpoint.CheckpointManager`` (``self.orbax``), which does the
    writing: sharded writes (each process writes only the shards it holds),
    asynchronous saves, atomic commits, and rotating old steps out. Every process calls
    every method, in the same order. On top of orbax, the manager

    - claims ``directory`` for this run (the file ``substrax.lock``, held by process 0:
      host, pid, run, since when) until ``close``; a claim whose process is gone from
      this host is taken over with a warning, so a killed run does not block its resume;
    - refuses to save a state that is not finite, so ``max_to_keep`` never rotates the
      finite steps out for a diverged one;
    - records a checksum of every array it saves, and checks them on ``restore``;
    - moves a step rotated out to a hidden trash directory before deleting it, so
      ``all_steps`` never lists a half-deleted step;
    - saves the step at hand after a SIGTERM, and ends the process (exit code 143).

    Example::

        with CheckpointManager(directory, max_to_keep=3, save_interval_steps=100) as ckpt:
            start = ckpt.restore(model, optimizer) if ckpt.latest_step() is not None else 0
            with train_step.bind(model, optimizer) as fast:
                for step in range(start + 1, steps + 1):
                    loss = fast(next(batches))
                    ckpt.save(step, fast)   # syncs fast, then saves when step % 100 == 0
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        max_to_keep: int | None = 3,
        save_interval_steps: int = 1,
        async_save: bool = True,
        save_on_sigterm: bool = True,
        read_only: bool = False,
    ) -> None:
        """Open (or create) ``directory``, and claim it for this run unless ``read_only``.

        Args:
          directory: Where the steps are kept, one subdirectory each; a local path, or a
            URL orbax understands (``gs://...``; no claim is taken there).
          max_to_keep: How many of the latest steps to keep; ``None`` keeps all.
          save_interval_steps: ``save`` writes a step that is a multiple of this, the
            first step it is given when ``directory`` holds none, and the step after a
            SIGTERM (``save_on_sigterm``); it skips the others unless forced.
          async_save: Whether ``save`` returns once the arrays are copied off the
            devices, writing them in the background (``wait`` blocks until written).
            The state may be stepped (its arrays donated) as soon as ``save`` returns.
          save_on_sigterm: Catch SIGTERM while the manager is open: the next ``save``
            saves its step whatever the interval, waits until it is written, and raises
            ``SystemExit(143)``; ``close`` raises it too when no save came first. A
            second SIGTERM acts at once, as it would without the manager. Taken only in
            the main thread. On a multi-process run with JAX's preemption service on
            (JAX's default) the notice is JAX's preemption sync point instead (the
            service catches SIGTERM and picks a step every process reaches). With it
            off (``substrax.launch`` turns it off) each process catches SIGTERM itself,
            and every ``save`` asks all processes (a one-value all-gather, so every
            process must call ``save`` at the same steps) whether one got it: a SIGTERM
            to any process saves the same step on all of them and ends them all.
          read_only: Open only to read: no claim, no SIGTERM handler; ``save`` refuses.

        Raises:
          DirectoryInUseError: If another run (or another manager of this process)
            holds ``directory``; the message names it (host, pid, since when).
        """
        self.directory = _directory(directory)
        self.read_only = read_only
        self._local = "://" not in self.directory
        self._primary = jax.process_index() == 0
        self._closed = False
        self._sweeper: threading.Thread | None = None
        lock = os.path.join(self.directory, _LOCK_FILE) if self._local and not read_only else None
        claim = self._claim() if lock is not None else None
        # Several processes agree on SIGTERM themselves when JAX's preemption service is off
        # (as substrax.launch turns it off): each save asks whether any process got one.
        self._agree_on_sigterm = (
            save_on_sigterm and not read_only and jax.process_count() > 1 and not _jax_preemption_service()
        )
        try:
            self._listening = (
                save_on_sigterm
                and not read_only
                and (jax.process_count() == 1 or self._agree_on_sigterm)
                and _Sigterm.listen()
            )
        except BaseException:
            _release(lock, claim["token"] if claim else None)
            raise
        self._release = weakref.finalize(
            self, _let_go, lock if claim else None, claim["token"] if claim else None, self._listening
        )
        options = ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep,
            save_interval_steps=save_interval_steps,
            enable_async_checkpointing=async_save,
            create=not read_only,
            todelete_subdir=_TRASH if self._local and not read_only else None,
        )
        try:
            self.orbax = ocp.CheckpointManager(
                self.directory, options=options, item_handlers=ocp.StandardCheckpointHandler()
            )
        except BaseException:
            self._release()
            raise
        self._sweep()  # a trash a killed run left

    def _claim(self) -> dict[str, Any] | None:
        """Process 0 claims the directory; every process learns whether it could."""
        claim: dict[str, Any] | None = None
        error: Exception | None = None
        if self._primary:
            try:
                claim = _claim(self.directory)
            except Exception as e:  # noqa: BLE001  (raised below, once every process knows)
                error = e
        if jax.process_count() > 1:
            refused = bool(multihost_utils.broadcast_one_to_all(np.int32(error is not None)))
            if refused and error is None:
                error = DirectoryInUseError(
                    f"{self.directory} is in use by another run: process 0 could not claim it (see its error)."
                )
        if error is not None:
            raise error
        return claim

    def all_steps(self) -> list[int]:
        """The steps saved and committed, oldest first."""
        return sorted(self.orbax.all_steps())

    def latest_step(self) -> int | None:
        """The newest committed step, or ``None`` when there is none."""
        return self.orbax.latest_step()

    def save(
        self,
        step: int,
        model: nnx.Module | BoundTrainStep,
        optimizer: nnx.Optimizer | None = None,
        *,
        force: bool = False,
    ) -> bool:
        """Save the state of ``model`` and ``optimizer`` as ``step``, if the interval says so.

        The state is checked first, each array read where its shards live (a small one
        of this process on the host): a NaN or an infinity in any floating array refuses
        the save, so the steps kept stay finite. A checksum of each array is recorded
        with the step, for ``restore`` to check.

        Args:
          step: The training step the state is at (usually the number of steps taken).
          model: The model, or a ``BoundTrainStep`` in place of both (it is synced first).
          optimizer: Its optimizer; omitted with a bound step.
          force: Save even a step the interval would skip.

        Returns:
          Whether a save was started (a bound step is synced only then).

        Raises:
          TypeError: If a bound step comes with an optimizer, or a model without one.
          ValueError: If a variable's array has been deleted (the model of a bound step
            that was not synced), naming it; or the manager is read-only.
          NonFiniteStateError: If an array holds a NaN or an infinity, naming the step
            and the first such arrays; nothing is saved, no step is deleted.
          SystemExit: With code 143 after a SIGTERM (``save_on_sigterm``), once this
            step is written.
        """
        _check_args(model, optimizer)
        if self.read_only:
            raise ValueError(f"this manager of {self.directory} is read-only: it does not save.")
        notice = self._termination_notice(step)
        if not (force or notice) and not self.orbax.should_save(step):
            return False
        model, optimizer = _unpack(model, optimizer)
        slots = _slots(model, optimizer)
        arrays = [slot.saved() for slot in slots]
        finite, sums = _inspect(arrays)
        if not finite.all():
            raise NonFiniteStateError(
                self._non_finite(step, [s.name for s, ok in zip(slots, finite) if not ok])
            )
        started = False
        if not (notice and step in self.all_steps()):
            self.orbax.wait_until_finished()  # as orbax's save would; then no deletion is under way
            self._sweep()
            record = [
                {"key": list(slot.key), "shape": list(x.shape), "dtype": str(x.dtype), "checksum": _hex(s)}
                for slot, x, s in zip(slots, arrays, sums)
            ]
            started = bool(
                self.orbax.save(
                    step,
                    args=ocp.args.StandardSave(_nest({slot.key: x for slot, x in zip(slots, arrays)})),
                    force=force or notice,
                    custom_metadata={_RECORD: {"version": 1, "arrays": record}},
                )
            )
        if notice:
            if self._primary:
                why = "SIGTERM" if self._listening or self._agree_on_sigterm else "JAX's preemption notice"
                print(
                    f"substrax.checkpoint: {why}: step {step} saved in {self.directory}; exiting (143).",
                    file=sys.stderr,
                    flush=True,
                )
            self.close()
            raise SystemExit(_SIGTERM_EXIT)
        return started

    def _termination_notice(self, step: int) -> bool:
        """Whether this run was told to stop: a SIGTERM noted, or JAX's preemption sync point."""
        if self._agree_on_sigterm:  # a SIGTERM to any process stops them all at this step
            return not _everywhere(not (self._listening and _Sigterm.pending))
        if self._listening:
            return _Sigterm.pending
        if jax.process_count() > 1:
            return bool(self.orbax.reached_preemption(step))
        return False

    def _non_finite(self, step: int, names: list[str]) -> str:
        shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        latest = self.latest_step()
        kept = f"the newest step kept there is {latest}" if latest is not None else "it holds no step yet"
        return (
            f"step {step} not saved in {self.directory}: its state is not finite ({shown} "
            f"hold a NaN or an infinity); {kept}."
        )

    def restore(self, model: nnx.Module, optimizer: nnx.Optimizer, step: int | None = None) -> int:
        """Fill ``model`` and ``optimizer`` from a saved step, in the layout they have now.

        Each array is read into the sharding (and dtype) of the array it replaces, so a
        checkpoint saved from one layout (replicated, ZeRO-1, FSDP; any number of
        processes) is restored into another; each process reads only the slices its
        devices hold. A model never placed (its arrays not committed to a device) gets
        uncommitted arrays back, which a step moves to its mesh. Restore before
        ``make_train_step(...).bind``: a bound step keeps its own arrays. Waits for a save
        in progress first.

        Every array read is checked against the checksum recorded when it was saved (a
        step saved before checksums were recorded is restored unchecked, with a
        warning). The model and optimizer are filled only from a step that checks out.
        With ``step=None``, a damaged latest step is skipped for the newest one that
        checks out, with a warning naming the damage; a manager that is not read-only
        also moves the damaged steps out of the listing, to ``.substrax-damaged/``, so
        the run saves those step numbers again.

        Args:
          model: The model to fill, built as the saved one was (the values are replaced).
          optimizer: Its optimizer, of the same kind as the saved one.
          step: Which step; ``None`` for the latest that is whole.

        Returns:
          The step restored.

        Raises:
          ValueError: If there is no checkpoint (or no such step), or the checkpoint's
            arrays do not match the state's: a variable missing from either, or of
            another shape; each message names the variable.
          DamagedCheckpointError: If ``step`` (or, with ``step=None``, every step) is
            damaged: in one line, the step and the damage (a file missing or cut short,
            an array whose values differ from those saved).
        """
        self.wait()
        slots = _slots(model, optimizer)
        steps = self.all_steps()
        if not steps:
            raise ValueError(f"no checkpoint in {self.directory}: it holds no committed step.")
        if step is not None:
            if step not in steps:
                raise ValueError(f"no checkpoint of step {step} in {self.directory}; it holds steps {steps}.")
            for slot, array in zip(slots, self._read(step, slots), strict=True):
                slot.fill(array)
            return step
        damaged: list[DamagedCheckpointError] = []
        for candidate in reversed(steps):
            try:
                arrays = self._read(candidate, slots)
            except DamagedCheckpointError as e:
                damaged.append(e)
                continue
            if damaged:
                self._skipped(candidate, damaged)
            for slot, array in zip(slots, arrays, strict=True):
                slot.fill(array)
            return candidate
        if len(damaged) == 1:
            raise damaged[0]
        older = [e.step for e in damaged[1:]]
        raise DamagedCheckpointError(
            damaged[0].step, f"{damaged[0]} The older steps {older} are damaged too."
        ) from damaged[0]

    def _read(self, step: int, slots: list[_Slot]) -> list[jax.Array]:
        """The arrays of ``step``, in the slots' order and shardings, checked against its checksums.

        Raises:
          ValueError: If the step's arrays do not match the slots.
          DamagedCheckpointError: If the step cannot be read, or reads back altered.
        """
        where = f"step {step} in {self.directory}"
        record: list[dict[str, Any]] | None = None
        restored: dict[Key, jax.Array] = {}
        error: DamagedCheckpointError | None = None
        try:
            record = self._record(step)
            shapes = self._saved_shapes(step, slots)
            if record is not None and {tuple(a["key"]): tuple(a["shape"]) for a in record} != shapes:
                raise DamagedCheckpointError(
                    step,
                    f"{where} is damaged: its index of arrays (default/_METADATA) disagrees with its checksums.",
                )
        except DamagedCheckpointError as e:
            error = e
        if error is None:
            _check_tree(step, slots, shapes, self.directory)
            dtypes = {tuple(a["key"]): a["dtype"] for a in record} if record is not None else {}
            targets = _nest({slot.key: slot.target(dtypes.get(slot.key)) for slot in slots})
            try:
                restored = dict(_flatten(self.orbax.restore(step, args=ocp.args.StandardRestore(targets))))
            except Exception as e:  # noqa: BLE001  (orbax and TensorStore raise many kinds, with pages of detail)
                error = _unreadable(step, self.directory, slots, e)
                error.__cause__ = e
        if not _everywhere(error is None):
            raise error or DamagedCheckpointError(
                step, f"{where} is damaged: another process could not read it."
            )
        arrays = [restored[slot.key] for slot in slots]
        if record is None:
            warnings.warn(
                f"{where} has no checksums (saved by an earlier substrax): restored without checking them.",
                stacklevel=3,
            )
            return arrays
        want = {tuple(a["key"]): a["checksum"] for a in record}
        _, sums = _inspect(arrays)
        bad = [slot.name for slot, s in zip(slots, sums) if _hex(s) != want[slot.key]]
        if bad:
            more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
            raise DamagedCheckpointError(
                step,
                f"{where} is damaged: {bad[0]}{more} does not match the checksum recorded when it was saved.",
            )
        return arrays

    def _record(self, step: int) -> list[dict[str, Any]] | None:
        """The step's checksums as saved, or ``None`` for a step saved without them.

        Raises:
          DamagedCheckpointError: If the step's metadata file is missing or unreadable.
        """
        path = epath.Path(self.directory) / str(step) / _STEP_METADATA
        damaged = f"step {step} in {self.directory} is damaged: its {_STEP_METADATA}"
        try:
            metadata = json.loads(path.read_bytes())
        except FileNotFoundError as e:
            raise DamagedCheckpointError(step, f"{damaged} is missing.") from e
        except (OSError, ValueError) as e:
            raise DamagedCheckpointError(step, f"{damaged} cannot be read ({_reason(e)}).") from e
        custom = metadata.get("custom_metadata") if isinstance(metadata, dict) else None
        record = custom.get(_RECORD) if isinstance(custom, dict) else None
        if record is None:
            return None
        arrays = record.get("arrays") if isinstance(record, dict) else None
        fields = {"key", "shape", "dtype", "checksum"}
        if not isinstance(arrays, list) or not all(
            isinstance(a, dict) and fields <= a.keys() for a in arrays
        ):
            raise DamagedCheckpointError(step, f"{damaged} holds a malformed record of checksums.")
        return arrays

    def _saved_shapes(self, step: int, slots: list[_Slot]) -> dict[Key, tuple[int, ...]]:
        """The shapes of a step's arrays, as orbax's metadata of them says.

        Raises:
          DamagedCheckpointError: If the metadata is missing or unreadable.
        """
        if not (epath.Path(self.directory) / str(step) / "default").exists():
            raise DamagedCheckpointError(
                step,
                f"step {step} in {self.directory} is damaged: its arrays' directory (default/) is missing.",
            )
        try:
            metadata = self.orbax.item_metadata(step)
        except Exception as e:
            raise _unreadable(step, self.directory, slots, e) from e
        tree = getattr(metadata, "tree", metadata)
        if not tree:
            raise DamagedCheckpointError(
                step,
                f"step {step} in {self.directory} is damaged: its index of arrays (default/_METADATA) is missing.",
            )
        return {key: tuple(getattr(value, "shape", ())) for key, value in _flatten(tree)}

    def _skipped(self, restored: int, damaged: list[DamagedCheckpointError]) -> None:
        """Warn of the damaged steps ``restore`` skipped; a writing manager moves them out of the listing."""
        steps = [e.step for e in damaged]
        moved = ""
        if not self.read_only and self._local:
            aside = os.path.join(self.directory, _DAMAGED)
            if self._primary:
                os.makedirs(aside, exist_ok=True)
                stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
                for s in steps:
                    os.rename(os.path.join(self.directory, str(s)), os.path.join(aside, f"{s}-{stamp}"))
            if jax.process_count() > 1:
                multihost_utils.sync_global_devices("substrax.checkpoint: damaged steps moved aside")
            self.orbax.reload()
            moved = f"; moved to {aside}"
        more = f" (older damaged steps skipped too: {steps[1:]})" if len(steps) > 1 else ""
        warnings.warn(
            f"restored step {restored}, the newest whole step: {str(damaged[0]).rstrip('.')}{more}{moved}.",
            stacklevel=3,
        )

    def _sweep(self, *, block: bool = False) -> None:
        """Delete the steps orbax moved to the trash, in the background (``block``: before returning).

        Call only when no save is finishing: orbax moves steps to the trash as a save commits.
        """
        if self.read_only or not self._local or not self._primary:
            return
        trash = os.path.join(self.directory, _TRASH)
        if os.path.isdir(trash):
            os.rename(trash, f"{trash}-{uuid.uuid4().hex}")  # orbax makes a new one when it needs it
        elif not block and not any(name.startswith(f"{_TRASH}-") for name in os.listdir(self.directory)):
            return
        if self._sweeper is not None and self._sweeper.is_alive():
            if not block:
                return  # the next sweep takes what this one left
            self._sweeper.join()
        self._sweeper = threading.Thread(
            target=_remove_trash, args=(self.directory,), name="substrax-checkpoint-sweep", daemon=True
        )
        self._sweeper.start()
        if block:
            self._sweeper.join()

    def wait(self) -> None:
        """Block until every save started has been written and committed."""
        self.orbax.wait_until_finished()
        self._sweep()

    def close(self) -> None:
        """Wait for saves in progress, delete the steps rotated out, release the claim and orbax's threads.

        Raises:
          SystemExit: With code 143 if a SIGTERM came while the manager was open (and no
            ``save`` ended the process first), once every save is written.
        """
        if self._closed:
            return
        self._closed = True
        try:
            self.orbax.close()
            self._sweep(block=True)
        finally:
            self._release()
        if self._listening and _Sigterm.pending:
            raise SystemExit(_SIGTERM_EXIT)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def save(
    directory: str | os.PathLike[str],
    step: int,
    model: nnx.Module | BoundTrainStep,
    optimizer: nnx.Optimizer | None = None,
) -> None:
    """Save ``model`` and ``optimizer`` as ``step`` in ``directory``, and wait until it is committed.

    Every process calls it; each writes the shards it holds. Earlier steps in
    ``directory`` are kept. For a training loop, ``CheckpointManager`` saves in the
    background and deletes old steps.

    Args:
      directory: Where the steps are kept, one subdirectory each.
      step: The step to save as; must not be in ``directory`` yet.
      model: The model, or a ``BoundTrainStep`` in place of both (it is synced first).
      optimizer: Its optimizer; omitted with a bound step.

    Raises:
      TypeError: If a bound step comes with an optimizer, or a model without one.
      ValueError: If ``step`` is already saved in ``directory``, or a variable's array
        has been deleted (a bound step's model, not synced), naming it.
      NonFiniteStateError: If an array holds a NaN or an infinity, naming it.
      DirectoryInUseError: If a run's ``CheckpointManager`` holds ``directory``.
    """
    with CheckpointManager(directory, max_to_keep=None, async_save=False, save_on_sigterm=False) as manager:
        if step in manager.all_steps():
            raise ValueError(f"step {step} is already saved in {manager.directory}.")
        manager.save(step, model, optimizer, force=True)


def restore(
    directory: str | os.PathLike[str], model: nnx.Module, optimizer: nnx.Optimizer, step: int | None = None
) -> int:
    """Fill ``model`` and ``optimizer`` from ``directory``, in the layout they have now.

    See ``CheckpointManager.restore``: any saved layout restores into any current one,
    and every array is checked against its checksum. It only reads: it takes no claim,
    so it reads a directory a run is writing, and leaves damaged steps where they are.

    Args:
      directory: Where the steps are kept.
      model: The model to fill, built as the saved one was.
      optimizer: Its optimizer, of the same kind as the saved one.
      step: Which step; ``None`` for the latest that is whole.

    Returns:
      The step restored.

    Raises:
      ValueError: If ``directory`` holds no checkpoint (or not ``step``), or the
        checkpoint's arrays do not match the state's, naming the variable.
      DamagedCheckpointError: If ``step`` (with ``step=None``: every step) is damaged.
    """
    if "://" not in os.fspath(directory) and not os.path.isdir(directory):
        raise ValueError(f"no checkpoint in {_directory(directory)}: no such directory.")
    with CheckpointManager(directory, max_to_keep=None, async_save=False, read_only=True) as manager:
        return manager.restore(model, optimizer, step)
