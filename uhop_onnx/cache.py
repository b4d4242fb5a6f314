"""The on-disk cache: where it lives, what identifies this machine, and an atomically rewritten JSON table."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

from .files import atomic_file

log = logging.getLogger(__name__)


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


@cache
def code_fingerprint() -> str:
    """A short hash of uhop-onnx's own Python source, so that what a cache keeps of its decisions (a measured
    plan) is not reused by a changed checkout that still carries the same version number."""
    from importlib import import_module

    packages = ("uhop_onnx", "uhop_onnx.partitioner", "uhop_onnx.providers", "uhop_onnx.custom_ops")
    folders = [Path(folder) for package in packages for folder in import_module(package).__path__]
    sources = sorted({source.resolve() for folder in folders for source in folder.rglob("*.py")})
    digest = hashlib.sha256()
    for source in sources:  # installed, the subpackages lie inside uhop_onnx; editable, beside it
        digest.update(source.read_bytes())
    return digest.hexdigest()[:16]


def device_fingerprint(*parts: object) -> str:
    """A short hash of what makes timings comparable: CPU model and flags, cores, machine, and `parts`
    (thread count, GPU name and driver, library build...)."""
    text = "\0".join([cpu_description(), str(os.cpu_count()), platform.machine(), *map(str, parts)])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


class JsonTable:
    """A JSON object in one file: read whole, updated by rewriting a temporary file and renaming it.

    A cache never breaks a run: `check` is called on each entry as it is read and one it raises on is
    ignored (so it is measured again, and the next update drops it); an unreadable file reads as empty and
    one that cannot be written (a read-only folder, a full disk) keeps nothing. Each such problem is logged
    once per file, with the file's path.
    """

    def __init__(self, path: Path, check: Callable[[Any], object] = lambda entry: None):
        self.path = path
        self.check = check

    def read(self) -> dict[str, Any]:
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as error:
            _report(self.path, "read", f"cannot be read ({error}); it is ignored")
            return {}
        if not isinstance(data, dict):
            _report(self.path, "read", f"holds a JSON {type(data).__name__}, not an object; it is ignored")
            return {}
        valid, refused = {}, {}
        for key, entry in data.items():
            try:
                self.check(entry)
            except Exception as error:  # noqa: BLE001 - an entry may be wrong in any way; it is only ignored
                refused[key] = f"{type(error).__name__}: {error}"
            else:
                valid[key] = entry
        if refused:
            key, why = next(iter(refused.items()))
            _report(self.path, "entries", f"has {len(refused)} invalid entries, ignored and measured again "
                    f"(first: {key!r}, {why})")
        return valid

    def get(self, key: str) -> Any:
        return self.read().get(key)

    def update(self, entries: dict[str, Any]) -> None:
        if not entries:
            return
        table = self.read() | entries
        try:
            with atomic_file(self.path) as handle:
                json.dump(table, handle, indent=1, sort_keys=True)
        except OSError as error:
            _report(self.path, "write", f"cannot be written ({error}); running without keeping these entries")


_REPORTED: set[tuple[Path, str]] = set()


def _report(path: Path, kind: str, problem: str) -> None:
    """Log a cache file's problem of one kind (read, entries, write) once per process."""
    if (path, kind) not in _REPORTED:
        _REPORTED.add((path, kind))
        log.warning("cache %s %s", path, problem)
