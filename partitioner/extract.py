"""Cut a set of nodes out of a model as a standalone, checker-valid ONNX model."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import onnx
from onnx import helper

from uhop_onnx.foundation.errors import PlanError
from uhop_onnx.foundation.graph import Graph, reads


def extract(model: onnx.ModelProto, graph: Graph, nodes: Iterable[int], outputs: Sequence[str] | None = None,
            name: str = "stage") -> onnx.ModelProto:
    """A model of `nodes` (indices into `graph`), reading what they need as inputs and initializers.

    `outputs` defaults to the tensors they write that are graph outputs or read by other nodes. The source
    model's IR version, opsets and functions are kept.
    """
    chosen = sorted(set(nodes))
    inside = set(chosen)
    produced = {out for i in chosen for out in graph.nodes[i].outputs if out}
    read = list(dict.fromkeys(t for i in chosen for t in sorted(reads(graph.nodes[i])) if t not in produced))
    if outputs is None:
        outputs = [t for t in dict.fromkeys(o for i in chosen for o in graph.nodes[i].outputs)
                   if t and (t in graph.outputs or any(j not in inside for j in graph.readers.get(t, ())))]
    src = model.graph
    declared = {v.name: v for v in (*src.input, *src.output, *src.value_info)}
    overridable = {i.name for i in src.input} & graph.initializers
    used = {(graph.nodes[i].domain, graph.nodes[i].op_type) for i in chosen}
    stage_inputs = [t for t in read if t not in graph.initializers or t in overridable]
    stage = onnx.ModelProto(ir_version=model.ir_version, opset_import=model.opset_import,
                            functions=[f for f in model.functions if (f.domain, f.name) in used])
    body = stage.graph  # filled in place: each weight is copied once, into the stage
    body.name = name
    body.node.extend(src.node[i] for i in chosen)
    body.input.extend(declared.get(t) or _value_info(graph, t) for t in stage_inputs)
    body.output.extend(declared.get(t) or _value_info(graph, t) for t in outputs)
    weights = set(read)
    body.initializer.extend(t for t in src.initializer if t.name in weights)
    body.sparse_initializer.extend(t for t in src.sparse_initializer if t.values.name in weights)
    body.value_info.extend(v for v in src.value_info if v.name in produced and v.name not in outputs)
    return stage


def _value_info(graph: Graph, tensor: str) -> onnx.ValueInfoProto:
    info = graph.tensors.get(tensor)
    if info is None or info.dtype is None:
        raise PlanError(
            f"tensor {tensor!r} would cross a stage boundary but its type could not be inferred; "
            "keep its producer and readers on one provider (assign=...)"
        )
    elem_type = onnx.TensorProto.DataType.Value(info.dtype.upper())
    return helper.make_tensor_value_info(tensor, elem_type, None if info.shape is None else list(info.shape))
