"""A static cost model, for placing on a board that is not here: FLOPs and bytes moved per node, counted at
the shapes the plan is built for."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from uhop_onnx.dtypes import numpy_dtype
from uhop_onnx.graph import Graph, Node
from uhop_onnx.inputs import at_shapes, free_inputs, measured_shapes

from .placer import Analysis


def sized(a: Analysis) -> Analysis:
    """`a` with every shape of its graph inferred at its sample feeds' shapes (the export's `--shape`, inputs
    or calibration), so that a free dimension counts at its size there, not as 1. Node names and order are
    those of `a.graph`; a tensor whose size depends on values (a `Range`'s) stays unknown and counts nothing."""
    if not a.feeds or not free_inputs(a.simplified):
        return a
    return replace(a, graph=Graph.from_model(at_shapes(a.simplified, measured_shapes(a.feeds))))


def elements(graph: Graph, name: str) -> int:
    info = graph.tensors.get(name)
    if info is None or info.shape is None:
        return 0
    return int(np.prod([d if isinstance(d, int) and d > 0 else 1 for d in info.shape]))


def nbytes(graph: Graph, name: str) -> int:
    info = graph.tensors.get(name)
    dtype = numpy_dtype(info.dtype) if info and info.dtype else None
    return elements(graph, name) * (dtype.itemsize if dtype is not None else 4)


def flops(graph: Graph, node: Node) -> float:
    """Multiply-adds count twice; other ops one operation per output element."""
    out = sum(elements(graph, o) for o in node.outputs if o)
    shapes = [graph.tensors.get(i) for i in node.inputs]
    if node.op_type in ("Conv", "ConvTranspose") and len(shapes) > 1 and shapes[1] and shapes[1].shape:
        per_output = int(np.prod([d if isinstance(d, int) else 1 for d in shapes[1].shape[1:]]))
        return 2.0 * out * per_output
    if node.op_type in ("MatMul", "Gemm") and shapes and shapes[0] and shapes[0].shape:
        transposed = node.op_type == "Gemm" and node.attributes.get("transA", 0)
        k = shapes[0].shape[-2 if transposed else -1]
        return 2.0 * out * (k if isinstance(k, int) else 1)
    return float(out)


def moved(graph: Graph, node: Node) -> float:
    """Bytes read and written."""
    return float(sum(nbytes(graph, t) for t in (*node.inputs, *node.outputs) if t))
