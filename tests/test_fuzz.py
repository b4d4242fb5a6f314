"""Fuzzing: valid models mutated by hypothesis, byte by byte and node by node.

Each mutant must end in our clear error (a `UhopError` subclass) or in a run that matches ONNX Runtime on
the same loaded model; never another exception, a crash or a hang. When ONNX Runtime refuses the loaded
mutant, we must refuse it too.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import uhop_onnx
from uhop_onnx import UhopError
from uhop_onnx.models import cnn, mlp

from .conftest import assert_matches
from .support import deadline

EXAMPLES = 100  # per test; each example plans, compiles and runs a small model on every provider present
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
SEEDS = {"cnn": lambda: cnn(size=8, channels=(3, 4, 4), classes=3), "mlp": lambda: mlp(batch=2, sizes=(8, 16, 4))}
ELEM_TYPES = [onnx.TensorProto.FLOAT, onnx.TensorProto.INT64, onnx.TensorProto.FLOAT16, onnx.TensorProto.BOOL,
              onnx.TensorProto.STRING, 0, 999]


def outcome(model: onnx.ModelProto | bytes) -> None:
    """Plan, compile and run `model`, and judge the result against ONNX Runtime."""
    with deadline(120):
        try:
            loaded = uhop_onnx.load(model)
            session = uhop_onnx.InferenceSession(loaded, profile=False)
            feeds = {s.name: np.random.default_rng(0).standard_normal(
                [d if isinstance(d, int) else 1 for d in s.shape or []]).astype(s.dtype or np.float32)
                for s in session.get_inputs()}
            results = session.run(None, feeds)
        except UhopError as error:
            assert type(error) is not UhopError and str(error), "a specific, non-empty error"
            event(f"refused: {type(error).__name__}")
            return
        event("ran")
        expected = onnxruntime_run(loaded, feeds)
        assert expected is not None, "ONNX Runtime refuses this model, yet it ran"
        assert_matches(results, expected)


def onnxruntime_run(model: onnx.ModelProto, feeds) -> list[np.ndarray] | None:
    import onnxruntime as ort

    try:
        session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        return session.run(None, feeds)
    except Exception:  # noqa: BLE001 - any refusal counts
        return None


@FUZZ
@given(seed=st.sampled_from(sorted(SEEDS)), data=st.data())
def test_byte_mutations(seed, data):
    """Bytes flipped, cut out or spliced in: mostly unparsable, sometimes a different valid model."""
    raw = bytearray(SEEDS[seed]().SerializeToString())
    for _ in range(data.draw(st.integers(1, 4), label="edits")):
        at = data.draw(st.integers(0, len(raw) - 1), label="at")
        kind = data.draw(st.sampled_from(["flip", "cut", "splice"]), label="kind")
        if kind == "flip":
            raw[at] ^= data.draw(st.integers(1, 255), label="mask")
        elif kind == "cut":
            del raw[at: at + data.draw(st.integers(1, 64), label="length")]
        else:
            raw[at:at] = data.draw(st.binary(min_size=1, max_size=16), label="bytes")
    outcome(bytes(raw))


def _names(model: onnx.ModelProto) -> list[str]:
    g = model.graph
    return sorted({*(i.name for i in g.input), *(t.name for t in g.initializer), *(o for n in g.node for o in n.output)})


@st.composite
def node_mutation(draw, model: onnx.ModelProto) -> str:
    """Apply one structural edit to `model` in place; return what was done."""
    g = model.graph
    k = draw(st.integers(0, len(g.node) - 1), label="node")
    node = g.node[k]
    kind = draw(st.sampled_from(["drop node", "rewire input", "rename output", "op type", "attribute",
                                 "drop initializer", "input type", "input shape", "opset", "duplicate node"]))
    if kind == "drop node":
        del g.node[k]
    elif kind == "rewire input" and node.input:
        node.input[draw(st.integers(0, len(node.input) - 1))] = draw(st.sampled_from(_names(model) + ["", "ghost"]))
    elif kind == "rename output":
        node.output[0] = draw(st.sampled_from(_names(model) + ["fresh"]))
    elif kind == "op type":
        node.op_type = draw(st.sampled_from(["Relu", "Add", "MatMul", "Conv", "Softmax", "Reshape", "Nope", ""]))
    elif kind == "attribute" and node.attribute:
        attribute = node.attribute[draw(st.integers(0, len(node.attribute) - 1))]
        if attribute.type == onnx.AttributeProto.INT:
            attribute.i = draw(st.integers(-(2**40), 2**40))
        elif attribute.type == onnx.AttributeProto.INTS:
            attribute.ints[:] = draw(st.lists(st.integers(-3, 2**33), max_size=6))
        elif attribute.type == onnx.AttributeProto.FLOAT:
            attribute.f = draw(st.floats(allow_nan=True, allow_infinity=True, width=32))
    elif kind == "drop initializer" and g.initializer:
        del g.initializer[draw(st.integers(0, len(g.initializer) - 1))]
    elif kind == "input type":
        g.input[0].type.tensor_type.elem_type = draw(st.sampled_from(ELEM_TYPES))
    elif kind == "input shape":
        dims = g.input[0].type.tensor_type.shape.dim
        dims[draw(st.integers(0, len(dims) - 1))].dim_value = draw(st.sampled_from([0, 1, 2, 7, 2**31, 2**62]))
    elif kind == "opset":
        model.opset_import[0].version = draw(st.sampled_from([1, 6, 7, 11, 13, 17, 21, 28, 29, 10_000]))
    elif kind == "duplicate node":
        g.node.insert(k, node)
    return kind


@FUZZ
@given(seed=st.sampled_from(sorted(SEEDS)), data=st.data())
def test_node_mutations(seed, data):
    """One to three structural edits: nodes dropped or rewired, ops, attributes, types and shapes changed."""
    model = SEEDS[seed]()
    for _ in range(data.draw(st.integers(1, 3), label="edits")):
        data.draw(node_mutation(model), label="edit")
    outcome(model)


@pytest.mark.parametrize("seed", sorted(SEEDS))
def test_seeds_run_unmutated(seed):
    """The fuzz seeds themselves run and match ONNX Runtime (so mutants start from a working model)."""
    model = SEEDS[seed]()
    session = uhop_onnx.InferenceSession(model, profile=False)
    feeds = {s.name: np.ones([d if isinstance(d, int) else 1 for d in s.shape], s.dtype)
             for s in session.get_inputs()}
    assert_matches(session.run(None, feeds), onnxruntime_run(model, feeds))
