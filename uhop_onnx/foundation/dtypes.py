"""Element types, in one table: ONNX's `TensorProto.DataType` number and name (`"tensor(float)"`), the numpy
dtype, and TFLite's `TensorType` number; and tensor signatures. Numpy only, so a board's bundle runner can use
it without onnx (checked against `onnx.helper`'s mappings in the tests)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from typing import NamedTuple

import numpy as np


class ElementType(NamedTuple):
    onnx: int  # TensorProto.DataType
    name: str  # ONNX's spelling in "tensor(...)"
    numpy: type | None  # None where numpy has no dtype (bfloat16, float8...)
    tflite: int | None  # TFLite's TensorType; None where TFLite has none


TABLE = (
    ElementType(1, "float", np.float32, 0),
    ElementType(2, "uint8", np.uint8, 3),
    ElementType(3, "int8", np.int8, 9),
    ElementType(4, "uint16", np.uint16, 16),
    ElementType(5, "int16", np.int16, 7),
    ElementType(6, "int32", np.int32, 2),
    ElementType(7, "int64", np.int64, 4),
    ElementType(8, "string", np.object_, 5),
    ElementType(9, "bool", np.bool_, 6),
    ElementType(10, "float16", np.float16, 1),
    ElementType(11, "double", np.float64, 10),
    ElementType(12, "uint32", np.uint32, 15),
    ElementType(13, "uint64", np.uint64, 12),
    ElementType(14, "complex64", np.complex64, 8),
    ElementType(15, "complex128", np.complex128, 11),
    ElementType(16, "bfloat16", None, 18),
    ElementType(17, "float8e4m3fn", None, None),
    ElementType(18, "float8e4m3fnuz", None, None),
    ElementType(19, "float8e5m2", None, None),
    ElementType(20, "float8e5m2fnuz", None, None),
    ElementType(21, "uint4", None, None),
    ElementType(22, "int4", None, 17),
    ElementType(23, "float4e2m1", None, None),
    ElementType(24, "float8e8m0", None, None),
    ElementType(25, "uint2", None, None),
    ElementType(26, "int2", None, None),
    ElementType(27, "float6e2m3", None, None),
    ElementType(28, "float6e3m2", None, None),
)
_BY_NAME = {t.name: t for t in TABLE}
_BY_ONNX = {t.onnx: t for t in TABLE}
_BY_NUMPY = {np.dtype(t.numpy): t for t in TABLE if t.numpy is not None}


@cache
def numpy_dtype(onnx_type: str | int) -> np.dtype | None:
    """`"tensor(float)"`, `"float"` or `TensorProto.FLOAT` -> `float32`; None for types numpy has no dtype for
    (bfloat16, float8) and for unknown ones."""
    if isinstance(onnx_type, int):
        row = _BY_ONNX.get(onnx_type)
    else:
        row = _BY_NAME.get(onnx_type.removeprefix("tensor(").removesuffix(")"))
    return np.dtype(row.numpy) if row is not None and row.numpy is not None else None


def onnx_type(dtype: np.dtype) -> str:
    """`float32` -> `"tensor(float)"`."""
    row = _BY_NUMPY.get(np.dtype(dtype))
    return f"tensor({row.name if row else np.dtype(dtype)})"


def tflite_type(dtype: np.dtype) -> int:
    """`float32` -> TFLite's `TensorType.FLOAT32` (0); `ValueError` where TFLite has none."""
    row = _BY_NUMPY.get(np.dtype(dtype))
    if row is None or row.tflite is None:
        raise ValueError(f"numpy dtype {np.dtype(dtype)} has no TFLite tensor type")
    return row.tflite


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
