"""Run a deployment bundle: its stages in their runtimes' own formats, with only numpy and those runtimes.

    bundle = uhop_onnx.load_bundle("model.bundle.tar.gz")
    outputs = bundle.run(None, {"input": x})

or `python -m uhop_onnx.bundle run BUNDLE --inputs in.npz [--output out.npz] [--key PUB]`. Every file is
checked against the manifest's sha256 before anything is loaded; with a key, the manifest's signature first
(in an archive, before any other member is unpacked).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import numpy as np

from uhop_onnx.foundation.dtypes import TensorSig
from uhop_onnx.foundation.errors import BundleError, InputError
from uhop_onnx.runtime.executor import Executor
from uhop_onnx.foundation.files import read_npz
from uhop_onnx.foundation.host import bounded_threads
from uhop_onnx.runtime.plan import Stage
from uhop_onnx.providers import REGISTRY

from .manifest import open_bundle, read_checked, read_manifest
from .signature import KeySource, check


class Bundle:
    """A loaded bundle, with onnxruntime's interface: `get_inputs`, `get_outputs`, `run`; `close()` (or a
    `with` block) releases its runners and an archive's unpacked files. A stage that fails to load closes
    the runners loaded before it."""

    def __init__(self, path: str | os.PathLike, threads: int | None = None, key: KeySource | None = None,
                 allowed_delegates: Iterable[str | os.PathLike] = ()):
        self.folder, self._scratch = open_bundle(path, None if key is None else signed_by(path, key))
        try:
            self.manifest, self.signed = open_checked(self.folder, path, key)
            stages = self.manifest["stages"]
            constants = (read_npz(self.folder / self.manifest["constants"], BundleError)
                         if self.manifest.get("constants") else {})
            with ExitStack() as loaded:  # the runners loaded so far, closed if a later stage fails to load
                runners = [loaded.enter_context(load_stage(self.folder, s, threads, exclusive=len(stages) == 1,
                                                           trusted=self.signed, allowed_delegates=allowed_delegates))
                           for s in stages]
                self._executor = Executor([Stage.from_json(s) for s in stages], runners, self.get_inputs(),
                                          [o.name for o in self.get_outputs()], constants)
                loaded.pop_all()
        except BaseException:
            self._remove_scratch()
            raise
        # A bundle exported at fixed shapes (what it computes from shapes folded there), or with stages whose
        # runtime built them for fixed shapes (`.rknn`, `.tflite` of a model with free dimensions), runs only at
        # the shapes it was exported at.
        fixed = self.manifest.get("fixed_shapes")
        built = sorted({s["provider"] for s in stages if s.get("built_for")})
        self._fixed = (fixed, "this bundle was") if fixed else (
            (self.manifest["shapes"], f"this bundle's {', '.join(built)} stages were") if built else None)

    def close(self) -> None:
        """Close every stage's runner and remove an archive's unpacked files; do not run the bundle after."""
        self._executor.close()
        self._remove_scratch()

    def __enter__(self) -> Bundle:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _remove_scratch(self) -> None:
        if self._scratch is not None:
            self._scratch.cleanup()
            self._scratch = None

    def get_inputs(self) -> list[TensorSig]:
        return [TensorSig(**t) for t in self.manifest["inputs"]]

    def get_outputs(self) -> list[TensorSig]:
        return [TensorSig(**t) for t in self.manifest["outputs"]]

    def get_providers(self) -> list[str]:
        return list(dict.fromkeys(s["provider"] for s in self.manifest["stages"]))

    def run(self, output_names: Sequence[str] | None, input_feed: Mapping[str, Any]) -> list[np.ndarray]:
        if self._fixed:
            self._check_fixed_shapes(input_feed, *self._fixed)
        return self._executor.run(output_names, input_feed)

    @staticmethod
    def _check_fixed_shapes(feeds: Mapping[str, Any], shapes: Mapping[str, list[int]], why: str) -> None:
        for name, shape in shapes.items():
            got = list(np.shape(feeds[name])) if name in feeds else shape
            if got != shape:
                at = ", ".join(f"{n} {'x'.join(map(str, dims))}" for n, dims in shapes.items())
                raise InputError(f"input {name!r} has shape {got}, but {why} built for {at}; export it again "
                                 f"with --shape {name}:{'x'.join(map(str, got))} to run at that shape")


def open_checked(folder: Path, path: str | os.PathLike, key: KeySource | None) -> tuple[dict[str, Any], bool]:
    """(the manifest, whether a signature by `key` covers it), once the signature (when a key is given) and
    then every file's hash and size match."""
    if key is not None:
        check_signature(folder, path, key)
    return read_checked(folder, path), key is not None


def signed_by(path: str | os.PathLike, key: KeySource) -> Callable[[Path], None]:
    """`check_signature` of the bundle from `path` by `key`, for `open_bundle` to run on an archive before it
    writes anything but the manifest and its signature."""
    return lambda folder: check_signature(folder, path, key)


def check_signature(folder: Path, path: str | os.PathLike, key: KeySource) -> None:
    """Raise `BundleError` unless the bundle in `folder` (from `path`) is signed by `key`."""
    read_manifest(folder)  # a well-formed manifest of bounded size before any cryptography
    check(folder, key, path)


def load_stage(folder: Path, stage: Mapping[str, Any], threads: int | None, exclusive: bool, trusted: bool = False,
               allowed_delegates: Iterable[str | os.PathLike] = ()):
    """A stage's runner, loaded by its provider from the artifact (`Provider.load_artifact`) with at most this
    host's cores as `threads`; `trusted` only when a signature the loader checked covers the stage's files. A
    missing runtime is named with its install."""
    try:
        return REGISTRY[stage["provider"]].load_artifact(folder, stage["artifact"], bounded_threads(threads), exclusive,
                                                         trusted=trusted, allowed_delegates=allowed_delegates)
    except ImportError as error:
        runtime = stage.get("runtime") or {}
        needs = runtime.get("name", stage["artifact"]["format"])
        raise BundleError(f"stage on {stage['provider']} needs {needs} "
                          f"{runtime.get('version', '')}, which is not installed here ({error}); "
                          f"install: {runtime.get('install', 'see the manifest')}") from None


def load_bundle(path: str | os.PathLike, threads: int | None = None, key: KeySource | None = None,
                allowed_delegates: Iterable[str | os.PathLike] = ()) -> Bundle:
    """A bundle folder or `.tar.gz`, checked against its manifest and ready to run. With `key` (a public key's
    PEM path or bytes), the manifest must carry a valid signature by it, and only then is native code the
    bundle carries (its kernels library, a delegate path) loaded; without one, a LiteRT delegate path is loaded
    only when it is a known delegate, in `allowed_delegates` or in `UHOP_ALLOWED_DELEGATES`."""
    return Bundle(path, threads, key, allowed_delegates)
