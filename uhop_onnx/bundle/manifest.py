"""A bundle's manifest: its schema, file hashes and sizes, and safe unpacking of archives. Imports no runtime.

The manifest is checked field by field with plain code (a board has only numpy): every violation is a
`BundleError` naming the field. An archive is read manifest first (its signature checked next, when a key is
given, before any other member is written); each later member must be a file the manifest names, of the size
it records, before a byte of it is written, and of the sha256 it records as it streams.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import shutil
import tarfile
import tempfile
import zlib
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path, PurePosixPath
from typing import IO, Any

from uhop_onnx.foundation.errors import BundleError, BundleNotFound
from uhop_onnx.foundation.files import check_external_data, temporary_folder
from uhop_onnx.precision.values import PRECISIONS
from uhop_onnx.providers import REGISTRY

SCHEMA = "uhop-onnx.bundle/3"  # /3: stages' precisions, and tolerances of the precision gate's form
READABLE = ("uhop-onnx.bundle/2", SCHEMA)  # a /2 manifest is a /3 one with fp32 stages only
MANIFEST = "manifest.json"
SIGNATURE = "manifest.sig"  # Ed25519 over the manifest's bytes (see `signature`)
MANIFEST_LIMIT = 16 << 20  # bytes: a manifest is JSON of names, hashes and small tables
SIGNATURE_LIMIT = 4096

__all__ = ["BundleError", "MANIFEST", "SCHEMA", "SIGNATURE", "check_files", "hash_files", "open_bundle",
           "read_checked", "read_manifest", "unpacked", "validate"]


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def hash_files(folder: Path) -> dict[str, dict[str, Any]]:
    """`{"sha256", "size"}` of every file under `folder` but the manifest and its signature, by POSIX path
    relative to it."""
    return {p.relative_to(folder).as_posix(): {"sha256": sha256(p), "size": p.stat().st_size}
            for p in sorted(folder.rglob("*")) if p.is_file() and p.name not in (MANIFEST, SIGNATURE)}


def read_manifest(folder: Path) -> dict[str, Any]:
    """The bundle's manifest, checked against the schema."""
    path = folder / MANIFEST
    if path.is_symlink() or not path.is_file():
        raise BundleError(f"{folder}: not a bundle (no {MANIFEST}); create one with `uhop-onnx export`")
    if path.stat().st_size > MANIFEST_LIMIT:
        raise BundleError(f"{path}: {path.stat().st_size} bytes, more than a manifest may hold ({MANIFEST_LIMIT})")
    return parse(path.read_bytes(), path)


def parse(data: bytes, where: object) -> dict[str, Any]:
    """A manifest from its bytes, validated; `where` names it in errors."""
    try:
        manifest = json.loads(data)
    except ValueError as error:
        raise BundleError(f"{where}: not valid JSON ({error})") from None
    except RecursionError:
        raise BundleError(f"{where}: its JSON is nested too deep to read; re-export the bundle") from None
    if not isinstance(manifest, dict) or manifest.get("schema") not in READABLE:
        found = manifest.get("schema") if isinstance(manifest, dict) else None
        raise BundleError(f"{where}: schema {found!r} is not {SCHEMA!r}; re-export the bundle")
    validate(manifest, where)
    return manifest


def read_checked(folder: Path, path: str | os.PathLike) -> dict[str, Any]:
    """The manifest of the bundle unpacked in `folder` (from `path`), once every file matches it."""
    manifest = read_manifest(folder)
    problems = check_files(folder, manifest)
    if problems:
        raise BundleError(f"{path}: refused, files do not match the manifest: {'; '.join(problems)}")
    return manifest


