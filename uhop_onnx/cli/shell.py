"""The process around the commands: `-v` anywhere, the runtimes' native stderr, warnings on one line, its age."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


IMPORTED = time.monotonic()
VERBOSE = ("-v", "--verbose")
AS_COMMAND = False  # main() sets it: `optimize --budget` then counts from the process's start


def age() -> float:
    """Seconds since this process started (from /proc), else since this module was imported."""
    try:
        started = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])  # field 22, in ticks
        return max(float(Path("/proc/uptime").read_text().split()[0]) - started / os.sysconf("SC_CLK_TCK"), 0.0)
    except (OSError, ValueError, IndexError):
        return time.monotonic() - IMPORTED


def one_line(message, category, filename, lineno, line=None) -> str:
    """A warning as `warning: its first line` (where in uhop-onnx it was raised is no news to the user)."""
    text = str(message).strip().splitlines()
    return f"warning: {text[0] if text else category.__name__}\n"


@contextmanager
def runtimes_silenced(silenced: bool) -> Iterator[None]:
    """While `silenced`, what native code writes to file descriptor 2 (LiteRT's "Created TensorFlow Lite
    XNNPACK delegate" line, runtimes' C++ logs) goes nowhere, while Python's `sys.stderr` (progress,
    warnings, errors) still reaches the terminal through a copy of the descriptor."""
    if not silenced:
        yield
        return
    sys.stderr.flush()
    kept, null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    original = sys.stderr
    sys.stderr = open(kept, "w", buffering=1, encoding=original.encoding, errors="backslashreplace", closefd=False)
    os.dup2(null, 2)
    os.close(null)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(kept, 2)
        os.close(kept)
        sys.stderr = original
