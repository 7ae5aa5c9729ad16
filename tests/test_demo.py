"""``make demo`` runs: both modes train, agree, and the gradient check passes."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest


@pytest.mark.slow  # make test-slow (in .ci/run): the whole demo, as make demo runs it
def test_demo_trains_both_modes_to_the_same_loss() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "substrax.demo", "--steps", "30"], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    out = done.stdout
    final = re.search(r"final loss: implicit ([\d.]+), explicit ([\d.]+)", out)
    assert final is not None, out
    implicit, explicit = map(float, final.groups())
    assert abs(implicit - explicit) <= 1e-5 * implicit
    first = re.search(r"^\s+0\s+([\d.]+)\s+([\d.]+)", out, flags=re.M)
    assert first is not None and implicit < float(first.group(1))  # the loss fell
    assert "gradient check: OK" in out
    assert "bind(model, optimizer)(batch)" in out
    # every layout and mode: state bytes per device fall with the split, each census matches
    rows = re.findall(r"^  (replicated|zero1|fsdp)\s+(implicit|explicit)\s+([\d,]+)\s+(\w+)", out, flags=re.M)
    assert len(rows) == 6, out
    held = {layout: int(nbytes.replace(",", "")) for layout, _, nbytes, _ in rows}
    assert held["fsdp"] < held["zero1"] < held["replicated"]
    assert all(verdict == "matches" for *_, verdict in rows), out
    worst = re.search(r"largest relative loss difference ([\d.e+-]+)", out)
    assert worst is not None and float(worst.group(1)) < 1e-5
