"""The placement for a board that is not here: each provider's static cost model (a target profile's) over
the same blocks and dynamic programme as the measured search."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from uhop_onnx.errors import ProviderError
from uhop_onnx.measure import Measurement

from .blocks import allowed_providers, blocks, boundary_classes, expand
from .path import cheapest_path
from .placer import Analysis, Block, Placement
from .static_cost import flops, moved


class CostModel(Protocol):
    """A provider's estimated cost: `stage_ms` a stage, plus `cost_ms(flops, bytes moved)` its nodes."""

    stage_ms: float

    def cost_ms(self, flops: float, nbytes: float) -> float: ...


@dataclass(frozen=True)
class StaticCost:
    """The `Placer` that estimates: a block costs its provider's stage plus its nodes' FLOPs and bytes moved."""

    models: Mapping[str, CostModel]  # provider label -> its cost model

    def place(self, a: Analysis) -> Placement:
        graph = a.graph
        units = blocks(graph, a.support, a.pinned)
        allowed = [allowed_providers(graph, a.support, a.pinned, b) for b in units]
        for block, options in zip(units, allowed):
            if not options:
                node = graph.nodes[block[0]]
                raise ProviderError(f"no provider of the target can run node {node.name!r} ({node.op_type})")
        costs = [{p: self._estimate(a, p, block) for p in options} for block, options in zip(units, allowed)]
        entry = {p: Measurement(m.stage_ms, 0.0, 0) for p, m in self.models.items()}
        choice = expand(units, cheapest_path(allowed, costs, [entry] * len(units)))
        return Placement("static", tuple(choice), blocks=[
            Block(b, graph.nodes[b[0]].name, graph.nodes[b[-1]].name, size, figures)
            for b, size, figures in zip(units, boundary_classes(graph, units), costs)])

    def _estimate(self, a: Analysis, label: str, block: tuple[int, ...]) -> Measurement:
        """An estimated figure (no rounds: nothing was timed)."""
        model, nodes = self.models[label], [a.graph.nodes[i] for i in block]
        return Measurement(model.stage_ms + sum(model.cost_ms(flops(a.graph, n), moved(a.graph, n)) for n in nodes),
                           0.0, 0)
