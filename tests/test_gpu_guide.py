"""The NVIDIA section of the guide "Plan a pod from a laptop" runs: its blocks, in order, from the root."""

from __future__ import annotations

import pytest
import test_docs
from conftest import needs_cuda_plugin

PAGE = test_docs.DOCS / "guides" / "pod-from-a-laptop.md"


@needs_cuda_plugin
def test_the_guides_gpu_blocks_run(monkeypatch: pytest.MonkeyPatch) -> None:
    found = test_docs.blocks(PAGE)
    gpu = [b for b in found if b.not_run is not None and "make test-gpu" in b.not_run]
    assert len(gpu) == 2
    namespace = test_docs.run_blocks(gpu, monkeypatch)  # the page loads examples/transformer_lm.py
    assert namespace["found"].matches and namespace["chosen"].fits
