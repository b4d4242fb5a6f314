"""What this host gives a process: its cores (the most threads a runtime is given), the memory it may still
allocate (what sample inputs may take), and its CPU's architecture and features (what its runtimes compute)."""

from __future__ import annotations

import functools
import os
import platform
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


def host_arch() -> str:
    """This host's CPU architecture, spelled as target profiles spell it: x86_64 or aarch64."""
    machine = platform.machine().lower()
    return {"amd64": "x86_64", "arm64": "aarch64"}.get(machine, machine)


@functools.cache
def cpu_features() -> frozenset[str]:
    """The CPU's features as the runtimes detect them, from CPUID (numpy reads it at import), lower-cased:
    `avx2`, `avx512vnni`, `avx512bf16`... Under an emulator they are the emulated CPU's, where /proc/cpuinfo
    would still give the host's."""
    import numpy

    core = getattr(numpy, "_core", None) or numpy.core
    return frozenset(name.lower() for name, present in core._multiarray_umath.__cpu_features__.items() if present)
