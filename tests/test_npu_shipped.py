"""Models as their authors ship them, on the RK3588's NPU: what is computed from shapes becomes constants at the
export's shapes, an opset outside Rockchip's range is converted for the NPU, the placement minimises its own
estimate over every assignment, and the shipped corpus (`benchmarks/rknn_zoo.py`'s `SHIPPED`) goes to the NPU
and verifies in Rockchip's simulator. The corpus's larger models are slow: `UHOP_SLOW=1` runs them too."""

from __future__ import annotations

import itertools
import json
import os
from types import SimpleNamespace

import numpy as np
import onnx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

import uhop_onnx
from benchmarks.rknn_zoo import SHIPPED, npu_figures
from uhop_onnx import InputError
from uhop_onnx.foundation.graph import Graph
from uhop_onnx.partitioner.partition import partition
from uhop_onnx.partitioner.placer import Analysis
from uhop_onnx.partitioner.static_cost import off_preferred, plan_ms
from uhop_onnx.partitioner.static_placer import StaticCost
from uhop_onnx.providers import Support
from uhop_onnx.foundation.samples import reference_outputs
from uhop_onnx.model.simplify import at_fixed_shapes, within_opsets
from uhop_onnx.precision import compare
from uhop_onnx.products.targets import TargetProvider, load_target
from uhop_onnx.providers.rknn.table import FP16_TOLERANCE

from .conftest import assert_matches, random_feeds, reference
from .support import SHAPE, TOOLKIT_MARKS, anchored, needs_toolkit, present_cpu_providers

ALL = bool(os.environ.get("UHOP_SLOW"))
SHAPE_OPS = {"Shape", "Size", "Range", "ConstantOfShape", "Gather", "Cast", "Unsqueeze", "Expand"}


def seeded(shape: tuple[int, ...]) -> np.ndarray:
    return np.random.default_rng(0).standard_normal(shape).astype(np.float32)


# -- 1. shape arithmetic folds at the export's shapes ----------------------------------------------------------

def test_the_anchor_grid_folds_to_constants_at_fixed_shapes():
    model = uhop_onnx.load(anchored())
    fixed = at_fixed_shapes(model, {"images": list(SHAPE)})
    assert {n.op_type for n in fixed.graph.node} == {"Conv", "Relu", "Sigmoid", "Add"}
    feeds = {"images": seeded(SHAPE)}
    assert_matches(list(reference_outputs(fixed.SerializeToString(), feeds).values()),
                   list(reference_outputs(model.SerializeToString(), feeds).values()))


@pytest.mark.skipif(SHIPPED[0].missing() is not None, reason=f"{SHIPPED[0].missing()}")
def test_a_shipped_yolov8_head_folds_to_constants_at_fixed_shapes():
    model = uhop_onnx.load(SHIPPED[0].path())  # free batch, height and width, as nudenet ships it
    fixed = at_fixed_shapes(model, {"images": [1, 3, 320, 320]})
    assert not SHAPE_OPS & {n.op_type for n in fixed.graph.node}
    assert {n.name for n in fixed.graph.node} <= {n.name for n in model.graph.node}, "names are kept"
    feeds = {"images": seeded((1, 3, 320, 320))}
    assert_matches(list(reference_outputs(fixed.SerializeToString(), feeds).values()),
                   list(reference_outputs(model.SerializeToString(), feeds).values()))


@pytest.mark.skipif("litert" not in present_cpu_providers(), reason="LiteRT is not installed")
def test_a_bundle_exported_at_fixed_shapes_says_so_and_refuses_other_shapes(tmp_path):
    out = uhop_onnx.export_bundle(anchored(), "arm64", tmp_path / "b", providers=["litert"],
                                  shapes={"images": SHAPE})
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["fixed_shapes"] == {"images": list(SHAPE)}
    [stage] = manifest["stages"]
    assert not SHAPE_OPS & {n.op_type for n in onnx.load(out / stage["reference"]).graph.node}
    bundle = uhop_onnx.load_bundle(out)
    feeds = {"images": seeded(SHAPE)}
    assert_matches(bundle.run(None, feeds), list(reference_outputs(anchored().SerializeToString(), feeds).values()))
    with pytest.raises(InputError, match=r"this bundle was built for images 1x3x128x128; export it again with "
                                         r"--shape images:1x3x64x64"):
        bundle.run(None, {"images": seeded((1, 3, 64, 64))})


# -- 2. any opset in ---------------------------------------------------------------------------------------------

