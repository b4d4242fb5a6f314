"""Writes that land whole or not at all: a file or a folder is built beside its target and renamed onto it,
with the modes the user's umask gives (mkstemp and mkdtemp would leave them private to the owner)."""

from __future__ import annotations

import os
import shutil
import tarfile
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

from .errors import OutputError, UhopError


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
        fd, temporary = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
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
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
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
        Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=folder)).rmdir()
    except OSError as error:
        raise _unwritable(target, error) from None


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


def read_npz(path: str | os.PathLike) -> dict:
    """The arrays of an `.npz` file by name (no pickled objects)."""
    import numpy as np

    with np.load(path, allow_pickle=False) as data:
        return {name: data[name] for name in data.files}


def write_archive(folder: Path, out: Path, first: tuple[str, ...] = ()) -> None:
    """`folder`'s files as a `.tar.gz` at `out`, written atomically; the files named in `first` (relative
    to `folder`) lead, in that order."""
    paths = [folder / name for name in first if (folder / name).exists()]
    paths += [p for p in sorted(folder.rglob("*")) if p.relative_to(folder).as_posix() not in first]
    with atomic_file(out, "wb") as handle, tarfile.open(fileobj=handle, mode="w:gz") as tar:
        for path in paths:
            tar.add(path, arcname=path.relative_to(folder).as_posix(), recursive=False)