def check_files(folder: Path, manifest: Mapping[str, Any]) -> list[str]:
    """Problems with the bundle's files: missing, changed, links, unlisted, or an ONNX model keeping data in
    another file (a runtime given its bytes would resolve that path against the working directory); empty
    when all match."""
    problems = []
    listed = manifest["files"]
    for name, entry in listed.items():
        path = folder / name
        if path.is_symlink() or os.path.realpath(path) != os.path.join(os.path.realpath(folder), *name.split("/")):
            problems.append(f"{name}: a symbolic link, or inside one (refused)")
        elif not path.is_file():
            problems.append(f"{name}: missing")
        elif path.stat().st_size != entry["size"] or sha256(path) != entry["sha256"]:
            problems.append(f"{name}: sha256 does not match the manifest (changed or truncated)")
    for path in sorted(folder.rglob("*")):
        name = path.relative_to(folder).as_posix()
        if name not in listed and name not in (MANIFEST, SIGNATURE) and (path.is_symlink() or not path.is_dir()):
            problems.append(f"{name}: not listed in the manifest")
    if not problems:
        for name in sorted(onnx_files(manifest)):
            try:
                check_external_data((folder / name).read_bytes(), None, name, BundleError,
                                    "a bundle's ONNX files hold their weights themselves (refused)")
            except BundleError as error:
                problems.append(str(error))
    return problems


def onnx_files(manifest: Mapping[str, Any]) -> set[str]:
    """The bundle's ONNX models: files named `.onnx`, and each stage's reference, the model it was built from
    and an `onnx` artifact's files."""
    names = {name for name in manifest["files"] if name.endswith(".onnx")}
    for stage in manifest["stages"]:
        names |= {stage["reference"], *filter(None, [stage.get("built_from")])}
        if stage["artifact"]["format"] == "onnx":
            names |= set(stage["artifact"]["files"])
    return names


# -- the schema ----------------------------------------------------------------------------------------------

def _field(data: Mapping[str, Any], key: str, kind: type | tuple[type, ...], where: str, optional: bool = False):
    """`data[key]`, of type `kind` (None allowed when `optional`), else a `BundleError` naming `where.key`."""
    if key not in data:
        if optional:
            return None
        raise BundleError(f"{where}.{key} is missing")
    value = data[key]
    if value is None and optional:
        return None
    if not isinstance(value, kind) or isinstance(value, bool) and bool not in _kinds(kind):
        names = "/".join(k.__name__ for k in _kinds(kind))
        raise BundleError(f"{where}.{key} must be {names}, got {type(value).__name__} {str(value)[:60]!r}")
    return value


def _kinds(kind: type | tuple[type, ...]) -> tuple[type, ...]:
    return kind if isinstance(kind, tuple) else (kind,)


def _strings(data: Mapping[str, Any], key: str, where: str) -> list[str]:
    values = _field(data, key, list, where)
    for k, value in enumerate(values):
        if not isinstance(value, str):
            raise BundleError(f"{where}.{key}[{k}] must be str, got {type(value).__name__}")
    return values


def _relative(name: str, where: str) -> str:
    """`name` when it is a plain relative POSIX path inside the bundle."""
    path = PurePosixPath(name)
    if not name or path.is_absolute() or ".." in path.parts or "\\" in name or name != path.as_posix():
        raise BundleError(f"{where} names {name!r}, which is not a relative path inside the bundle")
    return name


def _listed(files: Mapping[str, Any], name: object, where: str) -> None:
    if not isinstance(name, str) or name not in files:
        raise BundleError(f"{where} names {name!r}, a file the manifest's files do not list")


def _signatures(data: Mapping[str, Any], key: str, where: str) -> None:
    for k, sig in enumerate(_field(data, key, list, where)):
        at = f"{where}.{key}[{k}]"
        if not isinstance(sig, dict):
            raise BundleError(f"{at} must be an object")
        _field(sig, "name", str, at)
        _field(sig, "type", str, at)
        shape = _field(sig, "shape", list, at, optional=True)
        if shape is not None and not all(d is None or isinstance(d, (int, str)) for d in shape):
            raise BundleError(f"{at}.shape must hold ints, names or null")


