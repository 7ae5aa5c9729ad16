"""Every notebook in notebooks/ runs top to bottom, checks its claims and draws a figure.

Each notebook is executed with nbclient in a fresh kernel started from this interpreter (its
first cell emulates 8 CPU devices), so a failing cell, or a failing ``assert`` in one, fails
the test. The executed copy is kept in memory; the files on disk are not rewritten.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import nbclient
import nbformat
import pytest
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import AsyncKernelManager
from traitlets import default

NOTEBOOK_DIR = Path(__file__).resolve().parent.parent / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
CELL_TIMEOUT_S = 600  # generous: the machine running the suite may be busy
MIN_ASSERTS = 3
MIN_FIGURES = 1


class _ThisInterpreterSpecs(KernelSpecManager):
    """Kernel specs whose ``python3`` kernel is this interpreter, whatever else is installed."""

    def get_kernel_spec(self, kernel_name: str):  # type: ignore[no-untyped-def]
        spec = super().get_kernel_spec(kernel_name)
        if kernel_name == "python3":
            spec.argv = [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
        return spec


class _ThisInterpreterKernel(AsyncKernelManager):
    """nbclient's kernel manager, starting ``python3`` from this interpreter (the venv's)."""

    @default("kernel_spec_manager")
    def _this_interpreter_specs(self) -> KernelSpecManager:
        return _ThisInterpreterSpecs(data_dir=self.data_dir)


def test_there_are_notebooks() -> None:
    names = {p.name for p in NOTEBOOKS}
    assert {
        "01_collectives.ipynb",
        "02_gradients_under_shard_map.ipynb",
        "03_implicit_vs_explicit.ipynb",
    } <= names, names


def _run(path: Path):
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(
        nb,
        timeout=CELL_TIMEOUT_S,
        kernel_name="python3",
        kernel_manager_class=_ThisInterpreterKernel,
        resources={"metadata": {"path": str(path.parent)}},
    )
    client.execute()  # raises CellExecutionError, naming the cell, when a cell fails
    return nb


# The three longest run in make test-slow (.ci/run runs it): two processes, every layout
# compiled, tensor parallelism on three meshes.
SLOW = {"04_several_processes", "05_layouts_and_communication", "06_tensor_parallelism"}
# Those that compile for a TPU topology (libtpu) run in make test-tpu (tests/test_tpu_notebooks.py).
TPU = {"08_a_pod_step_predicted"}


def _marks(path: Path) -> list[pytest.MarkDecorator]:
    if path.stem in TPU:
        return [
            pytest.mark.skip(
                reason="compiles for a TPU topology: make test-tpu runs it (test_tpu_notebooks.py)"
            )
        ]
    return [pytest.mark.slow] if path.stem in SLOW else []


@pytest.mark.parametrize(
    "path", [pytest.param(p, marks=_marks(p)) for p in NOTEBOOKS], ids=[p.stem for p in NOTEBOOKS]
)
def test_notebook_runs(path: Path) -> None:
    code = [cell for cell in nbformat.read(path, as_version=4).cells if cell.cell_type == "code"]
    assert code, f"{path.name} has no code cells"
    first = code[0].source
    assert "use_cpu_devices(8)" in first, f"{path.name}: the first code cell must emulate 8 CPU devices"

    asserts = sum(len(re.findall(r"^\s*assert\b", cell.source, flags=re.MULTILINE)) for cell in code)
    assert asserts >= MIN_ASSERTS, f"{path.name} has {asserts} assert statements; want >= {MIN_ASSERTS}"

    executed = _run(path)
    outputs = [out for cell in executed.cells if cell.cell_type == "code" for out in cell.get("outputs", [])]
    assert not [out for out in outputs if out.get("output_type") == "error"]
    figures = sum(1 for out in outputs if "image/png" in out.get("data", {}))
    assert figures >= MIN_FIGURES, (
        f"{path.name} drew {figures} figures (image/png outputs); want >= {MIN_FIGURES}"
    )
