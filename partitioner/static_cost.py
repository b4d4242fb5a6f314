"""A static cost model, for placing on a board that is not here: FLOPs and bytes moved per node, counted at
the shapes the plan is built for; the choice it makes cheapest; and, under it, why a node is off the board's
preferred accelerator."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from uhop_onnx.foundation.dtypes import numpy_dtype
from uhop_onnx.foundation.errors import first_line, logger
from uhop_onnx.foundation.graph import Graph, Node
from uhop_onnx.foundation.inputs import at_shapes, free_inputs, measured_shapes
from uhop_onnx.foundation.samples import shapes_text

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
    return model.stage_ms + sum(node_ms(model, graph, n) for n in nodes)


def node_ms(model: CostModel, graph: Graph, node: Node) -> float:
    """One node's estimated cost under `model`, its stage's cost aside."""
    return model.cost_ms(flops(graph, node), moved(graph, node))


def runs(choice: Sequence[str]) -> list[tuple[str, list[int]]]:
    """The stages a choice (a label per node, in the graph's order) is estimated as: its runs of one label."""
    out: list[tuple[str, list[int]]] = []
    for i, label in enumerate(choice):
        if out and out[-1][0] == label:
            out[-1][1].append(i)
        else:
            out.append((label, [i]))
    return out


def plan_ms(graph: Graph, choice: Sequence[str], models: Mapping[str, CostModel]) -> float:
    """A choice's estimated end-to-end time: each node on its provider, and each stage (`runs`: each run of one
    label in the graph's order) its provider's `stage_ms`."""
    return sum(estimate_ms(models[label], graph, [graph.nodes[i] for i in nodes]) for label, nodes in runs(choice))


def cheapest(allowed: Sequence[Sequence[str]], costs: Sequence[Mapping[str, float]],
             stage_ms: Mapping[str, float]) -> list[str]:
    """The label of each node (in the graph's order) that minimises `plan_ms`: `allowed` and `costs` (ms) per
    node, `stage_ms` per label. A dynamic programme over the node order, its state the label of the node
    before: every assignment, NPU stages contiguous or not, is among those it weighs."""
    best: dict[str, float] = {}
    back: list[dict[str, str | None]] = []
    for labels, cost in zip(allowed, costs):
        step, came = {}, {}
        for p in labels:
            options = [(best[q] + cost[p] + (0.0 if q == p else stage_ms[p]), q) for q in best] or [
                (cost[p] + stage_ms[p], None)]
            step[p], came[p] = min(options, key=lambda o: o[0])
        best = step
        back.append(came)
    if not best:
        return []
    label = min(best, key=best.get)
    choice = [label]
    for came in reversed(back[1:]):
        label = came[label]
        choice.append(label)
    return choice[::-1]


def off_preferred(a: Analysis, stages: Sequence[PlacedStage], models: Mapping[str, CostModel],
                  preferred: Sequence[str]) -> list[dict[str, Any]]:
    """Each node of `stages` (a plan's, placed by the cost `models` over `a`, best `sized`) that is not on one
    of the `preferred` labels (a provider and its precision variants), with why: `kind` "assign" (the user's),
    "capability" (the provider's table or its runtime's own query said no), "build check" (the provider's build
    check refused it) or "cost" (`plan_ms` of the plan as placed, and with the nodes of the node's stage that a
    preferred label runs moved to the one that makes it fastest: never faster, as the placement minimised it)."""
    mine = list(preferred)
    graph, out = a.graph, []
    label_of = {name: stage.label for stage in stages for name in stage.nodes}
    choice = [label_of[n.name] for n in graph.nodes]
    placed = plan_ms(graph, choice, models)
    for stage in stages:
        if stage.label in mine:
            continue
        nodes = [graph.nodes[graph.index_of[name]] for name in stage.nodes]
        able = [n for n in nodes if n.name not in a.pinned and any(a.support[label][n.name] for label in mine)]
        moved_ms = {label: plan_ms(graph, _moved(choice, able, label, a), models) for label in mine}
        for node in nodes:
            entry = {"node": node.name, "op": node.op_type, "on": stage.label}
            if node.name in a.pinned:
                entry.update(kind="assign", reason=f"assigned to {a.pinned[node.name]}")
            elif node not in able:
                answer = a.support[mine[0]][node.name]
                entry.update(kind="build check" if answer.source == "check" else "capability", reason=answer.reason)
            else:
                best = min(moved_ms, key=moved_ms.get)
                entry.update(kind="cost", reason=_cost_text(stage.label, len(able), best, placed, moved_ms[best],
                                                            models[best].stage_ms),
                             ms={stage.label: round(placed, 4), best: round(moved_ms[best], 4)})
            out.append(entry)
    return out


def _moved(choice: Sequence[str], nodes: Sequence[Node], label: str, a: Analysis) -> list[str]:
    """`choice` with those of `nodes` that `label` runs on `label`."""
    moved = list(choice)
    for node in nodes:
        if a.support[label][node.name]:
            moved[node.index] = label
    return moved


def _cost_text(on: str, able: int, best: str, placed: float, moved_ms: float, stage_ms: float) -> str:
    return (f"estimated {placed:.3g} ms end to end as placed, {moved_ms:.3g} ms with the {able} node"
            f"{'s' if able != 1 else ''} of its {on} stage that {best} runs moved there "
            f"({stage_ms:g} ms per {best} stage)")
