"""Ed25519 signatures over a bundle's manifest (which holds the sha256 and size of every other file).

Hashes detect corruption; a signature detects tampering: whoever changes a file and recomputes its hash
cannot sign the new manifest without the private key. Keys are PEM files (PKCS#8 private, SubjectPublicKeyInfo
public), as `openssl pkey` reads them. The `cryptography` package is imported only here, and only when a key
is given, so the runner stays numpy-only for unsigned use.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from uhop_onnx.foundation.errors import BundleError, KeyFileError, first_line

from .manifest import MANIFEST, SIGNATURE, SIGNATURE_LIMIT

INSTALL = "pip install 'uhop-onnx[sign]'  (the cryptography package)"
KeySource = str | os.PathLike | bytes


def _crypto():
    try:
        from cryptography.exceptions import InvalidSignature
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric import ed25519
    except ImportError as error:
        raise KeyFileError(f"signatures need the cryptography package ({error}); install: {INSTALL}") from None
    return serialization, ed25519, InvalidSignature


def _named(key: KeySource) -> str:
    return "the given key" if isinstance(key, bytes) else str(key)


def _pem(key: KeySource, what: str) -> bytes:
    if isinstance(key, bytes):
        return key
    try:
        return Path(key).read_bytes()
    except OSError as error:
        raise KeyFileError(f"{key}: cannot read the {what} key ({error.strerror or error})") from None


def keygen(name: str | os.PathLike) -> tuple[Path, Path]:
    """Write a new Ed25519 pair: `NAME.key` (private, PKCS#8 PEM, mode 0600) and `NAME.pub` (public,
    SubjectPublicKeyInfo PEM). Neither may exist already."""
    serialization, ed25519, _ = _crypto()
    private, public = Path(f"{name}.key"), Path(f"{name}.pub")
    for path in (private, public):
        if path.exists() or path.is_symlink():
            raise KeyFileError(f"{path}: exists; choose another name (a key is never overwritten)")
    key = ed25519.Ed25519PrivateKey.generate()
    secret = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                               serialization.NoEncryption())
    shared = key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    written = []
    try:
        for path, data, mode in ((private, secret, 0o600), (public, shared, 0o644)):
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
            written.append(path)
            with os.fdopen(fd, "wb") as handle:
                handle.write(data)
    except OSError as error:
        for path in written:
            path.unlink(missing_ok=True)
        raise KeyFileError(f"cannot write the key pair {name}.key/.pub ({error.strerror or error})") from None
    return private, public


def signer(key: KeySource) -> Callable[[Path], Path]:
    """A function that writes `manifest.sig` beside the manifest in a folder, signed with the private key (PEM);
    the key is read and checked now, before any work is done."""
    serialization, ed25519, _ = _crypto()
    try:
        private = serialization.load_pem_private_key(_pem(key, "private"), password=None)
    except (ValueError, TypeError) as error:
        raise KeyFileError(f"{_named(key)}: not an unencrypted PEM private key ({first_line(error)}); make one with "
                        "`uhop-onnx keygen -o NAME`") from None
    if not isinstance(private, ed25519.Ed25519PrivateKey):
        raise KeyFileError(f"{_named(key)}: a {type(private).__name__}, not an Ed25519 key; make one with "
                        "`uhop-onnx keygen -o NAME`")

    def sign(folder: Path) -> Path:
        path = folder / SIGNATURE
        path.write_bytes(private.sign((folder / MANIFEST).read_bytes()))
        return path
    return sign


def check(folder: Path, key: KeySource, where: object) -> None:
    """Raise `BundleError` unless `manifest.sig` in `folder` is a valid signature of its manifest by `key`
    (a public key, PEM)."""
    serialization, ed25519, invalid = _crypto()
    try:
        public = serialization.load_pem_public_key(_pem(key, "public"))
    except (ValueError, TypeError) as error:
        raise KeyFileError(f"{_named(key)}: not a PEM public key ({first_line(error)}); give the NAME.pub that "
                        "`uhop-onnx keygen` wrote") from None
    if not isinstance(public, ed25519.Ed25519PublicKey):
        raise KeyFileError(f"{_named(key)}: a {type(public).__name__}, not an Ed25519 public key")
    path = folder / SIGNATURE
    if path.is_symlink() or not path.is_file():
        raise BundleError(f"{where}: refused: the bundle is unsigned (no {SIGNATURE}) and a key was given; "
                          "export it with --sign KEY")
    signature = path.read_bytes()[:SIGNATURE_LIMIT]
    try:
        public.verify(signature, (folder / MANIFEST).read_bytes())
    except invalid:
        raise BundleError(f"{where}: refused: the manifest's signature does not match {_named(key)}: the bundle was "
                          "changed after signing, or signed with another key") from None


def signed(folder: Path) -> bool:
    """Whether the bundle in `folder` carries a signature (checked only by `check`)."""
    return (folder / SIGNATURE).is_file()
