"""One process of a launcher test that needs no JAX: fast to start, and told apart by env.

``env``: print this process's ``SUBSTRAX_*`` settings as ``ENV <json>``, and a line to
stderr. ``fail CODE``: every process starts a ``sleep`` grandchild (``GRANDCHILD <pid>``)
and ignores SIGTERM and SIGINT, as a JAX process may; process 1 then exits with CODE
(``kill`` for SIGKILL) while the others sleep. ``wait``: the same, but nobody fails:
each prints ``READY`` and sleeps, for the launcher to be interrupted. ``quiet PATH``: the
same, but process 1 creates the file PATH after ``READY``, and process 0 prints ``tick``
every 0.2 s until PATH exists, and for 2 s after. ``gloo``: gloo's
"Rank R is connected" lines, interleaved as its threads print them, then one whole line.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

index = int(os.environ["SUBSTRAX_PROCESS_ID"])
mode = sys.argv[1]

if mode == "env":
    mine = {k: v for k, v in os.environ.items() if k.startswith(("SUBSTRAX_", "PYTHONUNBUFFERED"))}
    print("ENV " + json.dumps(mine))
    print(f"to stderr from {index}", file=sys.stderr)
    sys.exit(0)

if mode == "gloo":
    # what gloo's per-device threads print when their connections are up, pieces interleaved
    sys.stdout.write("[Gloo] Rank 4\n")
    sys.stdout.write("[Gloo] Rank  is connected to 75 peer ranks.  is connected to peer ranks. \n")
    sys.stdout.write("Expected number of connected peer ranks is : 7\n")
    sys.stdout.write("[Gloo] Rank 0 is connected to 7 peer ranks. ")
    sys.stdout.write("Expected number of connected peer ranks is : 7\n")
    print(f"line {index} whole")
    sys.exit(0)

sleeper = subprocess.Popen(["sleep", "300"])
print(f"GRANDCHILD {sleeper.pid}")
signal.signal(signal.SIGTERM, signal.SIG_IGN)
signal.signal(signal.SIGINT, signal.SIG_IGN)
print("READY")
if mode == "quiet" and index == 1:
    open(sys.argv[2], "w").close()
if mode == "quiet" and index == 0:
    ticks = 0
    while ticks < 10:
        time.sleep(0.2)
        print("tick")
        ticks += os.path.exists(sys.argv[2])
if mode == "fail" and index == 1:
    time.sleep(0.5)
    if sys.argv[2] == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    sys.exit(int(sys.argv[2]))
time.sleep(300)
