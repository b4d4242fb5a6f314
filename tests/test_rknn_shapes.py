"""A detector with free batch, height and width placed for the RK3588 at the export's shapes: its costs are
counted there (never with a free dimension as 1), its anchor grid (`Shape` -> `Range`) folds to constants,
and the whole model goes to the NPU and verifies in Rockchip's simulator."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import uhop_onnx
from uhop_onnx.graph import Graph
from uhop_onnx.partitioner.placer import Analysis
from uhop_onnx.partitioner.static_cost import flops, sized
from uhop_onnx.providers.rknn.converter import suggested_rule
from uhop_onnx.providers.rknn.setup import is_ready, venv_path

needs_toolkit = pytest.mark.skipif(
    not is_ready(), reason=f"rknn-toolkit2 environment absent at {venv_path()}: create it with "
                           "`uhop-onnx setup rknn`")

SHAPE = (1, 3, 128, 128)


def anchored(channels: int = 32) -> onnx.ModelProto:
    """Two convolutions, then an anchor grid as exporters write one: the feature map's `Shape`, its height and
    width gathered, `Range` over each, added to the map. Batch, height and width are free."""
    rng = np.random.default_rng(0)

    def weight(name, *shape):
        return numpy_helper.from_array((rng.standard_normal(shape) * 0.1).astype(np.float32), name)

    def scalar(name, value):
        return numpy_helper.from_array(np.array(value, np.int64), name)

    nodes = [
        helper.make_node("Conv", ["images", "w1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
        helper.make_node("Conv", ["r1", "w2"], ["c2"], name="conv2", pads=[1, 1, 1, 1]),
        helper.make_node("Sigmoid", ["c2"], ["s"], name="sigmoid"),
        helper.make_node("Shape", ["c2"], ["dims"], name="shape"),
        helper.make_node("Gather", ["dims", "two"], ["h"], name="gather_h", axis=0),
        helper.make_node("Gather", ["dims", "three"], ["w"], name="gather_w", axis=0),
        helper.make_node("Range", ["zero", "h", "one"], ["ys"], name="range_h"),
        helper.make_node("Range", ["zero", "w", "one"], ["xs"], name="range_w"),
        helper.make_node("Cast", ["ys"], ["yf"], name="cast_h", to=TensorProto.FLOAT),
        helper.make_node("Cast", ["xs"], ["xf"], name="cast_w", to=TensorProto.FLOAT),
        helper.make_node("Unsqueeze", ["yf", "one_axis"], ["ycol"], name="column"),
        helper.make_node("Add", ["ycol", "xf"], ["grid"], name="grid"),
        helper.make_node("Add", ["s", "grid"], ["boxes"], name="anchored"),
    ]
    graph = helper.make_graph(
        nodes, "anchored",
        [helper.make_tensor_value_info("images", TensorProto.FLOAT, ["batch", 3, "height", "width"])],
        [helper.make_tensor_value_info("boxes", TensorProto.FLOAT, ["batch", channels, "height", "width"])],
        [weight("w1", channels, 3, 3, 3), weight("w2", channels, channels, 3, 3), scalar("zero", 0),
         scalar("one", 1), scalar("two", 2), scalar("three", 3),
         numpy_helper.from_array(np.array([1], np.int64), "one_axis")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)


def test_costs_are_counted_at_the_export_shapes_not_with_free_dimensions_as_one():
    model = uhop_onnx.load(anchored())
    graph = Graph.from_model(model)
    a = Analysis(model, model, model, graph, [], {}, {}, feeds={"images": np.zeros(SHAPE, np.float32)})
    conv = graph.nodes[graph.index_of["conv2"]]
    assert flops(graph, conv) == 2 * 32 * 32 * 9  # height and width taken as 1: the bug this guards
    at = sized(a)
    assert [n.name for n in at.graph.nodes] == [n.name for n in graph.nodes]
    assert flops(at.graph, conv) == 2 * 32 * 32 * 9 * 128 * 128
    assert sized(Analysis(model, model, model, graph, [], {}, {}, feeds=None)).graph is graph


def test_a_failed_fusion_rule_is_read_from_the_toolkit_log():
    log = "W You can add disable_rules=['seperate_conv_rs_split'] in rknn.config() to temporarily disable"
    assert suggested_rule(log) == "seperate_conv_rs_split"
    assert suggested_rule("E build: some other failure") is None


@needs_toolkit
def test_a_free_shape_detector_goes_whole_to_the_npu_and_verifies(tmp_path):
    bundle = uhop_onnx.export_bundle(anchored(), "rk3588", tmp_path / "b",
                                     shapes={"images": SHAPE})
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert [s["provider"] for s in manifest["stages"]] == ["rknn"], manifest["stages"]
    assert manifest["stages"][0]["built_for"] == {"images": list(SHAPE)}
    assert manifest["stages"][0]["artifact"]["options"]["core_mask"] == "0_1_2"  # batch 1: all three cores
    report = uhop_onnx.verify_bundle(bundle)
    assert report["ok"], report
