"""Whether each array of a state is finite, and its checksum, alike in every layout and on
any number of processes.

See ``inspect_arrays``. ``everywhere`` asks every process of a run one question.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

__all__ = ["checksum_hex", "everywhere", "inspect_arrays"]


_U32 = np.uint32
_UNSIGNED = {2: jnp.uint2, 4: jnp.uint4, 8: jnp.uint8, 16: jnp.uint16, 32: jnp.uint32}
_ON_HOST = 1 << 16  # elements: a smaller array held by this process alone is checked by NumPy


def _mix(h: Any) -> Any:
    """murmur3's 32-bit finalizer (NumPy or JAX ``uint32``): each input bit flips each output bit."""
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


def inspect_arrays(arrays: Sequence[jax.Array]) -> tuple[np.ndarray, np.ndarray]:
    """Whether each array is finite (a floating one), and its checksum: ``bool[n]``, ``uint32[n, 2]``.

    Two wrapping 32-bit sums of each element's hashed bits and position: the same in every
    layout and process count. Read where the shards live (one jitted reduction), or by NumPy
    for a small array of this process.
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


def checksum_hex(checksum: np.ndarray) -> str:
    return "".join(f"{int(word):08x}" for word in checksum)


def everywhere(ok: bool) -> bool:
    """Whether ``ok`` holds on every process (a collective on a multi-process run)."""
    if jax.process_count() == 1:
        return ok
    return bool(np.all(multihost_utils.process_allgather(np.array([ok]))))
