"""The one element-type table agrees with onnx.helper's mappings and with TFLite's TensorType."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import onnx
import pytest
from onnx import helper

from uhop_onnx.foundation.dtypes import TABLE, numpy_dtype, onnx_type, tflite_type


def test_every_onnx_element_type_is_in_the_table_with_onnx_helpers_numpy_dtype():
    rows = {row.onnx: row for row in TABLE}
    for name, number in onnx.TensorProto.DataType.items():
        if number == onnx.TensorProto.UNDEFINED:
            continue
        row = rows[number]
        assert row.name == name.lower()
        theirs = np.dtype(helper.tensor_dtype_to_np_dtype(number))
        if row.numpy is None:
            assert theirs.type.__module__ != "numpy", f"{name}: numpy holds {theirs}; the table says it cannot"
            assert numpy_dtype(f"tensor({row.name})") is None
        else:
            assert np.dtype(row.numpy) == theirs
            assert numpy_dtype(f"tensor({row.name})") == theirs == numpy_dtype(number)
            assert onnx_type(theirs) == f"tensor({row.name})"
    assert len(rows) == len(TABLE) == len(onnx.TensorProto.DataType.items()) - 1


def test_tflite_types_are_tflites_own():
    pytest.importorskip("tflite")
    from tflite.TensorType import TensorType

    theirs = {k: v for k, v in vars(TensorType).items() if not k.startswith("_")}
    names = {"float": "FLOAT32", "double": "FLOAT64"}
    for row in TABLE:
        if row.tflite is not None:
            assert theirs[names.get(row.name, row.name.upper())] == row.tflite
            if row.numpy is not None:
                assert tflite_type(np.dtype(row.numpy)) == row.tflite
    with pytest.raises(ValueError, match="no TFLite tensor type"):
        tflite_type(np.dtype("datetime64[s]"))


def test_the_table_imports_without_onnx():
    code = ("import sys; sys.modules['onnx'] = None; from uhop_onnx.foundation.dtypes import numpy_dtype; "
            "import uhop_onnx.runtime.executor; print(numpy_dtype('tensor(float16)'))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "float16"
