"""The compiler options a step compiles with on a TPU or a GPU, and which a mode takes where
(``compiler_options``).

XLA's CPU compiler refuses these options, and each compiler the other's; each is measured by the census
(census guide, "On a TPU"; pod guide, "NVIDIA GPUs").
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "GPU_COMPILER_OPTIONS",
    "TPU_COMPILER_OPTIONS",
    "TPU_IMPLICIT_COMPILER_OPTIONS",
    "TPU_REFUSED_OPTIONS",
    "compiler_options",
]

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


# The explicit step's on a GPU: XLA's GPU compiler (jax 0.12.1's CUDA plugin) combines independent
# reduce-scatters into one, which it runs after the backward pass: the FSDP units' (H100 1x1x8, the
# example transformer's 4 blocks and the root as units: one reduce-scatter of 860,160 B), each unit's
# whole gradient kept to the end, temporary memory growing a layer per layer (test_units's stack of
# 256-wide layers: 1.03 layers per layer, 0.13 with this); each reduce-scatter as the step writes it
GPU_COMPILER_OPTIONS: dict[str, Any] = {
    "xla_gpu_reduce_scatter_combine_threshold_bytes": 0,
}


def compiler_options(mesh: Any, mode: str = "explicit") -> dict[str, Any] | None:
    """The compiler options a step of ``mode`` compiles with on ``mesh``'s platform, or None.

    ``make_train_step`` sets them; a step called inside your own ``jax.jit`` takes them as
    ``jax.jit(..., compiler_options=compiler_options(mesh))`` (census guide, "On a TPU").
    On a TPU: ``TPU_COMPILER_OPTIONS`` (explicit) or ``TPU_IMPLICIT_COMPILER_OPTIONS``; on a GPU
    ``GPU_COMPILER_OPTIONS`` (explicit; the implicit step's none).
    """
    devices = getattr(mesh, "devices", None)
    platform = devices.flat[0].platform if devices is not None and getattr(devices, "size", 0) else None
    if platform == "tpu":
        return dict(TPU_COMPILER_OPTIONS if mode == "explicit" else TPU_IMPLICIT_COMPILER_OPTIONS)
    if platform == "gpu" and mode == "explicit":
        return dict(GPU_COMPILER_OPTIONS)
    return None
