"""Each ONNX op the LiteRT converter lowers, against ONNX Runtime on random inputs, over shapes, attributes
and broadcast patterns. Rank-4 cases also run after a 1x1 convolution, so the op reads an NHWC-held value.

A case the converter declines must say why; a case it accepts must match ONNX Runtime."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

pytest.importorskip("ai_edge_litert")
pytest.importorskip("tflite")

from uhop_onnx.providers.litert import LiteRt
from uhop_onnx.providers.litert.converter import unconvertible

from .conftest import random_feeds, reference
from .support import broadcast_pair

SETTINGS = settings(max_examples=40, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow])
rng = np.random.default_rng(7)


def weights(*shape) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32)


def op_model(op: str, inputs: dict, attrs: dict | None = None, outputs: int = 1, opset: int = 18,
             nhwc: bool = False) -> onnx.ModelProto:
    """One `op` node. `inputs` maps names to a shape (a graph input) or an array (an initializer);
    with `nhwc`, the first input passes through a 1x1 convolution first."""
    nodes, initializers, graph_inputs, names = [], [], [], []
    for name, spec in inputs.items():
        if isinstance(spec, np.ndarray):
            initializers.append(numpy_helper.from_array(spec, name))
        else:
            graph_inputs.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, list(spec)))
        names.append(name)
    if nhwc:
        channels = inputs[names[0]][1]
        initializers.append(numpy_helper.from_array(weights(channels, channels, 1, 1), "mix"))
        nodes.append(helper.make_node("Conv", [names[0], "mix"], ["mixed"], name="mix"))
        names[0] = "mixed"
    out = [f"y{i}" for i in range(outputs)]
    nodes.append(helper.make_node(op, names, out, name="op", **(attrs or {})))
    graph = helper.make_graph(nodes, op, graph_inputs, [helper.make_tensor_value_info(o, TensorProto.FLOAT, None)
                                                        for o in out], initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)
    model = onnx.shape_inference.infer_shapes(model, strict_mode=True)
    onnx.checker.check_model(model)
    return model


def check(model: onnx.ModelProto, *, must_convert: bool = True) -> bool:
    """Convert, run on fresh inputs and compare with ONNX Runtime. Returns whether it converted."""
    declined = unconvertible(model)
    if declined:
        assert all(reason for reason in declined.values())
        assert not must_convert, declined
        return False
    runner = LiteRt(threads=1).compile(model)
    feeds = random_feeds(model, seed=11)
    expected = reference(model, feeds)
    got = runner.run(feeds)
    for output, want in zip(model.graph.output, expected):
        np.testing.assert_allclose(got[output.name], want, rtol=1e-4, atol=1e-5, equal_nan=True)
    return True


@SETTINGS
@given(pair=broadcast_pair(), op=st.sampled_from(["Add", "Sub", "Mul", "Div", "Max", "Min"]),
       constant=st.booleans())
def test_binary_broadcasting(pair, op, constant):
    a, b = pair
    check(op_model(op, {"a": a, "b": weights(*b) + 3 if constant else b}))


@SETTINGS
@given(shape=st.tuples(st.integers(1, 3), st.integers(1, 6), st.integers(1, 5), st.integers(1, 5)),
       op=st.sampled_from(["Add", "Mul", "Sub"]), operand=st.sampled_from(["channel", "scalar", "row", "variable"]))
def test_binary_on_nhwc_values(shape, op, operand):
    """Operands of an NHWC-held value: per-channel and scalar constants, and variables in ONNX layout."""
    other = {"channel": weights(shape[1], 1, 1), "scalar": weights(1), "row": weights(shape[3]),
             "variable": shape[1:]}[operand]
    check(op_model(op, {"x": shape, "b": other}, nhwc=True))


@pytest.mark.parametrize("op, attrs", [
    ("Relu", {}), ("Sigmoid", {}), ("Tanh", {}), ("HardSwish", {}), ("LeakyRelu", {"alpha": 0.2}),
    ("Erf", {}), ("Exp", {}), ("Abs", {}), ("Neg", {}), ("Identity", {}), ("Floor", {}), ("Ceil", {}),
    ("Sin", {}), ("Cos", {}), ("Elu", {}), ("HardSigmoid", {"alpha": 0.3, "beta": 0.4}),
])
def test_unary(op, attrs):
    check(op_model(op, {"x": (2, 3, 4, 5)}, attrs, nhwc=True))


def test_sqrt_and_log_of_positive_values():
    model = op_model("Sqrt", {"x": (3, 7)})
    assert check(model)
    assert check(op_model("Pow", {"x": (3, 7), "e": np.array(2.0, np.float32)}))
    assert check(op_model("Pow", {"x": (3, 7), "e": np.array(3.0, np.float32)}))


@pytest.mark.parametrize("low, high", [(0.0, 6.0), (-1.0, 1.0), (0.0, None), (-0.5, 0.25), (None, 0.3)])
def test_clip(low, high):
    bounds = {"lo": np.array(low if low is not None else -np.inf, np.float32)}
    if high is not None:
        bounds["hi"] = np.array(high, np.float32)
    check(op_model("Clip", {"x": (1, 4, 3, 3), **bounds}, nhwc=True))


@SETTINGS
@given(cin=st.integers(1, 6), cout=st.integers(1, 6), k=st.integers(1, 3), stride=st.integers(1, 2),
       pad=st.integers(0, 2), dilation=st.integers(1, 2), size=st.integers(5, 9),
       grouping=st.sampled_from(["one", "depthwise", "grouped"]), bias=st.booleans())
def test_conv(cin, cout, k, stride, pad, dilation, size, grouping, bias):
    group = {"one": 1, "depthwise": cin, "grouped": 2}[grouping]
    if grouping == "grouped":
        cin, cout = 2 * cin, 2 * cout
    if grouping == "depthwise":
        cout = cin * (1 + cout % 2)
    inputs = {"x": (1, cin, size, size + 1), "w": weights(cout, cin // group, k, k)}
    if bias:
        inputs["b"] = weights(cout)
    check(op_model("Conv", inputs, {"kernel_shape": [k, k], "strides": [stride, stride], "pads": [pad, pad, 0, pad],
                                    "dilations": [dilation, dilation], "group": group}))


@SETTINGS
@given(cin=st.integers(1, 4), cout=st.integers(1, 4), k=st.integers(1, 4), stride=st.integers(1, 2),
       pads=st.tuples(st.integers(0, 2), st.integers(0, 2)), dilation=st.integers(1, 2),
       grouping=st.sampled_from(["one", "depthwise"]), auto_pad=st.sampled_from(["NOTSET", "SAME_UPPER", "VALID"]))
def test_conv_1d(cin, cout, k, stride, pads, dilation, grouping, auto_pad):
    """Whisper's and speech models' front ends: Conv1d as a 2-D convolution of height 1."""
    group = cin if grouping == "depthwise" else 1
    cout = cin * cout if grouping == "depthwise" else cout
    if auto_pad == "SAME_UPPER":
        dilation = 1  # ONNX Runtime has no dilated SAME convolution
    attrs = {"strides": [stride], "dilations": [dilation], "group": group, "auto_pad": auto_pad}
    if auto_pad == "NOTSET":
        attrs["pads"] = list(pads)
    check(op_model("Conv", {"x": (2, cin, 11), "w": weights(cout, cin // group, k), "b": weights(cout)}, attrs))


def test_chained_1d_convolutions_stay_channels_last():
    """conv -> gelu -> conv, as in Whisper's encoder: no TRANSPOSE between the two convolutions."""
    graph = helper.make_graph([
        helper.make_node("Conv", ["x", "w0"], ["a"], name="c0", pads=[1, 1]),
        helper.make_node("Gelu", ["a"], ["b"], name="gelu"),
        helper.make_node("Conv", ["b", "w1"], ["y"], name="c1", pads=[1, 1], strides=[2])], "conv1d",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 6, 8])],
        [numpy_helper.from_array(weights(6, 4, 3), "w0"), numpy_helper.from_array(weights(6, 6, 3), "w1")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)], ir_version=9)
    assert check(model)
    from ai_edge_litert.interpreter import Interpreter
    from uhop_onnx.providers.litert.converter import convert

    ops = [o["op_name"] for o in Interpreter(model_content=convert(model))._get_ops_details()]
    assert ops.count("CONV_2D") == 2 and ops.count("TRANSPOSE") == 2, ops  # one in, one out