def _tolerance(data: Mapping[str, Any], key: str, where: str) -> None:
    """`{"rtol", "atol"}` (element by element), or `{"scaled": t}`: the precision gate's rule, a reduced-precision
    stage's and its bundle's outputs' (`max|y - ref| <= t * (1 + max|ref|)`)."""
    tolerance = _field(data, key, dict, where)
    if "scaled" in tolerance:
        value = _field(tolerance, "scaled", (int, float), f"{where}.{key}")
        if not value > 0:
            raise BundleError(f"{where}.{key}.scaled must be a number > 0, got {value!r}")
        return
    for bound in ("rtol", "atol"):
        value = _field(tolerance, bound, (int, float), f"{where}.{key}")
        if not value >= 0:
            raise BundleError(f"{where}.{key}.{bound} must be a number >= 0, got {value!r}")


def validate(manifest: Mapping[str, Any], where: object) -> None:
    """Check every field the runner and `verify` read; raise a `BundleError` naming the first bad one."""
    top = f"{where}: manifest"
    files = _field(manifest, "files", dict, top)
    for name, entry in files.items():
        at = f"{top}.files[{name!r}]"
        _relative(name, at)
        if not isinstance(entry, dict):
            raise BundleError(f"{at} must be an object with sha256 and size")
        digest = _field(entry, "sha256", str, at)
        if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
            raise BundleError(f"{at}.sha256 must be 64 lower-case hex digits")
        if _field(entry, "size", int, at) < 0:
            raise BundleError(f"{at}.size must be >= 0")
    model = _field(manifest, "model", dict, top)
    _field(model, "name", str, f"{top}.model")
    _field(model, "sha256", str, f"{top}.model")
    _field(manifest, "target", dict, top)
    _field(manifest, "placement", str, top, optional=True)
    _field(manifest, "profile", dict, top, optional=True)
    _field(manifest, "precision", dict, top, optional=True)
    off = _field(manifest, "off_accelerator", dict, top, optional=True)  # nodes off the board's accelerator, and why
    if off is not None:
        _field(off, "provider", str, f"{top}.off_accelerator")
        for n, entry in enumerate(_field(off, "nodes", list, f"{top}.off_accelerator")):
            for key in ("node", "op", "on", "kind", "reason"):
                _field(entry if isinstance(entry, dict) else {}, key, str, f"{top}.off_accelerator.nodes[{n}]")
    _signatures(manifest, "inputs", top)
    _signatures(manifest, "outputs", top)
    fixed = _field(manifest, "fixed_shapes", dict, top, optional=True)  # the input shapes it was exported at
    for name, dims in (fixed or {}).items():
        if not (isinstance(dims, list) and all(isinstance(d, int) and not isinstance(d, bool) for d in dims)):
            raise BundleError(f"{top}.fixed_shapes[{name!r}] must be a list of integers")
    _tolerance(manifest, "tolerance", top)
    constants = _field(manifest, "constants", str, top, optional=True)
    if constants is not None:
        _listed(files, constants, f"{top}.constants")
    samples = _field(manifest, "samples", dict, top)
    for key in ("inputs", "outputs"):
        _listed(files, _field(samples, key, str, f"{top}.samples"), f"{top}.samples.{key}")
    for k, stage in enumerate(_field(manifest, "stages", list, top)):  # none for a graph of no nodes
        at = f"{top}.stages[{k}]"
        if not isinstance(stage, dict):
            raise BundleError(f"{at} must be an object")
        provider = _field(stage, "provider", str, at)
        if provider not in REGISTRY:
            raise BundleError(f"{at}.provider {provider!r} is unknown; known: {', '.join(REGISTRY)}")
        _field(stage, "options", dict, at)
        for key in ("nodes", "inputs", "outputs"):
            _strings(stage, key, at)
        for d, pair in enumerate(_field(stage, "declared", list, at)):
            if not (isinstance(pair, list) and len(pair) == 2 and isinstance(pair[0], str)
                    and (pair[1] is None or isinstance(pair[1], list))):
                raise BundleError(f"{at}.declared[{d}] must be [name, dims or null]")
        artifact = _field(stage, "artifact", dict, at)
        fmt = _field(artifact, "format", str, f"{at}.artifact")
        if fmt != REGISTRY[provider].artifact_format:
            raise BundleError(f"{at}.artifact.format {fmt!r} is unknown for {provider}, whose stages are "
                              f"{REGISTRY[provider].artifact_format!r}")
        names = _strings(artifact, "files", f"{at}.artifact")
        if not names:
            raise BundleError(f"{at}.artifact.files is empty")
        for f, name in enumerate(names):
            _listed(files, name, f"{at}.artifact.files[{f}]")
        _field(artifact, "options", dict, f"{at}.artifact")
        _field(stage, "runtime", dict, at, optional=True)
        _listed(files, _field(stage, "reference", str, at), f"{at}.reference")
        _tolerance(stage, "tolerance", at)
        precision = _field(stage, "precision", str, at, optional=True)
        if precision is not None and precision not in PRECISIONS:
            raise BundleError(f"{at}.precision {precision!r} is not one of {', '.join(PRECISIONS)}")
        _field(stage, "gated", bool, at, optional=True)
        built_from = _field(stage, "built_from", str, at, optional=True)
        if built_from is not None:
            _listed(files, built_from, f"{at}.built_from")


