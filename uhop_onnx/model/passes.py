"""The onnx-ir passes `simplify` runs (imported when it runs: onnx-ir, onnxscript and the sympy they import
weigh about 60 MiB, which a process that never simplifies does not hold)."""

from __future__ import annotations

import onnx_ir as ir
from onnx_ir.passes import common

from ..foundation.errors import logger

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