@pytest.mark.parametrize("auto_pad", ["SAME_UPPER", "SAME_LOWER", "VALID"])
def test_conv_auto_pad(auto_pad):
    check(op_model("Conv", {"x": (1, 3, 7, 8), "w": weights(4, 3, 3, 3)}, {"auto_pad": auto_pad, "strides": [2, 2]}))


@SETTINGS
@given(k=st.integers(1, 4), stride=st.integers(1, 3), pad=st.integers(0, 1), output_padding=st.integers(0, 1),
       bias=st.booleans())
def test_conv_transpose(k, stride, pad, output_padding, bias):
    output_padding = min(output_padding, stride - 1, pad)
    inputs = {"x": (1, 3, 4, 5), "w": weights(3, 2, k, k)}
    if bias:
        inputs["b"] = weights(2)
    check(op_model("ConvTranspose", inputs, {"kernel_shape": [k, k], "strides": [stride, stride],
                                             "pads": [pad, pad, pad, pad], "output_padding": [output_padding] * 2}))


@SETTINGS
@given(op=st.sampled_from(["MaxPool", "AveragePool"]), k=st.integers(1, 3), stride=st.integers(1, 2),
       pad=st.integers(0, 1), ceil=st.integers(0, 1), include=st.integers(0, 1), size=st.integers(4, 7))
