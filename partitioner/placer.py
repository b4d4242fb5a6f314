"""The placement interface: what a placer is given (`Analysis`), what it decides (`Placement`), and the
`Placer` protocol its three kinds share (first-supported, the measured search, the static cost model).

Providers are named by label (`openvino`, `openvino[bf16]`, `openvino:GPU`) everywhere here: in the
pins, the choice, the block figures and the boundary costs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import onnx

from uhop_onnx.foundation.graph import Graph
from uhop_onnx.runtime.measure import Measurement
from uhop_onnx.precision import Precision
from uhop_onnx.providers import Provider, Support

Choice = tuple[str, ...]  # the provider label of each node, in the graph's order


@dataclass
class Analysis:
    """A model as placement sees it: loaded, simplified, and what each provider can run of it."""

    source: Any
    loaded: onnx.ModelProto
    simplified: onnx.ModelProto
    graph: Graph
    providers: list[Provider]  # in preference order, each label once
    support: dict[str, dict[str, Support]]  # provider label -> node name -> Support, in preference order
    pinned: dict[str, str]  # node name -> provider label
    feeds: dict[str, Any] | None = None  # the inputs measurements run on (None: free dimensions without a default)
    precision: Precision | None = None  # the reduced precisions competing, and what they are gated on

    def provider(self, label: str) -> Provider:
        """The provider of `label`."""
        return next(p for p in self.providers if p.label == label)


@dataclass(frozen=True)
class Block:
    """A run of nodes placed as a unit, and its figure on each provider that could run it whole."""

    nodes: tuple[int, ...]  # indices into the graph, in run order
    first: str  # the names of its first and last nodes
    last: str
    boundary_bytes: int  # the size class of the tensors live where it starts
    ms: Mapping[str, Measurement]  # provider label -> its figure (measured, failed or estimated)

    def to_json(self) -> dict[str, Any]:
        return {"first": self.first, "last": self.last, "nodes": len(self.nodes), "boundary_bytes": self.boundary_bytes,
                "ms": {label: m.ms for label, m in self.ms.items() if m.rounds}}


@dataclass(frozen=True)
class Candidate:
    """A whole plan that was timed: its choice, its figure and, where the precision gate checked it, the
    worst errors of its outputs and whether it was rejected."""

    choice: Choice
    figure: Measurement
    stages: str  # `openvino x12 > ort-cpu x3`
    accuracy: dict[str, Any] | None = None
    rejected: bool = False

    def to_json(self) -> dict[str, Any]:
        checked = {} if self.accuracy is None else {"accuracy": self.accuracy, "rejected": self.rejected}
        ok = self.figure.ok
        return {**self.figure.to_json(), "ms": self.figure.ms if ok else None,
                "interval": [round(x, 4) for x in self.figure.interval] if ok else None,
                "stages": self.stages, **checked}


@dataclass(frozen=True)
class Failure:
    """A measurement that failed: a block or an entry on one provider, or a pair `(before, after)`."""

    kind: str  # "block", "entry" or "pair"
    on: tuple[str, ...]  # (label,) or, for a pair, (label before, label after)
    error: str

    def to_json(self) -> dict[str, str]:
        return {"kind": self.kind, "on": ">".join(self.on), "error": self.error}


@dataclass(frozen=True)
class Effort:
    """What a measured placement cost: block, entry and boundary figures measured now and taken from the
    cache, seconds taken, and whether the search ran to its end (`complete`) or stopped at its budget."""

    measured: int
    cached: int
    seconds: float
    budget_s: float
    threads: int | None
    complete: bool = True


@dataclass(frozen=True)
class Undecided:
    """A decision between two whole plans that the budget ended before it settled: the plan that looked
    faster, the other, how many times as fast it looked (the other's figure over its own), on how many
    rounds, the plan chosen, and the budget that would give the timings still needed."""

    faster: str
    slower: str
    ratio: float
    rounds: int
    chosen: str
    budget_s: float

    def to_json(self) -> dict[str, Any]:
        return {"faster": self.faster, "slower": self.slower, "ratio": round(self.ratio, 4), "rounds": self.rounds,
                "chosen": self.chosen, "budget_s": self.budget_s}


@dataclass(frozen=True)
class StageCosts:
    """A stage's measured cost on every provider that ran all its blocks, and the boundary paid entering it."""

    alternatives: dict[str, float]
    boundary_ms: float | None


@dataclass(frozen=True)
class Placement:
    """Which provider runs each node, and what the choice was made on."""

    method: str  # "first-supported", "measured" or "static"
    choice: Choice
    chosen: str | None = None  # the name of the whole plan chosen (measured)
    plans: Mapping[str, Candidate] = field(default_factory=dict)  # the whole plans timed, by name
    blocks: Sequence[Block] = ()
    entries: Mapping[str, Mapping[int, Measurement]] = field(default_factory=dict)  # label -> size class -> figure
    # (label before, label after) -> size class -> the cost of a stage on `after` right after one on `before`
    boundaries: Mapping[tuple[str, str], Mapping[int, Measurement]] = field(default_factory=dict)
    failures: Sequence[Failure] = ()
    effort: Effort | None = None  # None: nothing was timed
    undecided: Undecided | None = None  # the decision the budget ended before it settled
    unmeasured: str | None = None  # why the chosen plan has no figure (None: it was timed)

    def stage_costs(self, stages: Sequence[tuple[str, Sequence[str]]]) -> list[StageCosts]:
        """For stages given as (provider label, node names) in run order: the summed figures of the blocks
        that start in each, on every provider measured on all of them, and the boundary (measured at the
        size of what enters its first block) from the stage before."""
        stage_of = {node: k for k, (_, nodes) in enumerate(stages) for node in nodes}
        costs = []
        for k, (label, _) in enumerate(stages):
            mine = [b for b in self.blocks if stage_of.get(b.first) == k]
            measured = [{p for p, m in b.ms.items() if m.rounds} for b in mine]
            options = set.intersection(*measured) if mine else set()
            order = [p for b in mine[:1] for p in b.ms if p in options]  # a block's figures are in preference order
            boundary = None
            if k > 0 and mine:
                figure = self.boundaries.get((stages[k - 1][0], label), {}).get(mine[0].boundary_bytes)
                boundary = figure.ms if figure is not None and figure.rounds else None
            costs.append(StageCosts({p: round(sum(b.ms[p].ms for b in mine), 4) for p in order}, boundary))
        return costs

    def to_json(self) -> dict[str, Any] | None:
        """The measured placement's report (a plan's `profile`); None for a placement that timed nothing."""
        effort = self.effort
        if effort is None:
            return None
        return {
            "placement": self.method,
            "chosen": self.chosen,
            "candidates": {name: c.to_json() for name, c in self.plans.items()},
            "blocks": [b.to_json() for b in self.blocks],
            "entry_ms": _measured({(label,): by_size for label, by_size in self.entries.items()}),
            "boundary_ms": _measured(self.boundaries),
            "failures": [f.to_json() for f in self.failures],
            "measured": effort.measured,
            "cached": effort.cached,
            "seconds": effort.seconds,
            "budget_s": effort.budget_s,
            "threads": effort.threads,
            "complete": effort.complete,
            **({"undecided": self.undecided.to_json()} if self.undecided else {}),
            **({"unmeasured": self.unmeasured} if self.unmeasured else {}),
        }


class Placer(Protocol):
    """Decides which provider runs each node of an analysed model."""

    def place(self, analysis: Analysis) -> Placement: ...


def _measured(figures: Mapping[tuple[str, ...], Mapping[int, Measurement]]) -> dict[str, dict[str, float]]:
    """`{"openvino>litert": {"65536": 0.012}}`: the measured figures only, a key with none left out."""
    out: dict[str, dict[str, float]] = {}
    for key, by_size in figures.items():
        for size, m in by_size.items():
            if m.rounds:
                out.setdefault(">".join(key), {})[str(size)] = m.ms
    return out
