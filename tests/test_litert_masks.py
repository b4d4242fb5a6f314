"""The LiteRT converter's boolean and integer ops (comparisons, logic, Where, Cast, the data movement of masks,
GatherElements/GatherND, CumSum), each against ONNX Runtime over broadcast patterns and edge values: NaN,
infinities, signed zeros, equal operands, negative indices. A case the converter declines must say why, and
the capability table must say yes wherever the converter converts."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

pytest.importorskip("ai_edge_litert")
pytest.importorskip("tflite")

from uhop_onnx.foundation.graph import Graph
from uhop_onnx.providers.capability import check as table_check
from uhop_onnx.providers.litert import LiteRt
from uhop_onnx.providers.litert.converter import unconvertible
from uhop_onnx.providers.litert.table import LITERT_TABLE

from .conftest import reference
from .support import broadcast_pair

SETTINGS = settings(max_examples=25, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
TYPES = {"float": TensorProto.FLOAT, "int32": TensorProto.INT32, "int64": TensorProto.INT64, "bool": TensorProto.BOOL}
EDGES = np.array([0.0, -0.0, 1.0, -1.0, 2.5, np.nan, np.inf, -np.inf], np.float32)


def values(dtype: str, shape, rng: np.random.Generator) -> np.ndarray:
    """Values with repeats across operands (so comparisons meet equal ones), and the float edge values."""
    if dtype == "bool":
        return rng.integers(0, 2, shape).astype(bool)
    if dtype == "float":
        return rng.choice(EDGES, shape)
    return rng.integers(-3, 4, shape).astype(np.dtype(dtype))


def model_of(op: str, inputs: dict, attrs: dict | None = None, outputs: int = 1, opset: int = 18) -> onnx.ModelProto:
    """One `op` node. `inputs` maps names to `(dtype, shape)` (a graph input) or an array (an initializer)."""
    graph_inputs, initializers = [], []
    for name, spec in inputs.items():
        if isinstance(spec, np.ndarray):
            initializers.append(numpy_helper.from_array(spec, name))
        else:
            graph_inputs.append(helper.make_tensor_value_info(name, TYPES[spec[0]], list(spec[1])))
    out = [f"y{i}" for i in range(outputs)]
    graph = helper.make_graph([helper.make_node(op, list(inputs), out, name="op", **(attrs or {}))], op, graph_inputs,
                              [helper.make_tensor_value_info(o, TensorProto.UNDEFINED, None) for o in out],
                              initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)
    model = onnx.shape_inference.infer_shapes(model, strict_mode=True)
    onnx.checker.check_model(model)
    return model


def check(model: onnx.ModelProto, *, must_convert: bool = True, seed: int = 3) -> bool:
    """Convert, run on edge-value inputs and compare with ONNX Runtime exactly (floats within fp32
    tolerance). Returns whether it converted; the table must accept every node the converter converts."""
    declined = unconvertible(model)
    if declined:
        assert all(declined.values())
        assert not must_convert, declined
        return False
    view = Graph.from_model(model)
    assert all(table_check(LITERT_TABLE, view.node(n.name), view) for n in model.graph.node)
    runner = LiteRt(threads=1).compile(model)
    rng = np.random.default_rng(seed)
    feeds = {}
    for value in model.graph.input:
        dims = [d.dim_value for d in value.type.tensor_type.shape.dim]
        kind = {v: k for k, v in TYPES.items()}[value.type.tensor_type.elem_type]
        feeds[value.name] = values(kind, dims, rng)
    got = runner.run(feeds)
    for output, want in zip(model.graph.output, reference(model, feeds)):
        value = got[output.name]
        assert value.dtype == want.dtype and value.shape == want.shape, (value.dtype, value.shape, want.shape)
        if want.dtype.kind == "f":
            np.testing.assert_allclose(value, want, rtol=1e-4, atol=1e-5, equal_nan=True)
        else:
            np.testing.assert_array_equal(value, want)
    return True


def declined_because(model: onnx.ModelProto, *words: str) -> None:
    [reason] = unconvertible(model).values()
    assert all(w in reason for w in words), reason


def operand(dtype: str, shape, constant: bool, rng=np.random.default_rng(5)):
    return values(dtype, shape, rng) if constant else (dtype, shape)


@SETTINGS
@given(pair=broadcast_pair(), op=st.sampled_from(["Equal", "Greater", "GreaterOrEqual", "Less", "LessOrEqual"]),
       dtype=st.sampled_from(["float", "int32", "int64"]), constant=st.booleans())
def test_comparisons_broadcast(pair, op, dtype, constant):
    a, b = pair
    check(model_of(op, {"a": (dtype, a), "b": operand(dtype, b, constant)}))


@SETTINGS
@given(pair=broadcast_pair(), op=st.sampled_from(["And", "Or", "Xor", "Equal"]), constant=st.booleans())
def test_logic_of_booleans_broadcasts(pair, op, constant):
    a, b = pair
    check(model_of(op, {"a": ("bool", a), "b": operand("bool", b, constant)}))


def test_not_and_is_nan():
    check(model_of("Not", {"x": ("bool", (2, 3, 4))}))
    check(model_of("IsNaN", {"x": ("float", (3, 5, 7))}))


@SETTINGS
@given(pair=broadcast_pair(), order=st.permutations([0, 1, 2]), dtype=st.sampled_from(["float", "int64"]),
       constant=st.sampled_from(["none", "condition", "branches"]))
def test_where_broadcasts_its_three_operands(pair, order, dtype, constant):
    """A variable or constant condition (a causal mask), variable or constant branches, in any broadcast."""
    cond, x, y = ([*pair, tuple(1 for _ in pair[1])][k] for k in order)
    check(model_of("Where", {"c": operand("bool", cond, constant == "condition"),
                             "x": operand(dtype, x, constant == "branches"),
                             "y": operand(dtype, y, constant == "branches")}))


def test_an_attention_mask_with_infinities():
    """The pattern of PyTorch's sdpa export: a boolean mask selects 0 or -inf."""
    check(model_of("Where", {"m": ("bool", (2, 1, 1, 4)), "zero": np.array([0.0], np.float32),
                             "minus": np.array([-np.inf], np.float32)}))


