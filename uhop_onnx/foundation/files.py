"""Files: writes that land whole or not at all (a file or a folder is built beside its target and renamed onto
it, with the modes the user's umask gives: mkstemp and mkdtemp would leave them private to the owner), staging
left by a killed process removed on the next write, temporary folders kept in one run folder per process
(one a killed process left is removed by the next), `.npz` arrays read without pickles, the external-data
files an ONNX model names checked to lie inside its own folder, and a serialized model's structure without its
tensors' values (both read from the protobuf wire format: a board has no onnx)."""

from __future__ import annotations

import mmap
import os
import re
import shutil
import tarfile
import tempfile
import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, TypeVar

from .errors import InputError, ModelError, OutputError, UhopError

_STAGING = re.compile(r"\..+\.uhop-(\d+)-[a-z0-9_]{8}")  # `.NAME.uhop-PID-XXXXXXXX`, beside its target
# `uhop-run-PID-XXXXXXXX` in the temporary folder (and `uhop-KIND-PID-XXXXXXXX`, as older versions named theirs)
_SCRATCH = re.compile(r"uhop-[a-z0-9]+-(\d+)-[a-z0-9_]{8}(\.npz)?")
_RUN = re.compile(r"uhop-run-(\d+)-[a-z0-9_]{8}")
_swept: set[str] = set()
_runs: dict[tuple[int, str], list] = {}  # (process, temporary folder) -> [its run folder, folders in use there]
_locks: dict[int, threading.Lock] = {}  # per process: a child forked while a thread held the lock gets its own


def umask() -> int:
    """The process's file mode creation mask."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


@contextmanager
def atomic_file(path: Path, mode: str = "w") -> Iterator[IO]:
    """An open temporary file beside `path`, renamed to `path` when the block ends without error. An
    `OutputError` when `path` cannot be written, or the write fails midway."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        sweep(path.parent)
        fd, temporary = tempfile.mkstemp(prefix=_staging(path.name), dir=path.parent)
    except OSError as error:
        raise _unwritable(path, error) from None
    try:
        os.fchmod(fd, 0o666 & ~umask())
        with os.fdopen(fd, mode) as handle:
            yield handle
        os.replace(temporary, path)
    except OSError as error:
        raise _midway(path, error) from None
    finally:
        Path(temporary).unlink(missing_ok=True)


@contextmanager
def new_folder(target: Path, error: type[UhopError] = UhopError) -> Iterator[Path]:
    """A temporary folder beside `target`, renamed to it when the block ends without error and removed
    otherwise. `target` must be absent or an empty folder (else `error`); an `OutputError` when it cannot be
    written, or a write fails midway."""
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise error(f"{target}: exists and is not an empty folder; choose a new output path")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        sweep(target.parent)
        staging = Path(tempfile.mkdtemp(prefix=_staging(target.name), dir=target.parent))
    except OSError as failure:
        raise _unwritable(target, failure) from None
    try:
        staging.chmod(0o777 & ~umask())
        yield staging
        if target.exists():
            target.rmdir()
        staging.rename(target)
    except OSError as failure:
        raise _midway(target, failure) from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)  # only what a failed block left


def check_writable(target: Path) -> None:
    """Raise `OutputError` now, before any work, when nothing can be written where `target` would go: its
    nearest existing folder is not a folder, or refuses a new entry. Creates nothing that stays."""
    folder = target.parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    if not folder.is_dir():
        raise OutputError(f"{target}: cannot be written: {folder} is not a folder; choose a writable path")
    try:
        Path(tempfile.mkdtemp(prefix=_staging(target.name), dir=folder)).rmdir()
    except OSError as error:
        raise _unwritable(target, error) from None


class TemporaryFolder:
    """A folder `KIND-XXXXXXXX` in this process's run folder `uhop-run-PID-XXXXXXXX`, in the system's temporary
    folder: `name` is its path; removed by `cleanup`, at the end of a `with` block, or at exit. The run folder
    is made for the first such folder (once the ones a killed process left there are removed) and removed with
    the last; a process killed before that leaves it to the next (`sweep`)."""

    def __init__(self, kind: str) -> None:
        key = _run_entered()
        try:
            self.name = tempfile.mkdtemp(prefix=f"{kind}-", dir=_runs[key][0])
        except BaseException:
            _run_left(key)
            raise
        self._finalizer = weakref.finalize(self, _removed, self.name, key)

    def cleanup(self) -> None:
        self._finalizer()

    def __enter__(self) -> str:
        return self.name

    def __exit__(self, *exc_info: object) -> None:
        self.cleanup()


def temporary_folder(kind: str) -> TemporaryFolder:
    """A temporary folder of this process's run folder (`TemporaryFolder`)."""
    return TemporaryFolder(kind)


def _lock() -> threading.Lock:
    return _locks.setdefault(os.getpid(), threading.Lock())


