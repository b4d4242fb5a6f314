"""The placement without timing: each node on the first provider, in preference order, that runs it."""

from __future__ import annotations

from collections.abc import Mapping

from uhop_onnx.foundation.errors import PlanError, ProviderError
from uhop_onnx.foundation.graph import Graph
from uhop_onnx.providers import Support

from .placer import Analysis, Placement


class FirstSupported:
    """The `Placer` that measures nothing."""

    def place(self, analysis: Analysis) -> Placement:
        return Placement("first-supported", tuple(first_supported(analysis.graph, analysis.support, analysis.pinned)))


def first_supported(graph: Graph, support: Mapping[str, Mapping[str, Support]], pinned: Mapping[str, str]
                    ) -> list[str]:
    """Each node's provider label: its pinned one, else the first (in the preference order of `support`,
    label -> node name -> Support) that runs it."""
    placement = []
    for node in graph.nodes:
        if node.name in pinned:
            label = pinned[node.name]
            verdict = support[label][node.name]
            if not verdict.ok:
                raise PlanError(f"node {node.name!r} is assigned to {label}, which cannot run it: {verdict.reason}")
            placement.append(label)
            continue
        chosen = next((label for label, table in support.items() if table[node.name].ok), None)
        if chosen is None:
            reasons = "; ".join(f"{label}: {table[node.name].reason}" for label, table in support.items())
            raise ProviderError(f"no provider can run node {node.name!r} ({node.op_type}): {reasons}")
        placement.append(chosen)
    return placement
