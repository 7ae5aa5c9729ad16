"""One compile per configuration (issue 61, item 7): ``plan``, the row's ``step.lower(...).compile()``
and ``check_communication`` share the compiled program (``substrax._shared.compiled``).

Counted by jax's own compile events (``/jax/core/compile/backend_compile_duration``, named by
the jitted function: the step is ``jit(pure)``, the update the census compiles alone
``jit(update)``). Before: plan, compile and census compiled the step three times (1.10B on a
v5e 2x4: 46.6 s, 36.6 s, 48 s).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager

import jax
import jax.numpy as jnp
import pytest
from models import abstract_batch, abstract_mlp, mse

import substrax
from substrax._shared import compiled
from substrax.mesh import create_device_mesh

_EVENT = "/jax/core/compile/backend_compile_duration"


@contextmanager
def counted() -> Iterator[list[str]]:
    """The names of the functions XLA compiles inside the block, one per compile."""
    names: list[str] = []

    def listen(event: str, duration: float, **kwargs: object) -> None:
        if event == _EVENT:
            names.append(str(kwargs.get("fun_name")))

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        yield names
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)


@pytest.fixture(autouse=True)
def _fresh() -> Iterator[None]:
    compiled.cache_clear()
    yield
    compiled.cache_clear()


def _state() -> tuple:
    model, optimizer = abstract_mlp(16, 32, 4)
    return model, optimizer, abstract_batch(16, 16, 4)


def test_plan_then_compile_then_census_compiles_the_step_once() -> None:
    model, optimizer, batch = _state()
    mesh = create_device_mesh({"data": 8})
    with counted() as names:
        (row,) = substrax.plan(
            mse,
            model,
            optimizer,
            batch,
            mesh=mesh,
            layouts=["fsdp"],
            placement={"min_size": 1},
            compiled=True,
        ).rows
        row.shard_state(model, optimizer)
        step = row.make_train_step(mse)
        program = step.lower(model, optimizer, batch).compile()
        found = step.check_communication(model, optimizer, batch)
    assert names.count("jit(pure)") == 1 and names.count("jit(update)") == 1, names
    assert found.matches and found.report.bytes_per_step() == row.total_bytes > 0
    assert program.as_text() == step.lower(model, optimizer, batch).compile().as_text()


def test_a_changed_configuration_compiles_again() -> None:
    """Another layout, another mesh, donation, the compile's own options, an operation's name:
    each a program of its own."""
    model, optimizer, batch = _state()
    mesh = create_device_mesh({"data": 8})
    substrax.shard_state(model, optimizer, mesh=mesh, layout="fsdp", min_size=1)
    step = substrax.make_train_step(mse, "explicit", mesh=mesh)
    with counted() as names:
        step.lower(model, optimizer, batch).compile()
        step.lower(model, optimizer, batch).compile()  # the same: kept
        step.lower(model, optimizer, batch, donate=False).compile()
        step.lower(model, optimizer, batch).compile({"xla_cpu_enable_fast_math": True})

        def named(model: object, batch: dict) -> jax.Array:
            with jax.named_scope("mine"):
                return mse(model, batch)

        substrax.make_train_step(named, "explicit", mesh=mesh).lower(model, optimizer, batch).compile()
        zero1, optimizer1, _ = _state()
        substrax.shard_state(zero1, optimizer1, mesh=mesh, layout="zero1", min_size=1)
        step.lower(zero1, optimizer1, batch).compile()
        other = create_device_mesh({"data": 4})
        small, optimizer2, _ = _state()
        substrax.shard_state(small, optimizer2, mesh=other, layout="fsdp", min_size=1)
        substrax.make_train_step(mse, "explicit", mesh=other).lower(small, optimizer2, batch).compile()
    assert names.count("jit(pure)") == 6, names


def test_a_kept_compile_warns_again() -> None:
    """A compile that warned (the TPU's refused reduce-scatter, tests/test_tpu_census.py) warns each hit."""
    lowered = jax.jit(lambda x: x + 1).lower(jnp.float32(1))
    compiled_once = []

    def compile_() -> object:
        compiled_once.append(1)
        warnings.warn("compiled as it could", UserWarning, stacklevel=1)
        return lowered.compile()

    for _ in range(2):
        with pytest.warns(UserWarning, match="compiled as it could"):
            compiled.cached(lowered, None, compile_)
    assert len(compiled_once) == 1