def _run_entered() -> tuple[int, str]:
    """The key of this process's run folder in the temporary folder (in `_runs`), made when absent, with one
    more folder in use."""
    key = (os.getpid(), tempfile.gettempdir())
    with _lock():
        if key not in _runs:
            sweep(Path(key[1]), _SCRATCH)
            _runs[key] = [tempfile.mkdtemp(prefix=f"uhop-run-{key[0]}-", dir=key[1]), 0]
        _runs[key][1] += 1
    return key


def _run_left(key: tuple[int, str]) -> None:
    """One folder fewer in use in the run folder of `key`; the last one removes it."""
    with _lock():
        _runs[key][1] -= 1
        if _runs[key][1] == 0:
            shutil.rmtree(_runs.pop(key)[0], ignore_errors=True)


def _removed(name: str, key: tuple[int, str]) -> None:
    """Remove the temporary folder `name`, in the process that made it (not in a forked child)."""
    if os.getpid() == key[0]:
        shutil.rmtree(name, ignore_errors=True)
        _run_left(key)


def dead_run(path: str | os.PathLike) -> Path | None:
    """The outermost run folder (`TemporaryFolder`) holding `path` whose process runs no more, if any: what a
    killed process's workers leave, to be removed once they are gone too."""
    found = None
    for folder in Path(path).parents:
        match = _RUN.fullmatch(folder.name)
        if match and not _running(int(match[1])):
            found = folder
    return found


def run_process(path: str | os.PathLike) -> int | None:
    """The process whose run folder (`TemporaryFolder`) holds `path` directly (`path` is one of its temporary
    folders), if it does."""
    match = _RUN.fullmatch(Path(path).parent.name)
    return int(match[1]) if match else None


