"""NaN, infinities and signed zeros through Relu, Clip, fused epilogues and residual sums, on every provider
present, against ONNX Runtime: NaN stays NaN, -0.0 stays -0.0, a Clip without a bound clips an infinity to
the largest float. OpenVINO's CPU plugin maps NaN to the lower bound in Relu and Clip (and in the convolutions
it fuses them into): that is pinned here, and the README's known limits say so."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import uhop_onnx
from uhop_onnx.providers import create

from .conftest import ATOL, RTOL, reference

SPECIAL = np.array([np.nan, -np.nan, np.inf, -np.inf, 0.0, -0.0, -1.5, 2.5, 7.0], np.float32)
LIMIT = np.finfo(np.float32).max


def const(name: str, value) -> onnx.TensorProto:
    return numpy_helper.from_array(np.asarray(value, np.float32), name)


def model(kind: str) -> onnx.ModelProto:
    """One small graph per case; `conv*` and `gemm*` are large enough for whole vector tiles."""
    rng = np.random.default_rng(0)
    shape, inits = [1, 8, 8, 8], []
    if kind == "relu":
        nodes = [helper.make_node("Relu", ["x"], ["y"])]
    elif kind.startswith("clip"):
        bounds = {"clip": ("lo", "hi"), "clip-min": ("lo",), "clip-max": ("", "hi"), "clip-none": ()}[kind]
        inits = [const("lo", 0.0), const("hi", 6.0)]
        nodes = [helper.make_node("Clip", ["x", *bounds], ["y"])]
    elif kind.startswith("conv"):
        k = 3 if kind == "conv3-relu" else 1
        inits = [const("w", rng.standard_normal((32, 8, k, k)) * 0.3), const("b", rng.standard_normal(32))]
        nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[k // 2] * 4),
                 helper.make_node("Relu", ["c"], ["y"])]
        out = [1, 32, 8, 8]
    elif kind == "residual":
        inits = [const("w", rng.standard_normal((8, 8, 1, 1)) * 0.3)]
        nodes = [helper.make_node("Conv", ["x", "w"], ["c"]), helper.make_node("Add", ["c", "x"], ["s"]),
                 helper.make_node("Relu", ["s"], ["y"])]
    elif kind == "gemm-clip":
        shape, out = [32, 48], [32, 64]
        inits = [const("w", rng.standard_normal((48, 64)) * 0.2), const("b", rng.standard_normal(64)),
                 const("lo", 0.0), const("hi", 6.0)]
        nodes = [helper.make_node("Gemm", ["x", "w", "b"], ["g"]), helper.make_node("Clip", ["g", "lo", "hi"], ["y"])]
    if kind not in ("conv1-relu", "conv3-relu", "gemm-clip"):
        out = shape
    graph = helper.make_graph(nodes, kind, [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, out)], initializer=inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def feeds(m: onnx.ModelProto) -> dict[str, np.ndarray]:
    """Normal values with the special ones at every lane position of several vectors."""
    shape = [d.dim_value for d in m.graph.input[0].type.tensor_type.shape.dim]
    x = np.random.default_rng(1).standard_normal(shape).astype(np.float32)
    flat = x.reshape(-1)
    flat[::5][:len(SPECIAL) * 6] = np.tile(SPECIAL, 6)
    return {"x": x}


KINDS = ["relu", "clip", "clip-min", "clip-max", "clip-none", "conv1-relu", "conv3-relu", "residual", "gemm-clip"]
PRESENT = [p for p in ("kernels", "litert", "ort-cpu") if create(p).present]


def run_on(provider: str, kind: str) -> tuple[np.ndarray, np.ndarray]:
    m = model(kind)
    x = feeds(m)
    session = uhop_onnx.InferenceSession(m, providers=[provider], profile=False)
    assert {s.provider for s in session.plan.stages} == {provider}, [s.provider for s in session.plan.stages]
    return session.run(None, x)[0], reference(m, x)[0]


def test_onnx_runtime_keeps_nan_and_signed_zeros():
    x = {"x": np.resize(SPECIAL, (1, 8, 8, 8))}
    got = reference(model("relu"), x)[0].reshape(-1)
    assert np.isnan(got[:2]).all() and got[2] == np.inf and got[3] == 0 and np.signbit(got[5])
    clipped = reference(model("clip-min"), x)[0].reshape(-1)
    assert clipped[2] == LIMIT  # Clip's absent max is the largest float, not infinity


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("provider", PRESENT)
def test_special_values_as_onnx_runtime_computes_them(provider, kind):
    got, want = run_on(provider, kind)
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL, equal_nan=True)
    zeros = (want == 0) & (got == 0)
    assert zeros.any() or kind == "gemm-clip"
    np.testing.assert_array_equal(np.signbit(got[zeros]), np.signbit(want[zeros]))


@pytest.mark.skipif(not create("openvino").present, reason="openvino is not installed")
@pytest.mark.parametrize("kind", ["relu", "clip", "clip-max", "conv1-relu", "residual"])
def test_openvino_maps_nan_to_the_lower_bound_in_relu_and_clip(kind):
    """A third-party difference, pinned: where ONNX Runtime gives NaN, OpenVINO's CPU Relu and Clip give the
    lower bound (0 for Relu; a Clip without a min, the lowest float). Every other value matches."""
    got, want = run_on("openvino", kind)
    nan = np.isnan(want)
    assert nan.any() and not np.isnan(got).any()
    assert (got[nan] == (-LIMIT if kind == "clip-max" else 0)).all()
    np.testing.assert_allclose(got[~nan], want[~nan], rtol=RTOL, atol=ATOL)


@pytest.mark.skipif(not create("kernels").present, reason="no C compiler for the kernels")
@pytest.mark.parametrize("algo", ["gemm", "im2col", "direct", "implicit", "implicit-oc", "bias_act"])
def test_every_isa_this_host_runs_keeps_nan_and_signed_zeros(algo):
    """Each target's library (AVX-512, AVX2, scalar C where this CPU runs them), on each clamp path: the
    GEMM's micro-kernel epilogue, every convolution algorithm, and the bias+residual+clamp pass."""
    from uhop_onnx.custom_ops.spec import Epilogue, LibrarySpec, Schedule, host_targets
    from uhop_onnx.custom_ops.verify import load

    rng = np.random.default_rng(2)
    x = rng.standard_normal((1, 8, 9, 9)).astype(np.float32)
    x.reshape(-1)[::3][:len(SPECIAL) * 8] = np.tile(SPECIAL, 8)
    w = (rng.standard_normal((24, 8, 1, 1)) * 0.3).astype(np.float32)
    a, b = x.reshape(8, -1).T.copy(), w.reshape(24, 8).T.copy()
    for target in host_targets():
        lib = load(LibrarySpec(target))
        mk = lib.spec.micro[0]
        schedule = Schedule(0, mk.mr * 4, 64, mk.nr * 8, "im2col" if algo in ("gemm", "bias_act") else algo, 1)
        for lo, hi in ((0.0, float("inf")), (0.0, 6.0), (-float(LIMIT), float(LIMIT))):
            epilogue = Epilogue(lo, hi)
            if algo == "bias_act":
                got, product = lib.bias_act(x, epilogue=epilogue), x
            elif algo == "gemm":
                got, product = lib.gemm(a, b, schedule, epilogue=epilogue), lib.gemm(a, b, schedule)
            else:
                got, product = lib.conv2d(x, w, schedule, epilogue=epilogue), lib.conv2d(x, w, schedule)
            want = np.where(product < lo, lo, product)  # ONNX Runtime's Clip: NaN and -0.0 kept
            want = np.where(want > hi, hi, want).astype(np.float32)
            assert np.isnan(product).any()
            np.testing.assert_array_equal(np.isnan(got), np.isnan(want), err_msg=f"{target} {algo} {lo} {hi}")
            np.testing.assert_array_equal(got[~np.isnan(got)], want[~np.isnan(want)], err_msg=f"{target} {algo}")
            np.testing.assert_array_equal(np.signbit(got), np.signbit(want), err_msg=f"{target} {algo} signs")
