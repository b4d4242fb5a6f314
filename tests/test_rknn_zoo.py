"""Rockchip's model zoo classes for the RK3588, exported by their own libraries (`uhop_onnx.models.zoo`) with
free batch, height and width, each placed at a small input size: at least 95% of its FLOPs on the NPU, the
simulator's outputs within the fp16 tolerance of ONNX Runtime, and every node left on the CPU listed with its
reason. The torchvision classifiers, two YOLO sizes and the int8 run are slow: `UHOP_SLOW=1` runs them
too."""

from __future__ import annotations

import json
import os

import pytest

import uhop_onnx
from uhop_onnx.foundation.graph import Graph
from uhop_onnx.foundation.inputs import at_shapes
from uhop_onnx.models.zoo import ZOO, available, calibration, export_onnx
from uhop_onnx.partitioner.static_cost import flops
from uhop_onnx.model.simplify import simplify

from .support import TOOLKIT_MARKS, needs_toolkit

SLOW = {"yolov8s", "yolo11n", "resnet50", "mobilenetv2"}
ALL = bool(os.environ.get("UHOP_SLOW"))


def cases():
    for model in ZOO:
        marks = list(TOOLKIT_MARKS)
        missing = available(model)
        if missing:
            marks.append(pytest.mark.skip(reason=f"{model.name}: {missing}"))
        if model.name in SLOW and not ALL:
            marks.append(pytest.mark.skip(reason=f"{model.name} is slow; UHOP_SLOW=1 runs it"))
        yield pytest.param(model, id=model.name, marks=marks)


@pytest.mark.parametrize("model", cases())
def test_zoo_model_runs_on_the_npu_in_the_simulator(model, tmp_path):
    path = export_onnx(model, tmp_path / "model.onnx")
    bundle = uhop_onnx.export_bundle(path, "rk3588", tmp_path / "b", shapes={"images": model.small})
    manifest = json.loads((bundle / "manifest.json").read_text())
    graph = Graph.from_model(at_shapes(simplify(uhop_onnx.load(path)), {"images": list(model.small)}))
    counts = {n.name: flops(graph, n) for n in graph.nodes}
    on_npu = {n for s in manifest["stages"] if s["provider"] == "rknn" for n in s["nodes"]}
    assert sum(v for n, v in counts.items() if n in on_npu) >= 0.95 * sum(counts.values())
    off = manifest["off_accelerator"]
    on_cpu = {n for s in manifest["stages"] if s["provider"] != "rknn" for n in s["nodes"]}
    assert {e["node"] for e in off["nodes"]} == on_cpu and all(e["reason"] for e in off["nodes"])
    report = uhop_onnx.verify_bundle(bundle)
    assert report["ok"] and any(s["provider"] == "rknn" and s["ran"] for s in report["stages"]), report


@needs_toolkit
@pytest.mark.skipif(not ALL, reason="int8 quantization in the simulator is slow; UHOP_SLOW=1 runs it")
def test_a_zoo_detector_at_int8_is_gated_in_the_simulator(tmp_path):
    (model,) = [m for m in ZOO if m.name == "retinaface-mobile"]
    path = export_onnx(model, tmp_path / "model.onnx")
    bundle = uhop_onnx.export_bundle(path, "rk3588", tmp_path / "b", shapes={"images": model.small},
                                     precision="int8", calibration=calibration(model.small), tolerance=0.05)
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert {s["precision"] for s in manifest["stages"] if s["provider"] == "rknn"} == {"int8"}
    assert set(manifest["precision"]["accuracy"]) == {o["name"] for o in manifest["outputs"]}
