"""What this host gives a process: its cores (the most threads a runtime is given) and the memory it may still
allocate (what sample inputs may take)."""

from __future__ import annotations

import os
import warnings
from pathlib import Path


def cores() -> int:
    """The CPU cores this process may run on (its affinity mask; all the host's where that is unknown)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def bounded_threads(threads: int | None, where: str = "threads") -> int | None:
    """`threads`, or this host's `cores()` when it asks for more (more threads than cores only compete for
    them, and a plan's or a caller's `threads=10000` would start ten thousand), with a warning naming `where`
    (once per place that asks)."""
    most = cores()
    if threads is None or threads <= most:
        return threads
    warnings.warn(f"{where}={threads} is more than the {most} cores this process may use; using {most}",
                  UserWarning, stacklevel=2)
    return most


def available_memory() -> int | None:
    """Bytes this process may still allocate: the kernel's `MemAvailable`, within the room left under a cgroup
    (v2) memory limit; None where neither is known."""
    limits = []
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                limits.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        pass
    cgroup = Path("/sys/fs/cgroup")
    try:
        limit = (cgroup / "memory.max").read_text().strip()
        if limit != "max":
            limits.append(int(limit) - int((cgroup / "memory.current").read_text()))
    except (OSError, ValueError):
        pass
    return max(min(limits), 0) if limits else None
