"""Where a runtime's answer departs from ONNX Runtime's on unusual inputs: out-of-range Gather indices, empty
batches, NaN through max-like ops. Each is made to match (routed, checked or computed here) or pinned as the
README's known limits state it, so that a runtime upgrade that changes it is noticed."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import uhop_onnx
from uhop_onnx.foundation.errors import StageError
from uhop_onnx.providers import create
from uhop_onnx.providers.indices import unchecked

from .conftest import ATOL, RTOL, reference

OPENVINO = create("openvino").present
LITERT = create("litert").present
KERNELS = create("kernels").present
CHECKED = [p for p, here in (("openvino", OPENVINO), ("litert", LITERT)) if here]


def one_node(op: str, inputs: dict, output: list, attrs: dict | None = None, inits=(), first=()) -> onnx.ModelProto:
    """`op` over initializers `first`, graph inputs `{name: (elem type, shape)}` and initializers `inits`, to
    float `y`."""
    values = [helper.make_tensor_value_info(n, t, s) for n, (t, s) in inputs.items()]
    names = [*(i.name for i in first), *inputs, *(i.name for i in inits)]
    node = helper.make_node(op, names, ["y"], name="op", **(attrs or {}))
    graph = helper.make_graph([node], op, values, [helper.make_tensor_value_info("y", TensorProto.FLOAT, output)],
                              [*first, *inits])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def session(model: onnx.ModelProto, provider: str, **options) -> uhop_onnx.InferenceSession:
    return uhop_onnx.InferenceSession(model, providers=[provider], profile=False, **options)


def placed(s: uhop_onnx.InferenceSession) -> list[str]:
    return [stage.provider for stage in s.plan.stages]


# -- Gather indices out of range ---------------------------------------------------------------------------

TABLE = numpy_helper.from_array(np.random.default_rng(0).standard_normal((10, 4)).astype(np.float32), "table")
EMBEDDING = one_node("Gather", {"ids": (TensorProto.INT64, ["n", 3])}, ["n", 3, 4], first=[TABLE])


@pytest.mark.parametrize("provider", CHECKED)
def test_an_embedding_lookup_stays_placed_and_fails_out_of_range_as_onnx_runtime_does(provider):
    """LiteRT would wrap index 10 to 0 and OpenVINO read zeros: the stage checks its index inputs first."""
    s = session(EMBEDDING, provider)
    assert placed(s) == [provider]
    ids = {"ids": np.array([[0, 9, -10], [-1, 3, 5]], np.int64)}
    np.testing.assert_array_equal(s.run(None, ids)[0], reference(EMBEDDING, ids)[0])
    for bad in (10, -11):
        ids = {"ids": np.array([[0, bad, 1]], np.int64)}
        with pytest.raises(Exception, match="out of"):
            reference(EMBEDDING, ids)
        with pytest.raises(StageError, match=f"{min(bad, 0)}\\.\\.{max(bad, 1)}, outside -10\\.\\.9"):
            s.run(None, ids)


@pytest.mark.parametrize("provider", CHECKED)
def test_indices_into_variable_data_are_not_placed_where_they_could_not_be_checked(provider):
    model = one_node("Gather", {"x": (TensorProto.FLOAT, ["n", 4]), "i": (TensorProto.INT64, [3])}, [3, 4])
    s = session(model, provider)
    assert placed(s) == ["ort-cpu"]
    with pytest.raises(StageError, match="out of data bounds"):
        s.run(None, {"x": np.ones((2, 4), np.float32), "i": np.array([0, 2, 1], np.int64)})


def test_only_indices_a_stage_receives_into_constant_data_are_checkable():
    computed = helper.make_graph(
        [helper.make_node("Cast", ["f"], ["i"], name="cast", to=TensorProto.INT64),
         helper.make_node("Gather", ["table", "i"], ["y"], name="gather"),
         helper.make_node("GatherND", ["table", "j"], ["z"], name="nd"),
         helper.make_node("Shape", ["j"], ["dims"], name="shape"),  # the model's own indices: [2, 1]
         helper.make_node("Gather", ["table", "dims"], ["w"], name="by_shape")], "g",
        [helper.make_tensor_value_info("f", TensorProto.FLOAT, [2]),
         helper.make_tensor_value_info("j", TensorProto.INT64, [2, 1])],
        [helper.make_tensor_value_info(name, TensorProto.FLOAT, [2, 4]) for name in "yzw"], [TABLE])
    assert set(unchecked(helper.make_model(computed))) == {"gather", "nd"}
    assert unchecked(EMBEDDING) == {}


# -- Empty batches ---------------------------------------------------------------------------------------------

W = numpy_helper.from_array(np.ones((8, 3), np.float32), "w")
EMPTY = {
    "gemm": one_node("Gemm", {"x": (TensorProto.FLOAT, ["n", 8])}, ["n", 3], inits=[W]),
    "matmul": one_node("MatMul", {"x": (TensorProto.FLOAT, ["n", 2, 8])}, ["n", 2, 3], inits=[W]),
    "relu": one_node("Relu", {"x": (TensorProto.FLOAT, ["n", 4, 8, 8])}, ["n", 4, 8, 8]),
    "maxpool": one_node("MaxPool", {"x": (TensorProto.FLOAT, ["n", 4, 8, 8])}, ["n", 4, 4, 4],
                        {"kernel_shape": [2, 2], "strides": [2, 2]}),
}
EMPTY_INPUT = {"gemm": (0, 8), "matmul": (0, 2, 8), "relu": (0, 4, 8, 8), "maxpool": (0, 4, 8, 8)}
EMPTY_RUN = [(p, k) for p, here in (("litert", LITERT), ("kernels", KERNELS)) if here
             for k in EMPTY if (p, k) != ("kernels", "maxpool")]  # the kernels have no MaxPool


@pytest.mark.parametrize("provider, kind", EMPTY_RUN)
def test_an_empty_batch_gives_empty_outputs_as_onnx_runtime_does(provider, kind):
    s = session(EMPTY[kind], provider)
    assert placed(s) == [provider]
    feeds = {"x": np.zeros(EMPTY_INPUT[kind], np.float32)}
    got, want = s.run(None, feeds)[0], reference(EMPTY[kind], feeds)[0]
    assert got.shape == want.shape and got.dtype == want.dtype
    ones = {"x": np.ones((1, *EMPTY_INPUT[kind][1:]), np.float32)}
    np.testing.assert_allclose(s.run(None, ones)[0], reference(EMPTY[kind], ones)[0], rtol=RTOL, atol=ATOL)


@pytest.mark.skipif(not LITERT, reason="litert is not installed")
def test_litert_refuses_an_empty_batch_whose_outputs_hold_values():
    """A sum over an empty batch is zeros, not empty: LiteRT cannot compute it, so the stage fails (and
    `fallback=True` re-runs it on ONNX Runtime) rather than answer something else."""
    model = one_node("ReduceSum", {"x": (TensorProto.FLOAT, ["n", 4])}, [4], {"keepdims": 0},
                     inits=[numpy_helper.from_array(np.array([0], np.int64), "axes")])
    feeds = {"x": np.zeros((0, 4), np.float32)}
    with pytest.raises(StageError, match="would be \\[4\\]"):
        session(model, "litert").run(None, feeds)
    with pytest.warns(RuntimeWarning, match="re-running it on ort-cpu"):
        np.testing.assert_array_equal(session(model, "litert", fallback=True).run(None, feeds)[0], np.zeros(4))


@pytest.mark.skipif(not OPENVINO, reason="openvino is not installed")
def test_openvino_fails_an_empty_batch_through_maxpool():
    """Pinned: OpenVINO's CPU MaxPool refuses a batch of 0 (an error, never other numbers)."""
    s = session(EMPTY["maxpool"], "openvino")
    assert placed(s) == ["openvino"]
    with pytest.raises(StageError, match="batch_size"):
        s.run(None, {"x": np.zeros((0, 4, 8, 8), np.float32)})