# -- folders and archives ------------------------------------------------------------------------------------

Check = Callable[[Path], None]  # run on the folder an archive is unpacked into (a signature check)
_SLACK = 64 << 10  # bytes an archive may hold past its members' data: headers, padding, end records


def open_bundle(path: str | os.PathLike, check: Check | None = None
                ) -> tuple[Path, tempfile.TemporaryDirectory | None]:
    """The bundle's folder: `path` itself, or a `.tar.gz` unpacked safely into a temporary folder (returned
    too, to keep it alive); `check` as for `extract`."""
    path = Path(path)
    if path.is_dir():
        return path, None
    if not path.is_file():
        raise BundleNotFound(f"{path}: no such bundle folder or archive")
    scratch = temporary_folder("bundle")
    try:
        extract(path, Path(scratch.name), check)
    except BaseException:
        scratch.cleanup()
        raise
    return Path(scratch.name), scratch


@contextmanager
def unpacked(path: str | os.PathLike, check: Check | None = None) -> Iterator[Path]:
    """`open_bundle` for the length of a `with` block."""
    folder, scratch = open_bundle(path, check)
    try:
        yield folder
    finally:
        if scratch is not None:
            scratch.cleanup()


def extract(archive: Path, folder: Path, check: Check | None = None) -> None:
    """Unpack a `.tar.gz` written by `export`: the manifest first (at most `MANIFEST_LIMIT` bytes), then its
    signature if any, then only plain files the manifest lists, each of the size it records, once each, its
    sha256 checked as it streams; the first that differs stops it. `check(folder)` (a signature check, say)
    runs once the manifest and its signature are written, before any other member. Nothing past what the
    manifest declares is decompressed, nor written beyond the free space. Folders are made as the files
    need them; anything else is refused before it is written."""
    try:
        with gzip.open(archive, "rb") as packed:
            stream = _Bounded(packed, MANIFEST_LIMIT + _SLACK, archive)
            with tarfile.open(fileobj=stream, mode="r|") as tar:
                _members(tar, archive, folder, stream, check)
    except (tarfile.TarError, OSError, EOFError, zlib.error) as error:
        raise BundleError(f"{archive}: not a readable .tar.gz bundle ({error})") from None


