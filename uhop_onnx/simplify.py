"""Provider-neutral graph simplification, as onnx-ir passes.

Node names and graph input and output names are kept, so plans and assignments can refer to them.
"""

from __future__ import annotations

import onnx
import onnx_ir as ir
from onnx_ir.passes import common


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


# Identity elimination in general is left out: onnx-ir's pass renames graph outputs it feeds.
PASSES = (
    common.LiftConstantsToInitializersPass(lift_all_constants=True, size_limit=0),
    ConstantIdentityPass(),
    common.RemoveUnusedNodesPass(),
    common.RemoveUnusedFunctionsPass(),
)


def simplify(model: onnx.ModelProto) -> onnx.ModelProto:
    """Lift constants to initializers, read constant Identities through, remove dead nodes; shapes are
    inferred again."""
    result = ir.passes.PassManager(PASSES, steps=2)(ir.serde.deserialize_model(model))
    if not result.modified:
        return model
    simplified = ir.serde.serialize_model(result.model)
    return onnx.shape_inference.infer_shapes(simplified, data_prop=True)
