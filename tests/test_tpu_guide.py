"""The guide "Plan a pod from a laptop" runs: its Python blocks, in order, from the repository's root."""

from __future__ import annotations

import pytest
import test_docs
from conftest import needs_libtpu

PAGE = test_docs.DOCS / "guides" / "pod-from-a-laptop.md"


@needs_libtpu
def test_the_guides_blocks_run(monkeypatch: pytest.MonkeyPatch) -> None:
    found = test_docs.blocks(PAGE)
    # test_gpu_guide runs the GPU's; the 1B model's block is left to the timeline tests' small models
    found = [
        b for b in found if b.not_run is None or "make test-gpu" not in b.not_run and "1B" not in b.not_run
    ]
    assert len(found) == 6 and all(b.not_run is not None and "make test-tpu" in b.not_run for b in found[:5])
    # the last runs on the CPU mesh of docs/snippets/setup.py (test_docs.py); the page loads examples/
    namespace = test_docs.run_blocks(found[:5], monkeypatch)
    assert namespace["found"].report.rows and namespace["peak"] > 0
