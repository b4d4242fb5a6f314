"""Provider-neutral graph simplification, as onnx-ir passes.

Node names and graph input and output names are kept, so plans and assignments can refer to them.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import onnx
import onnx_ir as ir
from onnx_ir.passes import common

from .errors import logger
from .inputs import Shapes, at_shapes

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
    rewrites its readers away (an Expand to the shape it already has)."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        ops = {node.op_type for node in ir.traversal.RecursiveGraphIterator(model.graph)}
        if ops & UNFOLDABLE or model.functions or not any(map(_integer_results, model.graph)):
            return ir.passes.PassResult(model, False)
        from onnxscript.optimizer import fold_constants

        copy = ir.serde.deserialize_model(ir.serde.serialize_model(model))
        copy.graph.outputs.extend(v for node in copy.graph if _integer_results(node) for v in node.outputs
                                  if v.uses() and not v.is_graph_output())
        try:
            fold_constants(copy, onnx_shape_inference=True, should_fold=_should_fold)
        except Exception as error:  # noqa: BLE001 - the folder may fail on any model; folding is optional
            log.warning("shape arithmetic left unfolded: %s", error)
            return ir.passes.PassResult(model, False)
        folded = {v.name: v.const_value for v in (*copy.graph.initializers.values(), *copy.graph.outputs)
                  if v.const_value is not None and v.dtype in SHAPE_TYPES}
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


def _integer_results(node: ir.Node) -> bool:
    return bool(node.outputs) and all(v.dtype in SHAPE_TYPES for v in node.outputs)


def _should_fold(node: ir.Node) -> bool | None:
    """onnxscript's own rules (which skip inputs past its size limit), except that a ConstantOfShape of
    integer or boolean results is folded too (a filled shape vector or mask; the folder's output size limit
    still bounds it), and a Transpose of floats is not (weights: only integers are taken back). Float results
    are folded in the copy for the integers computed from them (`ceil(h / patch)`, T5's log-spaced buckets)."""
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


def simplify(model: onnx.ModelProto) -> onnx.ModelProto:
    """Lift constants to initializers, read constant Identities through, fold integer shape arithmetic,
    remove dead nodes; shapes are inferred again."""
    passes = ir.passes.Sequential(*FOLDING, ir.passes.PassManager(PASSES, steps=2))
    result = passes(ir.serde.deserialize_model(model))
    if not result.modified:
        return model
    simplified = ir.serde.serialize_model(result.model)
    return onnx.shape_inference.infer_shapes(simplified, data_prop=True)


def at_fixed_shapes(model: onnx.ModelProto, shapes: Shapes,
                    values: Mapping[str, np.ndarray] | None = None) -> onnx.ModelProto:
    """`model` specialised for a runtime that builds for fixed shapes: its inputs at `shapes` (and those named
    in `values` made those constants, `inputs.at_shapes`), simplified there, so that shape arithmetic is
    folded. What such a runtime is asked about (`optimize`), built from (a session's stage) and exported as."""
    return simplify(at_shapes(model, shapes, values))
