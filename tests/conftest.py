"""8 emulated CPU devices for the whole suite, and the small models the tests train."""

from __future__ import annotations

import atexit
import importlib.util
import os
import shutil
import tempfile
from collections.abc import Callable

import jax

from substrax.mesh import use_cpu_devices

use_cpu_devices(8)  # before anything touches a backend


FAST_COMPILE = "--xla_backend_optimization_level=0"


def _compile_fast() -> None:
    """LLVM at its lowest level for every program the suite compiles (this process and its children).

    It cuts a small step's compile time, most of the suite's, by a third to a half; the optimized HLO and its
    buffers (what the census and memory tests read) do not depend on it: see
    docs/development.md. ``SUBSTRAX_TEST_XLA_OPT=default`` keeps XLA's own level.
    """
    flags = os.environ.get("XLA_FLAGS", "")
    if os.environ.get("SUBSTRAX_TEST_XLA_OPT") == "default" or "xla_backend_optimization_level" in flags:
        return
    os.environ["XLA_FLAGS"] = f"{flags} {FAST_COMPILE}".strip()


_compile_fast()


KEPT_CACHE_BYTES = 1 << 30


def _trim(directory: str, limit: int) -> None:
    """Remove the oldest files of ``directory`` until what is left is under ``limit`` bytes."""
    os.makedirs(directory, exist_ok=True)
    files = [e for e in os.scandir(directory) if e.is_file()]
    entries = sorted((e.stat().st_mtime, e.stat().st_size, e.path) for e in files)
    total = sum(size for _, size, _ in entries)
    for _, size, path in entries:
        if total <= limit:
            break
        os.remove(path)
        total -= size


def _compilation_cache() -> None:
    """Many tests compile the same small program under another name; compile each once.

    jax's persistent cache keys an executable by its HLO, the compile options and the
    versions, so a program a second test builds again is read back, not compiled.
    ``SUBSTRAX_TEST_CACHE=DIR`` keeps the cache in DIR across runs (``make test`` keeps
    ``.jax-test-cache``; past ``KEPT_CACHE_BYTES`` a run starts by removing the oldest
    entries); without it the directory is new for each run (the pytest process makes it;
    its xdist workers inherit it) and removed after. Subprocesses (notebooks, launched
    processes) compile for themselves. ``SUBSTRAX_TEST_CACHE=off``: no cache (``make test-tpu``:
    jax cannot read back a program compiled for compile-only TPU devices).
    """
    directory = os.environ.get("SUBSTRAX_TEST_CACHE")
    if directory == "off":
        return
    if directory:
        directory = os.environ["SUBSTRAX_TEST_CACHE"] = os.path.abspath(directory)
        if "PYTEST_XDIST_WORKER" not in os.environ:  # the run's first process, before its workers
            _trim(directory, KEPT_CACHE_BYTES)
    else:  # made here, removed when this process (the run's first) exits
        directory = os.environ["SUBSTRAX_TEST_CACHE"] = tempfile.mkdtemp(prefix="substrax-jax-cache-")
        atexit.register(shutil.rmtree, directory, ignore_errors=True)
    jax.config.update("jax_compilation_cache_dir", directory)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


_compilation_cache()

import numpy as np  # noqa: E402
import optax  # noqa: E402
import pytest  # noqa: E402
from flax import nnx  # noqa: E402
from models import MLP, Normed, mse, one_device_training, params_of, regression_batches  # noqa: E402,F401  (re-exported)

import substrax  # noqa: E402
from substrax._shared.schedule import EXPLICIT_ONLY  # noqa: E402
from substrax.mesh import create_device_mesh  # noqa: E402

# The compile-only TPU tests (tests/test_tpu_*.py, make test-tpu) compile for TPU topologies through libtpu.
needs_libtpu = pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None,
    reason="compiles for a TPU topology: needs libtpu (pip install 'substrax[tpu]', or make test-tpu)",
)


