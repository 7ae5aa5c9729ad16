"""Device meshes: build them, describe them, and emulate devices on the CPU.

Also re-exported: ``MeshRules`` and its helpers, and ``substrax.mesh.strategies``. The
meshes here default to ``AxisType.Auto`` axes, not ``jax.make_mesh``'s ``Explicit``:
see the batches guide, "Meshes with Auto axes".
"""

from substrax.mesh import strategies
from substrax.mesh._gpu import device_memory
from substrax.mesh._meshes import (
    DeviceMeshManager,
    create_data_parallel_mesh,
    create_device_mesh,
    create_hybrid_mesh,
    create_model_parallel_mesh,
    current_mesh,
    current_mesh_with,
    get_mesh_info,
    mesh_in_effect,
    mesh_info,
    use_cpu_devices,
)
from substrax.mesh._rules import (
    MeshRules,
    create_named_sharding,
    data_parallel_rules,
    fsdp_rules,
    partition_spec_for_names,
)
from substrax.mesh._topology import compile_only, topology_mesh
from substrax.mesh.strategies import (
    DataParallelStrategy,
    DimensionNames,
    FSDPStrategy,
    MultiDimensionalStrategy,
    ParallelismConfig,
    PipelineParallelStrategy,
    ShardingConfig,
    ShardingStrategy,
    TensorParallelStrategy,
)

__all__ = [
    "DeviceMeshManager",
    "MeshRules",
    "compile_only",
    "create_data_parallel_mesh",
    "create_device_mesh",
    "create_hybrid_mesh",
    "create_model_parallel_mesh",
    "create_named_sharding",
    "current_mesh",
    "current_mesh_with",
    "data_parallel_rules",
    "device_memory",
    "fsdp_rules",
    "get_mesh_info",
    "mesh_in_effect",
    "mesh_info",
    "partition_spec_for_names",
    "topology_mesh",
    "use_cpu_devices",
]
__all__ += strategies.__all__  # the strategies, re-exported
