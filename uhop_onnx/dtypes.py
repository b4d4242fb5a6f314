"""ONNX type strings (`"tensor(float)"`) and numpy dtypes, both ways, and tensor signatures."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

_NUMPY = {
    "float": np.float32, "float16": np.float16, "double": np.float64, "bool": np.bool_, "string": np.object_,
    "int8": np.int8, "int16": np.int16, "int32": np.int32, "int64": np.int64,
    "uint8": np.uint8, "uint16": np.uint16, "uint32": np.uint32, "uint64": np.uint64,
    "complex64": np.complex64, "complex128": np.complex128,
}
_ONNX = {np.dtype(v): k for k, v in _NUMPY.items()}


def numpy_dtype(onnx_type: str) -> np.dtype | None:
    """`"tensor(float)"` or `"float"` -> `float32`; None for types numpy has no dtype for (bfloat16, float8)."""
    name = onnx_type.removeprefix("tensor(").removesuffix(")")
    return np.dtype(_NUMPY[name]) if name in _NUMPY else None


def onnx_type(dtype: np.dtype) -> str:
    """`float32` -> `"tensor(float)"`."""
    return f"tensor({_ONNX.get(np.dtype(dtype), str(dtype))})"


@dataclass(frozen=True)
class TensorSig:
    """A model input or output, as onnxruntime's `NodeArg`: `name`, `shape`, `type` (`"tensor(float)"`)."""

    name: str
    type: str
    shape: list[int | str | None] | None  # None when unknown

    @property
    def dtype(self):
        """The numpy dtype of `type`, or None for types numpy cannot hold."""
        return numpy_dtype(self.type)
