"""The placement without timing: each node on the first provider, in preference order, that runs it."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from uhop_onnx.errors import PlanError, ProviderError
from uhop_onnx.graph import Graph
from uhop_onnx.providers import Support




def first_supported(graph: Graph, support: Sequence[Mapping[str, Support]], pinned: Mapping[str, int],
                    names: Sequence[str]) -> list[int]:
    """Each node goes to its pinned provider, else to the first provider (in preference order) that runs it."""
    placement = []
    for node in graph.nodes:
        if node.name in pinned:
            p = pinned[node.name]
            verdict = support[p][node.name]
            if not verdict.ok:
                raise PlanError(f"node {node.name!r} is assigned to {names[p]}, which cannot run it: {verdict.reason}")
            placement.append(p)
            continue
        chosen = next((p for p, table in enumerate(support) if table[node.name].ok), None)
        if chosen is None:
            reasons = "; ".join(f"{names[p]}: {table[node.name].reason}" for p, table in enumerate(support))
            raise ProviderError(f"no provider can run node {node.name!r} ({node.op_type}): {reasons}")
        placement.append(chosen)
    return placement
