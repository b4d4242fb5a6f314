"""A bundle's manifest: its schema, file hashes, and safe unpacking of archives. Imports no runtime."""

from __future__ import annotations

import hashlib
import json
import os
import tarfile
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path, PurePosixPath
from typing import Any

from uhop_onnx.errors import UhopError

SCHEMA = "uhop-onnx.bundle/1"
MANIFEST = "manifest.json"
FP32_TOLERANCE = {"rtol": 1e-4, "atol": 1e-5}


class BundleError(UhopError):
    """A bundle is missing, malformed, unsafe or tampered with."""

    exit_code = 1


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def hash_files(folder: Path) -> dict[str, str]:
    """sha256 of every file under `folder` but the manifest, by POSIX path relative to it."""
    return {p.relative_to(folder).as_posix(): sha256(p) for p in sorted(folder.rglob("*"))
            if p.is_file() and p.name != MANIFEST}


def read_manifest(folder: Path) -> dict[str, Any]:
    path = folder / MANIFEST
    if not path.is_file():
        raise BundleError(f"{folder}: not a bundle (no {MANIFEST}); create one with `uhop-onnx export`")
    try:
        manifest = json.loads(path.read_text())
    except ValueError as error:
        raise BundleError(f"{path}: not valid JSON ({error})") from None
    if not isinstance(manifest, dict) or manifest.get("schema") != SCHEMA:
        found = manifest.get("schema") if isinstance(manifest, dict) else None
        raise BundleError(f"{path}: schema {found!r} is not {SCHEMA!r}; re-export the bundle")
    return manifest


def read_checked(folder: Path, path: str | os.PathLike) -> dict[str, Any]:
    """The manifest of the bundle unpacked in `folder` (from `path`), once every file matches it."""
    manifest = read_manifest(folder)
    problems = check_files(folder, manifest)
    if problems:
        raise BundleError(f"{path}: refused, files do not match the manifest: {'; '.join(problems)}")
    return manifest


def check_files(folder: Path, manifest: dict[str, Any]) -> list[str]:
    """Problems with the bundle's files: missing, changed, or unlisted; empty when all match."""
    problems = []
    listed = manifest.get("files", {})
    for name, digest in listed.items():
        path = _inside(folder, name)
        if not path.is_file():
            problems.append(f"{name}: missing")
        elif sha256(path) != digest:
            problems.append(f"{name}: sha256 does not match the manifest (changed or truncated)")
    problems += [f"{name}: not listed in the manifest" for name in hash_files(folder) if name not in listed]
    return problems


def open_bundle(path: str | os.PathLike) -> tuple[Path, tempfile.TemporaryDirectory | None]:
    """The bundle's folder: `path` itself, or a `.tar.gz` unpacked safely into a temporary folder (returned
    too, to keep it alive)."""
    path = Path(path)
    if path.is_dir():
        return path, None
    if not path.is_file():
        raise BundleError(f"{path}: no such bundle folder or archive")
    scratch = tempfile.TemporaryDirectory(prefix="uhop-bundle-")
    try:
        extract(path, Path(scratch.name))
    except BaseException:
        scratch.cleanup()
        raise
    return Path(scratch.name), scratch


@contextmanager
def unpacked(path: str | os.PathLike) -> Iterator[Path]:
    """`open_bundle` for the length of a `with` block."""
    folder, scratch = open_bundle(path)
    try:
        yield folder
    finally:
        if scratch is not None:
            scratch.cleanup()


def extract(archive: Path, folder: Path) -> None:
    """Unpack a `.tar.gz` refusing absolute paths, `..`, links and anything but plain files and folders."""
    try:
        with tarfile.open(archive, "r:gz") as tar:
            members = tar.getmembers()
            for member in members:
                name = PurePosixPath(member.name)
                if name.is_absolute() or ".." in name.parts:
                    raise BundleError(f"{archive}: refused: member {member.name!r} would land outside the bundle")
                if not (member.isfile() or member.isdir()):
                    raise BundleError(f"{archive}: refused: member {member.name!r} is a link or special file")
            tar.extractall(folder, members=members, filter="data")
    except (tarfile.TarError, OSError, EOFError) as error:
        raise BundleError(f"{archive}: not a readable .tar.gz bundle ({error})") from None


def _inside(folder: Path, name: str) -> Path:
    relative = PurePosixPath(name)
    if relative.is_absolute() or ".." in relative.parts:
        raise BundleError(f"manifest names {name!r}, outside the bundle")
    return folder / relative
