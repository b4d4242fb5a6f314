"""uhop-onnx: write an ONNX model once, run it fast on whatever hardware is present.

Attributes are imported on first use, so that `uhop_onnx.bundle` on a board needs only numpy and the
runtimes a bundle names.
"""

import os
from importlib import import_module

# Run from a source checkout (the working folder on `sys.path` ahead of an installed copy), this package's
# subpackages kept beside it (providers/, partitioner/, ...) are found there, as an install maps them.
_SOURCE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if not os.path.isdir(os.path.join(__path__[0], "providers")) \
        and os.path.isfile(os.path.join(_SOURCE, "pyproject.toml")) \
        and os.path.isfile(os.path.join(_SOURCE, "providers", "__init__.py")):
    __path__.append(_SOURCE)

from .foundation import ortlib
from .foundation.errors import (
    BundleError,
    FreeDimensionError,
    InputError,
    KeyFileError,
    MeasurementError,
    ModelError,
    OutputError,
    PlanError,
    ProviderError,
    StageError,
    UhopError,
)

__version__ = "0.1.0"

ortlib.bind_if_loaded()

_LAZY = {
    "load": "uhop_onnx.model.loader",
    "optimize": "uhop_onnx.products.optimizer",
    "analyze": "uhop_onnx.products.optimizer",
    "InferenceSession": "uhop_onnx.products.session",
    "Plan": "uhop_onnx.runtime.plan",
    "Stage": "uhop_onnx.runtime.plan",
    "devices": "uhop_onnx.providers",
    "export_bundle": "uhop_onnx.products.export",
    "load_bundle": "uhop_onnx.bundle",
    "verify_bundle": "uhop_onnx.products.verify",
    "tune_bundle": "uhop_onnx.products.export",
    "get_available_providers": "uhop_onnx.providers",
    "patch_onnxruntime": "uhop_onnx.products.patch",
    "unpatch_onnxruntime": "uhop_onnx.products.patch",
}
# onnxruntime's own option and value types, so that `import uhop_onnx as ort` scripts find them
_ORT = ("SessionOptions", "RunOptions", "OrtValue", "GraphOptimizationLevel")

__all__ = [
    "BundleError",
    "InferenceSession",
    "FreeDimensionError",
    "InputError",
    "KeyFileError",
    "MeasurementError",
    "ModelError",
    "OutputError",
    "Plan",
    "PlanError",
    "ProviderError",
    "Stage",
    "StageError",
    "UhopError",
    "devices",
    "export_bundle",
    "get_available_providers",
    "load",
    "load_bundle",
    "optimize",
    "patch_onnxruntime",
    "tune_bundle",
    "unpatch_onnxruntime",
    "verify_bundle",
]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    if name in _ORT:
        return getattr(ortlib.load(), name)
    raise AttributeError(f"module 'uhop_onnx' has no attribute {name!r}")
