"""A step's peak memory per device, from its trace, by the rules of one compiler: XLA:CPU's.

A liveness walk over the jaxpr (``_walk``) writes down the program XLA would compile it to:
which values it keeps, fuses, copies and combines (``_passes``), in the order its scheduler
runs them, the buffers packed as its buffer assigner packs them (``_heap``). What is the
compiler's own (the fusions it makes, the reductions it runs as YNNPACK kernels from 4,096
elements, the copies its layouts ask for, its scheduler's order, 64-byte alignment) is one
module, ``xla_cpu``, measured against XLA:CPU's programs. A TPU's or a GPU's compiler keeps
other buffers: their rules would be modules beside it (``xla_tpu``, ``xla_gpu``), chosen by
the mesh's platform; there ``substrax.plan`` compiles each configuration instead
(``PlanRow.compiler``). See the planning guide for the rules and how close it comes.
"""

from substrax._plan._memory._heap import Memory
from substrax._plan._memory._walk import estimate

__all__ = ["Memory", "estimate"]
