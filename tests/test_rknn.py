"""RKNN: the capability table, options, presence and the worker protocol everywhere; with the toolkit
environment (`uhop-onnx setup rknn`), real conversions checked in Rockchip's simulator against ONNX Runtime."""

from __future__ import annotations

import io
import json
import platform

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from uhop_onnx import InferenceSession
from uhop_onnx.foundation.errors import ProviderError
from uhop_onnx.foundation.graph import Graph
from uhop_onnx.models import BUILDERS
from uhop_onnx.partitioner.capabilities import capabilities
from uhop_onnx.providers import devices
from uhop_onnx.providers.capability import check
from uhop_onnx.providers.rknn import Rknn, board_soc
from uhop_onnx.providers.rknn import worker as rknn_worker
from uhop_onnx.providers.rknn.converter import Toolkit, convert
from uhop_onnx.providers.rknn.setup import READY, create_venv, is_ready, venv_path
from uhop_onnx.precision import compare
from uhop_onnx.providers.rknn.table import FP16_TOLERANCE, RKNN_TABLE

from .conftest import random_feeds, reference
from .support import needs_toolkit

def single(op: str, shape: list[int], opset: int = 17, **attributes) -> onnx.ModelProto:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    graph = helper.make_graph([helper.make_node(op, ["x"], ["y"], name=op, **attributes)], op, [x], [y])
    return helper.make_model(graph, ir_version=8, opset_imports=[helper.make_opsetid("", opset)])


def verdict(model: onnx.ModelProto):
    graph = Graph.from_model(model)
    return check(RKNN_TABLE, graph.nodes[0], graph)


def test_table_takes_the_cnn_and_refuses_what_rockchip_lists_as_unsupported():
    graph = Graph.from_model(BUILDERS["cnn"]())
    assert all(check(RKNN_TABLE, node, graph).ok for node in graph.nodes)
    for op in ("TopK", "Neg", "Einsum", "GroupNormalization", "NonMaxSuppression"):
        assert not verdict(single(op, [1, 8])).ok
    assert "opset 20" in verdict(single("Relu", [1, 8], opset=20)).reason
    assert "mode" in verdict(single("Resize", [1, 3, 8, 8], mode="cubic")).reason
    assert verdict(single("Resize", [1, 3, 8, 8], mode="linear")).ok


def test_batch_one_remarks_come_from_shapes():
    provider = Rknn({"simulate": True})
    from uhop_onnx.providers.rknn.table import remarks

    assert list(remarks(Graph.from_model(single("Softmax", [4, 8])))) == ["Softmax"]
    assert remarks(Graph.from_model(single("Softmax", [1, 8]))) == {}
    assert "batch size 1" in remarks(Graph.from_model(single("Softmax", [4, 8])))["Softmax"].reason
    assert provider.tolerance == FP16_TOLERANCE and provider.at_precision("int8").tolerance is None


@pytest.mark.parametrize(("name", "value"), [("target", "rk9999"), ("core_mask", "3")])
def test_bad_options_name_the_valid_ones(name, value):
    with pytest.raises(ProviderError, match=f"unknown {name} '{value}'; valid: "):
        Rknn({name: value})
    with pytest.raises(ProviderError, match="simulate must be true or false"):
        Rknn({"simulate": "yes"})


def test_presence_on_this_host_is_honest():
    listed = [d for d in devices() if d.id == "rknn"]
    assert len(listed) == 2  # the NPU, and the simulator
    npu = Rknn().availability
    if platform.machine() not in ("aarch64", "arm64"):
        assert not npu.present and npu.reason.startswith(f"no Rockchip NPU on this {platform.machine()} host")
        assert npu.install == "uhop-onnx setup rknn"
    simulator = Rknn({"simulate": True}).availability
    assert simulator.present == is_ready()
    if not simulator.present:
        assert "rknn-toolkit2 environment not found" in simulator.reason and simulator.install == "uhop-onnx setup rknn"


def test_board_soc_is_read_from_the_device_tree(tmp_path, monkeypatch):
    from uhop_onnx.providers import rknn

    tree = tmp_path / "compatible"
    tree.write_bytes(b"radxa,rock-5b\0rockchip,rk3588\0")
    monkeypatch.setattr(rknn, "DEVICE_TREE", tree)
    assert board_soc() == "rk3588"
    tree.write_bytes(b"raspberrypi,5-model-b\0brcm,bcm2712\0")
    assert board_soc() is None


def test_worker_protocol_refuses_other_versions_and_unknown_ops():
    requests = [json.dumps({"protocol": 2, "op": "info"}), json.dumps({"protocol": 1, "op": "explode"}),
                json.dumps({"protocol": 1, "op": "run"})]
    replies = io.StringIO()
    rknn_worker.serve(requests, replies)
    answers = [json.loads(line) for line in replies.getvalue().splitlines()]
    assert [a["ok"] for a in answers] == [False, False, False]
    assert "protocol 2 requested; this worker speaks 1" in answers[0]["error"]
    assert "unknown op 'explode'" in answers[1]["error"]
    assert "no model is loaded" in answers[2]["error"]


