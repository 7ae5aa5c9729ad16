"""A pipelined step refuses a loss that is not a scalar, as an unpipelined one does (#60.2).

The explicit pipelined step took a per-row loss and updated the state: under 1F1B it returned
the loss's shape ``(4,)``, under GPipe its sum. Both modes and both schedules now refuse it
while tracing, so nothing runs and the state keeps its values.
"""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from models import Residual, Tower, make_placed, sine_batches

import substrax
from substrax.mesh import create_device_mesh


class Net(Tower):
    def __init__(self) -> None:
        super().__init__(Residual, 4, 8, gate=True, scale=0.5)


def per_row(model: Net, batch: dict) -> jax.Array:
    """A squared error a row: the mean over the last axis only, one value a row."""
    return ((model(batch["x"]) - batch["y"]) ** 2)[:, None].mean(axis=-1)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("mode", substrax.MODES)
def test_a_loss_that_is_not_a_scalar_is_refused_the_state_untouched(mode: str, schedule: str) -> None:
    mesh = create_device_mesh({"data": 2, "stage": 4})
    model, opt = make_placed(Net, optax.adam(0.1), mesh, stages=Residual)
    before = [np.asarray(x) for x in jax.tree.leaves(nnx.state((model, opt)))]
    step = substrax.make_train_step(per_row, mode, mesh=mesh, microbatches=4, schedule=schedule)
    # the loss of one microbatch of the rows the mode's loss sees: 32 / 4 global, 16 / 4 a data shard
    rows = 8 if mode == "implicit" else 4
    with pytest.raises(
        ValueError, match=rf"The loss must be a scalar array; loss_fn returned an array of shape \({rows},\)"
    ):
        step(model, opt, sine_batches(1, 32)[0])
    after = [np.asarray(x) for x in jax.tree.leaves(nnx.state((model, opt)))]
    assert len(after) == len(before)
    for a, b in zip(after, before, strict=True):  # parameters, the moments and the step count
        np.testing.assert_array_equal(a, b)
