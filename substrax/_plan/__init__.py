"""A plan before compiling: each configuration's communication and memory per device, from a trace.

``plan`` (``_rows``) places a copy of the state in each candidate configuration, traces and
lowers its step (compiling only the optimizer update, alone), applies
``TrainStep.check_communication``'s rule (``expected_step``, read against the trace:
``_items``) and walks the trace for the peak memory by XLA:CPU's rules (``_memory``). On a
mesh of other devices (a TPU's or a GPU's, ``topology_mesh``'s) it compiles each
configuration for them and reads both from the program instead. Its rows and table:
``_table``. See the planning guide.
"""

from substrax._plan._rows import plan
from substrax._plan._table import Plan, PlanRow

__all__ = ["Plan", "PlanRow", "plan"]