@contextmanager
def scratch_beside(target: Path) -> Iterator[Path]:
    """A folder beside `target` for the work that makes it (a compiler's files), removed when the block ends;
    one a killed process left there is removed by the next (`sweep`)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    sweep(target.parent)
    folder = Path(tempfile.mkdtemp(prefix=_staging(target.name), dir=target.parent))
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def sweep(folder: Path, pattern: re.Pattern = _STAGING) -> None:
    """Remove what a process killed midway left in `folder`: entries named by `pattern` (a staging file or
    folder beside its target, by default) whose process runs no more on this host. Each folder is swept once
    per process; what cannot be removed is left."""
    key = os.path.abspath(folder)
    if key in _swept:
        return
    _swept.add(key)
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return
    for entry in entries:
        match = pattern.fullmatch(entry.name)
        if not match or _running(int(match[1])):
            continue
        try:
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path, ignore_errors=True)
            else:
                os.unlink(entry.path)
        except OSError:
            continue  # removed meanwhile by another process, or not ours to remove


def _running(pid: int) -> bool:
    """Whether a process with this id runs on this host (a zombie, dead but not yet waited for, does not)."""
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):
        return False
    except PermissionError:  # another user's
        pass
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] not in ("Z", "X")
    except (OSError, IndexError):  # no /proc here
        return True


def _staging(name: str) -> str:
    """The prefix of a staging entry for `name`, naming this process (see `sweep`)."""
    return f".{name}.uhop-{os.getpid()}-"


def _unwritable(path: Path, error: OSError) -> OutputError:
    return OutputError(f"{path}: cannot be written: {error.strerror or error}; choose a writable path")


@contextmanager
def writing(target: Path) -> Iterator[None]:
    """An `OSError` in the block (a full disk, say) becomes an `OutputError` (exit 1) naming `target`, for
    blocks that clean up after themselves."""
    try:
        yield
    except OutputError:
        raise
    except OSError as error:
        raise _midway(target, error) from None


def _midway(path: Path, error: OSError) -> OutputError:
    return OutputError(f"{path}: writing failed midway: {error.strerror or error}; nothing was left behind "
                       "(free some space, or choose another path)", exit_code=1)


def read_npz(path: str | os.PathLike | IO[bytes], error: type[UhopError] = InputError, where: object = None) -> dict:
    """The arrays of an `.npz` file by name. Arrays of Python objects are never unpickled: such an array, or a
    file that is no `.npz`, is an `error` naming `where` (default: `path`)."""
    import zipfile

    import numpy as np

    where = path if where is None else where
    name = None
    try:
        with np.load(path, allow_pickle=False) as data:
            arrays = {}
            for name in data.files:
                arrays[name] = data[name]
            return arrays
    except ValueError as failure:
        if name is not None and "allow_pickle" in str(failure):
            raise error(f"{where}: array {name!r} holds Python objects, which are never unpickled; store "
                        "numeric arrays only (numpy.savez of plain arrays)") from None
        raise error(f"{where}: cannot read its arrays ({failure}); write it with numpy.savez") from None
    except (OSError, EOFError, zipfile.BadZipFile, AttributeError, TypeError) as failure:
        raise error(f"{where}: not a readable .npz ({type(failure).__name__}: {failure}); write it with "
                    "numpy.savez") from None


# -- external data: ONNX tensors whose bytes live in another file -----------------------------------------------

def check_external_data(model: bytes, folder: Path | None, where: object, error: type[UhopError] = ModelError,
                        remedy: str = "load the model from its file path instead") -> bool:
    """Whether the serialized ONNX `model` keeps tensors' data in other files, once each such file is checked
    (`check_locations`). Reads the protobuf wire format itself: no onnx needed (a board has none)."""
    return check_locations(external_tensors(model, where, error), folder, where, error, remedy)


def check_locations(found: list[tuple[str, dict[str, str]]], folder: Path | None, where: object,
                    error: type[UhopError] = ModelError, remedy: str = "load the model from its file path instead"
                    ) -> bool:
    """Whether `found`, the (name, external_data entries) of a model's tensors that keep their data in other
    files, names any, once each is checked: a relative path that stays inside `folder` once links are
    resolved, a regular file holding the bytes the tensor names. Anything else is an `error` naming `where`;
    without a `folder` (a model given as bytes, or one a runtime reads from bytes and would resolve against
    the working directory), any such tensor is, with `remedy`."""
    if found and folder is None:
        name, entries = found[0]
        raise error(f"{where}: tensor {name!r} keeps its data in another file ({entries.get('location')!r}); "
                    f"{remedy}")
    root = folder.resolve() if folder is not None else None
    sizes: dict[str, int | None] = {}  # location -> its file's size (None: not a file inside the folder)
    for name, entries in found:
        location = entries.get("location", "")
        try:
            offset, length = int(entries.get("offset") or 0), int(entries.get("length") or 0)
            if location not in sizes:
                target = (root / location).resolve()
                inside = location and not Path(location).is_absolute() and target.is_relative_to(root)
                sizes[location] = target.stat().st_size if inside and target.is_file() else -1 if inside else None
        except (ValueError, OSError) as failure:
            raise error(f"{where}: external data of tensor {name!r} names {location!r} at offset "
                        f"{entries.get('offset')!r}, length {entries.get('length')!r}: not usable "
                        f"({failure})") from None
        if sizes[location] is None:
            raise error(f"{where}: external data of tensor {name!r} points outside the model's folder "
                        f"({location!r}); keep external data files beside the model")
        if sizes[location] < 0:
            raise error(f"{where}: external data file {location!r} of tensor {name!r} is missing")
        if offset < 0 or length < 0 or offset + length > sizes[location]:
            raise error(f"{where}: external data of tensor {name!r} runs past the end of {location!r}")
    return bool(found)


# The fields of ONNX's messages (onnx.proto) that lead to a tensor: message -> {field number: message it holds}.
_LEADS = {
    "model": {7: "graph", 25: "function"},
    "graph": {1: "node", 5: "tensor", 15: "sparse"},
    "function": {7: "node"},
    "node": {5: "attribute"},
    "attribute": {5: "tensor", 6: "graph", 10: "tensor", 11: "graph", 22: "sparse", 23: "sparse"},
    "sparse": {1: "tensor", 2: "tensor"},
    "tensor": {13: "entry"},
}
_TENSOR_NAME, _DATA_LOCATION, _EXTERNAL = 8, 14, 1


def external_tensors(model: bytes, where: object = "model", error: type[UhopError] = ModelError
                     ) -> list[tuple[str, dict[str, str]]]:
    """(name, external_data entries) of each tensor of a serialized ONNX model (initializers, tensor
    attributes, sparse tensors, in every subgraph and function) whose `data_location` is EXTERNAL: its data
    lives in another file. Bytes that are no protobuf are an `error`."""
    data = memoryview(model)
    tensors: list[dict] = []
    pending: list[tuple[str, int, int, dict | None]] = [("model", 0, len(data), None)]  # (message, span, record)
    while pending:
        kind, at, end, record = pending.pop()
        if kind == "tensor":
            record = {"name": "", "location": 0, "entries": []}
            tensors.append(record)
        while at < end:
            key, at = _varint(data, at, end, where, error)
            number, wire = key >> 3, key & 7
            if wire == 0:
                value, at = _varint(data, at, end, where, error)
                if kind == "tensor" and number == _DATA_LOCATION:
                    record["location"] = value
            elif wire == 2:
                size, at = _varint(data, at, end, where, error)
                if at + size > end:
                    raise error(f"{where}: not an ONNX model or truncated (a field runs past its message)")
                if kind == "entry" or kind == "tensor" and number == _TENSOR_NAME:
                    record[number] = _text(data[at:at + size], where, error)
                elif number in _LEADS.get(kind, {}):
                    inner = _LEADS[kind][number]
                    entry = {} if inner == "entry" else None
                    if entry is not None:
                        record["entries"].append(entry)
                    pending.append((inner, at, at + size, entry))
                at += size
            elif wire in (1, 5):
                at += 8 if wire == 1 else 4
            else:
                raise error(f"{where}: not an ONNX model (protobuf wire type {wire})")
        if at > end:
            raise error(f"{where}: not an ONNX model or truncated (a field runs past its message)")
    return [(t.get(_TENSOR_NAME, ""), {e.get(1, ""): e.get(2, "") for e in t["entries"]})
            for t in tensors if t["location"] == _EXTERNAL]


T = TypeVar("T")


def read_mapped(path: Path, read: Callable[[mmap.mmap], T]) -> T:
    """`read(view)` of a file mapped rather than read: a walk of a model's wire format (`external_tensors`,
    `skeleton`) touches only its fields' headers. A `UhopError` it raises is raised again, as its kind and
    message, once the mapping is closed (its traceback holds views of the mapping, which would keep it open)."""
    with path.open("rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as view:
        try:
            return read(view)
        except UhopError as error:
            kind, message = type(error), str(error)
    raise kind(message)


_VALUES = frozenset({4, 5, 6, 7, 9, 10, 11})  # TensorProto's fields that hold its values
_WHOLE = 1024  # a message shorter than this is kept as it is
_DEEPEST = 100  # messages nested deeper are refused, as protobuf's parser refuses them


def skeleton(model: bytes, where: object = "model", error: type[UhopError] = ModelError) -> bytes:
    """The serialized ONNX `model` without its tensors' values: each tensor keeps its name, type, dims and
    where its data lives. What the model's structure, signature and external data need, parsed in a small
    part of the time the whole model takes. Bytes that are no protobuf are an `error`."""
    data = memoryview(model)
    return b"".join(_without_values(data, 0, len(data), "model", where, error))


def _without_values(data: memoryview, at: int, end: int, kind: str, where: object, error: type[UhopError],
                    depth: int = 0) -> list:
    """The fields of one `kind` of message in `data[at:end]`, as pieces of bytes, tensors' values left out."""
    if depth > _DEEPEST:
        raise error(f"{where}: not an ONNX model that can be read (messages nested over {_DEEPEST} deep)")
    pieces: list = []
    leads = _LEADS.get(kind, {})
    while at < end:
        begin = at
        key, at = _varint(data, at, end, where, error)
        number, wire, keyed = key >> 3, key & 7, at
        if wire == 0:
            _, at = _varint(data, at, end, where, error)
        elif wire == 2:
            size, at = _varint(data, at, end, where, error)
            if at + size > end:
                raise error(f"{where}: not an ONNX model or truncated (a field runs past its message)")
            if number in leads and size >= _WHOLE:
                inner = b"".join(_without_values(data, at, at + size, leads[number], where, error, depth + 1))
                pieces += [data[begin:keyed], _encoded(len(inner)), inner]
                at += size
                continue
            at += size
        elif wire in (1, 5):
            at += 8 if wire == 1 else 4
        else:
            raise error(f"{where}: not an ONNX model (protobuf wire type {wire})")
        if not (kind == "tensor" and number in _VALUES):
            pieces.append(data[begin:at])
    if at > end:
        raise error(f"{where}: not an ONNX model or truncated (a field runs past its message)")
    return pieces


