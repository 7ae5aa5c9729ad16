"""Two JAX processes x 4 CPU devices: placement, the replicated check, and both steps.

One launch runs every check (``workers/mp_worker.py checks``); each test reads its own
``RESULT`` lines, which both processes must print. The references are independent of
the code under test: the NumPy batch itself for placement, and a one-device training
run on the whole batch, which each process computes on its own first device.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from workers.launching import Run, launch, reaping, running

from substrax.spmd import check_replicated_equal, create_data_parallel_sharding, place_batch_on_shards

BOUND_S = 30


@pytest.fixture(scope="module")
def checks_run() -> Run:
    return launch(2, 4, "mp_worker.py", "checks", timeout=240)


def results(run: Run, name: str) -> dict[str, str]:
    """Process prefix to what its check ``name`` reported."""
    return dict(re.findall(rf"^(\[p\d\]) RESULT {name} (.*)$", run.stdout, flags=re.M))


@pytest.mark.parametrize(
    "name",
    [
        "topology",  # one 8-device system from 2 processes x 4 devices
        "stitch",  # each process's rows land where the NumPy concatenation puts them
        "replicated",  # a batch-level value, replicated, passes the equality check
        "mismatch",  # a replicated value that differs is named, with the process
        "hybrid_mesh",  # create_hybrid_mesh: data over the processes (DCN), model inside one (ICI)
        "steps_implicit",  # 12 adam steps match the one-device reference
        "steps_explicit",
        "held_implicit",  # arrays held on one process only: the same program on both (a hang else)
        "held_explicit",
        "hsdp_implicit",  # hybrid sharding, a replica per process: the same 12 steps
        "hsdp_explicit",
        "gather_implicit",  # a gathered metric is replicated: np.asarray reads it on every process
        "gather_explicit",
        # each process passes its own rows as NumPy to the plain call and .bind (FSDP with batch_spec;
        # HSDP with the default specs, rows over (replica, data)): the one-device run on the whole batch
        "own_rows_implicit",
        "own_rows_explicit",
        "own_rows_hsdp_implicit",
        "own_rows_hsdp_explicit",
        "own_rows_differ",  # a leaf whose rows differ between processes is refused by path, both modes
        # masked optimizer state (optax.MaskedNode) placed by shard_state: 3 steps as on one device
        "masked_muon_fsdp_implicit",
        "masked_muon_replicated_explicit",
        "masked_partition_fsdp_explicit",
        "masked_partition_replicated_implicit",
    ],
)
def test_on_two_processes(checks_run: Run, name: str) -> None:
    assert results(checks_run, name) == {"[p0]": "ok", "[p1]": "ok"}, checks_run.output


def test_the_run_ends_cleanly_with_prefixed_output(checks_run: Run) -> None:
    assert checks_run.returncode == 0, checks_run.output
    assert "[p0] ALL DONE" in checks_run.stdout and "[p1] ALL DONE" in checks_run.stdout
    assert "[p1] stderr is passed on too" in checks_run.stderr
    assert running(checks_run.pids()) == []


def test_a_raising_jax_process_ends_the_run_fast() -> None:
    # Process 1 raises; process 0 ignores SIGTERM, as JAX's preemption handler would.
    run = launch(2, 4, "mp_worker.py", "fail", timeout=120)
    with reaping(run.pids()) as pids:
        assert run.returncode == 1, run.output
        assert "[p1] RuntimeError: deliberate failure in process 1" in run.stderr
        assert f"[launch] process 1 (pid {pids[1]}) exited with code 1" in run.stderr
        assert run.seconds < BOUND_S
        assert len(pids) == 4 and running(pids) == []


def test_check_replicated_on_one_process_is_a_no_op(mesh8) -> None:
    batch = {"rows": np.ones((8, 2), np.float32), "lam": np.float32(0.5)}
    shardings = {"rows": create_data_parallel_sharding(mesh8), "lam": NamedSharding(mesh8, P())}
    assert check_replicated_equal(batch, shardings) is None
    placed = place_batch_on_shards(batch, shardings, check_replicated=True)
    np.testing.assert_array_equal(np.asarray(placed["rows"]), batch["rows"])
    assert float(placed["lam"]) == 0.5 and placed["lam"].sharding.is_fully_replicated
