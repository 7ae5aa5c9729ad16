"""What XLA's GPU compiler rewrites in a pipelined step, read from HLO text shaped as it writes it
(measured: tests/test_gpu_steps.py's pipeline on H100 1x1x8, jax 0.12.1's CUDA plugin).

It combines the carry's permutes of a tick into one collective-permute of several buffers, and
folds a whole gradient's sum over ``stage`` (the pipeline's) and over ``data`` (the step's) into one
all-reduce over both. The census reads each buffer of a combined permute, and pairs the folded
all-reduce with the two it replaced, each of its bytes; without one of them it is a difference.
"""

from __future__ import annotations

import dataclasses

from substrax.census import census, compare
from substrax.census._expected import Expected, ExpectedCollective

HLO = """HloModule step, num_partitions=8

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %sum = f32[] add(%x, %y)
}

ENTRY %main (carry: f32[4,8], gate: f32[8], bias: f32[1]) -> (f32[4,8], f32[8], f32[1]) {
  %carry = f32[4,8]{1,0} parameter(0)
  %gate = f32[8]{0} parameter(1)
  %bias = f32[1]{0} parameter(2)
  %cp = ((f32[4,8]{1,0}, f32[8]{0}), (f32[4,8]{1,0}, f32[8]{0})) collective-permute-start(%carry, %gate), \
channel_id=1, source_target_pairs={{0,1},{1,2},{2,3},{4,5},{5,6},{6,7}}
  %cp-done = (f32[4,8]{1,0}, f32[8]{0}) collective-permute-done(%cp)
  %moved = f32[4,8]{1,0} get-tuple-element(%cp-done), index=0
  %moved.1 = f32[8]{0} get-tuple-element(%cp-done), index=1
  %folded = f32[1]{0} all-reduce(%bias), channel_id=2, replica_groups={{0,1,2,3,4,5,6,7}}, \
use_global_device_ids=true, to_apply=%add
  ROOT %out = (f32[4,8]{1,0}, f32[8]{0}, f32[1]{0}) tuple(%moved, %moved.1, %folded)
}
""".replace("\\\n", "")
MESH = {"data": 2, "stage": 4}


def _expected(*drop: str) -> Expected:
    items = [
        ExpectedCollective(
            "collective-permute", "carry", 128, "pipeline", buffer="f32[4,8]", axes=("stage",)
        ),
        ExpectedCollective("collective-permute", "gate", 32, "pipeline", buffer="f32[8]", axes=("stage",)),
        ExpectedCollective("all-reduce", "bias", 4, "gradients", buffer="f32[1]", axes=("data",)),
        ExpectedCollective("all-reduce", "bias over stages", 4, "pipeline", buffer="f32[1]", axes=("stage",)),
    ]
    return Expected("fsdp", "explicit", 1, tuple(i for i in items if i.what not in drop))


def test_a_combined_permute_is_read_buffer_by_buffer() -> None:
    (permute, _) = census(HLO, mesh=MESH).rows
    assert [str(p.buffer) for p in permute.parts] == ["f32[4,8]", "f32[8]"]
    assert permute.bytes == 160 and permute.axes == ("stage",) and permute.shift == 1
    # before: its first buffer alone, 128 B; the gate's permute read as not compiled


def test_an_in_place_permute_moves_its_input_alone() -> None:
    in_place = HLO.replace(
        "collective-permute-start(%carry, %gate), channel_id=1,",
        "collective-permute-start(%carry, %gate), channel_id=1, slice_sizes={{4,8}},",
    )
    (permute, _) = census(in_place, mesh=MESH).rows
    assert [str(p.buffer) for p in permute.parts] == ["f32[4,8]"] and permute.bytes == 128


def test_a_folded_all_reduce_carries_both_it_replaced() -> None:
    found = compare(census(HLO, mesh=MESH), _expected())
    assert found.matches, found
    (note,) = [n for n in found.notes if "folds" in n]
    assert "bias over data and bias over stages over stage compiled as one all-reduce over both" in note


def test_a_folded_all_reduce_without_one_of_them_is_a_difference() -> None:
    assert not compare(census(HLO, mesh=MESH), _expected("bias over stages")).matches
    assert not compare(census(HLO, mesh=MESH), _expected("bias")).matches
    other = _expected()
    shifted = [
        dataclasses.replace(i, axes=("data",)) if i.what == "bias over stages" else i for i in other.items
    ]
    assert not compare(census(HLO, mesh=MESH), dataclasses.replace(other, items=tuple(shifted))).matches
