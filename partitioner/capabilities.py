"""Which nodes each provider can run: its declarative table, refined by the runtime's own query; and what
an unlisted last resort may take."""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping, Sequence

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


def only_the_rest(support: Sequence[Mapping[str, Support]], labels: Sequence[str], keep: Collection[str] = ()
                  ) -> dict[str, Support]:
    """The answers of a last resort that was not listed (the last of `support`): "no" for every node a listed
    provider supports, except the nodes in `keep` (assigned to it)."""
    *listed, last = support
    answers = dict(last)
    for name, verdict in last.items():
        runners = [label for label, table in zip(labels, listed) if table[name].ok]
        if verdict.ok and runners and name not in keep:
            answers[name] = Support(False, f"a listed provider runs it ({', '.join(runners)}); {labels[-1]}, not "
                                    "listed, takes only the nodes none of them runs", "list")
    return answers


def _query_one(model: onnx.ModelProto, graph: Graph, provider: Provider, index: int) -> dict[str, Support]:
    name = graph.nodes[index].name
    try:
        return provider.query(extract(model, graph, [index], name="query"))
    except Exception as error:  # noqa: BLE001
        first = (str(error).strip().splitlines() or [type(error).__name__])[0][:300]
        return {name: Support(False, f"the runtime rejects it: {first}", "runtime")}
