"""Capability tables: each constraint of an `OpRule` accepts what it should and names what it refuses."""

from __future__ import annotations

import onnx
import pytest
from onnx import TensorProto, helper

from uhop_onnx.foundation.graph import Graph
from uhop_onnx.providers.capability import check
from uhop_onnx.providers.openvino import OPENVINO_TABLE


def _graph(nodes, inputs, outputs, initializers=(), opset=21) -> Graph:
    model = helper.make_model(helper.make_graph(nodes, "g", inputs, outputs, list(initializers)),
                              opset_imports=[helper.make_opsetid("", opset)])
    return Graph.from_model(onnx.shape_inference.infer_shapes(model))


def _float(name, shape):
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)


@pytest.mark.parametrize(("shape_dims", "ok"), [([2], True), ([None], False)])
def test_reshape_needs_a_shape_of_known_length(shape_dims, ok):
    graph = _graph([helper.make_node("Reshape", ["x", "s"], ["y"], name="r")],
                   [_float("x", [2, 3]), helper.make_tensor_value_info("s", TensorProto.INT64, shape_dims)],
                   [_float("y", None)])
    support = check(OPENVINO_TABLE, graph.nodes[0], graph)
    assert support.ok is ok
    if not ok:
        assert "input 1 ('s') must have a known length" in support.reason


@pytest.mark.parametrize(("peepholes", "ok"), [(False, True), (True, False)])
def test_lstm_peepholes_are_refused_on_openvino(peepholes, ok):
    inputs = ["x", "w", "r", "", "", "", "", "p"] if peepholes else ["x", "w", "r"]
    graph = _graph([helper.make_node("LSTM", inputs, ["y"], hidden_size=4, name="lstm")],
                   [_float("x", [5, 1, 3]), _float("w", [1, 16, 3]), _float("r", [1, 16, 4]), _float("p", [1, 12])],
                   [_float("y", None)])
    support = check(OPENVINO_TABLE, graph.nodes[0], graph)
    assert support.ok is ok
    if not ok:
        assert "input 7 ('p')" in support.reason


def test_quantize_linear_needs_constant_scale_on_openvino():
    scale = helper.make_tensor("scale", TensorProto.FLOAT, [], [0.5])
    node_constant = helper.make_node("QuantizeLinear", ["x", "scale"], ["q1"], name="constant")
    node_computed = helper.make_node("QuantizeLinear", ["x", "s2"], ["q2"], name="computed")
    graph = _graph([node_constant, helper.make_node("Abs", ["s"], ["s2"]), node_computed],
                   [_float("x", [4]), _float("s", [])],
                   [helper.make_tensor_value_info(n, TensorProto.UINT8, [4]) for n in ("q1", "q2")], [scale])
    by_name = {node.name: check(OPENVINO_TABLE, node, graph) for node in graph.nodes}
    assert by_name["constant"].ok
    assert not by_name["computed"].ok and "must be a constant initializer" in by_name["computed"].reason


def test_float16_stays_off_openvino():
    graph = _graph([helper.make_node("Relu", ["x"], ["y"], name="relu")],
                   [helper.make_tensor_value_info("x", TensorProto.FLOAT16, [4])],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT16, [4])])
    support = check(OPENVINO_TABLE, graph.nodes[0], graph)
    assert not support.ok and "float16" in support.reason
