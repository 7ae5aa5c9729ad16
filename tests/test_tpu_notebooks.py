"""The notebooks that compile for a TPU topology (libtpu, no TPU; make test-tpu), run as
tests/test_notebooks.py runs the others: top to bottom in a fresh kernel, every assert held,
a figure drawn."""

from __future__ import annotations

import pytest
from conftest import needs_libtpu
from test_notebooks import NOTEBOOK_DIR, TPU
from test_notebooks import test_notebook_runs as run_notebook

pytestmark = needs_libtpu


@pytest.mark.parametrize("name", sorted(TPU))
def test_the_tpu_notebook_runs(name: str) -> None:
    run_notebook(NOTEBOOK_DIR / f"{name}.ipynb")
