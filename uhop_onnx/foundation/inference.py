"""Shape inference without the weights' values: onnx's pass copies the model into C++ and back, each weight four
times over (a 21 MB model's inference peaks 115 MiB above it). Shapes are never computed from a tensor of
`LARGE` elements or more, so those go in as typed inputs and their values stay where they are."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import onnx

LARGE = 1024  # elements: an initializer this large is typed for inference, never read


def weightless(model: onnx.ModelProto, shapes: Mapping[str, Sequence[int]] | None = None) -> onnx.ModelProto:
    """A copy of `model` for shape inference: its large and sparse initializers typed inputs (no values); with
    `shapes`, its inputs named there at those shapes, and its outputs' and other values' shapes left to
    inference."""
    from onnx import helper

    g = model.graph
    weights = {t.name for t in g.initializer}
    values = [t for t in g.initializer if math.prod(t.dims) < LARGE]
    typed = [helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)) for t in g.initializer
             if math.prod(t.dims) >= LARGE]
    typed += [helper.make_tensor_value_info(t.values.name, t.values.data_type, list(t.dims))
              for t in g.sparse_initializer]
    shapes = shapes or {}
    inputs = [helper.make_tensor_value_info(i.name, i.type.tensor_type.elem_type, list(shapes[i.name]))
              if i.name in shapes and i.type.HasField("tensor_type") else i for i in g.input if i.name not in weights]
    outputs = [helper.make_tensor_value_info(o.name, o.type.tensor_type.elem_type, None)
               if shapes and o.type.HasField("tensor_type") else o for o in g.output]
    return helper.make_model(helper.make_graph(g.node, g.name, inputs + typed, outputs, initializer=values,
                                               value_info=() if shapes else g.value_info),
                             ir_version=model.ir_version, opset_imports=model.opset_import, functions=model.functions)


def inferred(model: onnx.ModelProto, **options: bool) -> onnx.ModelProto:
    """`model` with its shapes inferred as `onnx.shape_inference.infer_shapes(model, **options)` infers them
    (default: with data propagation), on its `weightless` copy. `model` itself is changed (its nodes, with their
    subgraphs' shapes, its value infos, outputs and functions replaced by the inferred ones) and returned; what
    inference raises, it raises before changing anything."""
    import onnx

    shaped = onnx.shape_inference.infer_shapes(weightless(model), **({"data_prop": True} | options))
    g, inferred_graph = model.graph, shaped.graph
    for field in ("node", "value_info", "output"):
        del getattr(g, field)[:]
        getattr(g, field).extend(getattr(inferred_graph, field))
    del model.functions[:]
    model.functions.extend(shaped.functions)
    return model