@pytest.mark.parametrize("op, dtype", [("Less", "float"), ("Equal", "int64"), ("And", "bool"), ("Xor", "bool")])
def test_broadcasts_past_rank_four(op, dtype):
    a, b = (2, 1, 3, 1, 2, 1), (1, 2, 1, 3, 2, 3)
    check(model_of(op, {"a": (dtype, a[:5]), "b": (dtype, b[:5])}))
    check(model_of(op, {"a": (dtype, a), "b": (dtype, b)}))
    check(model_of("Where", {"c": ("bool", a), "x": ("float", b), "y": np.array(1.0, np.float32)}))


@pytest.mark.parametrize("source", ["float", "int32", "int64", "bool"])
@pytest.mark.parametrize("target", ["float", "int32", "int64", "bool"])
def test_cast_between_numbers_and_booleans(source, target):
    """Non-zero (and NaN) is true, true is 1; float to integer is declined (C++ leaves out-of-range values
    undefined where ONNX Runtime saturates or wraps)."""
    model = model_of("Cast", {"x": (source, (4, 6))}, {"to": TYPES[target]})
    if source == "float" and target in ("int32", "int64"):
        declined_because(model, "float32 to integers")
    else:
        check(model)


BOOL_MOVES = [
    ("Reshape", {"s": np.array([3, -1], np.int64)}, {}),
    ("Flatten", {}, {"axis": 2}),
    ("Transpose", {}, {"perm": [2, 0, 1]}),
    ("Squeeze", {"a": np.array([1], np.int64)}, {}),
    ("Unsqueeze", {"a": np.array([0, -1], np.int64)}, {}),
    ("Expand", {"s": np.array([2, 3, 4, 5], np.int64)}, {}),
    ("Tile", {"r": np.array([2, 1, 3], np.int64)}, {}),
    ("Slice", {"b": np.array([1], np.int64), "e": np.array([-1], np.int64), "a": np.array([2], np.int64)}, {}),
    ("Gather", {"i": np.array([[0, 2], [-1, 1]], np.int64)}, {"axis": 0}),
    ("Identity", {}, {}),
]


@pytest.mark.parametrize("op, constants, attrs", BOOL_MOVES, ids=[m[0] for m in BOOL_MOVES])
def test_masks_move_as_booleans(op, constants, attrs):
    x = (3, 1, 5) if op in ("Squeeze", "Expand") else (3, 2, 5)
    check(model_of(op, {"x": ("bool", x), **constants}, attrs))


def test_masks_concatenate_but_do_not_split():
    check(model_of("Concat", {"a": ("bool", (2, 3)), "b": ("bool", (2, 1))}, {"axis": 1}))
    split = model_of("Split", {"x": ("bool", (2, 4)), "s": np.array([1, 3], np.int64)}, {"axis": 1}, outputs=2)
    declined_because(split, "SPLIT_V", "bool")
    view = Graph.from_model(split)
    assert "bool" in table_check(LITERT_TABLE, view.node("op"), view).reason