def test_pools_convert_exactly_or_decline(op, k, stride, pad, ceil, include, size):
    attrs = {"kernel_shape": [k, k], "strides": [stride, stride], "pads": [pad] * 4, "ceil_mode": ceil}
    if op == "AveragePool":
        attrs["count_include_pad"] = include
    if pad >= k:
        return
    check(op_model(op, {"x": (1, 3, size, size)}, attrs, nhwc=True), must_convert=op == "MaxPool")


@pytest.mark.parametrize("op", ["GlobalAveragePool", "GlobalMaxPool"])
def test_global_pools(op):
    check(op_model(op, {"x": (2, 5, 4, 3)}, nhwc=True))


def test_batch_normalization():
    c = 4
    stats = {"s": weights(c), "b": weights(c), "m": weights(c), "v": np.abs(weights(c)) + 0.5}
    check(op_model("BatchNormalization", {"x": (2, c, 3, 3), **stats}, {"epsilon": 1e-3}, nhwc=True))


@SETTINGS
@given(m=st.integers(1, 5), k=st.integers(1, 6), n=st.integers(1, 6), trans_a=st.integers(0, 1),
       trans_b=st.integers(0, 1), constant_b=st.booleans(), c_kind=st.sampled_from(["none", "row", "full", "scalar"]),
       alpha=st.sampled_from([1.0, 0.5]), beta=st.sampled_from([1.0, 2.0]))
def test_gemm(m, k, n, trans_a, trans_b, constant_b, c_kind, alpha, beta):
    b_shape = (n, k) if trans_b else (k, n)
    inputs = {"a": (k, m) if trans_a else (m, k), "b": weights(*b_shape) if constant_b else b_shape}
    if c_kind != "none":
        inputs["c"] = weights(*{"row": (n,), "full": (m, n), "scalar": (1,)}[c_kind])
    attrs = {"transA": trans_a, "transB": trans_b, "alpha": alpha, "beta": beta}
    check(op_model("Gemm", inputs, attrs), must_convert=constant_b or alpha == 1.0)


@SETTINGS
@given(batch=st.lists(st.integers(1, 3), max_size=2).map(tuple), m=st.integers(1, 4), k=st.integers(1, 5),
       n=st.integers(1, 5), constant_b=st.booleans(), broadcast_b=st.booleans())
def test_matmul(batch, m, k, n, constant_b, broadcast_b):
    b_shape = (k, n) if broadcast_b or constant_b else (*batch, k, n)
    check(op_model("MatMul", {"a": (*batch, m, k), "b": weights(*b_shape) if constant_b else b_shape}))


