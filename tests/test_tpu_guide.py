"""The guide "Plan a pod from a laptop" runs: its Python blocks, in order, from the repository's root."""

from __future__ import annotations

from typing import Any

import pytest
import test_docs
from conftest import needs_libtpu

PAGE = test_docs.DOCS / "guides" / "pod-from-a-laptop.md"


@needs_libtpu
def test_the_guides_blocks_run(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(test_docs.ROOT)  # the page loads examples/transformer_lm.py
    namespace: dict[str, Any] = {"__name__": "__docs__"}
    found = test_docs.blocks(PAGE)
    found = [b for b in found if b.not_run is None or "make test-gpu" not in b.not_run]  # test_gpu_guide
    assert len(found) == 6 and all(b.not_run is not None and "make test-tpu" in b.not_run for b in found[:5])
    for block in found[:5]:  # the last runs on the CPU mesh of docs/snippets/setup.py (test_docs.py)
        test_docs._run(block, namespace)
    assert namespace["found"].report.rows and namespace["peak"] > 0
