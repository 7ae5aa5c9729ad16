"""The compiler options a step compiles with on a TPU, and which a mode takes where (``compiler_options``).

XLA's CPU and GPU compilers refuse these options; each is measured by the census (census guide, "On a TPU").
"""

from __future__ import annotations

from typing import Any

__all__ = ["TPU_COMPILER_OPTIONS", "TPU_IMPLICIT_COMPILER_OPTIONS", "TPU_REFUSED_OPTIONS", "compiler_options"]

# What keeps the TPU compiler (libtpu 0.0.52) from rewriting the collectives this step writes; each
# measured by the census on v5e 2x4 (census guide, "On a TPU"). XLA's CPU and GPU compilers refuse them.
TPU_COMPILER_OPTIONS: dict[str, Any] = {
    # bfloat16 propagation: a float32 parameter gathered as bfloat16 where its uses are default-precision
    # matmuls, and a reduce-scatter of a small gradient decomposed into an all-reduce
    "xla_jf_bf16_propagation": False,
    # async collective fusion in several steps: each gather cloned into each of its uses (43 gathers
    # of 15 parameters)
    "xla_tpu_enable_async_collective_fusion_multiple_steps": False,
    # its all-gather and reduce-scatter decomposers, which run a collective as an all-reduce of the
    # (zero-padded) whole: on v5e 4x4, 8x8, 8x16 and 16x16 every reduce-scatter, on 8x8 and up a
    # gather of a small block (8x8: of any), anywhere a one-row block or one across a tile's lanes
    # (census guide, "On a TPU"); the step writes its reduce-scatters in blocks the TPU emits
    # without them (substrax._shared.scatter)
    "xla_disable_hlo_passes": "reduce-scatter-decomposer,all_gather_decomposer",
}

# Where the TPU compiler refuses a reduce-scatter as written (UNIMPLEMENTED: a block it cannot emit,
# as a loss function's own psum_scatter of a small activation may be), the program compiles again
# with its reduce-scatter decomposer on (substrax._train.pinned), warning; the census names the rest
TPU_REFUSED_OPTIONS: dict[str, Any] = {
    **TPU_COMPILER_OPTIONS,
    "xla_disable_hlo_passes": "all_gather_decomposer",
}


# The implicit step's: XLA chooses its collectives, but not to clone each gather into each use
# (measured, FSDP and HSDP over 8 chips: 43 gathers of 15 parameters; d=256, 4 blocks: 75 gathers,
# 52.5 MB, against 31 and 12.9 MB with it, and less temporary memory, 9.68 MB against 10.27 MB),
# nor to run its gathers as all-reduces of the whole (FSDP over a v5e 16x16, d=64: 262,144 B of
# gathers as all-reduces without it)
TPU_IMPLICIT_COMPILER_OPTIONS: dict[str, Any] = {
    "xla_tpu_enable_async_collective_fusion_multiple_steps": False,
    "xla_disable_hlo_passes": "all_gather_decomposer",
}


def compiler_options(mesh: Any, mode: str = "explicit") -> dict[str, Any] | None:
    """The compiler options a step of ``mode`` compiles with on ``mesh``'s platform, or None.

    ``make_train_step`` sets them; a step called inside your own ``jax.jit`` takes them as
    ``jax.jit(..., compiler_options=compiler_options(mesh))`` (census guide, "On a TPU").
    On a TPU: ``TPU_COMPILER_OPTIONS`` (explicit) or ``TPU_IMPLICIT_COMPILER_OPTIONS``.
    """
    devices = getattr(mesh, "devices", None)
    if devices is None or not getattr(devices, "size", 0) or devices.flat[0].platform != "tpu":
        return None
    return dict(TPU_COMPILER_OPTIONS if mode == "explicit" else TPU_IMPLICIT_COMPILER_OPTIONS)
