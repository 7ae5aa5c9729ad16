"""Census regressions the mesh fuzzer's pipeline axis found (``tests/test_fuzz_mesh.py``): each draw as
found, checked as the fuzzer checks it (trained against one device, the census matched).
"""

from __future__ import annotations

from test_fuzz_mesh import MeshConfig, check

SEED_62 = MeshConfig(
    mode="explicit", data=1, model=2, layout="fsdp", microbatches=2, optimizer="sgd", heads=4, causal=True,
    blocks=4, width=32, seed=62, steps=2, units=False, stages=4, schedule="zb-h1",
)  # fmt: skip


def test_regression_zb_h1s_weight_slot_keeps_only_the_collectives_a_weight_needs() -> None:
    """Found by the pipeline axis drawing ZB-H1 (2026-12-07): ``SEED_62``'s census expected each
    tensor-parallel input gradient's all-reduce in the weight slot too (a ``declare_backward`` tap
    recorded into the list it was created with, wherever its pullback ran again), 8,192 B more than
    compiled: XLA keeps one of a block's two there (the LayerNorm's weights need the up projection's
    input gradient) and drops the other. Now the weight slot's are optional (``declared.optional``)."""
    check(SEED_62)


SEED_56222 = MeshConfig(
    mode="explicit", data=2, model=1, layout="fsdp", microbatches=4, optimizer="sgd", heads=2, causal=False,
    blocks=8, width=16, seed=56222, steps=2, units=True, stages=4, schedule="interleaved-1f1b", chunks=2,
)  # fmt: skip


def test_regression_a_model_axis_of_one_device_splits_no_units_buffer() -> None:
    """Found by the pipeline axis drawing interleaved 1F1B (2026-12-08, under Adam; here SGD: the census
    is the optimizer's alike): each block an FSDP unit beside a ``model`` axis of one device. The census
    expected a unit's parameters split over ``model`` in a buffer apart from the rest (their specs name
    it), the step gathered them in one (nothing varies over an axis of one device): every unit's
    gather and reduce-scatter unmatched. 1F1B failed the same (4 blocks, 4 stages, or 8). Now an
    axis of one device is no other axis of a unit's buffer."""
    check(SEED_56222)


SEED_1189 = MeshConfig(
    mode="explicit", data=2, model=2, layout="zero1", microbatches=4, optimizer="sgd", heads=4, causal=True,
    blocks=2, width=16, seed=1189, steps=2, units=True, stages=2, schedule="1f1b",
)  # fmt: skip


def test_regression_one_layer_a_stage_beside_a_model_axis() -> None:
    """Found by the pipeline axis drawing ZB-H1 (2026-12-07; 1F1B too, and on the code before ZB-H1):
    with one block a stage (``blocks == stages``) and tensor parallelism, the step trained to the
    reference but its census did not match: the layers' all-reduces over ``model`` (3,072 B here)
    traced in 1F1B's warm-up and cool-down, loops of one tick on 2 stages, were expected inside a
    loop; XLA runs a loop of one iteration's body once, outside loops (and the stage's one layer
    too). Now a declared collective records whether a loop of more than one iteration encloses it
    (``declared.looping``: the schedule's loops, the stage's layers). Two blocks a stage matched."""
    check(SEED_1189)
