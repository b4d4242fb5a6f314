"""A static cost model, for placing on a board that is not here: FLOPs and bytes moved per node, counted at
the shapes the plan is built for; and, under it, why a node is off the board's preferred accelerator."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from uhop_onnx.dtypes import numpy_dtype
from uhop_onnx.errors import first_line, logger
from uhop_onnx.graph import Graph, Node
from uhop_onnx.inputs import at_shapes, free_inputs, measured_shapes
from uhop_onnx.samples import shapes_text

from .placer import Analysis

log = logger(__name__)

if TYPE_CHECKING:
    from .static_placer import CostModel


class PlacedStage(Protocol):
    label: str  # its provider's label (`rknn`, `rknn[int8]`)
    nodes: list[str]


def sized(a: Analysis) -> Analysis:
    """`a` with every shape of its graph inferred at its sample feeds' shapes (the export's `--shape`, inputs
    or calibration), so that a free dimension counts at its size there, not as 1. Node names and order are
    those of `a.graph`; a tensor whose size depends on values (a `Range`'s) stays unknown and counts nothing."""
    if not a.feeds or not free_inputs(a.simplified):
        return a
    shapes = measured_shapes(a.feeds)
    try:
        return replace(a, graph=Graph.from_model(at_shapes(a.simplified, shapes)))
    except Exception as error:  # noqa: BLE001 - shape inference may refuse the shapes; the declared ones stand
        log.warning("the static cost model counts at the declared shapes: inferring the model's at %s failed: %s",
                    shapes_text(shapes), first_line(error))
        return a


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


def estimate_ms(model: CostModel, graph: Graph, nodes: Sequence[Node]) -> float:
    """`nodes` as one stage under `model`: its stage cost plus each node's FLOPs and bytes moved."""
    return model.stage_ms + sum(model.cost_ms(flops(graph, n), moved(graph, n)) for n in nodes)


def off_preferred(a: Analysis, stages: Sequence[PlacedStage], models: Mapping[str, CostModel],
                  preferred: Sequence[str]) -> list[dict[str, Any]]:
    """Each node of `stages` (a plan's, placed by the cost `models` over `a`, best `sized`) that is not on one
    of the `preferred` labels (a provider and its precision variants), with why: `kind` "assign" (the user's),
    "capability" (the provider's table or its runtime's own query said no), "build check" (the provider's build
    check refused it) or "cost" (the
    cost model's `ms` for the node's stage where it went and, for the nodes the preferred provider runs,
    there)."""
    mine = list(preferred)
    graph, out = a.graph, []
    for stage in stages:
        if stage.label in mine:
            continue
        nodes = [graph.nodes[graph.index_of[name]] for name in stage.nodes]
        able = [n for n in nodes if any(a.support[label][n.name] for label in mine)]
        ms = {stage.label: estimate_ms(models[stage.label], graph, nodes)}
        if able:
            ms.update({label: estimate_ms(models[label], graph, able) for label in mine})
        for node in nodes:
            entry = {"node": node.name, "op": node.op_type, "on": stage.label}
            if node.name in a.pinned:
                entry.update(kind="assign", reason=f"assigned to {a.pinned[node.name]}")
            elif node not in able:
                answer = a.support[mine[0]][node.name]
                entry.update(kind="build check" if answer.source == "check" else "capability", reason=answer.reason)
            else:
                entry.update(kind="cost", reason=_cost_text(stage.label, len(nodes), len(able), ms, models),
                             ms={label: round(v, 4) for label, v in ms.items()})
            out.append(entry)
    return out


def _cost_text(on: str, count: int, able: int, ms: Mapping[str, float], models: Mapping[str, CostModel]) -> str:
    best = min((label for label in ms if label != on), key=ms.get)
    part = "" if able == count else f" (the {able} nodes it runs)"
    return (f"estimated {ms[on]:.3g} ms for its stage of {count} on {on}, {ms[best]:.3g} ms on {best}{part}, "
            f"{models[best].stage_ms:g} ms of it per stage")
