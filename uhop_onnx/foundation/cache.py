"""The on-disk cache: where it lives, what identifies this machine, an atomically rewritten JSON table, files
known by the hash of their bytes, and a size cap that drops the least recently used entries first."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import platform
import re
import shutil
import stat
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from .errors import InputError, UhopError, first_line, logger
from .files import atomic_file, external_tensors, read_mapped

log = logger(__name__)


def cache_dir() -> Path:
    """`$UHOP_CACHE_DIR`, else `$XDG_CACHE_HOME/uhop-onnx`, else `~/.cache/uhop-onnx`, made private (0700)
    when absent. A folder that another user could have written (`distrust`) is not used: the process runs on
    a private temporary folder instead, uncached, with one warning naming the folder and the fix."""
    if os.environ.get("UHOP_CACHE_DIR"):
        folder = Path(os.environ["UHOP_CACHE_DIR"])
    else:
        folder = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "uhop-onnx"
    why = distrust(folder)
    if why is None:
        _make_private(folder)
        return folder
    if folder not in _UNCACHED:
        _UNCACHED[folder] = tempfile.TemporaryDirectory(prefix="uhop-uncached-")
        log.warning("cache %s is not used: %s, so another user could place plans or libraries there that this "
                    "process would run; running uncached. Fix: `chmod go-w` the folder (and own it), or set "
                    "UHOP_CACHE_DIR to a folder of your own", folder, why)
    return Path(_UNCACHED[folder].name)


_UNCACHED: dict[Path, tempfile.TemporaryDirectory] = {}  # an untrusted cache folder -> this process's own


def distrust(folder: Path) -> str | None:
    """Why `folder` cannot be trusted as a cache, or None: it, or a folder above it inside the user's home,
    is owned by another user (root excepted) or writable by group or others."""
    folder = folder.absolute()
    try:
        home = Path.home().absolute()
    except (KeyError, RuntimeError):
        home = None
    above = [p for p in folder.parents if home is not None and p != home and p.is_relative_to(home)]
    for path in [folder, *above]:
        try:
            info = path.stat()
        except OSError:  # not made yet (made private), or unreadable (reading it names the problem)
            continue
        if info.st_uid not in (os.geteuid(), 0):
            return f"{path} is owned by another user (uid {info.st_uid})"
        if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            return f"{path} is writable by {'others' if info.st_mode & stat.S_IWOTH else 'its group'}"
    return None


def _make_private(folder: Path) -> None:
    """Make `folder` and any missing folder above it, each readable by its owner alone."""
    missing = []
    for path in [folder, *folder.parents]:
        if path.exists():
            break
        missing.append(path)
    for path in reversed(missing):
        try:
            path.mkdir(mode=0o700)
        except FileExistsError:
            continue
        except OSError:  # read-only: writing names the problem
            return


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


TABLE_BYTES = 16 * 1024**2  # a larger table is set aside unread
TABLE_DEPTH = 16  # and one nested deeper than this


class JsonTable:
    """A JSON object in one file: read whole, updated under a lock (`locked`) by rewriting a temporary file
    and renaming it, so that processes updating it at once lose no entry.

    A cache never breaks a run: `check` is called on each entry as it is read and one it raises on is
    ignored (so it is measured again, and the next update drops it); an unreadable file, or one over
    `TABLE_BYTES` or `TABLE_DEPTH`, reads as empty (and the next update replaces it); one that cannot be
    written (a read-only folder, a full disk) keeps nothing. Each such problem is logged once per file, with
    the file's path.
    """

    def __init__(self, path: Path, check: Callable[[Any], object] = lambda entry: None):
        self.path = path
        self.check = check

    def read(self) -> dict[str, Any]:
        try:
            with self.path.open("rb") as file:
                text = file.read(TABLE_BYTES + 1)
            if len(text) > TABLE_BYTES:
                raise ValueError(f"larger than {TABLE_BYTES} bytes")
            data = json.loads(text)
            _shallow(data)
        except FileNotFoundError:
            return {}
        except (OSError, ValueError, RecursionError) as error:
            _report(self.path, "read", f"cannot be read ({first_line(error)}); it is set aside: "
                    "its entries are measured again, and the next update replaces it")
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

    def update(self, entries: dict[str, Any]) -> dict[str, Any]:
        """Add or replace `entries`, under the lock; the entries they replaced."""
        if not entries:
            return {}
        try:
            with locked(self.path):
                table = self.read()
                replaced = {key: table[key] for key in entries if key in table}
                with atomic_file(self.path) as handle:
                    json.dump(table | entries, handle, indent=1, sort_keys=True)
                return replaced
        except OSError as error:
            _report(self.path, "write", f"cannot be written ({error}); running without keeping these entries")
            return {}


@contextmanager
def locked(path: Path) -> Iterator[None]:
    """An exclusive lock (`fcntl.flock`) on the lock file beside `path`, held for the block: other processes,
    and other threads of this one, wait for it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path.with_name(f".{path.name}.lock"), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def _shallow(data: Any) -> None:
    """Raise ValueError when `data` nests deeper than `TABLE_DEPTH`."""
    level = [data]
    for _ in range(TABLE_DEPTH):
        level = [v for item in level if isinstance(item, (dict, list))
                 for v in (item.values() if isinstance(item, dict) else item)]
        if not level:
            return
    raise ValueError(f"nested deeper than {TABLE_DEPTH} levels")


