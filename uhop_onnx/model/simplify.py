"""Provider-neutral graph simplification, as onnx-ir passes.

Node names and graph input and output names are kept, so plans and assignments can refer to them.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import onnx
import onnx_ir as ir
from onnx_ir.passes import common

from ..foundation.errors import logger
from ..foundation.inference import inferred
from ..foundation.inputs import Shapes, at_shapes

log = logger(__name__)


class ConstantIdentityPass(ir.passes.InPlacePass):
    """Readers of `Identity(initializer)` read the initializer itself (exporters emit these for shared
    weights); the Identity goes. One feeding a graph output stays, so output names are kept."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        outputs = set(map(id, graph.outputs))
        modified = False
        for node in list(graph):
            source = node.inputs[0] if node.op_type == "Identity" and node.domain == "" and node.inputs else None
            if source is None or source.name not in graph.initializers or source in graph.inputs:
                continue
            if id(node.outputs[0]) in outputs:
                continue
            node.outputs[0].replace_all_uses_with(source)
            graph.remove(node, safe=True)
            modified = True
        return ir.passes.PassResult(model, modified)


# onnxscript's folder inlines If branches and fails on sequence ops whatever `should_fold` says: models with
# these are left unfolded.
UNFOLDABLE = frozenset({"If", "Loop", "Scan", "SequenceAt", "SequenceConstruct", "SequenceEmpty", "SequenceErase",
                        "SequenceInsert", "SequenceLength", "SequenceMap", "SplitToSequence", "ConcatFromSequence",
                        "Optional", "OptionalGetElement", "OptionalHasElement"})
SHAPE_TYPES = frozenset({ir.DataType.INT64, ir.DataType.INT32, ir.DataType.BOOL})  # shapes, indices and the tests on them


class FoldShapeArithmeticPass(ir.passes.InPlacePass):
    """Integer and boolean results computable before run time become initializers: the Shape -> Gather ->
    Concat -> Reshape chains exporters emit (with their Equal -> Where tests of -1 entries, and masks built
    from constant ranges), which runtimes that compile static graphs (LiteRT, OpenVINO, RKNN) refuse or split
    at. onnxscript's constant folder runs on a copy, and only these constants are taken back (not its other
    rewrites), so every other node keeps its name and no float value changes; the producers left unread go
    with the dead nodes. In the copy every such value is a graph output, so that none is lost when the folder
    rewrites its readers away (an Expand to the shape it already has).

    With `fixed` (the inputs' shapes are fixed), values of any type computed from shapes and found constant
    are taken back too, whatever their size (within the folder's output limit): a YOLO head's anchor grid and
    strides (`Shape` -> `Range` -> `Cast` -> `Add`, `ConstantOfShape`), which a fixed-shape runtime would
    otherwise refuse or compute at run time."""

    def __init__(self, fixed: bool = False):
        super().__init__()
        self.fixed = fixed

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        ops = {node.op_type for node in ir.traversal.RecursiveGraphIterator(model.graph)}
        derived = _from_shapes(model.graph) if self.fixed else frozenset()

        def taken(value: ir.Value) -> bool:
            return value.dtype in SHAPE_TYPES or value.name in derived

        if ops & UNFOLDABLE or model.functions or not any(taken(v) for node in model.graph for v in node.outputs):
            return ir.passes.PassResult(model, False)
        from onnxscript.optimizer import fold_constants

        copy = ir.serde.deserialize_model(ir.serde.serialize_model(model))
        copy.graph.outputs.extend(v for node in copy.graph for v in node.outputs
                                  if taken(v) and v.uses() and not v.is_graph_output())
        try:
            fold_constants(copy, onnx_shape_inference=True, should_fold=lambda node: _should_fold(node, derived))
        except Exception as error:  # noqa: BLE001 - the folder may fail on any model; folding is optional
            log.warning("shape arithmetic left unfolded: %s", error)
            return ir.passes.PassResult(model, False)
        folded = {v.name: v.const_value for v in (*copy.graph.initializers.values(), *copy.graph.outputs)
                  if v.const_value is not None and taken(v)}
        modified = False
        for node in list(model.graph):
            for value in node.outputs:
                tensor = folded.get(value.name)
                if tensor is None or value.is_graph_output() or not value.uses():
                    continue
                constant = ir.Value(name=f"{value.name}.folded", shape=tensor.shape,
                                    type=ir.TensorType(tensor.dtype), const_value=tensor)
                model.graph.register_initializer(constant)
                value.replace_all_uses_with(constant)
                modified = True
        return ir.passes.PassResult(model, modified)


