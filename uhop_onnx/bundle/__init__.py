"""Run a deployment bundle: its stages in their runtimes' own formats, with only numpy and those runtimes.

    bundle = uhop_onnx.load_bundle("model.bundle.tar.gz")
    outputs = bundle.run(None, {"input": x})

or `python -m uhop_onnx.bundle run BUNDLE --inputs in.npz [--output out.npz]`. Every file is checked
against the manifest's sha256 before anything is loaded.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from importlib import import_module
from pathlib import Path
from typing import Any

import numpy as np

from uhop_onnx.dtypes import TensorSig
from uhop_onnx.executor import Executor, StageIO
from uhop_onnx.files import read_npz

from .manifest import BundleError, open_bundle, read_checked

# Stage format -> the module whose `load_stage(folder, artifact, threads, exclusive)` runs it.
FORMATS = {
    "onnx": "uhop_onnx.providers.ort",
    "openvino-ir": "uhop_onnx.providers.openvino",
    "tflite": "uhop_onnx.providers.litert.runner",
    "rknn": "uhop_onnx.providers.rknn.runner",
    "kernels": "uhop_onnx.providers.kernels",
}


class Bundle:
    """A loaded bundle, with onnxruntime's interface: `get_inputs`, `get_outputs`, `run`."""

    def __init__(self, path: str | os.PathLike, threads: int | None = None):
        self.folder, self._scratch = open_bundle(path)
        self.manifest = read_checked(self.folder, path)
        stages = self.manifest["stages"]
        runners = [load_stage(self.folder, s, threads, exclusive=len(stages) == 1) for s in stages]
        constants = read_npz(self.folder / self.manifest["constants"]) if self.manifest.get("constants") else {}
        ios = [StageIO(f"{s['provider']} ({s['artifact']['format']})", s["inputs"], s["outputs"],
                       [(name, None if dims is None else tuple(dims)) for name, dims in s["declared"]]) for s in stages]
        self._executor = Executor(ios, runners, self.get_inputs(), [o.name for o in self.get_outputs()], constants)

    def get_inputs(self) -> list[TensorSig]:
        return [TensorSig(**t) for t in self.manifest["inputs"]]

    def get_outputs(self) -> list[TensorSig]:
        return [TensorSig(**t) for t in self.manifest["outputs"]]

    def get_providers(self) -> list[str]:
        return list(dict.fromkeys(s["provider"] for s in self.manifest["stages"]))

    def run(self, output_names: Sequence[str] | None, input_feed: Mapping[str, Any]) -> list[np.ndarray]:
        return self._executor.run(output_names, input_feed)


def load_stage(folder: Path, stage: Mapping[str, Any], threads: int | None, exclusive: bool):
    """A stage's runner, from its runtime's own format; a missing runtime is named with its install."""
    artifact = stage["artifact"]
    if artifact["format"] not in FORMATS:
        raise BundleError(f"stage format {artifact['format']!r} is unknown; known: {', '.join(FORMATS)}")
    try:
        return import_module(FORMATS[artifact["format"]]).load_stage(folder, artifact, threads, exclusive)
    except ImportError as error:
        runtime = stage.get("runtime", {})
        raise BundleError(f"stage on {stage['provider']} needs {runtime.get('name', artifact['format'])} "
                          f"{runtime.get('version', '')}, which is not installed here ({error}); "
                          f"install: {runtime.get('install', 'see the manifest')}") from None


def load_bundle(path: str | os.PathLike, threads: int | None = None) -> Bundle:
    """A bundle folder or `.tar.gz`, checked against its manifest and ready to run."""
    return Bundle(path, threads)
