"""The on-disk cache: where it lives, what identifies this machine, and an atomically rewritten JSON table."""

from __future__ import annotations

import hashlib
import json
import os
import platform
from functools import cache
from pathlib import Path
from typing import Any

from .files import atomic_file


def cache_dir() -> Path:
    """`$UHOP_CACHE_DIR`, else `$XDG_CACHE_HOME/uhop-onnx`, else `~/.cache/uhop-onnx`."""
    if os.environ.get("UHOP_CACHE_DIR"):
        return Path(os.environ["UHOP_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "uhop-onnx"


@cache
def cpu_description() -> str:
    """CPU model and ISA flags, as the kernel reports them."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [line for line in f if line.startswith(("model name", "flags", "Features", "CPU part"))]
    except OSError:
        lines = []
    return "".join(sorted(set(lines))) or platform.processor()


def device_fingerprint(*parts: object) -> str:
    """A short hash of what makes timings comparable: CPU model and flags, cores, machine, and `parts`
    (thread count, GPU name and driver, library build...)."""
    text = "\0".join([cpu_description(), str(os.cpu_count()), platform.machine(), *map(str, parts)])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


class JsonTable:
    """A JSON object in one file: read whole, updated by rewriting a temporary file and renaming it."""

    def __init__(self, path: Path):
        self.path = path

    def read(self) -> dict[str, Any]:
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def get(self, key: str) -> Any:
        return self.read().get(key)

    def update(self, entries: dict[str, Any]) -> None:
        if not entries:
            return
        table = self.read() | entries
        with atomic_file(self.path) as handle:
            json.dump(table, handle, indent=1, sort_keys=True)
