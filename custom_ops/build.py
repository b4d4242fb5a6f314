"""Compile generated C into a shared library (or a static aarch64 program), cached on disk.

The cache key is the hash of the source, the flags and the compiler's version banner, so a new compiler or a
changed generator rebuilds. Files are written under a temporary name and renamed, so a concurrent build or an
interrupted one never leaves a half-written library in place; a sidecar holds the SHA-256 of each build, and a
cached file that no longer matches it is rebuilt. The compiler's own temporary files go to the build's folder
beside its output (one a killed build left is removed by the next), and a build interrupted by an exception
(a signal's) kills the compiler with what it started.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import subprocess
import time
from contextlib import suppress
from functools import cache
from pathlib import Path

from uhop_onnx.foundation.cache import cache_dir
from uhop_onnx.foundation.errors import UhopError, logger
from uhop_onnx.foundation.files import scratch_beside

from .spec import TARGETS, host_target

log = logger(__name__)

BASE_FLAGS = ("-O3", "-std=c11", "-fno-math-errno", "-pthread", "-D_POSIX_C_SOURCE=200809L", "-D_ISOC11_SOURCE")


class BuildError(UhopError):
    """The C compiler is missing or rejected the generated source."""


@cache
def compiler_version(compiler: str) -> str:
    """The first line of `compiler --version`; raises `BuildError` when the compiler is not installed."""
    if shutil.which(compiler) is None:
        raise BuildError(f"C compiler {compiler!r} is not on PATH")
    out = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=False)
    return (out.stdout.splitlines() or [compiler])[0].strip()


def compile_command(target: str, shared: bool = True) -> list[str]:
    t = TARGETS[target]
    kind = ["-shared", "-fPIC"] if shared else ["-static"]
    return [t.compiler, *BASE_FLAGS, *t.flags, *kind]


def build(source: str, target: str | None = None, *, shared: bool = True, libs: tuple[str, ...] = ("-lm",)) -> Path:
    """The path of the compiled `source` for `target` (the host's by default), building it unless cached."""
    target = target or host_target()
    command = compile_command(target, shared)
    version = compiler_version(command[0])
    key = hashlib.sha256("\0".join([source, *command, *libs, version]).encode()).hexdigest()[:24]
    out = cache_dir() / "kernels" / f"{target}-{key}{'.so' if shared else ''}"
    if _intact(out):
        return out
    with scratch_beside(out) as tmp:
        c_file, binary = tmp / "kernels.c", tmp / out.name
        c_file.write_text(source)
        result = _compiled([*command, str(c_file), "-o", str(binary), *libs], tmp)
        if result.returncode != 0:
            raise BuildError(f"{command[0]} failed to build the {target} kernels:\n{result.stderr[-2000:]}")
        digest = tmp / "digest"
        digest.write_text(_digest(binary))
        os.replace(binary, out)
        os.replace(digest, _sidecar(out))
    log.info("built %s", out)
    return out


def _compiled(command: list[str], folder: Path) -> subprocess.CompletedProcess:
    """`command` run to its end, its temporary files (the compiler's `.s` and `.o`) in `folder`; killed with what
    it started when an exception interrupts the wait."""
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "TMPDIR": str(folder)})
    try:
        out, err = process.communicate()
    except BaseException:
        for pid in _stopped(process.pid):
            with suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        process.wait()
        raise
    return subprocess.CompletedProcess(command, process.returncode, out, err)


def _stopped(pid: int) -> list[int]:
    """`pid` and its descendants, each stopped (SIGSTOP) before its children are read, so that none starts
    another meanwhile (a compiler driver starts the compiler proper, the assembler, the linker in turn)."""
    with suppress(ProcessLookupError):
        os.kill(pid, signal.SIGSTOP)
    for _ in range(100):  # the signal is sent, not yet taken: wait for the process to stop (or die)
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
        except (OSError, IndexError):
            break
        if state in "tTZX":
            break
        time.sleep(0.001)
    found = [pid]
    for children in Path(f"/proc/{pid}/task").glob("*/children"):
        with suppress(OSError):
            for child in children.read_text().split():
                found += _stopped(int(child))
    return found


def _sidecar(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _intact(path: Path) -> bool:
    """Whether a cached build exists and still has the content it was built with."""
    try:
        return _sidecar(path).read_text() == _digest(path)
    except OSError:
        return False


def evict(path: Path) -> None:
    """Remove a cached build that failed to load or verify, so the next `build` compiles it afresh."""
    path.unlink(missing_ok=True)
    _sidecar(path).unlink(missing_ok=True)