# -- NaN through max-like ops ----------------------------------------------------------------------------------

X = np.random.default_rng(1).standard_normal((1, 4, 8, 8)).astype(np.float32)
X[0, :, ::3, ::3] = np.nan  # the first element of every pooling window, and others
NAN_CASES = {
    "maxpool": EMPTY["maxpool"],
    "softmax": one_node("Softmax", {"x": (TensorProto.FLOAT, ["n", 4, 8, 8])}, ["n", 4, 8, 8], {"axis": -1}),
    "reducemax": one_node("ReduceMax", {"x": (TensorProto.FLOAT, ["n", 4, 8, 8])}, ["n", 4, 1, 1],
                          {"axes": [2, 3]}),
}
NAN_LOST = [(p, k) for p, k, here in (("openvino", "maxpool", OPENVINO), ("openvino", "softmax", OPENVINO),
                                      ("litert", "maxpool", LITERT), ("litert", "reducemax", LITERT)) if here]


@pytest.mark.parametrize("provider, kind", NAN_LOST)
def test_nan_is_lost_through_max_like_ops_on_these_runtimes(provider, kind):
    """Pinned: where ONNX Runtime gives NaN, these give numbers (`README`, Known limits); NaN-free values match."""
    model = NAN_CASES[kind]
    s = session(model, provider)
    assert placed(s) == [provider]
    got, want = s.run(None, {"x": X})[0], reference(model, {"x": X})[0]
    assert np.isnan(want).any() and np.isnan(got).sum() < np.isnan(want).sum()
    clean = np.nan_to_num(X, nan=-5.0)  # no NaN: every value as ONNX Runtime's
    np.testing.assert_allclose(s.run(None, {"x": clean})[0], reference(model, {"x": clean})[0], rtol=RTOL, atol=ATOL)