def _encoded(value: int) -> bytes:
    """`value` as a protobuf varint."""
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _text(data: memoryview, where: object, error: type[UhopError]) -> str:
    try:
        return bytes(data).decode("utf-8")
    except UnicodeDecodeError:
        raise error(f"{where}: a tensor's name or external data entry {bytes(data[:40])!r} is not valid UTF-8; "
                    "the file is corrupt") from None


def _varint(data: memoryview, at: int, end: int, where: object, error: type[UhopError]) -> tuple[int, int]:
    value = shift = 0
    while at < end and shift < 64:
        byte = data[at]
        value |= (byte & 0x7F) << shift
        at += 1
        if not byte & 0x80:
            return value, at
        shift += 7
    raise error(f"{where}: not an ONNX model or truncated (a number runs past its message)")


def write_archive(folder: Path, out: Path, first: tuple[str, ...] = ()) -> None:
    """`folder`'s files as a `.tar.gz` at `out`, written atomically; the files named in `first` (relative
    to `folder`) lead, in that order."""
    paths = [folder / name for name in first if (folder / name).exists()]
    paths += [p for p in sorted(folder.rglob("*")) if p.relative_to(folder).as_posix() not in first]
    with atomic_file(out, "wb") as handle, tarfile.open(fileobj=handle, mode="w:gz") as tar:
        for path in paths:
            tar.add(path, arcname=path.relative_to(folder).as_posix(), recursive=False)
