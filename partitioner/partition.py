"""Group nodes placed on the same provider into convex stages that run in order."""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

from uhop_onnx.foundation.graph import Graph


@dataclass(frozen=True)
class StageSpec:
    """Nodes (indices into the graph, in run order) that one provider (by label) runs as one subgraph."""

    provider: str
    nodes: tuple[int, ...]


def partition(graph: Graph, placement: Sequence[str]) -> list[StageSpec]:
    """Split the graph into stages, one provider each, in an order that respects every dependency.

    A topological order is built that stays on the current provider while it can (Kahn's algorithm,
    preferring ready nodes of that provider), then cut where the provider changes. Each stage is a
    contiguous run of a topological order, so no path leaves a stage and comes back into it, and the
    stages themselves run in sequence.
    """
    if len(placement) != len(graph.nodes):
        raise ValueError(f"placement has {len(placement)} entries for {len(graph.nodes)} nodes")
    waiting = [len(p) for p in graph.predecessors]
    ready: dict[str, list[int]] = {}
    for i, count in enumerate(waiting):
        if count == 0:
            heapq.heappush(ready.setdefault(placement[i], []), i)
    stages: list[StageSpec] = []
    current: list[int] = []
    provider = None
    while any(ready.values()):
        if not ready.get(provider):
            provider = min((heap[0], p) for p, heap in ready.items() if heap)[1]
            if current:
                stages.append(StageSpec(placement[current[0]], tuple(current)))
                current = []
        node = heapq.heappop(ready[provider])
        current.append(node)
        for j in sorted(graph.successors[node]):
            waiting[j] -= 1
            if waiting[j] == 0:
                heapq.heappush(ready.setdefault(placement[j], []), j)
    if current:
        stages.append(StageSpec(placement[current[0]], tuple(current)))
    return stages
