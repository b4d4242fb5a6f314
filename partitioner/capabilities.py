"""Which nodes each provider can run: its declarative table, refined by the runtime's own query and by the
check its compile makes; and what an unlisted last resort may take."""

from __future__ import annotations

from collections.abc import Collection, Mapping

import onnx

from uhop_onnx.foundation.errors import CheckError, first_line, logger
from uhop_onnx.foundation.graph import Graph
from uhop_onnx.providers import Provider, Support
from uhop_onnx.providers.capability import CapabilityTable, check

from .extract import extract

log = logger(__name__)


def capabilities(model: onnx.ModelProto, graph: Graph, provider: Provider, query: bool = True,
                 table: CapabilityTable | None = None) -> dict[str, Support]:
    """Node name -> Support for one provider.

    The table (`table`, else the provider's) decides first; with `query`, the nodes it accepts are cut out as
    one model and put to the runtime's query, and what that accepts to the provider's build-time check (the
    one its compile makes). Where the runtime cannot take that model whole, or the check fails, each node is
    asked alone; a node whose check fails alone is a "no" (source "check") with the check's reason, so
    placement gives it to the next provider that runs it.
    """
    verdicts = {n.name: check(table or provider.table, n, graph) for n in graph.nodes}
    accepted = [n.index for n in graph.nodes if verdicts[n.name].ok]
    if not accepted or not query:
        return verdicts
    if not provider.present:  # listed from its files, it fails its probe here: asked nothing, it runs nothing
        absent = Support(False, f"{provider.id} is not available: {provider.probed.reason}", "runtime")
        return {**verdicts, **{graph.nodes[i].name: absent for i in accepted}}
    try:
        verdicts.update(provider.query(extract(model, graph, accepted, name="query")))
    except Exception as error:  # noqa: BLE001 - any runtime failure means "ask node by node"
        log.debug("%s: query of %d nodes failed (%s); asking node by node", provider.id, len(accepted), error)
        for i in accepted:
            verdicts.update(_query_one(model, graph, provider, i))
    passed = [i for i in accepted if verdicts[graph.nodes[i].name].ok]
    if not passed:
        return verdicts
    try:
        provider.check(extract(model, graph, passed, name="check"))
    except Exception as error:  # noqa: BLE001 - which nodes fail is found one by one
        log.debug("%s: the check of %d nodes failed (%s); checking node by node", provider.id, len(passed), error)
        verdicts.update(_check_one(model, graph, provider, i) for i in passed)
    return verdicts


def only_the_rest(support: Mapping[str, Mapping[str, Support]], keep: Collection[str] = ()) -> dict[str, Support]:
    """The answers of a last resort that was not listed (the last of `support`, provider label -> node name
    -> Support): "no" for every node a listed provider supports, except the nodes in `keep` (assigned to it)."""
    *listed, (resort, last) = support.items()
    answers = dict(last)
    for name, verdict in last.items():
        runners = [label for label, table in listed if table[name].ok]
        if verdict.ok and runners and name not in keep:
            answers[name] = Support(False, f"a listed provider runs it ({', '.join(runners)}); {resort}, not "
                                    "listed, takes only the nodes none of them runs", "list")
    return answers


def _check_one(model: onnx.ModelProto, graph: Graph, provider: Provider, index: int) -> tuple[str, Support]:
    name = graph.nodes[index].name
    try:
        provider.check(extract(model, graph, [index], name=name))
    except CheckError as error:
        log.warning("%s fails its build check on node %r (%s); the node goes to the next provider that runs it",
                    provider.label, name, first_line(error))
        return name, Support(False, f"fails the build check: {first_line(error)}", "check")
    except Exception as error:  # noqa: BLE001 - a stage of this node alone would not build either
        return name, Support(False, f"the runtime rejects it: {first_line(error, 300)}", "runtime")
    return name, Support(True)


def _query_one(model: onnx.ModelProto, graph: Graph, provider: Provider, index: int) -> dict[str, Support]:
    name = graph.nodes[index].name
    try:
        return provider.query(extract(model, graph, [index], name="query"))
    except Exception as error:  # noqa: BLE001
        first = (str(error).strip().splitlines() or [type(error).__name__])[0][:300]
        return {name: Support(False, f"the runtime rejects it: {first}", "runtime")}


def whole_model(support: Mapping[str, Mapping[str, Support]], pinned: Mapping[str, str]) -> list[str]:
    """The providers (labels) whose answers refuse nodes, but only for want of a rank or length that shape
    inference could not find (source "unknown"), and to which every pin (if any) goes: compiling the whole
    model, the runtime may find them itself, so the search times their whole-model plans, which the accuracy
    gate checks."""
    return [label for label, answers in support.items()
            if any(not s.ok for s in answers.values()) and all(s.ok or s.source == "unknown" for s in answers.values())
            and set(pinned.values()) <= {label}]
