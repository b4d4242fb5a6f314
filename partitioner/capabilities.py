"""Which nodes each provider can run: its declarative table, refined by the runtime's own query."""

from __future__ import annotations

import logging

import onnx

from uhop_onnx.graph import Graph
from uhop_onnx.providers import Provider, Support
from uhop_onnx.providers.capability import check

from .extract import extract

log = logging.getLogger(__name__)


def capabilities(model: onnx.ModelProto, graph: Graph, provider: Provider, query: bool = True) -> dict[str, Support]:
    """Node name -> Support for one provider.

    The table decides first; with `query`, the nodes it accepts are cut out as one model and put to the
    runtime's query. Where the runtime cannot take that model whole, each node is asked alone.
    """
    verdicts = {n.name: check(provider.table, n, graph) for n in graph.nodes}
    accepted = [n.index for n in graph.nodes if verdicts[n.name].ok]
    if not accepted or not query:
        return verdicts
    try:
        verdicts.update(provider.query(extract(model, graph, accepted, name="query")))
    except Exception as error:  # noqa: BLE001 - any runtime failure means "ask node by node"
        log.debug("%s: query of %d nodes failed (%s); asking node by node", provider.id, len(accepted), error)
        for i in accepted:
            verdicts.update(_query_one(model, graph, provider, i))
    return verdicts


def _query_one(model: onnx.ModelProto, graph: Graph, provider: Provider, index: int) -> dict[str, Support]:
    name = graph.nodes[index].name
    try:
        return provider.query(extract(model, graph, [index], name="query"))
    except Exception as error:  # noqa: BLE001
        first = (str(error).strip().splitlines() or [type(error).__name__])[0][:300]
        return {name: Support(False, f"the runtime rejects it: {first}", "runtime")}
