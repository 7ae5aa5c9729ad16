"""All-reduces across TPU slices, read from HLO text shaped as the TPU compiler writes it.

The TPU compiler compiles one slice's program of a mesh over two slices (v5e 2x4 each, HSDP:
``replica`` across the slices, ``data`` within): the whole gradients and the loss, summed over
both axes, as an all-reduce over the slice's chips of their buffer padded to whole tiles
(``ZeroCrop``), then a send/recv pair the TPU runtime reduces across the slices; the slices' sum
over ``replica`` as one send/recv pair (measured, libtpu 0.0.52: tests/test_tpu_census.py). The
census packs the expected all-reduces into those pairs exactly, so one dropped or doubled is a
difference (census guide, "Across slices").
"""

from __future__ import annotations

import dataclasses

import pytest

from substrax.census import census, compare
from substrax.census._expected import Expected, ExpectedCollective

_ATTRIBUTES = (
    '_xla_host_transfer_handler_name="xla_megascale_runtime",_xla_host_transfer_rendezvous="{name}",'
    '_xla_megascale_reduce_operation="SUM",_xla_megascale_transfer_type="ALL_REDUCE"'
)


def _pair(n: int, operand: str, shape: str) -> str:
    """A send/recv pair across slices (and its -done's), of ``operand`` (``shape``)."""
    attributes = "frontend_attributes={" + _ATTRIBUTES.format(name=f"all-reduce.{20 + n}_0") + "}"
    return f"""
  %after-all.{n} = token[] after-all()
  %send.{n} = ({shape}, u32[], token[]) send(%{operand}, %after-all.{n}), channel_id={2 * n}, \
is_host_transfer=true, {attributes}
  %recv.{n} = ({shape}, u32[], token[]) recv(%after-all.{n}), channel_id={2 * n + 1}, \
is_host_transfer=true, {attributes}
  %send-done.{n} = token[] send-done(%send.{n}), channel_id={2 * n}, is_host_transfer=true
  %recv-done.{n} = ({shape}, token[]) recv-done(%recv.{n}), channel_id={2 * n + 1}, is_host_transfer=true
  %summed.{n} = {shape} get-tuple-element(%recv-done.{n}), index=0"""


# 1,921 float32 elements (1,920 of whole gradients and the loss) padded to 2,048 and summed over the
# slice, then across; 10 tiles (40,960 B) of slices summed across, dense: no padding
HLO = f"""HloModule step, num_partitions=8

%add (x: f32[], y: f32[]) -> f32[] {{
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %sum = f32[] add(%x, %y)
}}

ENTRY %main (whole: f32[1921], slices: f32[10,8,128]) -> (f32[2,8,128], f32[10,8,128]) {{
  %whole = f32[1921]{{0:T(1024)}} parameter(0)
  %slices = f32[10,8,128]{{2,1,0:T(8,128)}} parameter(1)
  %crop = f32[2048]{{0:T(1024)}} custom-call(%whole), custom_call_target="ZeroCrop"
  %flat = f32[2,8,128]{{2,1,0:T(8,128)}} bitcast(%crop)
  %all-reduce.1 = f32[2,8,128]{{2,1,0:T(8,128)}} all-reduce(%flat), channel_id=1, \
replica_groups={{{{0,1,2,3,4,5,6,7}}}}, use_global_device_ids=true, to_apply=%add
  {_pair(1, "all-reduce.1", "f32[2,8,128]{2,1,0:T(8,128)}")}
  {_pair(2, "slices", "f32[10,8,128]{2,1,0:T(8,128)}")}
  ROOT %out = (f32[2,8,128]{{2,1,0:T(8,128)}}, f32[10,8,128]{{2,1,0:T(8,128)}}) tuple(%summed.1, %summed.2)
}}
""".replace("\\\n", "")
MESH = {"replica": 2, "data": 8}


def _expected(whole: int = 30, slices: tuple[int, ...] = (8192,) * 4 + (4096,) * 2) -> Expected:
    """30 whole gradients of 256 B and the loss (optional) over both axes; the slices over ``replica``."""
    both = ("replica", "data")
    items = [ExpectedCollective("all-reduce", f"w{i}", 256, "gradients", axes=both) for i in range(whole)]
    items.append(ExpectedCollective("all-reduce", "loss", 4, "loss", axes=both, optional=True))
    items += [
        ExpectedCollective("all-reduce", f"across 'replica': s{i}", size, "gradients", axes=("replica",))
        for i, size in enumerate(slices)
    ]
    return Expected("hsdp", "explicit", 1, tuple(items))


