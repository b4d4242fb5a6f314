"""LiteRT full-integer int8: stages our converter quantizes from calibration ranges, run by the real LiteRT
interpreter and compared with ONNX Runtime fp32 on inputs that were not in the calibration set."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import uhop_onnx
from uhop_onnx.foundation.errors import CheckError, ProviderError
from uhop_onnx.runtime.measure import Profiler
from uhop_onnx.models import cnn
from uhop_onnx.precision import errors
from uhop_onnx.providers import REGISTRY
from uhop_onnx.providers.litert import LiteRt
from uhop_onnx.providers.litert.converter import convert
from uhop_onnx.providers.litert.int8 import Calibrated, calibration_of, with_calibration
from uhop_onnx.providers.litert.runner import interpreter_module
from uhop_onnx.providers.quantize import Calibration

from .conftest import reference
from .support import Charging, FakeClock, fake_provider

pytestmark = pytest.mark.skipif(not LiteRt().present, reason=LiteRt().availability.reason)


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("UHOP_CACHE_DIR", str(tmp_path / "cache"))


def samples(model: onnx.ModelProto, seeds) -> list[dict[str, np.ndarray]]:
    shape = [d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim]
    return [{"input": np.random.default_rng(seed).standard_normal(shape).astype(np.float32)} for seed in seeds]


def int8(model: onnx.ModelProto, seeds=range(100, 116)) -> LiteRt:
    return LiteRt().at_precision("int8", Calibration(model, samples(model, seeds)))


def cnn_ops() -> onnx.ModelProto:
    """What CNNs are made of: Conv + Clip(0, 6), depthwise Conv + Relu, a residual Add, Mul by a per-channel
    constant, Clip(-1, 3), swish (Sigmoid, Mul), HardSwish, MaxPool and AveragePool joined by Concat, global
    average pool, Reshape, MatMul + Add, Softmax; the logits are an output too."""
    rng = np.random.default_rng(4)

    def weight(name, *shape, scale=None):
        fan_in = int(np.prod(shape[1:])) if len(shape) > 1 else 1
        values = rng.standard_normal(shape) * (scale or fan_in ** -0.5)
        return numpy_helper.from_array(values.astype(np.float32), name)

    def const(name, value):
        return numpy_helper.from_array(np.asarray(value, np.float32), name)

    n = helper.make_node
    nodes = [
        n("Conv", ["input", "w1", "b1"], ["c1"], name="/stem/Conv", pads=[1, 1, 1, 1], kernel_shape=[3, 3]),
        n("Clip", ["c1", "zero", "six"], ["r1"], name="/stem/Clip"),
        n("Conv", ["r1", "wd", "bd"], ["c2"], name="/dw/Conv", pads=[1, 1, 1, 1], kernel_shape=[3, 3], group=8),
        n("Relu", ["c2"], ["r2"], name="/dw/Relu"),
        n("Add", ["r2", "r1"], ["a"], name="/res/Add"),
        n("Mul", ["a", "gamma"], ["m"], name="/scale/Mul"),
        n("Clip", ["m", "minus_one", "three"], ["cl"], name="/clip/Clip"),
        n("Sigmoid", ["cl"], ["sg"], name="/swish/Sigmoid"),
        n("Mul", ["cl", "sg"], ["sw"], name="/swish/Mul"),
        n("HardSwish", ["sw"], ["hs"], name="/hs/HardSwish"),
        n("MaxPool", ["hs"], ["p1"], name="/max/MaxPool", kernel_shape=[2, 2], strides=[2, 2]),
        n("AveragePool", ["hs"], ["p2"], name="/avg/AveragePool", kernel_shape=[2, 2], strides=[2, 2]),
        n("Concat", ["p1", "p2"], ["cat"], name="/cat/Concat", axis=1),
        n("GlobalAveragePool", ["cat"], ["gap"], name="/gap/GlobalAveragePool"),
        n("Reshape", ["gap", "flat"], ["f"], name="/flat/Reshape"),
        n("MatMul", ["f", "wf"], ["mm"], name="/fc/MatMul"),
        n("Add", ["mm", "bf"], ["logits"], name="/fc/Add"),
        n("Softmax", ["logits"], ["probabilities"], name="/softmax/Softmax", axis=-1),
    ]
    initializers = [weight("w1", 8, 3, 3, 3), weight("b1", 8, scale=0.1), weight("wd", 8, 1, 3, 3),
                    weight("bd", 8, scale=0.1), const("zero", 0.0), const("six", 6.0), const("minus_one", -1.0),
                    const("three", 3.0), numpy_helper.from_array(rng.uniform(0.5, 1.5, (1, 8, 1, 1)).astype(np.float32),
                                                                 "gamma"),
                    numpy_helper.from_array(np.array([1, 16], np.int64), "flat"), weight("wf", 16, 10, scale=1.0),
                    weight("bf", 10, scale=0.1)]
    graph = helper.make_graph(nodes, "cnn_ops",
                              [helper.make_tensor_value_info("input", TensorProto.FLOAT, [1, 3, 16, 16])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, 10]),
                               helper.make_tensor_value_info("probabilities", TensorProto.FLOAT, [1, 10])],
                              initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.checker.check_model(model)
    return onnx.shape_inference.infer_shapes(model)


def assert_close_to_fp32(model: onnx.ModelProto, run, seeds=range(8)) -> None:
    """`run(feeds) -> {output: array}` gives cosine >= 0.999 on every output, and the same top-1 on 2-D scores,
    on inputs not in the calibration set."""
    for sample in samples(model, seeds):
        got = run(sample)
        want = dict(zip([o.name for o in model.graph.output], reference(model, sample)))
        for name, e in errors(got, want).items():
            assert e["cosine"] >= 0.999 and e.get("top1_agrees", True), (name, e)


def test_an_int8_cnn_stage_matches_onnx_runtime_fp32_on_other_inputs():
    model = cnn()
    variant = int8(model)
    assert "int8" in LiteRt().precisions() and variant.label == "litert[int8]"
    runner = variant.compile(variant.lower(model))
    assert_close_to_fp32(model, runner.run)
    assert 0 < runner.error < 0.1  # the build check's own figure, against fp32


def test_the_ops_a_cnn_needs_are_int8_inside_and_float_at_the_edges():
    model = cnn_ops()
    variant = int8(model)
    runner = variant.compile(variant.lower(model))
    assert_close_to_fp32(model, runner.run)
    interpreter = interpreter_module().Interpreter(model_content=runner.model)
    edges = [d["name"] for d in (*interpreter.get_input_details(), *interpreter.get_output_details())]
    assert sorted(edges) == ["input", "logits", "probabilities"]
    assert {d["dtype"] for d in (*interpreter.get_input_details(), *interpreter.get_output_details())} == {np.float32}
    inside = [d for d in interpreter.get_tensor_details() if d["name"] not in edges]
    assert {d["dtype"] for d in inside} <= {np.int8, np.int32}  # int32: biases and the shape of Reshape


def test_the_flatbuffer_holds_int8_weights_per_channel_biases_at_their_scale_and_activations_per_tensor():
    model = cnn_ops()
    variant = int8(model)
    blob = convert(model, ranges=calibration_of(variant.lower(model)).ranges)
    interpreter = interpreter_module().Interpreter(model_content=blob)
    tensors = {d["name"]: d for d in interpreter.get_tensor_details()}
    q = {name: d["quantization_parameters"] for name, d in tensors.items()}
    weights = {name: d for name, d in tensors.items() if name.startswith(("w1/", "wd/"))}
    assert len(weights) == 2
    for name, d in weights.items():
        axis = 0 if name.startswith("w1/") else 3  # CONV_2D is OHWI, DEPTHWISE_CONV_2D 1HWO
        scales, zeros = q[name]["scales"], q[name]["zero_points"]
        assert d["dtype"] == np.int8 and q[name]["quantized_dimension"] == axis and len(scales) == 8
        assert (zeros == 0).all() and (scales > 0).all()
        assert np.abs(interpreter.get_tensor(d["index"])).max() == 127  # each channel's largest weight is +-127
    conv_input = q["input/int8"]  # the stem Conv reads the quantized input
    bias = next(name for name in tensors if name.startswith("b1/"))
    assert tensors[bias]["dtype"] == np.int32 and (q[bias]["zero_points"] == 0).all()
    np.testing.assert_allclose(q[bias]["scales"], conv_input["scales"][0] * q[next(iter(weights))]["scales"], rtol=1e-6)
    lo, hi = calibration_of(variant.lower(model)).ranges["c1"]
    for name in ("c1", "a", "m", "cat", "logits/int8"):  # one scale and zero point per activation tensor
        assert tensors[name]["dtype"] == np.int8 and len(q[name]["scales"]) == 1
        assert -128 <= q[name]["zero_points"][0] <= 127
    scale, zero = float(q["c1"]["scales"][0]), int(q["c1"]["zero_points"][0])  # the stem Conv, Clip(0, 6) fused
    assert zero == -128 and (127 - zero) * scale == pytest.approx(min(hi, 6.0), rel=1e-6)  # its range, clipped
    softmax = q["probabilities/int8"]  # SOFTMAX writes LiteRT's fixed int8 scale
    assert softmax["scales"][0] == pytest.approx(1 / 256) and softmax["zero_points"][0] == -128


def zeros_and_steps() -> onnx.ModelProto:
    """What exporters leave in real CNNs: a Conv with all-zero output channels and one of all-zero weights (a
    residual branch whose last BatchNorm starts at gamma 0, folded), an unfolded BatchNormalization, and a
    HardSigmoid squeeze-excitation gate; each is lowered through values ONNX does not name."""
    rng = np.random.default_rng(5)
    w1 = (rng.standard_normal((8, 3, 3, 3)) / 5).astype(np.float32)
    w1[:3] = 0.0
    arrays = {"w1": w1, "b1": np.zeros(8, np.float32), "w2": np.zeros((8, 8, 1, 1), np.float32),
              "b2": np.zeros(8, np.float32), "gamma": rng.uniform(0.5, 2.0, 8).astype(np.float32),
              "beta": rng.standard_normal(8).astype(np.float32), "mean": rng.standard_normal(8).astype(np.float32),
              "var": rng.uniform(0.5, 2.0, 8).astype(np.float32), "wf": rng.standard_normal((10, 8)).astype(np.float32),
              "bf": np.zeros(10, np.float32)}
    n = helper.make_node
    nodes = [n("Conv", ["input", "w1", "b1"], ["c1"], name="/c1/Conv", pads=[1, 1, 1, 1], kernel_shape=[3, 3]),
             n("Relu", ["c1"], ["r1"], name="/c1/Relu"),
             n("Conv", ["r1", "w2", "b2"], ["c2"], name="/c2/Conv", kernel_shape=[1, 1]),
             n("Add", ["c2", "r1"], ["a"], name="/res/Add"),
             n("BatchNormalization", ["a", "gamma", "beta", "mean", "var"], ["bn"], name="/bn/BatchNormalization"),
             n("HardSigmoid", ["bn"], ["gate"], name="/se/HardSigmoid", alpha=1 / 6),
             n("Mul", ["bn", "gate"], ["gated"], name="/se/Mul"),
             n("GlobalAveragePool", ["gated"], ["gap"], name="/gap/GlobalAveragePool"),
             n("Flatten", ["gap"], ["f"], name="/flat/Flatten"),
             n("Gemm", ["f", "wf", "bf"], ["output"], name="/fc/Gemm", transB=1)]
    graph = helper.make_graph(nodes, "zeros_and_steps",
                              [helper.make_tensor_value_info("input", TensorProto.FLOAT, [1, 3, 16, 16])],
                              [helper.make_tensor_value_info("output", TensorProto.FLOAT, [1, 10])],
                              [numpy_helper.from_array(v, k) for k, v in arrays.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    return onnx.shape_inference.infer_shapes(model)


def test_zero_weights_an_unfolded_batchnorm_and_hardsigmoid_run_int8():
    model = zeros_and_steps()
    variant = int8(model)
    runner = variant.compile(variant.lower(model))  # XNNPACK refused zero-weight channels at scale 1 once
    assert_close_to_fp32(model, runner.run)
    interpreter = interpreter_module().Interpreter(model_content=runner.model)
    assert {d["dtype"] for d in interpreter.get_tensor_details()
            if d["name"] not in ("input", "output")} <= {np.int8, np.int32}


def test_concat_reads_inputs_of_other_scales_requantized_to_its_own():
    rng = np.random.default_rng(6)
    n = helper.make_node
    nodes = [n("Conv", ["input", "w"], ["c"], name="/conv/Conv", kernel_shape=[1, 1]),
             n("Relu", ["c"], ["r"], name="/conv/Relu"),
             n("Mul", ["r", "three"], ["m"], name="/triple/Mul"),
             n("Concat", ["r", "m"], ["output"], name="/cat/Concat", axis=1)]
    graph = helper.make_graph(nodes, "cat", [helper.make_tensor_value_info("input", TensorProto.FLOAT, [1, 3, 4, 4])],
                              [helper.make_tensor_value_info("output", TensorProto.FLOAT, [1, 8, 4, 4])],
                              [numpy_helper.from_array(rng.standard_normal((4, 3, 1, 1)).astype(np.float32), "w"),
                               numpy_helper.from_array(np.float32(3.0), "three")])
    model = onnx.shape_inference.infer_shapes(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)],
                                                                 ir_version=8))
    variant = int8(model)
    runner = variant.compile(variant.lower(model))
    assert_close_to_fp32(model, runner.run)
    interpreter = interpreter_module().Interpreter(model_content=runner.model)
    ops = [o["op_name"] for o in interpreter._get_ops_details()]
    assert ops.count("QUANTIZE") == 2  # the input, and r (a third of the range) at the Concat's scale


def with_sqrt(model: onnx.ModelProto) -> onnx.ModelProto:
    """`cnn_ops` with a Sqrt of its probabilities as a third output: LiteRT has no int8 SQRT."""
    model.graph.node.append(helper.make_node("Sqrt", ["probabilities"], ["roots"], name="/tail/Sqrt"))
    model.graph.output.append(helper.make_tensor_value_info("roots", TensorProto.FLOAT, [1, 10]))
    return model


def test_an_op_without_an_int8_kernel_refuses_the_stage_with_its_reason():
    model = with_sqrt(cnn_ops())
    LiteRt().check(model)  # fp32 converts it
    with pytest.raises(ProviderError, match=r"int8.*node '/tail/Sqrt' is lowered to SQRT, which has no int8 kernel"):
        int8(model).check(model)


def test_the_same_calibration_gives_the_same_bytes_and_another_does_not():
    model = cnn()
    first = convert(model, ranges=calibration_of(int8(model).lower(model)).ranges)
    assert convert(model, ranges=calibration_of(int8(model).lower(model)).ranges) == first
    assert convert(model, ranges=calibration_of(int8(model, range(200, 216)).lower(model)).ranges) != first
    assert convert(model) != first


def test_the_build_check_catches_an_int8_stage_that_computes_wrong_values():
    model = cnn()
    variant = int8(model)
    calibrated = calibration_of(variant.lower(model))
    narrow = Calibrated({name: (lo / 50, hi / 50) for name, (lo, hi) in calibrated.ranges.items()}, calibrated.moments)
    with pytest.raises(CheckError, match="differs from ONNX Runtime on output 'output': the error's norm"):
        variant.compile(with_calibration(model, narrow))  # every value saturates


def test_int8_from_an_fp16_variant_quantizes_the_float32_weights():
    model = cnn()
    variant = LiteRt().at_precision("fp16").at_precision("int8", Calibration(model, samples(model, range(100, 104))))
    assert variant.options == {} and variant.label == "litert[int8]"
    assert_close_to_fp32(model, variant.compile(variant.lower(model)).run, seeds=range(2))


def test_an_uncalibrated_variant_says_what_it_needs():
    with pytest.raises(ProviderError, match="calibration"):
        LiteRt().at_precision("int8").lower(cnn())


def test_a_saved_int8_plan_rebuilds_from_the_ranges_it_carries(tmp_path):
    model = cnn()
    plan = uhop_onnx.optimize(model, providers=["litert"], profile=False)
    variant = int8(model)
    for stage in plan.stages:
        stage.model, stage.precision = variant.lower(plan.stage_model(stage)), "int8"
    plan.save(tmp_path / "plan")
    session = uhop_onnx.InferenceSession(tmp_path / "plan")
    assert [s.label for s in session.plan.stages] == ["litert[int8]"]
    assert_close_to_fp32(model, lambda feeds: dict(zip(["output"], session.run(None, feeds))))


def charged_litert(clock: FakeClock):
    """LiteRT, charging the fake clock half as much per node at int8 as at fp32: the search's figures are
    exact, while the gate runs the real stages."""

    class Charged(LiteRt):
        def compile(self, model, *, exclusive=True):
            cost = len(model.graph.node) * (0.5 if self.precision == "int8" else 1.0) / 1e3
            return Charging(super().compile(model, exclusive=exclusive), cost, clock)

    return Charged


def test_optimize_places_int8_litert_stages_that_pass_the_accuracy_gate(monkeypatch):
    clock = FakeClock()
    monkeypatch.setitem(REGISTRY, "litert", charged_litert(clock))
    monkeypatch.setitem(REGISTRY, "ort-cpu", fake_provider("ort-cpu", {}, 100.0, clock))
    model = cnn()
    calibration = {"input": np.concatenate([s["input"] for s in samples(model, range(100, 116))])}
    plan = uhop_onnx.optimize(model, providers=["litert"], precision="int8", tolerance=0.05, calibration=calibration,
                              profiler=Profiler(clock=clock, warmup=1))
    assert {(s.provider, s.precision) for s in plan.stages} == {("litert", "int8")}
    assert plan.tolerance == 0.05 and plan.accuracy["output"]["top1_agrees"]
    assert plan.accuracy["output"]["cosine"] >= 0.999
    session = uhop_onnx.InferenceSession(plan)
    assert_close_to_fp32(model, lambda feeds: dict(zip(["output"], session.run(None, feeds))))


def test_what_int8_refuses_stays_fp32_and_the_rest_is_int8(monkeypatch):
    clock = FakeClock()
    monkeypatch.setitem(REGISTRY, "litert", charged_litert(clock))
    monkeypatch.setitem(REGISTRY, "ort-cpu", fake_provider("ort-cpu", {}, 100.0, clock))
    model = with_sqrt(cnn_ops())
    calibration = {"input": np.concatenate([s["input"] for s in samples(model, range(100, 116))])}
    plan = uhop_onnx.optimize(model, providers=["litert"], precision="int8", tolerance=0.05, calibration=calibration,
                              profiler=Profiler(clock=clock, warmup=1))
    precision = {node: s.precision for s in plan.stages for node in s.nodes}
    assert precision["/tail/Sqrt"] == "fp32" and precision["/stem/Conv"] == "int8"
    assert {s.provider for s in plan.stages} == {"litert"}