@pytest.mark.parametrize("dtype", ["float", "int64", "bool"])
@pytest.mark.parametrize("axis", [0, 1, -1])
def test_gather_elements_at_constant_and_variable_indices(dtype, axis):
    """Negative indices count from the end; variable ones too (wrapped, as Gather's are)."""
    rng = np.random.default_rng(2)
    shape, index_shape = (4, 5, 6), [4, 5, 6]
    index_shape[axis] = 2
    bound = shape[axis]
    indices = rng.integers(-bound, bound, index_shape).astype(np.int64)
    check(model_of("GatherElements", {"x": (dtype, shape), "i": indices}, {"axis": axis}))
    variable = model_of("GatherElements", {"x": (dtype, shape), "i": ("int64", index_shape)}, {"axis": axis})
    check(variable)  # random indices in -3..3: within every axis here


def test_gather_elements_with_a_smaller_index_grid():
    """Indices may be smaller than the data along the other axes too (RoBERTa's token types: [1, 8] from
    [1, 512])."""
    check(model_of("GatherElements", {"x": ("int64", (2, 9)), "i": np.array([[4, 0, -1]], np.int64)}, {"axis": 1}))


def test_constants_the_reference_evaluator_cannot_fold_are_computed_in_the_stage():
    """ONNX's reference GatherElements fails past 64 entries along its axis (BERT's token types: [1, 512]):
    the converter lowers the node instead of folding it."""
    data, indices = np.arange(100, dtype=np.int64).reshape(1, 100), np.array([[99, 0, 5, -1]], np.int64)
    nodes = [helper.make_node("GatherElements", ["data", "i"], ["picked"], name="gather", axis=1),
             helper.make_node("Add", ["picked", "x"], ["y"], name="add")]
    graph = helper.make_graph(nodes, "fold", [helper.make_tensor_value_info("x", TensorProto.INT64, [1, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.INT64, [1, 4])],
                              [numpy_helper.from_array(data, "data"), numpy_helper.from_array(indices, "i")])
    assert check(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8))


@pytest.mark.parametrize("indices", [
    np.array([[0, 1], [2, -1], [-3, 0]], np.int64),  # whole slices of the last axis
    np.array([[1, 2, 3]], np.int64),  # one element
    np.array([[[1], [0]], [[-1], [2]]], np.int64),  # rows, over a grid of indices
], ids=["pairs", "element", "rows"])
@pytest.mark.parametrize("dtype", ["float", "bool"])
def test_gather_nd_at_constant_indices(indices, dtype):
    check(model_of("GatherND", {"x": (dtype, (3, 4, 5)), "i": indices}))


def test_gather_nd_declines_what_it_cannot_express():
    declined_because(model_of("GatherND", {"x": ("float", (3, 4)), "i": ("int64", (2, 1))}), "must be constant")
    declined_because(model_of("GatherND", {"x": ("float", (2, 4)), "i": np.zeros((2, 1), np.int64)},
                              {"batch_dims": 1}), "batch_dims=1")
    declined_because(model_of("GatherElements", {"x": ("float", (2, 4)), "i": np.array([[0, 4]], np.int64)},
                              {"axis": 1}), "outside")


@pytest.mark.parametrize("dtype", ["float", "int32", "int64"])
@pytest.mark.parametrize("axis, exclusive, reverse", [(1, 0, 0), (-1, 1, 0), (0, 0, 1), (2, 1, 1)])
def test_cumsum(dtype, axis, exclusive, reverse):
    """RoBERTa's position ids: cumsum of the non-padding mask."""
    model = model_of("CumSum", {"x": (dtype, (2, 3, 4)), "axis": np.array(axis, np.int64)},
                     {"exclusive": exclusive, "reverse": reverse})
    check(model)


def test_a_padding_mask_becomes_position_ids():
    """input_ids != pad -> int32 -> cumsum * mask + pad, as RoBERTa exports it, in one stage."""
    pad = np.array(1, np.int64)
    nodes = [helper.make_node("Equal", ["ids", "pad"], ["is_pad"], name="eq"),
             helper.make_node("Not", ["is_pad"], ["keep"], name="not"),
             helper.make_node("Cast", ["keep"], ["mask"], name="cast", to=TensorProto.INT32),
             helper.make_node("CumSum", ["mask", "axis"], ["running"], name="cumsum"),
             helper.make_node("Mul", ["running", "mask"], ["counted"], name="mul"),
             helper.make_node("Cast", ["counted"], ["wide"], name="wide", to=TensorProto.INT64),
             helper.make_node("Add", ["wide", "pad"], ["y"], name="add")]
    graph = helper.make_graph(nodes, "positions", [helper.make_tensor_value_info("ids", TensorProto.INT64, [2, 7])],
                              [helper.make_tensor_value_info("y", TensorProto.INT64, [2, 7])],
                              [numpy_helper.from_array(pad, "pad"), numpy_helper.from_array(np.array(1, np.int64),
                                                                                            "axis")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    assert check(model)
