"""Shape inference on a model's weightless copy gives what onnx's own inference of the whole model gives."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper, shape_inference

from uhop_onnx.foundation.inference import inferred, weightless

MODELS = Path(__file__).resolve().parent.parent / "models"


def branching() -> onnx.ModelProto:
    """A free batch, a 64x64 weight, a Reshape whose shape is a small initializer, shape arithmetic (Shape,
    Gather, Concat) and an If whose branches infer shapes of their own."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 64])
    flag = helper.make_tensor_value_info("flag", TensorProto.BOOL, [])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    weights = [numpy_helper.from_array(np.ones((64, 64), np.float32), "w"),
               numpy_helper.from_array(np.array([-1, 8, 8], np.int64), "to"),
               numpy_helper.from_array(np.array([0], np.int64), "first"),
               numpy_helper.from_array(np.array([64], np.int64), "width")]
    branch = {name: helper.make_graph([helper.make_node(op, ["r"], [f"{name}_out"])], name, [],
                                      [helper.make_tensor_value_info(f"{name}_out", TensorProto.FLOAT, None)])
              for name, op in (("then", "Relu"), ("else", "Neg"))}
    nodes = [helper.make_node("MatMul", ["x", "w"], ["m"]),
             helper.make_node("Reshape", ["m", "to"], ["r"]),
             helper.make_node("Shape", ["x"], ["s"]),
             helper.make_node("Gather", ["s", "first"], ["b"]),
             helper.make_node("Concat", ["b", "width"], ["flat"], axis=0),
             helper.make_node("If", ["flag"], ["chosen"], then_branch=branch["then"], else_branch=branch["else"]),
             helper.make_node("Reshape", ["chosen", "flat"], ["y"])]
    graph = helper.make_graph(nodes, "branching", [x, flag], [y], initializer=weights)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def shapes(model: onnx.ModelProto) -> dict[str, bytes]:
    """Every typed value of the model and of its subgraphs, name -> its type serialized."""
    values = {v.name: v.type.SerializeToString() for v in (*model.graph.value_info, *model.graph.output)}
    for node in model.graph.node:
        for attribute in node.attribute:
            if attribute.type == onnx.AttributeProto.GRAPH:
                values |= {f"{node.name}/{v.name}": v.type.SerializeToString()
                           for v in (*attribute.g.value_info, *attribute.g.output)}
    return values


@pytest.mark.parametrize("make", [branching, lambda: onnx.load(MODELS / "example_encoder.onnx"),
                                  lambda: onnx.load(MODELS / "example_mobilenet.onnx")],
                         ids=["branching", "example_encoder", "example_mobilenet"])
def test_the_shapes_inferred_without_the_weights_are_onnx_s_own(make):
    expected = shape_inference.infer_shapes(make(), data_prop=True)
    model = make()
    weights = [t.SerializeToString() for t in model.graph.initializer]
    got = inferred(model)
    assert got is model
    assert shapes(got) == shapes(expected) and len(shapes(got)) > 3
    assert [t.SerializeToString() for t in got.graph.initializer] == weights


def test_the_weightless_copy_holds_no_large_value_and_types_them_as_inputs():
    light = weightless(branching())
    assert [t.name for t in light.graph.initializer] == ["to", "first", "width"]
    typed = {v.name: v for v in light.graph.input}
    assert [d.dim_value for d in typed["w"].type.tensor_type.shape.dim] == [64, 64]


def test_a_model_inference_refuses_is_left_as_it_was():
    model = branching()
    model.graph.node[0].input[1] = "to"  # MatMul of [batch, 64] by an int64 vector: a type error
    before = model.SerializeToString()
    with pytest.raises(shape_inference.InferenceError):
        inferred(model, check_type=True, strict_mode=True)
    assert model.SerializeToString() == before