def convolutions(opset: int, middle: str = "Relu") -> onnx.ModelProto:
    """Conv -> `middle` -> Relu -> Conv on 1x32x64x64 (enough work for the NPU), at `opset`."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 32, 64, 64])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 32, 64, 64])
    w = numpy_helper.from_array((np.random.default_rng(0).standard_normal((32, 32, 3, 3)) * 0.05).astype(np.float32),
                                "w")
    nodes = [helper.make_node("Conv", ["x", "w"], ["a"], name="c1", pads=[1, 1, 1, 1]),
             helper.make_node(middle, ["a"], ["b"], name="middle"),
             helper.make_node("Relu", ["b"], ["c"], name="r"),
             helper.make_node("Conv", ["c", "w"], ["y"], name="c2", pads=[1, 1, 1, 1])]
    return helper.make_model(helper.make_graph(nodes, "convolutions", [x], [y], [w]),
                             opset_imports=[helper.make_opsetid("", opset)], ir_version=7)


def test_a_model_is_converted_into_the_range_node_by_node_where_a_node_has_no_adapter():
    feeds = {"x": seeded((1, 32, 64, 64))}
    converted, failed = within_opsets(convolutions(11), 12, 19, feeds)
    assert failed == {} and converted.opset_import[0].version == 12
    converted, failed = within_opsets(convolutions(20, "Gelu"), 12, 19, feeds)  # Gelu is new in opset 20
    assert list(failed) == ["middle"] and "No Previous Version of Gelu" in failed["middle"]
    assert [n.name for n in converted.graph.node] == ["c1", "r", "c2"] and converted.opset_import[0].version == 19
    assert "b" in {i.name for i in converted.graph.input}, "the node left out feeds the rest from outside"


@needs_toolkit
def test_an_opset_11_model_goes_whole_to_the_npu_and_verifies(tmp_path):
    bundle = uhop_onnx.export_bundle(convolutions(11), "rk3588", tmp_path / "b")
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert [s["provider"] for s in manifest["stages"]] == ["rknn"], manifest.get("off_accelerator")
    assert uhop_onnx.verify_bundle(bundle)["ok"]


@needs_toolkit
def test_a_session_on_the_npu_simulator_takes_an_opset_11_model_as_export_does():
    model = convolutions(11)
    session = uhop_onnx.InferenceSession(model, providers=[("rknn", {"simulate": True})], profile=False)
    assert session.get_providers() == ["rknn"]
    feeds = random_feeds(model)
    for got, want in zip(session.run(None, feeds), reference(model, feeds)):
        assert compare(got, want, FP16_TOLERANCE)["ok"]
    session.close()


@needs_toolkit
def test_a_node_the_converter_cannot_move_stays_off_the_npu_with_its_reason(tmp_path):
    bundle = uhop_onnx.export_bundle(convolutions(20, "Gelu"), "rk3588", tmp_path / "b")
    manifest = json.loads((bundle / "manifest.json").read_text())
    off = {e["node"]: e for e in manifest["off_accelerator"]["nodes"]}
    assert set(off) == {"middle"} and "No Previous Version of Gelu" in off["middle"]["reason"], off
    assert [s["provider"] for s in manifest["stages"]][::2] == ["rknn", "rknn"]
    assert uhop_onnx.verify_bundle(bundle)["ok"]


# -- 3. the placement minimises its own estimate ------------------------------------------------------------------

RK3588 = {p.id: p for p in load_target("rk3588").providers}


def chain(ops: list[str], channels: int = 32, size: int = 64) -> onnx.ModelProto:
    """A chain of `ops` ("conv" a 3x3 convolution, else that elementwise op) on 1 x channels x size x size."""
    dims = [1, channels, size, size]
    w = numpy_helper.from_array(np.zeros((channels, channels, 3, 3), np.float32), "w")
    nodes, previous = [], "x"
    for k, op in enumerate(ops):
        if op == "conv":
            nodes.append(helper.make_node("Conv", [previous, "w"], [f"t{k}"], name=f"n{k}", pads=[1, 1, 1, 1]))
        else:
            nodes.append(helper.make_node(op, [previous], [f"t{k}"], name=f"n{k}"))
        previous = f"t{k}"
    graph = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, dims)],
                              [helper.make_tensor_value_info(previous, TensorProto.FLOAT, dims)], [w])
    return onnx.shape_inference.infer_shapes(
        helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9))


def analysis(model: onnx.ModelProto, off: set[int]) -> Analysis:
    """`model` as placement sees it: the NPU runs every node but those at the positions `off`, the CPU all."""
    graph = Graph.from_model(model)
    support = {"rknn": {n.name: Support(n.index not in off, "" if n.index not in off else "not on the NPU here")
                        for n in graph.nodes},
               "ort-cpu": {n.name: Support(True) for n in graph.nodes}}
    return Analysis(model, model, model, graph, [], support, {})


def baselines(count: int, off: set[int]) -> dict[str, list[str]]:
    """The plans the placement must never be estimated slower than."""
    first = min(off, default=count)
    return {"all on the CPU": ["ort-cpu"] * count,
            "the NPU up to the first node it cannot run": ["rknn"] * first + ["ort-cpu"] * (count - first),
            "each node the NPU cannot run alone on the CPU": ["ort-cpu" if k in off else "rknn" for k in range(count)]}


def test_the_chosen_plan_is_the_cheapest_of_every_assignment_and_explained_so():
    ops = ["conv", "Relu"] * 7
    off = {6, 7, 9}
    a = analysis(chain(ops), off)
    models = {"rknn": RK3588["rknn"], "ort-cpu": RK3588["ort-cpu"]}
    chosen = StaticCost(models).place(a).choice
    free = [k for k in range(len(ops)) if k not in off]
    every = []
    for labels in itertools.product(["rknn", "ort-cpu"], repeat=len(free)):
        choice = ["ort-cpu"] * len(ops)
        for k, label in zip(free, labels):
            choice[k] = label
        every.append(plan_ms(a.graph, choice, models))
    assert plan_ms(a.graph, chosen, models) == pytest.approx(min(every))
    assert chosen[0] == chosen[-1] == "rknn" and "ort-cpu" in chosen, "two NPU stages around the CPU's"
    stages = [SimpleNamespace(label=s.provider, nodes=[a.graph.nodes[i].name for i in s.nodes])
              for s in partition(a.graph, chosen)]
    entries = off_preferred(a, stages, models, ["rknn"])
    assert {e["node"] for e in entries} == {a.graph.nodes[k].name for k, label in enumerate(chosen) if label != "rknn"}
    for entry in entries:
        if entry["kind"] == "cost":
            assert entry["ms"][entry["on"]] <= entry["ms"]["rknn"], entry  # the reason agrees with the choice
        else:
            assert entry["kind"] == "capability" and a.graph.index_of[entry["node"]] in off


@settings(max_examples=60, deadline=None)
@given(ops=st.lists(st.sampled_from(["conv", "Relu", "Sigmoid", "Tanh"]), min_size=2, max_size=24),
       data=st.data(), npu_gflops=st.floats(50, 5000), npu_stage_ms=st.floats(0, 2),
       cpu_gflops=st.floats(5, 100), cpu_stage_ms=st.floats(0, 0.2))
def test_the_chosen_plan_is_never_estimated_slower_than_the_simple_ones(ops, data, npu_gflops, npu_stage_ms,
                                                                          cpu_gflops, cpu_stage_ms):
    off = set(data.draw(st.lists(st.integers(0, len(ops) - 1), max_size=4)))
    a = analysis(chain(ops, channels=8, size=16), off)
    models = {"rknn": TargetProvider("rknn", gflops=npu_gflops, gbps=25, stage_ms=npu_stage_ms),
              "ort-cpu": TargetProvider("ort-cpu", gflops=cpu_gflops, gbps=12, stage_ms=cpu_stage_ms)}
    chosen = StaticCost(models).place(a).choice
    assert all(chosen[k] == "ort-cpu" for k in off)
    ms = plan_ms(a.graph, chosen, models)
    for name, plan in baselines(len(ops), off).items():
        assert ms <= plan_ms(a.graph, plan, models) + 1e-9, name


# -- 4. the shipped corpus ----------------------------------------------------------------------------------------

LONG = {"ppocr-det", "ppocr-rec"}


def shipped():
    for model in SHIPPED:
        marks = list(TOOLKIT_MARKS)
        if model.missing():
            marks.append(pytest.mark.skip(reason=model.missing()))
        if model.name in LONG and not ALL:
            marks.append(pytest.mark.skip(reason=f"{model.name} takes long in the simulator; UHOP_SLOW=1 runs it"))
        yield pytest.param(model, id=model.name, marks=marks)


@pytest.mark.parametrize("model", shipped())
def test_a_shipped_model_runs_on_the_npu_and_verifies_in_the_simulator(model, tmp_path):
    samples = model.samples() if model.samples else None
    where = {"inputs": samples[0]} if samples else {"shapes": model.shapes or None}
    bundle = uhop_onnx.export_bundle(model.path(), "rk3588", tmp_path / "b", **where)
    figures = npu_figures(model.path(), bundle, "fp16")
    assert figures["npu_nodes"] >= 0.95 * figures["nodes"] and figures["npu_flops_share"] >= 0.95, figures
    manifest = json.loads((bundle / "manifest.json").read_text())
    on_cpu = {n for s in manifest["stages"] if s["provider"] != "rknn" for n in s["nodes"]}
    assert {e["node"] for e in manifest["off_accelerator"]["nodes"]} == on_cpu
    report = uhop_onnx.verify_bundle(bundle)
    ran = [s for s in report["stages"] if s["provider"] == "rknn" and s["ran"]]
    assert ran, report
    assert report["ok"], report  # deep ones' fp16 error, accumulated layer by layer, is 0.0076 of their scale