def test_int8_without_calibration_is_refused_before_the_toolkit_runs():
    with pytest.raises(ProviderError, match="int8 needs calibration samples"):
        Toolkit().build(BUILDERS["cnn"](), dtype="int8")
    with pytest.raises(ProviderError, match="unknown target"):
        Toolkit().build(BUILDERS["cnn"](), target="rk1808")


@needs_toolkit
def test_setup_is_idempotent(monkeypatch):
    first = create_venv()
    stamp = (first / READY).stat().st_mtime_ns  # the marker of a complete environment
    monkeypatch.setattr("uhop_onnx.providers.rknn.setup._run", lambda command: pytest.fail(f"ran {command} again"))
    assert create_venv() == first == venv_path()  # the second call installs nothing and changes nothing
    assert (first / READY).stat().st_mtime_ns == stamp


@needs_toolkit
def test_cnn_in_the_simulator_matches_onnxruntime_at_fp16():
    model = BUILDERS["cnn"]()
    session = InferenceSession(model, providers=[("rknn", {"simulate": True})], profile=False)
    assert [s.provider for s in session.plan.stages] == ["rknn"]
    feeds = random_feeds(model, seed=3)
    (actual,), (expected,) = session.run(None, feeds), reference(model, feeds)
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    assert compare(actual, expected, FP16_TOLERANCE)["ok"]


@needs_toolkit
def test_convert_writes_an_rknn_file(tmp_path):
    out = tmp_path / "cnn.rknn"
    seconds = convert(BUILDERS["cnn"](), out, target="rk3576")
    assert seconds > 0 and out.read_bytes()[:4] == b"RKNN"


@needs_toolkit
def test_int8_with_calibration_runs_quantized(tmp_path):
    model = BUILDERS["cnn"]()
    rng = np.random.default_rng(5)
    np.savez(tmp_path / "calibration.npz", input=rng.standard_normal((6, 1, 3, 32, 32)).astype(np.float32))
    feeds = random_feeds(model, seed=4)
    (expected,) = reference(model, feeds)
    errors = {}
    for dtype in ("fp16", "int8"):
        options = {"simulate": True, "calibration": str(tmp_path / "calibration.npz")}
        runner = Rknn(options).at_precision(dtype).compile(model)
        try:
            actual = runner.run(feeds)["output"]
        finally:
            runner.close()
        assert actual.dtype == np.float32 and actual.shape == expected.shape  # float I/O around the int8 model
        errors[dtype] = np.abs(actual - expected).max()
        cosine = float(np.dot(actual.ravel(), expected.ravel()) / np.linalg.norm(actual) / np.linalg.norm(expected))
        assert cosine > 0.999, (dtype, cosine)
    assert errors["int8"] > errors["fp16"]  # quantization really happened
    assert errors["int8"] < 0.1 * np.abs(expected).max()


@needs_toolkit
def test_capabilities_combine_the_table_remarks_and_the_converter():
    model = BUILDERS["mlp"]()  # batch 4: the list allows Softmax at batch 1 only
    support = capabilities(model, Graph.from_model(model), Rknn({"simulate": True}))
    refused = {name for name, s in support.items() if not s.ok}
    assert refused == {"/softmax/Softmax"}


def test_the_precision_is_the_one_record_of_the_dtype():
    """The toolkit builds at the dtype of the precision (fp16 at fp32: the NPU has none), which stage options do
    not record again; a `dtype` option, which built int8 under an fp32 label, is refused naming the precision."""
    base = Rknn({"simulate": True})
    assert base.precisions() == ["fp16", "int8"]
    int8 = base.at_precision("int8")
    assert (int8.label, int8.dtype, int8.options) == ("rknn[int8]", "int8", {"simulate": True})
    assert (base.dtype, base.at_precision("fp32").dtype, base.at_precision("fp16").dtype) == ("fp16",) * 3
    assert int8.at_precision("fp32").dtype == "fp16"
    assert Rknn().at_precision("int8").simulator().label == "rknn[int8]"  # the simulator at the stage's precision
    with pytest.raises(ProviderError, match="ask for precision int8 or fp16"):
        Rknn({"dtype": "int8"})


@needs_toolkit
def test_int8_variant_is_quantized_on_the_calibration_values_in_the_simulator():
    from uhop_onnx.providers.quantize import Calibration

    model = BUILDERS["cnn"]()
    rng = np.random.default_rng(5)
    calibration = Calibration(model, [{"input": rng.standard_normal((1, 3, 32, 32)).astype(np.float32)}
                                      for _ in range(6)])
    feeds = random_feeds(model, seed=4)
    (expected,) = reference(model, feeds)
    errors = {}
    for dtype in ("fp16", "int8"):
        runner = Rknn({"simulate": True}).at_precision(dtype, calibration).compile(model)
        try:
            actual = runner.run(feeds)["output"]
        finally:
            runner.close()
        errors[dtype] = np.abs(actual - expected).max()
        cosine = float(np.dot(actual.ravel(), expected.ravel()) / np.linalg.norm(actual) / np.linalg.norm(expected))
        assert cosine > 0.999, (dtype, cosine)
    assert errors["int8"] > errors["fp16"]  # quantized on those samples, not built at fp16
    assert Rknn({"simulate": True}).at_precision("int8", calibration).lower(model) is model  # the toolkit quantizes