def _members(tar: tarfile.TarFile, archive: Path, folder: Path, stream: _Bounded, check: Check | None) -> None:
    """`extract`'s loop over the archive's members; `stream`'s limit is raised to what the manifest declares."""
    manifest = None
    seen: set[str] = set()
    for member in tar:
        name = member.name.removeprefix("./")
        if member.isdir():
            continue
        if not member.isfile():
            raise BundleError(f"{archive}: refused: member {member.name!r} is a link or special file")
        if manifest is None:
            manifest = _first(tar, member, archive, folder)
            stream.limit = _declared(manifest, archive, folder)
            continue
        if check is not None and name != SIGNATURE:
            check(folder)
            check = None
        expected = SIGNATURE_LIMIT if name == SIGNATURE else manifest["files"].get(name, {}).get("size")
        if expected is None:
            raise BundleError(f"{archive}: refused: member {member.name!r} is not listed in the manifest")
        if name in seen:
            raise BundleError(f"{archive}: refused: member {member.name!r} appears twice")
        if member.size != expected and not (name == SIGNATURE and member.size <= expected):
            raise BundleError(f"{archive}: refused: member {member.name!r} is {member.size} bytes; "
                              f"the manifest records {expected}")
        seen.add(name)
        target = folder / _relative(name, f"{archive}: member")
        target.parent.mkdir(parents=True, exist_ok=True)
        digest = hashlib.sha256()
        with tar.extractfile(member) as source, open(target, "xb") as sink:
            for chunk in iter(lambda: source.read(1 << 20), b""):
                digest.update(chunk)
                sink.write(chunk)
        if name != SIGNATURE and digest.hexdigest() != manifest["files"][name]["sha256"]:
            raise BundleError(f"{archive}: refused: member {member.name!r} does not match its sha256 in the "
                              "manifest (changed or corrupted)")
    if manifest is None:
        raise BundleError(f"{archive}: refused: no {MANIFEST} in the archive")
    if check is not None:
        check(folder)


def _first(tar: tarfile.TarFile, member: tarfile.TarInfo, archive: Path, folder: Path) -> dict[str, Any]:
    """The manifest, the archive's first member, parsed and written to `folder`."""
    if member.name.removeprefix("./") != MANIFEST:
        raise BundleError(f"{archive}: refused: the first member is {member.name!r}, not {MANIFEST}")
    if member.size > MANIFEST_LIMIT:
        raise BundleError(f"{archive}: refused: {MANIFEST} of {member.size} bytes (at most {MANIFEST_LIMIT})")
    data = tar.extractfile(member).read()
    manifest = parse(data, f"{archive}: {MANIFEST}")
    (folder / MANIFEST).write_bytes(data)
    return manifest


def _declared(manifest: Mapping[str, Any], archive: Path, folder: Path) -> int:
    """How many bytes the archive may decompress to, by its manifest; a `BundleError` when its files would not
    fit in `folder`'s free space."""
    sizes = [entry["size"] for entry in manifest["files"].values()]
    free = shutil.disk_usage(folder).free
    if sum(sizes) > free:
        raise BundleError(f"{archive}: refused: its manifest declares {sum(sizes)} bytes of files, more than the "
                          f"{free} bytes free in {folder.parent}; free some space or set TMPDIR")
    blocks = sum(-(-size // 512) * 512 for size in (*sizes, MANIFEST_LIMIT, SIGNATURE_LIMIT))
    return blocks + 2048 * (len(sizes) + 2) + _SLACK


class _Bounded(io.RawIOBase):
    """A stream that refuses to read past `limit` bytes of `source`."""

    def __init__(self, source: IO[bytes], limit: int, archive: Path):
        self.source, self.limit, self.archive, self.count = source, limit, archive, 0

    def readable(self) -> bool:
        return True

    def read(self, size: int = -1) -> bytes:
        data = self.source.read(size if size >= 0 else self.limit + 1 - self.count)
        self.count += len(data)
        if self.count > self.limit:
            raise BundleError(f"{self.archive}: refused: it unpacks to more than the {self.limit} bytes its "
                              "manifest declares")
        return data
