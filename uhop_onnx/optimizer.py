"""`optimize`: model -> graph -> capabilities -> placement -> stages -> Plan."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import onnx
from onnx import numpy_helper

from .bench import time_plans_in_processes
from .cache import JsonTable, cache_dir, device_fingerprint
from .errors import PlanError
from .graph import Graph
from .loader import load
from .partitioner.capabilities import capabilities
from .partitioner.extract import extract
from .partitioner.partition import partition
from .partitioner.placement import first_supported
from .partitioner.profiler import Profiler
from .partitioner.search import Search, in_process
from .plan import Plan, Stage
from .providers import (
    LAST_RESORT,
    Provider,
    ProviderSpec,
    Support,
    create,
    parse_spec,
    resolve,
)
from .samples import sample_feeds
from .session import InferenceSession
from .simplify import simplify


@dataclass
class Analysis:
    """A model as placement sees it: loaded, simplified, and what each provider can run of it."""

    source: Any
    loaded: onnx.ModelProto
    simplified: onnx.ModelProto
    graph: Graph
    providers: list[Provider]  # in preference order
    support: list[dict[str, Support]]  # per provider: node name -> Support
    pinned: dict[str, int]  # node name -> index into providers


def analyze(model: str | os.PathLike | onnx.ModelProto, providers: Sequence[ProviderSpec] | None = None,
            assign: Mapping[str, str] | None = None, threads: int | None = None,
            progress: Callable[[str], None] = lambda step: None, *,
            chosen: list[Provider] | None = None) -> Analysis:
    """Load, check and simplify `model`, and ask every provider which of its nodes it can run.

    `chosen` gives the provider objects directly (a target board's, present here or not); a provider not
    present on this host answers from its table alone.
    """
    progress("loading and checking the model")
    loaded = load(model)
    progress("simplifying the graph")
    simplified = simplify(loaded)
    graph = Graph.from_model(simplified)
    extend = chosen is None
    chosen = resolve(providers, threads) if chosen is None else list(chosen)
    pinned = _pins(assign or {}, loaded, graph, chosen, threads, extend)
    support = []
    for provider in chosen:
        progress(f"asking {provider.label} what it can run")
        support.append(capabilities(simplified, graph, provider, query=provider.present))
    return Analysis(model, loaded, simplified, graph, chosen, support, pinned)


def optimize(model: str | os.PathLike | onnx.ModelProto, providers: Sequence[ProviderSpec] | None = None,
             assign: Mapping[str, str] | None = None, profile: bool = True, threads: int | None = None, *,
             budget: float = 60.0, profiler: Profiler | None = None,
             progress: Callable[[str], None] = lambda step: None) -> Plan:
    """Place every node of `model` on a provider and split it into stages.

    `providers` lists provider ids (or `(id, options)`) in preference order; None means every provider
    present. `assign` pins nodes (by name in the loaded model) to provider ids. With `profile`, candidate
    placements are measured on this machine (within `budget` seconds for the search, figures cached on
    disk) and the fastest is kept; without it, each node goes to the first provider that supports it.
    Whole plans are timed each in its own process, as they will run; a given `profiler` times everything
    in this process instead (with a fake clock, tests get exact figures).
    """
    a = analyze(model, providers, assign, threads, progress)
    if not profile:
        progress("placing nodes and cutting stages")
        return build_plan(a, first_supported(a.graph, a.support, a.pinned, [p.label for p in a.providers]), threads)
    return place_measured(a, threads, budget=budget, profiler=profiler, progress=progress)


def place_measured(a: Analysis, threads: int | None, *, budget: float = 60.0, profiler: Profiler | None = None,
                   progress: Callable[[str], None] = lambda step: None) -> Plan:
    """The plan of `a` that measures fastest on this machine (see `optimize`)."""
    labels = [p.label for p in a.providers]
    progress("measuring candidate placements")
    if profiler is None:
        def time_plans(placements):
            return time_plans_in_processes({name: build_plan(a, pl, threads) for name, pl in placements.items()},
                                           threads)
    else:
        feeds = sample_feeds(a.graph.signature(name) for name in a.graph.inputs)

        def run_plan(placement: list[int]):
            session = InferenceSession(build_plan(a, placement, threads), threads=threads)
            return lambda: session.run(None, feeds)

        time_plans = in_process(run_plan, profiler)
    store = JsonTable(cache_dir() / "profiles" / f"{device_fingerprint(threads, *labels)}.json")
    search = Search(a.simplified, a.graph, a.providers, a.support, a.pinned, time_plans,
                    profiler=profiler or Profiler(), store=store, budget_s=budget, threads=threads)
    placement = search.run()
    plan = build_plan(a, placement, threads)
    plan.placement, plan.profile = "measured", search.report
    _attribute_costs(plan, a, search)
    return plan


def _attribute_costs(plan: Plan, a: Analysis, search: Search) -> None:
    """Give each stage the measured cost of its blocks on its provider, on every provider that could run
    them all, and the boundary paid where it follows another stage, at the size of what enters it."""
    labels = [p.label for p in a.providers]
    blocks = search.report["blocks"]
    stage_of = {node: k for k, stage in enumerate(plan.stages) for node in stage.nodes}
    for k, stage in enumerate(plan.stages):
        mine = [b for b in blocks if stage_of.get(b["first"]) == k]
        options = set.intersection(*(set(b["ms"]) for b in mine)) if mine else set()
        stage.alternatives = {label: round(sum(b["ms"][label] for b in mine), 4) for label in labels if label in options}
        stage.cost_ms = stage.alternatives.get(stage.label)
        if k > 0 and mine:
            pair = search.report["boundary_ms"].get(f"{plan.stages[k - 1].label}>{stage.label}", {})
            stage.boundary_ms = pair.get(str(mine[0]["boundary_bytes"]))


def build_plan(a: Analysis, placement: Sequence[int], threads: int | None) -> Plan:
    """The plan of a placement: convex stages, each extracted as its own model."""
    graph = a.graph
    stages = []
    for k, spec in enumerate(partition(graph, placement)):
        provider = a.providers[spec.provider]
        stage_model = extract(a.simplified, graph, spec.nodes, name=f"stage_{k}")
        stages.append(Stage(
            provider=provider.id,
            options=dict(provider.options),
            nodes=[graph.nodes[i].name for i in spec.nodes],
            inputs=[i.name for i in stage_model.graph.input],
            outputs=[o.name for o in stage_model.graph.output],
            file=f"stage_{k:02d}_{provider.id}.onnx",
            model=stage_model,
        ))
    return Plan(
        model_name=_model_name(a.source, a.loaded),
        model_hash=hashlib.sha256(a.loaded.SerializeToString(deterministic=True)).hexdigest(),
        inputs=[graph.signature(name) for name in graph.inputs],
        outputs=[graph.signature(name) for name in graph.outputs],
        providers=[{"id": p.id, "options": dict(p.options), "version": p.availability.version} for p in a.providers],
        stages=stages,
        constants={t.name: numpy_helper.to_array(t) for t in a.simplified.graph.initializer if t.name in graph.outputs},
        threads=threads,
    )


def _pins(assign: Mapping[str, str], loaded: onnx.ModelProto, graph: Graph, chosen: list[Provider],
          threads: int | None, extend: bool) -> dict[str, int]:
    """Node name -> index into `chosen`. An assigned provider missing from `chosen` joins it, before the
    last resort, when `extend`; names of nodes that simplification removed are ignored."""
    known = {n.name for n in loaded.graph.node}
    for node, spec in assign.items():
        if node not in known:
            sample = ", ".join(sorted(known)[:10])
            raise PlanError(f"assign: no node named {node!r} in the model (nodes include: {sample})")
        if _find(chosen, spec) is None and not extend:
            raise PlanError(f"assign: {spec!r} is not among the providers ({', '.join(p.label for p in chosen)})")
        if _find(chosen, spec) is None:
            provider = create(spec, threads)
            provider.require()
            chosen.insert(len(chosen) - (chosen[-1].id == LAST_RESORT), provider)
    return {node: _find(chosen, spec) for node, spec in assign.items() if node in graph.index_of}


def _find(chosen: list[Provider], spec: ProviderSpec) -> int | None:
    ident, options = parse_spec(spec)
    return next((i for i, p in enumerate(chosen) if p.id == ident and (not options or p.options == options)), None)


def _model_name(source, loaded: onnx.ModelProto) -> str:
    if isinstance(source, (str, os.PathLike)):
        return os.path.splitext(os.path.basename(os.fspath(source)))[0]
    return loaded.graph.name or "model"
