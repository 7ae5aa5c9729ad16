"""Run one training script as several JAX processes: locally, or on a cluster.

``python -m substrax.launch --num-processes 2 --devices-per-process 4 train.py`` starts
two processes joined into one 8-device JAX system; the script calls ``initialize()``
first thing, and loads its rows with ``process_slice``. See the processes guide.
"""

from __future__ import annotations

from substrax.launch._env import launch_env  # substrax.checkpoint's
from substrax.launch._join import initialize, process_slice
from substrax.launch._launcher import launch
from substrax.launch._port import free_port

__all__ = ["free_port", "initialize", "launch", "process_slice"]
