"""Pipelines on two JAX processes x 4 CPU devices, each process passing its own rows (#60.1).

One launch (``workers/pipeline_rows_worker.py``) runs every check; each test reads its own
``RESULT`` lines, which both processes must print. On ``(stage 4, data 2)`` the stage axis
spans the processes and each holds both data shards; on ``(data 2, stage 4)`` each holds one.
Either way the global batch is the processes' rows in process order: the reference is a
one-device run of plain nnx on the whole 32 rows, which each process computes on its own
first device.
"""

from __future__ import annotations

import re

import pytest
from workers.launching import Run, launch

import substrax

MESHES = ["stage4-data2", "data2-stage4"]


@pytest.fixture(scope="module")
def rows_run() -> Run:
    return launch(2, 4, "pipeline_rows_worker.py", timeout=480)


def results(run: Run, name: str) -> dict[str, str]:
    """Process prefix to what its check ``name`` reported."""
    return dict(re.findall(rf"^(\[p\d\]) RESULT {name} (.*)$", run.stdout, flags=re.M))


@pytest.mark.parametrize("mesh", MESHES)
def test_each_processs_rows_place_as_the_concatenation(rows_run: Run, mesh: str) -> None:
    # place_batch_on_shards of this process's 16 rows: the 32 rows, every shard as in the whole batch
    assert results(rows_run, f"placed_{mesh}") == {"[p0]": "ok", "[p1]": "ok"}, rows_run.output


RUNS = [(mode, schedule) for mode in substrax.MODES for schedule in ("gpipe", "1f1b")]
RUNS.append(("explicit", "interleaved-1f1b"))  # two chunks a stage: moved between the processes


@pytest.mark.parametrize(("mode", "schedule"), RUNS)
@pytest.mark.parametrize("mesh", MESHES)
def test_a_pipeline_trains_on_each_processs_rows_like_one_device(
    rows_run: Run, mesh: str, mode: str, schedule: str
) -> None:
    # own rows to the call (NumPy) and placed by place_batch_on_shards: SGD as one device on all 32
    # rows; a NaN in process 1's rows skips the step, the state untouched
    assert results(rows_run, f"trains_{mesh}_{mode}_{schedule}") == {"[p0]": "ok", "[p1]": "ok"}, (
        rows_run.output
    )


@pytest.mark.parametrize(
    "name",
    [
        "refused_differ",  # where rows are gathered, a leaf whose shape differs between processes is named
        "refused_two_dims",  # a leaf split on two dimensions whose blocks two processes share is named
    ],
)
def test_rows_that_cannot_be_each_processs_own_are_refused(rows_run: Run, name: str) -> None:
    assert results(rows_run, name) == {"[p0]": "ok", "[p1]": "ok"}, rows_run.output


def test_the_run_ends_cleanly(rows_run: Run) -> None:
    assert rows_run.returncode == 0, rows_run.output
    assert "[p0] ALL DONE" in rows_run.stdout and "[p1] ALL DONE" in rows_run.stdout
