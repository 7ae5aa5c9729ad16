"""Processes for the launcher's fault tests that need no JAX (each starts in a blink).

``stall``: process 1 prints ``READY`` and stops itself (SIGSTOP), as a debugger or an
operator might stop it; process 0 waits a moment for the launcher to see that, then
exits 134, as a JAX process whose peer stopped answering aborts.
``leave``: process 1 exits 0 at once; process 0 waits a moment, then exits 134.
"""

from __future__ import annotations

import os
import signal
import sys
import time

index = int(os.environ["SUBSTRAX_PROCESS_ID"])
mode = sys.argv[1]

print("READY", flush=True)
if index == 1:
    if mode == "stall":
        os.kill(os.getpid(), signal.SIGSTOP)
    sys.exit(0)
time.sleep(1.5)
sys.exit(134)
