"""The census of programs XLA's GPU compiler wrote (trimmed from an FSDP step compiled for 8 H100s).

No plugin needed: the census reads HLO text. tests/test_gpu_steps.py compiles such programs.
"""

from __future__ import annotations

import substrax

# The GPU compiler combined two bias gradients and the loss into one all-reduce of a flat buffer it
# concatenated (a fusion whose root is the concatenate), reduced asynchronously (start, done).
FSDP_H100 = """HloModule jit_pure, num_partitions=8

%region_4.0 (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %add = f32[] add(%a, %b)
}

%wrapped_concatenate_computation.1 (param_0.240: f32[128], param_1.316: f32[512], \
param_2.223: f32[1]) -> f32[641] {
  %param_0.240 = f32[128]{0} parameter(0)
  %param_1.316 = f32[512]{0} parameter(1)
  %param_2.223 = f32[1]{0} parameter(2)
  ROOT %concatenate.3 = f32[641]{0} concatenate(%param_0.240, %param_1.316, %param_2.223), dimensions={0}
}

ENTRY %main (p0: f32[8,128], p1: f32[8,512], p2: f32[]) -> f32[641] {
  %p0 = f32[8,128]{1,0} parameter(0)
  %p1 = f32[8,512]{1,0} parameter(1)
  %p2 = f32[] parameter(2)
  %loop_reduce_fusion = f32[128]{0} fusion(%p0), kind=kLoop, calls=%region_4.0
  %loop_reduce_fusion.1 = f32[512]{0} fusion(%p1), kind=kLoop, calls=%region_4.0
  %bitcast.145 = f32[1]{0} bitcast(%p2)
  %wrapped_concatenate.1 = f32[641]{0} fusion(%loop_reduce_fusion, %loop_reduce_fusion.1, %bitcast.145), \
kind=kLoop, calls=%wrapped_concatenate_computation.1
  %all-reduce-start.1 = ((f32[641]{0}), f32[641]{0}) all-reduce-start(%wrapped_concatenate.1), channel_id=1, \
replica_groups=[1,8]<=[8], use_global_device_ids=true, to_apply=%region_4.0, \
metadata={op_name="jit(pure)/shard_map/(substrax.grad_reduce/psum_invariant:\
substrax.grad_reduce/psum_invariant:jvp(substrax.loss)/psum_invariant)"}
  ROOT %all-reduce-done.1 = f32[641]{0} all-reduce-done(%all-reduce-start.1)
}
""".replace("\\\n", "")


def test_a_concatenated_all_reduce_is_read_as_the_buffers_it_concatenates() -> None:
    report = substrax.census(FSDP_H100, mesh={"data": 8})
    assert len(report.rows) == 1 and report.rows[0].opcode == "all-reduce-start"  # the async pair once
    parts = report.rows[0].parts
    assert [str(p.buffer) for p in parts] == ["f32[128]", "f32[512]", "f32[]"]  # the loss's bitcast undone
    assert [p.bytes for p in parts] == [512, 2048, 4] and report.rows[0].bytes == 641 * 4
    scopes = [p.op_name.rsplit("/", 2)[-2] for p in parts]
    assert scopes == ["substrax.grad_reduce", "substrax.grad_reduce", "jvp(substrax.loss)"]
