"""Free dimensions (`-1`, symbolic, unnamed) end to end: signatures as ONNX Runtime shows them, feeds of any
allowed shape, the shapes profiling measures at, and a plan measured at one shape run at another."""

from __future__ import annotations

import json

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
from .support import present_cpu_providers


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


def test_parse_shape_and_its_errors():
    from uhop_onnx.foundation.inputs import parse_shape, parse_shapes

    assert parse_shape("images:1x3x640x640") == ("images", (1, 3, 640, 640))
    assert parse_shape("a:b:2x3") == ("a:b", (2, 3))
    for bad in ("images", ":1x3", "x:1x-3", "x:1xq", "x:"):
        with pytest.raises(InputError, match="NAME:DIMS"):
            parse_shape(bad)
    with pytest.raises(InputError, match="given twice"):
        parse_shapes(["x:1", "x:2"])


def test_profile_feeds_take_the_given_shapes_and_name_what_is_missing(tmp_path):
    from uhop_onnx.foundation.dtypes import TensorSig
    from uhop_onnx.foundation.inputs import profile_feeds

    sigs = [TensorSig("images", "tensor(float)", [None, 3, "height", "width"]), TensorSig("k", "tensor(int64)", [-1])]
    with pytest.raises(InputError, match=r"'images' axis 2 \('height'\), input 'images' axis 3 \('width'\).*"
                                         r"--shape images:1x3xHEIGHTxWIDTH"):
        profile_feeds(sigs)
    feeds = profile_feeds(sigs, shapes={"images": (2, 3, 64, 48)})
    assert feeds["images"].shape == (2, 3, 64, 48) and feeds["k"].shape == (1,) and feeds["k"].dtype == np.int64
    with pytest.raises(InputError, match="dimension 1 must be 3"):
        profile_feeds(sigs, shapes={"images": (1, 4, 8, 8)})
    with pytest.raises(InputError, match="no input 'image'.*its inputs: images, k"):
        profile_feeds(sigs, shapes={"image": (1, 3, 8, 8)})
    sample = np.ones((1, 3, 8, 8), np.float32)
    np.savez(tmp_path / "in.npz", images=sample)
    assert profile_feeds(sigs, inputs=tmp_path / "in.npz")["images"].tolist() == sample.tolist()
    with pytest.raises(InputError, match="dtype float64"):
        profile_feeds(sigs, inputs={"images": sample.astype(np.float64)})