_REPORTED: set[tuple[Path, str]] = set()


def _report(path: Path, kind: str, problem: str) -> None:
    """Log a cache file's problem of one kind (read, entries, write) once per process."""
    if (path, kind) not in _REPORTED:
        _REPORTED.add((path, kind))
        log.warning("cache %s %s", path, problem)


# Digests of files, remembered beside what identifies one version of a file. The change time is set by the
# kernel on every write, rename, chmod or utime and no user can set it, so a file replaced by another of the
# same size and modification time (`cp -p`, `rsync -t`) is hashed again. A file changed within the last
# RACY_S seconds is hashed every time: time stamps that close may not yet tell two versions apart.
RACY_S = 2.0
LARGE = 4 * 1024**2  # bytes: a smaller file is hashed (3 ms or less) again each time, as quick as the table


def file_digest(path: Path) -> str:
    """The sha256 of a file's bytes (`_remembered`); of an ONNX model that keeps data in other files of its
    folder, of its bytes and theirs (weights replaced beside an unchanged model file make another model).
    Files it names outside its folder, or that are not regular files, are left out: loading refuses them."""
    own = _remembered(path)
    data = _data_files(path)
    if not data:
        return own
    digest = hashlib.sha256(own.encode())
    for location, target in data:
        digest.update(f"\0{location}\0{_remembered(target)}".encode())
    return digest.hexdigest()


def _remembered(path: Path) -> str:
    """The sha256 of the file's bytes; of a `LARGE` file, remembered in the cache (`model-hashes.json`) by its
    path, device, inode, size, modification and change times."""
    stat = path.stat()
    if stat.st_size < LARGE:
        return _hashed(path)
    seen = f"{stat.st_dev}:{stat.st_ino}:{stat.st_size}:{stat.st_mtime_ns}:{stat.st_ctime_ns}"
    store = JsonTable(cache_dir() / "model-hashes.json", _seen_digest)
    known = store.get(str(path))
    if known and known[0] == seen:
        return known[1]
    digest = _hashed(path)
    if time.time_ns() - stat.st_ctime_ns > RACY_S * 1e9:
        store.update({str(path): [seen, digest]})
    return digest


def _data_files(path: Path) -> list[tuple[str, Path]]:
    """(location, file) of each file of its folder that a model file names as external data, in order; none
    for a file that is no model. The file is mapped, not read: the walk reads only its fields' headers."""
    try:
        locations = {entries.get("location", "") for _, entries in read_mapped(path, external_tensors)}
    except (OSError, ValueError, UhopError):  # empty, unreadable or no model: loading it names the problem
        return []
    folder = path.resolve().parent
    found = [(location, (folder / location).resolve()) for location in sorted(locations) if location]
    return [(location, target) for location, target in found if target.is_relative_to(folder) and target.is_file()]


def _hashed(path: Path) -> str:
    with path.open("rb") as file:  # streamed: a second whole copy of a large model costs more than hashing it
        return hashlib.file_digest(file, "sha256").hexdigest()


def model_digest(model: Any) -> str:
    """The sha256 of a model: of a path (`file_digest`: with the external data files it names), of `bytes`,
    or of an `onnx.ModelProto` serialized deterministically."""
    if isinstance(model, bytes):
        return hashlib.sha256(model).hexdigest()
    if hasattr(model, "SerializeToString"):
        return hashlib.sha256(model.SerializeToString(deterministic=True)).hexdigest()
    path = Path(model).resolve()
    try:
        return file_digest(path)
    except OSError:
        return hashlib.sha256(os.fsencode(path)).hexdigest()  # load() names the problem


def _seen_digest(entry: Any) -> None:
    """A model-hashes entry is [dev:inode:size:mtime:ctime, sha256]."""
    if not (isinstance(entry, list) and len(entry) == 2 and all(isinstance(part, str) for part in entry)):
        raise TypeError(f"{entry!r} is not [dev:inode:size:mtime:ctime, sha256]")


# The size cap. An entry is a file or folder directly inside one of the cache's folders (a plan, a quantized
# stage, a LiteRT conversion, a kernels build, a table), or a file at its top (its kind: the file's name
# without suffix). Its last use is the latest modification or access time of anything in it (`touch` marks
# a use).
DEFAULT_CAP = 2 * 1024**3
KEPT = ("rknn-venv", "corpus")  # the rknn-toolkit2 environment and the benchmarks' exports: never pruned
IN_PROGRESS_S = 24 * 3600  # a `.name` or `tmp...` entry younger than this is a write under way, left alone
_UNITS = {"": 1, "K": 1024, "M": 1024**2, "G": 1024**3, "T": 1024**4}


