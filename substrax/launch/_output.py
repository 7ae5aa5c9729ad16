"""The children's output: each line passed on under its process's prefix, gloo's chatter dropped."""

from __future__ import annotations

import re
import sys
import threading
from collections.abc import Callable
from typing import BinaryIO

# When its connections are up, gloo prints "[Gloo] Rank R is connected to N peer ranks.
# Expected number of connected peer ranks is : N" once per device, from one thread per
# device, one piece at a time: the pieces interleave ("[Gloo] Rank 4", "[Gloo] Rank  is
# connected to 75 peer ranks.  is connected to peer ranks. "), numbers astray.
_GLOO_PIECES = re.compile(
    r"\[Gloo\] Rank ?| ?is connected to ?| ?peer ranks\. ?|Expected number of connected peer ranks is : ?"
)


def drop_gloo_chatter(line: str) -> str | None:
    """``line`` without gloo's "Rank R is connected" pieces; ``None`` when only they were in it.

    They carry no information. A line that held only their pieces and numbers is dropped;
    any other line keeps everything but the pieces.
    """
    rest, found = _GLOO_PIECES.subn("", line)
    if not found:
        return line
    return rest if rest.strip(" \t\r\n0123456789") else None


class Printer:
    """Writes whole lines from every child, each under its prefix, one at a time.

    Streams are named ("stdout", "stderr") and looked up at each write, so output
    follows any redirection of ``sys.stdout`` (a notebook, pytest's capture).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()

    def write(self, stream: str, prefix: str, line: str) -> None:
        with self._lock:
            out = getattr(sys, stream)
            try:
                out.write(prefix + line.rstrip("\n") + "\n")
                out.flush()
            except (BrokenPipeError, ValueError):
                pass  # our own output is gone (a closed pipe); keep draining the child's

    def pump(
        self, pipe: BinaryIO, stream: str, prefix: str, on_line: Callable[[], None] = lambda: None
    ) -> None:
        with pipe:
            after_gloo = False  # gloo's pieces leave stray newlines and digits on the lines after them
            for raw in iter(pipe.readline, b""):
                on_line()
                text = raw.decode(errors="replace")
                line = drop_gloo_chatter(text)
                if line is not None and after_gloo and not line.strip(" \t\r\n0123456789"):
                    line = None
                after_gloo = line is None or line != text
                if line is not None:
                    self.write(stream, prefix, line)

    def say(self, text: str) -> None:
        self.write("stderr", "[launch] ", text)
