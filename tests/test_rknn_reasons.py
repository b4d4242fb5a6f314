"""Why a node is off the RK3588's NPU: `export` records each one in the manifest (`off_accelerator`) with the
NPU's capability answer or the cost model's figures, prints one line per reason, and `explain` shows it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from uhop_onnx.bundle.manifest import validate
from uhop_onnx.foundation.errors import BundleError
from uhop_onnx.runtime.report import off_accelerator_lines

from .support import anchored, needs_toolkit


def with_topk(model: onnx.ModelProto) -> onnx.ModelProto:
    """`model` with its output flattened and a TopK after it (Rockchip's list has no TopK)."""
    graph = model.graph
    graph.node.extend([helper.make_node("Flatten", ["boxes"], ["flat"], name="flatten", axis=1),
                       helper.make_node("TopK", ["flat", "k"], ["values", "indices"], name="topk")])
    graph.initializer.append(numpy_helper.from_array(np.array([5], np.int64), "k"))
    del graph.output[:]
    graph.output.extend([helper.make_tensor_value_info("values", TensorProto.FLOAT, ["batch", 5]),
                         helper.make_tensor_value_info("indices", TensorProto.INT64, ["batch", 5])])
    return model


def test_reasons_print_one_line_per_group_within_80_columns():
    reason = "ai.onnx.TopK is not in rknn's table"
    off = {"provider": "rknn", "nodes": [
        {"node": "topk", "op": "TopK", "on": "ort-cpu", "kind": "capability", "reason": reason},
        *({"node": f"r{k}", "op": "Range", "on": "ort-cpu", "kind": "cost", "reason": "estimated 0.1 ms for its "
           "stage of 6 on ort-cpu, 0.4 ms on rknn, 0.3 ms of it per stage"} for k in range(6))]}
    lines = off_accelerator_lines(off)
    assert lines[0] == "7 nodes off rknn:"
    assert lines[1] == f"  1 on ort-cpu (TopK): capability: {reason}"
    assert lines[2].startswith("  6 on ort-cpu (Range x6): cost: estimated 0.1 ms")
    assert all(len(line) <= 80 for line in lines) and len(lines) == 4  # the cost line wraps once
    assert off_accelerator_lines({"provider": "rknn", "nodes": []}) == ["every node is on rknn"]
    assert off_accelerator_lines(None) == []


def test_the_manifest_field_is_checked():
    manifest = {"schema": "uhop-onnx.bundle/3", "files": {}, "model": {"name": "m", "sha256": "0"},
                "target": {}, "inputs": [], "outputs": [], "tolerance": {"rtol": 0.0, "atol": 0.0},
                "samples": {"inputs": "i", "outputs": "o"}, "stages": [],
                "off_accelerator": {"provider": "rknn", "nodes": [{"node": "a", "op": "TopK", "on": "ort-cpu"}]}}
    with pytest.raises(BundleError, match=r"off_accelerator.nodes\[0\].kind is missing"):
        validate(manifest, "m")


@needs_toolkit
def test_export_records_prints_and_explains_why_nodes_are_off_the_npu(tmp_path):
    # At 16x16 the whole model is too small for the NPU's stage overhead; TopK is not on Rockchip's list.
    onnx.save(with_topk(anchored(8)), tmp_path / "m.onnx")
    run = subprocess.run([sys.executable, "-m", "uhop_onnx.cli", "export", str(tmp_path / "m.onnx"), "--target",
                          "rk3588", "--shape", "images:1x3x16x16", "-o", str(tmp_path / "b")],
                         capture_output=True, text=True, env={**os.environ, "COLUMNS": "80"})
    assert run.returncode == 0, run.stderr
    manifest = json.loads((tmp_path / "b" / "manifest.json").read_text())
    off = {entry["node"]: entry for entry in manifest["off_accelerator"]["nodes"]}
    assert manifest["off_accelerator"]["provider"] == "rknn"
    assert off["topk"]["kind"] == "capability" and "TopK is not in rknn's table" in off["topk"]["reason"]
    conv = off["conv2"]
    assert conv["kind"] == "cost" and conv["ms"]["rknn"] > conv["ms"][conv["on"]], conv
    assert set(off) == {n for s in manifest["stages"] for n in s["nodes"]}  # every node, once
    assert "range_h" not in off, "the anchor grid is constant at the export's shapes"
    assert "capability: ai.onnx.TopK is not in rknn's table" in run.stdout
    explained = subprocess.run([sys.executable, "-m", "uhop_onnx.cli", "explain", str(tmp_path / "b")],
                               capture_output=True, text=True)
    assert explained.returncode == 0, explained.stderr
    assert "off rknn" in explained.stdout and "(TopK): capability" in explained.stdout