def detector(seed: int = 0) -> onnx.ModelProto:
    """A detector-like conv net with free batch, height and width: conv 3x3 -> relu -> conv 3x3 stride 2 ->
    a 1x1 head, the feature map's size following the image's."""
    rng = np.random.default_rng(seed)
    weights = {"w1": (8, 3, 3, 3), "b1": (8,), "w2": (16, 8, 3, 3), "b2": (16,), "w3": (6, 16, 1, 1), "b3": (6,)}
    inits = [numpy_helper.from_array((rng.standard_normal(s) * 0.3).astype(np.float32), n) for n, s in weights.items()]
    nodes = [
        helper.make_node("Conv", ["images", "w1", "b1"], ["c1"], name="/stem/Conv", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"], name="/stem/Relu"),
        helper.make_node("Conv", ["r1", "w2", "b2"], ["c2"], name="/down/Conv", pads=[1, 1, 1, 1], strides=[2, 2]),
        helper.make_node("Relu", ["c2"], ["r2"], name="/down/Relu"),
        helper.make_node("Conv", ["r2", "w3", "b3"], ["boxes"], name="/head/Conv"),
    ]
    graph = helper.make_graph(
        nodes, "detector",
        [helper.make_tensor_value_info("images", TensorProto.FLOAT, ["batch", 3, "height", "width"])],
        [helper.make_tensor_value_info("boxes", TensorProto.FLOAT, ["batch", 6, None, None])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("provider", present_cpu_providers())
def test_a_plan_placed_at_one_shape_runs_at_others_on_every_provider(provider):
    model = detector()
    reference = ort_session(model)
    session = uhop_onnx.InferenceSession(model, providers=[provider], profile=False,
                                         shapes={"images": (1, 3, 32, 48)})
    assert session.plan.shapes == {"images": [1, 3, 32, 48]}
    assert session.get_providers() == [provider]  # every node stays on it, at every shape below
    assert session.get_inputs()[0].shape == ["batch", 3, "height", "width"]
    for shape in [(1, 3, 32, 48), (2, 3, 40, 24), (1, 3, 17, 9), (1, 3, 32, 48)]:
        x = np.random.default_rng(sum(shape)).standard_normal(shape).astype(np.float32)
        assert_matches(session.run(None, {"images": x}), reference.run(None, {"images": x}))


@pytest.mark.parametrize("provider", [p for p in present_cpu_providers() if p != "kernels"])
def test_the_encoder_runs_whole_at_any_batch_and_sequence(provider):
    """The shipped TorchScript export: integer shape arithmetic over free batch and sequence axes."""
    reference = ort_session(str(EXAMPLE_ENCODER))
    session = uhop_onnx.InferenceSession(str(EXAMPLE_ENCODER), providers=[provider], profile=False,
                                         shapes={"input_ids": (2, 16)})
    assert [s.provider for s in session.plan.stages] == [provider]
    for shape in [(2, 16), (1, 5), (3, 40)]:
        ids = np.random.default_rng(shape[1]).integers(0, encoder.VOCAB, shape)
        assert_matches(session.run(None, {"input_ids": ids}), reference.run(None, {"input_ids": ids}))


@pytest.mark.slow
def test_measured_plan_records_its_shapes_and_runs_at_another(tmp_path):
    model = detector()
    with pytest.raises(InputError, match=r"'images' axis 2 \('height'\), input 'images' axis 3 \('width'\)"):
        uhop_onnx.optimize(model, providers=["ort-cpu"])
    x = np.random.default_rng(1).standard_normal((1, 3, 24, 40)).astype(np.float32)
    plan = uhop_onnx.optimize(model, providers=["openvino", "ort-cpu"], inputs={"images": x}, budget=0)
    assert plan.shapes == {"images": [1, 3, 24, 40]} and plan.placement == "measured"
    plan.save(tmp_path / "plan")
    loaded = uhop_onnx.Plan.load(tmp_path / "plan")
    assert loaded.shapes == plan.shapes and "images: 1x3x24x40" in (tmp_path / "plan" / "report.md").read_text()
    y = np.random.default_rng(2).standard_normal((2, 3, 16, 16)).astype(np.float32)
    expected = ort_session(model).run(None, {"images": y})
    assert_matches(uhop_onnx.InferenceSession(loaded).run(None, {"images": y}), expected)


@pytest.mark.slow
def test_cli_stops_on_free_dims_and_measures_at_the_given_shape(tmp_path):
    from .support import uhop

    onnx.save(detector(), tmp_path / "det.onnx")
    result = uhop("optimize", str(tmp_path / "det.onnx"), "-o", str(tmp_path / "plan"), cwd=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    message = " ".join(result.stderr.split())  # the console wraps long lines
    assert "axis 2 ('height')" in message and "--shape images:1x3xHEIGHTxWIDTH" in message
    assert not (tmp_path / "plan").exists()
    result = uhop("optimize", str(tmp_path / "det.onnx"), "-o", str(tmp_path / "plan"), "--shape", "images:1x3x64x48",
                  "--providers", "openvino,ort-cpu", "--budget", "0", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert json.loads((tmp_path / "plan" / "plan.json").read_text())["shapes"] == {"images": [1, 3, 64, 48]}
    assert "images: 1x3x64x48" in " ".join(uhop("explain", str(tmp_path / "plan")).stdout.split())
    x = np.random.default_rng(0).standard_normal((2, 3, 30, 20)).astype(np.float32)
    np.savez(tmp_path / "in.npz", images=x)
    result = uhop("run", str(tmp_path / "plan"), "--inputs", str(tmp_path / "in.npz"), "-o", str(tmp_path / "out.npz"))
    assert result.returncode == 0, result.stderr
    with np.load(tmp_path / "out.npz") as got:
        assert_matches([got["boxes"]], ort_session(detector()).run(None, {"images": x}))
    result = uhop("optimize", str(tmp_path / "det.onnx"), "-o", str(tmp_path / "bad"), "--shape", "images:1x4x64x48")
    assert result.returncode == 2 and "dimension 1 must be 3" in " ".join(result.stderr.split())


@pytest.mark.skipif("litert" not in present_cpu_providers(), reason="LiteRT is not installed")
def test_a_bundle_built_for_fixed_shapes_records_them_and_names_them_for_any_other(tmp_path):
    model = detector()
    with pytest.raises(InputError, match="--shape images:1x3xHEIGHTxWIDTH"):
        uhop_onnx.export_bundle(model, "arm64", tmp_path / "never", providers=["litert"])
    out = uhop_onnx.export_bundle(model, "arm64", tmp_path / "bundle", providers=["litert"],
                                  shapes={"images": (1, 3, 32, 40)})
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["shapes"] == {"images": [1, 3, 32, 40]}
    [stage] = manifest["stages"]
    assert stage["provider"] == "litert" and stage["built_for"] == {"images": [1, 3, 32, 40]}
    assert uhop_onnx.verify_bundle(out)["ok"]
    bundle = uhop_onnx.load_bundle(out)
    x = np.random.default_rng(3).standard_normal((1, 3, 32, 40)).astype(np.float32)
    assert_matches(bundle.run(None, {"images": x}), ort_session(model).run(None, {"images": x}))
    with pytest.raises(InputError, match=r"built for images 1x3x32x40; export it again with --shape images:1x3x16x16"):
        bundle.run(None, {"images": np.zeros((1, 3, 16, 16), np.float32)})


@pytest.mark.slow
def test_rknn_in_the_simulator_builds_once_per_shape():
    from uhop_onnx.providers.rknn.setup import is_ready
    from uhop_onnx.precision import compare
    from uhop_onnx.providers.rknn.table import FP16_TOLERANCE

    if not is_ready():
        pytest.skip("rknn-toolkit2 environment absent: create it with `uhop-onnx setup rknn`")
    model = detector()
    session = uhop_onnx.InferenceSession(model, providers=[("rknn", {"simulate": True})], profile=False,
                                         shapes={"images": (1, 3, 16, 24)})
    assert session.get_providers() == ["rknn"]
    for shape in [(1, 3, 16, 24), (1, 3, 20, 12)]:
        x = np.random.default_rng(sum(shape)).standard_normal(shape).astype(np.float32)
        [got], [want] = session.run(None, {"images": x}), ort_session(model).run(None, {"images": x})
        assert got.shape == want.shape
        assert compare(got, want, FP16_TOLERANCE)["ok"]


def test_triton_export_says_where_shapes_go(tmp_path):
    from .support import uhop

    onnx.save(detector(), tmp_path / "det.onnx")
    result = uhop("export", str(tmp_path / "det.onnx"), "--format", "triton", "-o", str(tmp_path / "repo"),
                  "--shape", "images:1x3x32x32")
    assert result.returncode == 2 and "optimize MODEL -o PLAN --shape" in result.stderr
    assert not (tmp_path / "repo").exists()
