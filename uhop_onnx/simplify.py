"""Provider-neutral graph simplification, as onnx-ir passes.

Node names and graph input and output names are kept, so plans and assignments can refer to them.
"""

from __future__ import annotations

import onnx
import onnx_ir as ir
from onnx_ir.passes import common

# Identity elimination is left out: onnx-ir's pass renames graph outputs it feeds.
PASSES = (
    common.LiftConstantsToInitializersPass(lift_all_constants=True, size_limit=0),
    common.RemoveUnusedNodesPass(),
    common.RemoveUnusedFunctionsPass(),
)


def simplify(model: onnx.ModelProto) -> onnx.ModelProto:
    """Lift constants to initializers and remove dead nodes; shapes are inferred again."""
    result = ir.passes.PassManager(PASSES, steps=2)(ir.serde.deserialize_model(model))
    if not result.modified:
        return model
    simplified = ir.serde.serialize_model(result.model)
    return onnx.shape_inference.infer_shapes(simplified, data_prop=True)