# Ops whose results are computed from shapes alone, or generated from constants, never from tensor data.
SHAPE_SOURCES = frozenset({"Shape", "Size", "Range", "ConstantOfShape", "EyeLike"})


def _from_shapes(graph: ir.Graph) -> frozenset[str]:
    """Names of the values of `graph` that a `SHAPE_SOURCES` op computes, or that are computed from one (in
    part: whether the rest is constant is the folder's to find)."""
    names: set[str] = set()
    for node in graph:  # in topological order
        if (node.domain == "" and node.op_type in SHAPE_SOURCES) or any(v is not None and v.name in names
                                                                         for v in node.inputs):
            names.update(v.name for v in node.outputs)
    return frozenset(names)


def _integer_results(node: ir.Node) -> bool:
    return bool(node.outputs) and all(v.dtype in SHAPE_TYPES for v in node.outputs)


def _should_fold(node: ir.Node, derived: frozenset[str] = frozenset()) -> bool | None:
    """onnxscript's own rules (which skip inputs past its size limit), except that a node computed from shapes
    (`derived`, at fixed shapes) and a ConstantOfShape of integer or boolean results are folded whatever their
    inputs' size (a filled shape vector or mask, an anchor grid; the folder's output size limit still bounds
    them), and another Transpose of floats is not (weights: only integers are taken back). Float results are
    folded in the copy for the integers computed from them (`ceil(h / patch)`, T5's log-spaced buckets)."""
    if any(v.name in derived for v in node.outputs):
        return True
    if node.op_type == "ConstantOfShape" and node.domain == "":
        return True if _integer_results(node) else None
    return False if node.op_type == "Transpose" and not _integer_results(node) else None


FOLDING = (FoldShapeArithmeticPass(),)  # once, first: it works on a copy of the whole model
# Then these, twice (each may leave work for another). Identity elimination in general is left out: onnx-ir's
# pass renames graph outputs it feeds.
PASSES = (
    common.LiftConstantsToInitializersPass(lift_all_constants=True, size_limit=0),
    ConstantIdentityPass(),
    common.RemoveUnusedNodesPass(),
    common.RemoveUnusedFunctionsPass(),
)


def simplify(model: onnx.ModelProto, fixed: bool = False) -> onnx.ModelProto:
    """Lift constants to initializers, read constant Identities through, fold integer shape arithmetic (with
    `fixed`, everything computed from shapes: the inputs' shapes are fixed), remove dead nodes; shapes are
    inferred again."""
    folding = (FoldShapeArithmeticPass(fixed=True),) if fixed else FOLDING
    passes = ir.passes.Sequential(*folding, ir.passes.PassManager(PASSES, steps=2))
    result = passes(ir.serde.deserialize_model(model))
    if not result.modified:
        return model
    return inferred(ir.serde.serialize_model(result.model))


def at_fixed_shapes(model: onnx.ModelProto, shapes: Shapes,
                    values: Mapping[str, np.ndarray] | None = None) -> onnx.ModelProto:
    """`model` specialised for a runtime that builds for fixed shapes: its inputs at `shapes` (and those named
    in `values` made those constants, `inputs.at_shapes`), simplified there, so that everything computed from
    shapes is folded. What such a runtime is asked about (`optimize`), built from (a session's stage) and
    exported as."""
    return simplify(at_shapes(model, shapes, values), fixed=True)


def opset(model: onnx.ModelProto) -> int | None:
    """The model's ai.onnx opset version (None when it imports none)."""
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), None)


