"""A detector with free batch, height and width placed for the RK3588 at the export's shapes: its costs are
counted there (never with a free dimension as 1), its anchor grid (`Shape` -> `Range`) folds to constants,
and the whole model goes to the NPU and verifies in Rockchip's simulator."""

from __future__ import annotations

import json

import numpy as np

import uhop_onnx
from uhop_onnx.foundation.graph import Graph
from uhop_onnx.partitioner.placer import Analysis
from uhop_onnx.partitioner.static_cost import flops, sized
from uhop_onnx.providers.rknn.converter import suggested_rule

from .support import SHAPE, anchored, needs_toolkit


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
