"""Free dimensions (`-1`, symbolic, unnamed) end to end: signatures as ONNX Runtime shows them, feeds of any
allowed shape, the shapes profiling measures at, and a plan measured at one shape run at another."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import uhop_onnx
from uhop_onnx import InputError
from uhop_onnx.models import EXAMPLE_ENCODER
from uhop_onnx.models import make_example_encoder as encoder

from .conftest import assert_matches


def matmul_model(dims: list) -> onnx.ModelProto:
    """x[dims] @ w[4, 4] -> Relu, opset 17, with the same (free) dims on the output."""
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((4, 4)).astype(np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["m"], name="mm"), helper.make_node("Relu", ["m"], ["y"], name="relu")],
        "free", [helper.make_tensor_value_info("x", TensorProto.FLOAT, dims)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, dims)], [w])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def ort_session(model: onnx.ModelProto | str) -> ort.InferenceSession:
    source = model if isinstance(model, str) else model.SerializeToString()
    return ort.InferenceSession(source, providers=["CPUExecutionProvider"])


def test_shipped_encoder_matches_its_builder():
    model = onnx.load(EXAMPLE_ENCODER)
    onnx.checker.check_model(model)
    declared = [(v.name, helper.tensor_dtype_to_np_dtype(v.type.tensor_type.elem_type).name,
                 [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]) for v in model.graph.input]
    assert declared == [(n, "int64" if t == "int64" else "float32", dims) for n, t, dims in encoder.INPUTS]
    outputs = [(v.name, [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]) for v in model.graph.output]
    assert outputs == [(n, dims) for n, _, dims in encoder.OUTPUTS]
    assert {o.version for o in model.opset_import if o.domain == ""} == {encoder.OPSET}
    ops = {n.op_type for n in model.graph.node}
    assert {"Shape", "Gather", "Concat", "Reshape"} <= ops  # integer shape arithmetic, as exporters write it


@pytest.mark.parametrize("dims, shown", [([-1, 4], [None, 4]), (["batch", 4], ["batch", 4]), ([None, 4], [None, 4])])
def test_free_dims_show_and_run_as_in_onnxruntime(dims, shown):
    model = matmul_model(dims)
    reference = ort_session(model)
    assert reference.get_inputs()[0].shape == shown
    session = uhop_onnx.InferenceSession(model, providers=["ort-cpu"], profile=False)
    assert session.get_inputs()[0].shape == shown
    assert session.get_outputs()[0].shape == reference.get_outputs()[0].shape
    for batch in (1, 3, 0):
        x = np.random.default_rng(batch).standard_normal((batch, 4)).astype(np.float32)
        assert_matches(session.run(None, {"x": x}), reference.run(None, {"x": x}))
    with pytest.raises(InputError, match="dimension 1 must be 4"):
        session.run(None, {"x": np.zeros((2, 5), np.float32)})