# The compile-only GPU tests (tests/test_gpu_*.py, make test-gpu) compile for NVIDIA topologies through jax's
# CUDA plugin, with CUDA's ptxas and libdevice.
def _gpu_stack() -> str:
    from substrax.mesh._gpu import cuda_tools, plugin_installed

    if not plugin_installed():
        return "jax's CUDA plugin (jax-cuda13-plugin, jax-cuda13-pjrt)"
    tools = cuda_tools()
    wheels = (("ptxas", "nvidia-cuda-nvcc"), ("libdevice", "nvidia-nvvm"))
    return ", ".join(f"{k} ({w})" for k, w in wheels if not tools[k])


needs_cuda_plugin = pytest.mark.skipif(
    bool(_gpu_stack()),
    reason=f"compiles for an NVIDIA GPU topology: needs {_gpu_stack()} "
    "(pip install 'substrax[gpu]', or make test-gpu)",
)


def assert_consistent(row: substrax.PlanRow, target: str) -> None:
    """The fields of a row compiled for ``target`` (a ``substrax.timeline.TARGETS`` name) hold together
    (issue 62's invariants; tests/test_tpu_timeline.py, tests/test_gpu_timeline.py)."""
    from substrax.timeline import TARGETS

    assert row.timeline is not None and row.timeline.target is TARGETS[target], row
    assert row.flops > 0 and row.compute_seconds > 0, row
    assert 0 <= row.exposed_seconds <= row.communication_seconds, row
    assert row.compute_seconds <= row.step_seconds <= row.compute_seconds + row.communication_seconds, row
    assert row.step_seconds == pytest.approx(row.compute_seconds + row.exposed_seconds)
    assert 0 < row.mfu <= 1, row


# The layouts of a mesh with one data axis; "hsdp" needs a replica axis too (tests/test_hsdp.py).
FLAT_LAYOUTS = tuple(layout for layout in substrax.LAYOUTS if layout != "hsdp")

# Each mode with each pipeline schedule it runs (implicit mode refuses the explicit-only ones).
PIPELINES = tuple(
    (mode, schedule)
    for mode in substrax.MODES
    for schedule in substrax.SCHEDULES
    if mode == "explicit" or schedule not in EXPLICIT_ONLY
)


def reference_training(
    batches: list[dict], *, lr: float = 1e-2, seed: int = 0, tx: optax.GradientTransformation | None = None
) -> tuple[list[float], dict]:
    """Train on one device, no mesh, no sharding: the reference both paths must match (Adam by default)."""
    tx = optax.adam(lr) if tx is None else tx
    losses, model = one_device_training(batches, tx, model=lambda: MLP(seed=seed))
    return losses, params_of(model)


def noise_floor(make_tx: Callable[[], optax.GradientTransformation], batches: list[dict]) -> float:
    """How far two valid one-device runs end apart when only the batch's summation order differs."""
    _, a = reference_training(batches, tx=make_tx())
    order = np.random.default_rng(1).permutation(len(batches[0]["x"]))
    _, b = reference_training([{k: v[order] for k, v in batch.items()} for batch in batches], tx=make_tx())
    return max(float(np.max(np.abs(a[k] - b[k]))) for k in a)


def assert_trains_to(step: Callable, model: nnx.Module, optimizer: nnx.Optimizer, batches: list, want: dict,
                     *, rtol: float = 1e-5, atol: float = 1e-6) -> None:  # fmt: skip
    """``step`` on each batch; then each of ``want``'s parameters within ``rtol``, ``atol`` of the model's
    (the defaults: SGD, held to float32 round-off)."""
    for b in batches:
        step(model, optimizer, b)
    got = params_of(model)
    for key in want:
        np.testing.assert_allclose(got[key], want[key], rtol=rtol, atol=atol, err_msg=key)


def assert_params_close(got: dict, want: dict, *, rtol: float = 2e-5, atol: float = 2e-6) -> None:
    assert got.keys() == want.keys()
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=rtol, atol=atol, err_msg=name)


@pytest.fixture(scope="session")
def mesh8() -> jax.sharding.Mesh:
    return create_device_mesh({"data": 8})