def test_matmul_reads_a_transposed_operand_as_held():
    """q @ k^T with k^T from a Transpose: BATCH_MATMUL with adj_y, no TRANSPOSE op."""
    graph = helper.make_graph(
        [helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 2, 1], name="t"),
         helper.make_node("MatMul", ["q", "kt"], ["y"], name="mm")], "attention",
        [helper.make_tensor_value_info("q", TensorProto.FLOAT, [2, 4, 8]),
         helper.make_tensor_value_info("k", TensorProto.FLOAT, [2, 6, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4, 6])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    assert check(model)
    from ai_edge_litert.interpreter import Interpreter
    from uhop_onnx.providers.litert.converter import convert

    ops = [o["op_name"] for o in Interpreter(model_content=convert(model))._get_ops_details()]
    assert ops == ["BATCH_MATMUL"]


@pytest.mark.parametrize("op, attrs, extra", [
    ("Reshape", {}, {"s": np.array([2, -1, 4], np.int64)}),
    ("Flatten", {"axis": 2}, {}),
    ("Squeeze", {}, {"axes": np.array([0], np.int64)}),
    ("Unsqueeze", {}, {"axes": np.array([1, -1], np.int64)}),
    ("Transpose", {"perm": [0, 3, 1, 2]}, {}),
    ("Transpose", {"perm": [2, 0, 3, 1]}, {}),
    ("Softmax", {"axis": 1}, {}),
    ("Softmax", {"axis": -1}, {}),
    ("Softmax", {"axis": 2}, {}),
    ("LogSoftmax", {"axis": 1}, {}),
    ("PRelu", {}, {"slope": weights(4, 1, 1)}),
    ("Expand", {}, {"shape": np.array([2, 1, 1, 1, 1], np.int64)}),
    ("Tile", {}, {"repeats": np.array([2, 1, 3, 1], np.int64)}),
    ("ReduceMean", {"keepdims": 0}, {"axes": np.array([1], np.int64)}),
    ("ReduceSum", {"keepdims": 1}, {"axes": np.array([2, 3], np.int64)}),
    ("ReduceMax", {"keepdims": 0}, {"axes": np.array([0, -1], np.int64)}),
    ("Gather", {"axis": 1}, {"i": np.array([[3, 0], [-1, 2]], np.int64)}),
    ("Gather", {"axis": 3}, {"i": np.array(1, np.int64)}),
    ("Pad", {"mode": "constant"}, {"p": np.array([0, 1, 2, 0, 0, 0, 1, 3], np.int64)}),
    ("Pad", {"mode": "constant"}, {"p": np.array([0, 0, 1, 1, 0, 0, 1, 1], np.int64), "v": np.array(1.5, np.float32)}),
    ("Pad", {"mode": "reflect"}, {"p": np.array([0, 0, 2, 1, 0, 0, 1, 2], np.int64)}),
], ids=lambda v: str(v)[:30] if not isinstance(v, dict) else None)
def test_layout_sensitive_ops_after_nhwc(op, attrs, extra):
    check(op_model(op, {"x": (1, 4, 5, 6), **extra}, attrs, nhwc=True))


@SETTINGS
@given(axis=st.integers(-4, 3), pieces=st.lists(st.integers(1, 3), min_size=1, max_size=3), nhwc=st.booleans())
def test_concat_and_split(axis, pieces, nhwc):
    base = [1, 3, 4, 5]
    shapes_ = [tuple(p if i == axis % 4 else d for i, d in enumerate(base)) for p in pieces]
    inputs = {f"x{i}": s for i, s in enumerate(shapes_)}
    if nhwc and axis % 4 == 1:  # the 1x1 convolution keeps the channel count: keep the first piece's
        return
    check(op_model("Concat", inputs, {"axis": axis}, nhwc=nhwc))
    total = tuple(sum(pieces) if i == axis % 4 else d for i, d in enumerate(base))
    check(op_model("Split", {"x": total, "s": np.array(pieces, np.int64)}, {"axis": axis}, outputs=len(pieces),
                   nhwc=nhwc))


@SETTINGS
@given(data=st.data(), nhwc=st.booleans())
def test_slice(data, nhwc):
    shape = (1, 4, 6, 7)
    axes = data.draw(st.lists(st.integers(0, 3), min_size=1, max_size=3, unique=True))
    starts, ends, steps = [], [], []
    for axis in axes:
        step = data.draw(st.sampled_from([1, 2, -1, -2]))
        start = data.draw(st.integers(-shape[axis], shape[axis] - 1))
        end = data.draw(st.sampled_from([-shape[axis] - 5, -1, 0, 2, shape[axis], 2**62]))
        starts.append(start), ends.append(end), steps.append(step)
    length = len(range(*slice(starts[0], ends[0], steps[0]).indices(shape[axes[0]])))
    inputs = {"x": shape, "st": np.array(starts, np.int64), "en": np.array(ends, np.int64),
              "ax": np.array(axes, np.int64), "sp": np.array(steps, np.int64)}
    try:
        model = op_model("Slice", inputs, nhwc=nhwc)
    except onnx.shape_inference.InferenceError:
        return
    check(model, must_convert=length > 0 and all(
        len(range(*slice(s, e, p).indices(shape[a]))) for s, e, a, p in zip(starts, ends, axes, steps)))


@pytest.mark.parametrize("mode, coordinates, nearest, scale", [
    ("nearest", "asymmetric", "floor", 2.0),
    ("nearest", "half_pixel", "round_prefer_floor", 2.0),
    ("nearest", "tf_half_pixel_for_nn", "floor", 3.0),
    ("nearest", "asymmetric", "floor", 0.5),
    ("linear", "half_pixel", None, 2.0),
    ("linear", "half_pixel", None, 0.5),
    ("linear", "pytorch_half_pixel", None, 1.5),
    ("linear", "align_corners", None, 2.0),
    ("linear", "asymmetric", None, 3.0),
])
def test_resize(mode, coordinates, nearest, scale):
    attrs = {"mode": mode, "coordinate_transformation_mode": coordinates}
    if nearest:
        attrs["nearest_mode"] = nearest
    inputs = {"x": (1, 3, 4, 6), "roi": np.zeros(0, np.float32), "scales": np.array([1, 1, scale, scale], np.float32)}
    check(op_model("Resize", inputs, attrs, nhwc=True))


def test_resize_modes_litert_cannot_match_are_declined():
    inputs = {"x": (1, 3, 4, 6), "roi": np.zeros(0, np.float32), "scales": np.array([1, 1, 0.5, 0.5], np.float32)}
    model = op_model("Resize", inputs, {"mode": "nearest", "nearest_mode": "round_prefer_floor"})
    assert "round_prefer_floor" in unconvertible(model)["op"]
    assert "cubic" in unconvertible(op_model("Resize", inputs, {"mode": "cubic"}))["op"]


@pytest.mark.parametrize("policy, sizes, exact", [("stretch", [5, 9], True), ("not_smaller", [7, 9], False),
                                                  ("not_larger", [7, 9], True), ("not_smaller", [8, 12], True)])
def test_resize_by_sizes_keeping_the_aspect_ratio(policy, sizes, exact):
    """A kept aspect ratio maps coordinates by one scale (7/4 for H and W of a 4x6 input resized to at least
    7x9, giving 7x11), which LiteRT matches only where it is each axis's output/input ratio."""
    inputs = {"x": (1, 2, 4, 6), "roi": np.zeros(0, np.float32), "scales": np.zeros(0, np.float32),
              "sizes": np.array(sizes, np.int64)}
    model = op_model("Resize", inputs, {"axes": [2, 3], "keep_aspect_ratio_policy": policy, "mode": "linear"},
                     opset=19)
    assert check(model, must_convert=False) == exact


@pytest.mark.parametrize("axis, bias", [(-1, True), (-2, True), (1, False)])
def test_layer_normalization(axis, bias):
    shape = (2, 3, 4, 5)
    inputs = {"x": shape, "scale": weights(*shape[axis:])}
    if bias:
        inputs["bias"] = weights(*shape[axis:])
    check(op_model("LayerNormalization", inputs, {"axis": axis, "epsilon": 1e-5}, nhwc=True))


@pytest.mark.parametrize("shape", [(2, 3, 7), (1, 4, 5, 6), (2, 2, 3, 4, 2)])
def test_instance_normalization(shape):
    """wav2vec2's feature extractor (rank 3), and 2-D and 3-D images."""
    channels = shape[1]
    inputs = {"x": shape, "scale": weights(channels), "bias": weights(channels)}
    check(op_model("InstanceNormalization", inputs, {"epsilon": 1e-5}, nhwc=len(shape) == 4))


def test_reciprocal():
    """T5's RMS norm as the dynamo exporter writes it: 1 / sqrt(mean(x^2) + eps)."""
    check(op_model("Reciprocal", {"x": (3, 5)}))


def test_gelu_op_and_exported_gelu_pattern():
    check(op_model("Gelu", {"x": (2, 8)}, opset=20))
    check(op_model("Gelu", {"x": (2, 8)}, {"approximate": "tanh"}, opset=20))