def within_opsets(model: onnx.ModelProto, low: int, high: int,
                  feeds: Mapping[str, np.ndarray] | None = None) -> tuple[onnx.ModelProto, dict[str, str]]:
    """`model` with its ai.onnx opset moved into `low..high` by onnx's version converter, and the nodes that
    could not be moved (name -> the converter's reason). The whole model is converted at once where the
    converter can; else node by node: a node that converts is kept at the new opset, one that does not is left
    out, its outputs inputs of the model returned. With `feeds`, the result is checked against ONNX Runtime
    running `model`; a difference raises `ModelError`."""
    version = opset(model)
    if version is None or low <= version <= high:
        return model, {}
    target = min(max(version, low), high)
    try:
        converted, failed = onnx.version_converter.convert_version(model, target), {}
    except Exception:  # noqa: BLE001 - some node has no adapter: found one by one
        converted, failed = _converted_node_by_node(model, target)
    _named(converted)
    if feeds is not None:
        _check_conversion(model, converted, feeds, f"opset {version} -> {target}")
    return converted, failed


def _converted_node_by_node(model: onnx.ModelProto, target: int) -> tuple[onnx.ModelProto, dict[str, str]]:
    from onnx import helper

    inferred = onnx.shape_inference.infer_shapes(model)
    graph = inferred.graph
    types = {v.name: v for v in (*graph.input, *graph.value_info, *graph.output)}
    initializers = {t.name: t for t in graph.initializer}

    def typed(name: str) -> onnx.ValueInfoProto:
        return types.get(name) or helper.make_empty_tensor_value_info(name)

    nodes, failed, cut = [], {}, []
    for node in graph.node:
        used = [name for name in node.input if name]
        inputs = [typed(n) for n in used if n not in initializers]
        weights = [initializers[n] for n in used if n in initializers]
        single = helper.make_model(
            helper.make_graph([node], node.name, inputs, [typed(n) for n in node.output if n], weights),
            ir_version=model.ir_version, opset_imports=model.opset_import)
        try:
            nodes.extend(onnx.version_converter.convert_version(single, target).graph.node)
        except Exception as error:  # noqa: BLE001 - the converter's reason is the node's
            failed[node.name] = f"onnx's version converter cannot take it to opset {target}: {_reason(error)}"
            cut.extend(typed(n) for n in node.output if n)
    opsets = [helper.make_opsetid(o.domain, target if o.domain in ("", "ai.onnx") else o.version)
              for o in model.opset_import]
    converted = helper.make_model(
        helper.make_graph(nodes, graph.name, [*graph.input, *cut], list(graph.output), list(graph.initializer)),
        ir_version=model.ir_version, opset_imports=opsets)
    return onnx.shape_inference.infer_shapes(converted), failed


def _reason(error: Exception) -> str:
    """The converter's message without its source location (`...h:23: adapt: Assertion `false` failed: `)."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return text.rsplit("failed: ", 1)[-1]


def _named(model: onnx.ModelProto) -> None:
    """Names for the nodes the converter added (it leaves them unnamed)."""
    taken = {n.name for n in model.graph.node}
    for k, node in enumerate(model.graph.node):
        if not node.name:
            node.name = f"{node.op_type}_{k}.converted"
            while node.name in taken:
                node.name += "_"
            taken.add(node.name)


def _check_conversion(model: onnx.ModelProto, converted: onnx.ModelProto, feeds: Mapping[str, np.ndarray],
                      what: str) -> None:
    """ONNX Runtime's results of `converted` against those of `model` on `feeds` (the outputs of the nodes left
    out of `converted` fed to it from `model`'s run)."""
    from ..foundation.errors import ModelError
    from ..precision.accuracy import FP32_TOLERANCE, compare
    from ..foundation.samples import reference_outputs

    cut = [v for v in converted.graph.input if v.name not in {i.name for i in model.graph.input}]
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    probe.graph.output.extend(v for v in cut if v.type.HasField("tensor_type"))
    want = reference_outputs(probe.SerializeToString(), dict(feeds))
    got = reference_outputs(converted.SerializeToString(), {**feeds, **{v.name: want[v.name] for v in cut}})
    for name in (o.name for o in model.graph.output):
        verdict = compare(got[name], want[name], FP32_TOLERANCE) if name in got else {"ok": True}
        if not verdict["ok"]:
            raise ModelError(f"{what}: output {name!r} differs from ONNX Runtime's on the original "
                             f"({verdict.get('error') or 'max abs error %g' % verdict['max_abs_error']})")