def test_the_census_reads_what_each_send_carries_and_what_feeds_it() -> None:
    rows = {r.name: r for r in census(HLO, mesh=MESH).rows}
    assert rows["send.1"].axes == rows["recv.2"].axes == ("replica",) and rows["all-reduce.1"].axes == (
        "data",
    )
    assert rows["send.1"].crosses == rows["recv.1"].crosses == "all-reduce"
    assert rows["send.1"].rendezvous == rows["recv.1"].rendezvous != rows["send.2"].rendezvous
    assert rows["send.1"].fed_by == "all-reduce.1" and rows["send.2"].fed_by == "slices"
    assert rows["all-reduce.1"].unpadded == 1921 * 4 and rows["all-reduce.1"].bytes == 2048 * 4
    assert rows["send.2"].unpadded is None


def test_the_all_reduces_across_slices_match_the_pairs_that_carry_them() -> None:
    found = compare(census(HLO, mesh=MESH), _expected())
    assert found.matches, found
    carried = {i.what: {p.row.name for p in parts} for i, parts in found.matched}
    assert carried["w0"] == carried["loss"] == {"all-reduce.1", "send.1", "recv.1"}
    assert carried["across 'replica': s0"] == {"send.2", "recv.2"}
    assert "all-reduce across slices" in str(found)
    (whole,) = [n for n in found.notes if "over replica, data" in n]
    assert "(w0, w1, w2, w3, +27 more: 7,684 B)" in whole and "padded to whole tiles (8,192 B sent)" in whole


@pytest.mark.parametrize(
    "expected",
    [
        _expected(whole=29),  # the program sums a whole gradient the step does not write (or twice)
        _expected(whole=31),  # the step writes one the program does not sum
        _expected(slices=(8192,) * 4 + (4096,)),  # a slice summed and not written
        _expected(slices=(8192,) * 4 + (4096,) * 3),  # a slice written and not summed
        _expected(slices=(8192,) * 5 + (4096,) * 2),  # one summed twice in the expectation
    ],
)
def test_a_buffer_dropped_or_doubled_across_slices_is_a_difference(expected: Expected) -> None:
    found = compare(census(HLO, mesh=MESH), expected)
    assert not found.matches
    assert any("no set of them fills each pair exactly" in n for n in found.notes), found.notes


def test_without_the_runtimes_attributes_a_send_is_not_an_all_reduce() -> None:
    plain = HLO.replace('_xla_megascale_transfer_type="ALL_REDUCE"', "")
    found = compare(census(plain, mesh=MESH), _expected())
    assert not found.matches
    assert {p.kind for p in found.unexpected} == {"all-reduce", "send", "recv"}


def test_an_item_over_in_slice_axes_alone_is_not_carried_across() -> None:
    """A gradient summed over ``data`` only is not what a pair over ``replica`` carries."""
    expected = _expected()
    inside = [dataclasses.replace(i, axes=("data",)) if i.what.startswith("w") else i for i in expected.items]
    found = compare(census(HLO, mesh=MESH), dataclasses.replace(expected, items=tuple(inside)))
    assert not found.matches


# the loss alone summed over both axes (measured: TinyLlama's shape, HSDP over two v5e 16x16, every
# gradient split): a row of 128 lanes over the slice, then across, no ZeroCrop saying it held 4 B
SCALAR = f"""HloModule step, num_partitions=8

%add (x: f32[], y: f32[]) -> f32[] {{
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %sum = f32[] add(%x, %y)
}}

ENTRY %main (loss: f32[1,1,128]) -> f32[1,1,128] {{
  %loss = f32[1,1,128]{{2,1,0:T(1,128)}} parameter(0)
  %all-reduce.1 = f32[1,1,128]{{2,1,0:T(1,128)}} all-reduce(%loss), channel_id=1, \
replica_groups={{{{0,1,2,3,4,5,6,7}}}}, use_global_device_ids=true, to_apply=%add
  {_pair(1, "all-reduce.1", "f32[1,1,128]{2,1,0:T(1,128)}")}
  ROOT %out = f32[1,1,128]{{2,1,0:T(1,128)}} copy(%summed.1)
}}
""".replace("\\\n", "")


@pytest.mark.parametrize(("items", "matches"), [(("loss",), True), ((), False), (("loss", "again"), True)])
def test_a_scalar_padded_to_a_row_of_lanes_carries_up_to_its_bytes(items: tuple, matches: bool) -> None:
    """Its padding unrecorded, the row holds up to its 512 B: the loss (4 B) matches; nothing is a
    difference; the loss twice (8 B) matches too, the one case this cannot tell apart."""
    both = ("replica", "data")
    expected = Expected(
        "hsdp", "explicit", 1, tuple(ExpectedCollective("all-reduce", w, 4, "loss", axes=both) for w in items)
    )
    found = compare(census(SCALAR, mesh=MESH), expected)
    assert found.matches == matches, found
