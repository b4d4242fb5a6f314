"""The placement for a board that is not here: each provider's static cost model (a target profile's), minimised
over every assignment of the nodes by a dynamic programme over the node order (`static_cost.cheapest`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from uhop_onnx.foundation.errors import ProviderError
from uhop_onnx.runtime.measure import Measurement

from .blocks import allowed_providers, boundary_classes
from .placer import Analysis, Block, Placement
from .static_cost import cheapest, estimate_ms, flops, moved, runs


class CostModel(Protocol):
    """A provider's estimated cost: `stage_ms` a stage, plus `cost_ms(flops, bytes moved)` its nodes."""

    stage_ms: float

    def cost_ms(self, flops: float, nbytes: float) -> float: ...


@dataclass(frozen=True)
class StaticCost:
    """The `Placer` that estimates: each node costs its provider's `cost_ms` of its FLOPs and bytes moved, and each
    stage its provider's `stage_ms`; the choice is the cheapest in sum (`static_cost.plan_ms`)."""

    models: Mapping[str, CostModel]  # provider label -> its cost model

    def place(self, a: Analysis) -> Placement:
        graph = a.graph
        allowed = [allowed_providers(graph, a.support, a.pinned, [node.index]) for node in graph.nodes]
        for node, options in zip(graph.nodes, allowed):
            if not options:
                raise ProviderError(f"no provider of the target can run node {node.name!r} ({node.op_type})")
        costs = []
        for node, options in zip(graph.nodes, allowed):
            work = flops(graph, node), moved(graph, node)
            costs.append({p: self.models[p].cost_ms(*work) for p in options})
        choice = cheapest(allowed, costs, {p: m.stage_ms for p, m in self.models.items()})
        units = [tuple(nodes) for _, nodes in runs(choice)]
        return Placement("static", tuple(choice), blocks=[
            Block(b, graph.nodes[b[0]].name, graph.nodes[b[-1]].name, size, self._figures(a, b))
            for b, size in zip(units, boundary_classes(graph, units))])

    def _figures(self, a: Analysis, block: tuple[int, ...]) -> dict[str, Measurement]:
        """The block as one stage on each provider that runs all of it: estimated figures (no rounds: nothing
        was timed)."""
        nodes = [a.graph.nodes[i] for i in block]
        return {p: Measurement(estimate_ms(self.models[p], a.graph, nodes), 0.0, 0)
                for p in allowed_providers(a.graph, a.support, a.pinned, block)}