@dataclass(frozen=True)
class Entry:
    path: Path
    kind: str
    bytes: int
    used: float

    def to_json(self) -> dict[str, Any]:
        return {"path": str(self.path), "kind": self.kind, "bytes": self.bytes}


def parse_size(text: str, where: str = "UHOP_CACHE_MAX") -> int:
    """Bytes from `2147483648`, `500M`, `2G` or `1.5GB` (K, M, G, T are powers of 1024)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d*)?)\s*([KMGT]?)(?:i?B)?\s*", text, re.IGNORECASE)
    if not match:
        raise InputError(f"{where}={text!r} is not a size: give bytes, or a number with K, M, G or T (2G, 500M)")
    return int(float(match[1]) * _UNITS[match[2].upper()])


def cache_cap() -> int:
    """`$UHOP_CACHE_MAX` in bytes, 2 GiB when unset."""
    text = os.environ.get("UHOP_CACHE_MAX", "").strip()
    return parse_size(text) if text else DEFAULT_CAP


def entries() -> list[Entry]:
    """The cache's entries, least recently used first (none when the cache folder is absent)."""
    root = cache_dir()
    found = [_entry(child, child.stem) for child in _children(root) if child.name not in KEPT and not child.is_dir()]
    for folder in _children(root):
        if folder.name not in KEPT and folder.is_dir() and not folder.is_symlink():
            found += [_entry(child, folder.name) for child in _children(folder)]
    return sorted((e for e in found if e is not None), key=lambda e: e.used)


def _children(folder: Path) -> list[Path]:
    """`folder`'s entries but writes under way; none when it cannot be read."""
    try:
        children = list(folder.iterdir())
    except OSError:
        return []
    return [c for c in children if not (c.name.startswith((".", "tmp")) and _age(c) < IN_PROGRESS_S)]


def _age(path: Path) -> float:
    try:
        return time.time() - path.lstat().st_mtime
    except OSError:
        return 0.0


def _entry(path: Path, kind: str) -> Entry | None:
    """`path`'s size and last use; None when it vanished meanwhile."""
    try:
        own = path.lstat()
    except OSError:
        return None
    files = list(_walk(path)) if path.is_dir() and not path.is_symlink() else [own]
    return Entry(path, kind, sum(s.st_size for s in files), max(max(s.st_mtime, s.st_atime) for s in [own, *files]))


def _walk(folder: Path) -> Iterator[os.stat_result]:
    """The stat of every file below `folder` (symbolic links not followed)."""
    for parent, _, files in os.walk(folder):
        for name in files:
            try:
                yield os.lstat(os.path.join(parent, name))
            except OSError:
                continue


def touch(path: Path) -> None:
    """Mark a cache entry as used now (nothing when the cache is read-only)."""
    try:
        os.utime(path)
    except OSError:
        pass


def discard(path: Path) -> bool:
    """Remove a cache entry: renamed aside first, so that no reader sees it half removed. Whether it was."""
    aside = path.with_name(f".discarded-{uuid.uuid4().hex[:8]}-{path.name}")
    try:
        path.rename(aside)
    except OSError:
        return False
    if aside.is_dir():
        shutil.rmtree(aside, ignore_errors=True)
    else:
        aside.unlink(missing_ok=True)
    return True


def prune(max_bytes: int | None = None) -> dict[str, Any]:
    """Remove entries, least recently used first, until the cache holds at most `max_bytes` (default
    `cache_cap()`); a report: folder, cap, bytes before and after, entries removed."""
    cap = cache_cap() if max_bytes is None else max_bytes
    found = entries()
    before = sum(e.bytes for e in found)
    over = []
    for entry in found:
        if before - sum(e.bytes for e in over) <= cap:
            break
        over.append(entry)
    return _removing(over, before, cap)


def clear() -> dict[str, Any]:
    """Remove every entry (what `KEPT` names stays); the report `prune` gives."""
    found = entries()
    return _removing(found, sum(e.bytes for e in found), 0)


def _removing(chosen: list[Entry], before: int, cap: int) -> dict[str, Any]:
    removed = [entry for entry in chosen if discard(entry.path)]
    after = before - sum(e.bytes for e in removed)
    if removed:
        log.info("cache %s: removed %d entries (%d bytes); %d bytes left, cap %d", cache_dir(), len(removed),
                 before - after, after, cap)
    return {"folder": str(cache_dir()), "cap": cap, "before": before, "bytes": after,
            "removed": [e.to_json() for e in removed]}


def info() -> dict[str, Any]:
    """The cache folder, its cap, total size, entries and bytes by kind, and what is never pruned."""
    found = entries()
    kinds: dict[str, dict[str, int]] = {}
    for entry in found:
        kind = kinds.setdefault(entry.kind, {"entries": 0, "bytes": 0})
        kind["entries"] += 1
        kind["bytes"] += entry.bytes
    root = cache_dir()
    return {"folder": str(root), "cap": cache_cap(), "bytes": sum(e.bytes for e in found), "entries": len(found),
            "kinds": dict(sorted(kinds.items())), "kept": [name for name in KEPT if (root / name).exists()]}
