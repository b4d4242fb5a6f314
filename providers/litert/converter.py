"""ONNX stage -> `.tflite` bytes, written directly with the `tflite` flatbuffer builders.

`convert` lowers every node (see `ops`), full-integer int8 when given calibration ranges (see `int8`), or
raises a `ProviderError` naming the node it cannot express;
`unconvertible` answers, node by node, which ones it cannot express and why, whatever stage each ends up in.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np
import onnx
from onnx import helper, numpy_helper

from uhop_onnx.foundation.errors import ProviderError
from uhop_onnx.foundation.inference import inferred

from .int8 import full_integer
from .lowering import Lowering, Node, Unsupported, identity
from .ops import LOWERINGS

SHAPE_ONLY = {"Reshape": 1, "Expand": 1, "Tile": 1, "Split": 1, "ConstantOfShape": 0, "Resize": 3}  # op -> input
RANDOM = frozenset({"RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike", "Bernoulli",
                    "Multinomial"})


def convert(model: onnx.ModelProto, fp16: bool = False, ranges: Mapping[str, Sequence[float]] | None = None, *,
            prepare: bool = True) -> bytes:
    """The stage as a `.tflite` model whose inputs and outputs are the stage's, by name, in ONNX layout;
    full-integer int8 inside, from the calibration `ranges` of its values, when they are given. With `prepare`
    False, `model` is as `prepared` gave it (not copied again)."""
    cx, _ = _lower(prepared(model) if prepare else model, fp16, strict=True)
    try:
        _declare_outputs(cx)
        if ranges is not None:
            full_integer(cx.writer, ranges)
    except Unsupported as why:
        raise ProviderError(f"litert cannot convert {model.graph.name or 'the stage'}"
                            f"{' to int8' if ranges is not None else ''}: {why}") from None
    return cx.writer.serialize()


def unconvertible(model: onnx.ModelProto) -> dict[str, str]:
    """Node name -> why the converter cannot express it, for every node it cannot.

    Each node is judged on what it gets from outside any stage: initializers are constants, but what other
    nodes compute (shape arithmetic too) may come from another provider, as a variable.
    """
    return _lower(prepared(model), fp16=False, strict=False)[1]


def prepared(model: onnx.ModelProto) -> onnx.ModelProto:
    """`model` with shapes inferred, and the inputs that only restate a static output shape (Reshape's
    shape, Expand's, Tile's repeats, Split's sizes, ConstantOfShape's shape, Resize's sizes) replaced by
    the constant the static shapes give. It computes what `model` does on every input its static shapes
    admit; a stage cut from a model may get such a value from another provider, as a variable."""
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    model = inferred(copy, data_prop=False)
    known = {v.name: tuple(d.dim_value if d.HasField("dim_value") else 0 for d in v.type.tensor_type.shape.dim)
             for v in (*model.graph.input, *model.graph.value_info, *model.graph.output)
             if v.type.tensor_type.HasField("shape")}
    known.update({t.name: tuple(t.dims) for t in model.graph.initializer})
    fixed = {t.name for t in model.graph.initializer}
    for node in model.graph.node:
        position, value = _implied(node, known)
        if value is None or node.input[position] in fixed:
            continue
        name = f"{node.input[position]}/static/{len(model.graph.initializer)}"
        model.graph.initializer.append(numpy_helper.from_array(value, name))
        node.input[position] = name
    return model


def _implied(node: onnx.NodeProto, known: dict[str, tuple[int, ...]]) -> tuple[int, np.ndarray | None]:
    """The position of `node`'s input that only restates its static output shapes, and the value they give it
    (None when there is none, or the shapes are not all static)."""
    position = SHAPE_ONLY.get(node.op_type) if node.domain in ("", "ai.onnx") else None
    if position is None or position >= len(node.input) or not node.input[position]:
        return 0, None
    shapes = [known.get(name) for name in (node.input[0], *node.output)]
    if any(s is None or not all(s) for s in shapes):
        return position, None
    source, out = shapes[0], shapes[1]
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    if node.op_type == "Tile":
        value = [o // i for i, o in zip(source, out)] if all(o % i == 0 for i, o in zip(source, out)) else None
    elif node.op_type == "Split":
        axis = attrs.get("axis", 0) % len(source)
        value = [s[axis] for s in shapes[1:]]
    elif node.op_type == "Resize":
        stretch = attrs.get("keep_aspect_ratio_policy", b"stretch") == b"stretch"
        value = [out[a] for a in attrs.get("axes", range(len(out)))] if stretch else None
    else:
        value = list(out)
    return position, None if value is None else np.array(value, np.int64)


def _lower(model: onnx.ModelProto, fp16: bool, strict: bool) -> tuple[Lowering, dict[str, str]]:
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    cx = Lowering(model, fp16)
    for value in model.graph.input:
        if value.name not in cx.consts:
            try:
                cx.writer.inputs.append(cx.write(value.name, nonfloat=True))
            except Unsupported as why:  # fine while only its shape is read (Shape); the reason for any other reader
                cx.unavailable[value.name] = str(why)
    failures: dict[str, str] = {}
    initializers = set(cx.consts)
    nodes, members = fuse_gelu([(Node.from_proto(n, opset), n.domain) for n in model.graph.node], cx)
    for node, proto_domain in nodes:
        try:
            if proto_domain not in ("", "ai.onnx"):
                raise Unsupported(f"domain {proto_domain!r}; the converter handles ai.onnx")
            cx.node = node.name
            _lower_node(cx, node, model.opset_import)
        except Unsupported as why:
            if strict:
                raise ProviderError(f"litert cannot convert node {node.name!r} ({node.op}): {why}") from None
            failures.update(dict.fromkeys(members.get(node.name, [node.name]), str(why)))
            for name in node.outputs:  # stand-ins, so that the nodes after it are judged on their own
                _variable(cx, name)
        else:
            if not strict:  # the next node may be on another provider: what this one computed is a variable there
                for name in node.outputs:
                    if name in cx.consts and name not in initializers:
                        del cx.consts[name]
                        _variable(cx, name)
    return cx, failures


def _lower_node(cx: Lowering, node: Node, opsets) -> None:
    """Fold a node whose inputs are all constants; where ONNX's evaluator cannot, and for every other node,
    write its LiteRT operators."""
    if all(name in cx.consts for name in node.inputs if name) and node.inputs and node.op not in RANDOM:
        try:
            return fold(cx, node, opsets)
        except Unsupported as folding:
            if node.op not in LOWERINGS:
                raise
            try:
                return LOWERINGS[node.op](cx, node)
            except Unsupported as why:
                raise Unsupported(f"{folding}; and it cannot be lowered: {why}") from None
    if node.op not in LOWERINGS:
        raise Unsupported(f"no LiteRT lowering for {node.op}; lowered ops: {', '.join(sorted(LOWERINGS))}")
    LOWERINGS[node.op](cx, node)


def _variable(cx: Lowering, name: str) -> None:
    """`name` as a LiteRT tensor computed at run time (or why it cannot be one)."""
    if not name:
        return
    try:
        cx.write(name, nonfloat=True)
    except Unsupported as why:
        cx.unavailable[name] = str(why)


def fold(cx: Lowering, node: Node, opsets) -> None:
    """Compute a node whose inputs are all constants (shape arithmetic, mostly) with ONNX's reference
    evaluator: its outputs become constants."""
    from onnx.reference import ReferenceEvaluator

    proto = helper.make_node(node.op, node.inputs, node.outputs, **node.attrs)
    graph = helper.make_graph([proto], "fold", [], [helper.make_value_info(o, onnx.TypeProto()) for o in node.outputs
                                                   if o],
                              [numpy_helper.from_array(cx.consts[n], n) for n in dict.fromkeys(node.inputs) if n])
    try:
        values = ReferenceEvaluator(helper.make_model(graph, opset_imports=opsets)).run(None, {})
    except Exception as error:  # noqa: BLE001 - the evaluator's own failure, as a reason
        raise Unsupported(f"folding its constant inputs failed: {error}") from None
    cx.consts.update({name: np.asarray(v) for name, v in zip([o for o in node.outputs if o], values)})


def _declare_outputs(cx: Lowering) -> None:
    """Declare the graph outputs, in ONNX layout and under their ONNX names."""
    for name in cx.outputs:
        shape = cx.shape(name)
        index = cx.read(name, identity(len(shape)), nonfloat=True)
        if index in cx.writer.inputs or index in cx.writer.outputs or cx.writer.tensors[index].buffer:
            copy = cx.temp(shape, cx.writer.tensors[index].dtype)
            cx.op("RESHAPE", [index, cx.int32(shape)], [copy])
            index = copy
        cx.writer.tensors[index].name = name
        cx.writer.outputs.append(index)


def fuse_gelu(nodes: list[tuple[Node, str]], cx: Lowering) -> tuple[list[tuple[Node, str]], dict[str, list[str]]]:
    """x * 0.5 * (1 + erf(x / sqrt(2))), as exporters write Gelu, becomes one GELU node (named after its
    last node). Returns the nodes with their domains, and the names of each fused node's members."""
    produced = {o: n for n, _ in nodes for o in n.outputs}
    readers: dict[str, list[Node]] = {}
    for n, _ in nodes:
        for name in n.inputs:
            readers.setdefault(name, []).append(n)

    def sole(name: str, op: str) -> Node | None:
        found = readers.get(name, [])
        ok = len(found) == 1 and found[0].op == op and cx.readers[name] == 1 and name not in cx.outputs
        return found[0] if ok else None

    def other(node: Node, name: str) -> str:
        return node.inputs[1] if node.inputs[0] == name else node.inputs[0]

    def constant(name: str, value: float) -> bool:
        array = cx.consts.get(name)
        return array is not None and array.size == 1 and math.isclose(float(array.reshape(())), value, rel_tol=1e-6)

    members: dict[str, list[str]] = {}
    replaced: dict[str, Node | None] = {}  # member -> the fused node (last member) or None (dropped)
    for erf in (n for n, _ in nodes if n.op == "Erf"):
        scale = produced.get(erf.inputs[0])
        if scale is None or scale.op not in ("Div", "Mul") or sole(scale.outputs[0], "Erf") is None:
            continue
        x = scale.inputs[0] if scale.op == "Div" or scale.inputs[0] not in cx.consts else scale.inputs[1]
        if not constant(other(scale, x), math.sqrt(2) if scale.op == "Div" else 1 / math.sqrt(2)):
            continue
        add = sole(erf.outputs[0], "Add")
        first = add and constant(other(add, erf.outputs[0]), 1.0) and sole(add.outputs[0], "Mul")
        second = first and sole(first.outputs[0], "Mul")
        if not second:
            continue
        pair = {other(first, add.outputs[0]), other(second, first.outputs[0])}
        if x not in pair or not any(constant(p, 0.5) for p in pair):
            continue
        chain = [scale, erf, add, first, second]
        members[second.name] = [n.name for n in chain]
        replaced.update(dict.fromkeys((n.name for n in chain[:-1]), None))
        replaced[second.name] = Node(second.name, "Gelu", (x,), second.outputs, {}, second.opset)
    kept = [(replaced.get(n.name, n), domain) for n, domain in nodes]
    return [(n, domain) for n, domain in kept if n is not None], members
