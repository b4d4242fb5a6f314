"""Placement by measured cost: the assignment that makes the whole model fastest.

1. Blocks (`blocks.py`) are timed on every provider that can run them whole; each provider's cost of
   entering a stage, and for each ordered pair of providers the cost of a stage on the second right after
   one on the first (the tensor handed over as the session does: left on a device both share, else copied
   to the host), are timed per size class of the tensors live where blocks start (powers of 16 bytes, from
   4 KiB): what a boundary of that size costs.
2. A dynamic programme over the blocks in topological order picks, for each block, the provider that
   minimises the summed block costs plus the boundaries paid where the provider changes.
3. That plan, the greedy plan, and each provider's own plan (that provider first, the rest filling in) are
   built and timed whole, in alternating rounds; the fastest wins, so the result is never slower by the
   profiler's own figures than the best single provider; plans within 10% of the fastest are timed again
   in fresh processes and keep their faster figure. While the budget lasts, moving a stage's blocks to
   another provider (a neighbour's first, merging the two) is tried and kept when it beats the noise.
4. With a `gate` (reduced precision), a candidate is a (provider, precision) pair wherever a provider is
   one above (each variant is its own entry in `providers`), and a whole plan is chosen only if the gate
   accepts its outputs: the fastest accepted plan wins; a rejected one is never chosen, however fast.

A measurement that fails (the runtime raises while building or running) is recorded with its error, as
the provider that raised it said it, and is never a figure: a block is placed only where it was
measured, a failed entry or boundary is treated as not measured, and a whole plan that failed is never
chosen; when every whole plan fails, the search raises `MeasurementError` listing each one's error.

Every figure goes to the on-disk cache keyed by content hash, provider, version, threads and device.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np
import onnx

from uhop_onnx.cache import JsonTable
from uhop_onnx.errors import MeasurementError, ProviderError, first_line
from uhop_onnx.executor import hand_over
from uhop_onnx.graph import Graph
from uhop_onnx.inputs import feeds_digest
from uhop_onnx.providers import Provider, Runner, Support
from uhop_onnx.samples import shapes_text

from .blocks import blocks, live_tensors
from .extract import extract
from .placement import first_supported
from .profiler import Measurement, Profiler, build
from .static_cost import nbytes

log = logging.getLogger(__name__)

Placement = list[int]
CONTENDERS = 0.10  # whole plans within this share of the fastest are timed again before one is chosen
SMALLEST_CLASS = 1 << 12  # boundary size classes: 4 KiB, 64 KiB, 1 MiB, ... (each 16 times the last)
PlanTimer = Callable[[Mapping[str, Placement]], dict[str, Measurement]]  # named placements -> their whole figures
# A placement -> whether its outputs are within the accuracy budget, and its figures (None: nothing to check)
Gate = Callable[[Placement], tuple[bool, dict[str, Any] | None]]


def in_process(run_plan: Callable[[Placement], Callable[[], object]], profiler: Profiler) -> PlanTimer:
    """Time whole plans in this process with `profiler`; `run_plan` makes a call that runs a placement's plan."""
    def time_plans(placements: Mapping[str, Placement]) -> dict[str, Measurement]:
        calls, failed = build({name: (lambda pl=pl: run_plan(pl)) for name, pl in placements.items()})
        return profiler.measure(calls) | failed

    return time_plans


@dataclass
class Search:
    """What the measured placement needs, and what it found."""

    model: onnx.ModelProto
    graph: Graph
    providers: list[Provider]
    support: list[dict[str, Support]]
    pinned: dict[str, int]
    time_plans: PlanTimer
    feeds: Mapping[str, np.ndarray]  # the model's inputs every measurement runs on
    profiler: Profiler = field(default_factory=Profiler)
    store: JsonTable | None = None
    budget_s: float = 60.0
    threads: int | None = None
    gate: Gate | None = None
    report: dict[str, Any] = field(default_factory=dict)
    _known: dict[str, Any] = field(default_factory=dict, repr=False)  # the cache as read
    _fresh: dict[str, Any] = field(default_factory=dict, repr=False)  # measured in this search
    _hits: set[str] = field(default_factory=set, repr=False)  # keys whose cached figure this search used
    _failed: dict[str, str] = field(default_factory=dict, repr=False)  # block, entry, pair key -> its error
    _gated: dict[str, tuple[bool, dict[str, Any] | None]] = field(default_factory=dict, repr=False)  # by candidate

    def run(self) -> Placement:
        started = time.monotonic()
        self._known = self.store.read() if self.store else {}
        labels = [p.label for p in self.providers]
        greedy = self._prefer(range(len(self.providers)))  # raises, naming it, when a node runs nowhere
        units = blocks(self.graph, self.support, self.pinned)
        allowed = [allowed_providers(self.graph, self.support, self.pinned, b) for b in units]
        block_costs = self._block_costs(units, allowed)
        measured = [[p for p in ps if block_costs[k][p].ok] for k, ps in enumerate(allowed)]
        classes = boundary_classes(self.graph, units)
        entry, boundary = self._entry_costs(classes, allowed)
        entries = [{p: entry[p, c] for p in ps if entry[p, c].ok} for ps, c in zip(measured, classes)]
        crossings = [{(q, p): m for (q, p, size), m in boundary.items() if size == c and m.ok} for c in classes]
        candidates = {}
        if all(measured):
            candidates["searched"] = expand(len(self.graph.nodes), units,
                                            cheapest_path(measured, block_costs, entries, crossings))
        candidates["first-supported"] = greedy
        for p, label in enumerate(labels):
            candidates[f"{label} first"] = self._prefer([p, *(q for q in range(len(labels)) if q != p)])
        whole = self._measure_plans(_unique(candidates))
        timed = [name for name, m in whole.items() if m.ok]
        if not timed:
            raise self._none_timed(candidates, whole)
        accepted = [name for name in sorted(timed, key=lambda name: whole[name].ms)
                    if self._accepts(name, candidates[name])]
        if not accepted:
            raise MeasurementError("every candidate plan was outside the accuracy tolerance: "
                                   + ", ".join(sorted(timed)))
        best = self._improve(candidates, whole, accepted[0], units, measured, started)
        self.report = {
            "placement": "measured",
            "chosen": best,
            "candidates": {name: {**m.to_json(), "ms": _finite(m.ms), "stages": _stage_labels(candidates[name], labels),
                                  **self._accuracy(name)}
                           for name, m in whole.items()},
            "blocks": [{"first": self.graph.nodes[b[0]].name, "last": self.graph.nodes[b[-1]].name, "nodes": len(b),
                        "boundary_bytes": size, "ms": {labels[p]: c.ms for p, c in costs.items() if c.rounds}}
                       for b, size, costs in zip(units, classes, block_costs)],
            "entry_ms": _by_class({(labels[p], size): m for (p, size), m in entry.items()}),
            "boundary_ms": _by_class({(f"{labels[q]}>{labels[p]}", size): m for (q, p, size), m in boundary.items()}),
            "failures": [{"kind": key.split("|")[0], "on": _measured_on(key), "error": error}
                         for key, error in self._failed.items()],
            "measured": len(self._fresh),
            "cached": len(self._hits),
            "seconds": round(time.monotonic() - started, 3),
            "budget_s": self.budget_s,
            "threads": self.threads,
        }
        if self.store:
            self.store.update(self._fresh)
        return candidates[best]

    def _accepts(self, name: str, placement: Placement) -> bool:
        """Whether the gate (if any) accepts the placement's outputs; remembered by candidate name."""
        if self.gate is None:
            return True
        if name not in self._gated:
            self._gated[name] = self.gate(placement)
            if not self._gated[name][0]:
                log.info("candidate %s is outside the accuracy tolerance: %s", name, self._gated[name][1])
        return self._gated[name][0]

    def _accuracy(self, name: str) -> dict[str, Any]:
        """A candidate's report entries from the gate: its outputs' errors, and whether it was rejected."""
        if name not in self._gated or self._gated[name][1] is None:
            return {}
        ok, figures = self._gated[name]
        return {"accuracy": figures, "rejected": not ok}

    def _none_timed(self, candidates: Mapping[str, Placement], whole: Mapping[str, Measurement]) -> MeasurementError:
        """The error when no whole plan could be timed: the sample shapes, and each candidate's error."""
        labels = [p.label for p in self.providers]
        shapes = shapes_text(self.feeds)
        listed = "\n".join(f"  {name} ({_stage_labels(candidates[name], labels)}): {m.error}"
                           for name, m in whole.items())
        return MeasurementError(f"no candidate plan could be timed on sample inputs of shapes {shapes}; "
                                f"each one's error:\n{listed}")

    # -- what may run where

    def _prefer(self, order: Sequence[int]) -> Placement:
        order = list(order)
        ranked = first_supported(self.graph, [self.support[p] for p in order],
                                 {n: order.index(p) for n, p in self.pinned.items()},
                                 [self.providers[p].label for p in order])
        return [order[r] for r in ranked]

    # -- measuring, through the cache

    def _lookup(self, keys: Iterable[str]) -> dict[str, Measurement]:
        """The figures the cache holds for `keys` (a failure an older version cached is not a figure)."""
        found = {k: Measurement.from_json(self._known[k]) for k in set(keys) if k in self._known}
        found = {k: m for k, m in found.items() if m.ok}
        self._hits.update(found)
        return found

    def _remember(self, fresh: Mapping[str, Measurement]) -> None:
        """Keep the figures for the cache; a failure is never cached."""
        self._fresh.update({k: m.to_json() for k, m in fresh.items() if m.ok})

    def _cached(self, jobs: Mapping[str, Callable[[], Callable[[], object]]], together: bool = False
                ) -> dict[str, Measurement]:
        """Measure the jobs whose keys the cache does not hold (all of them, `together`, unless it holds
        every one: figures that are compared must come from the same rounds); `jobs` build their call
        lazily. A job that fails to build or run is a failure, so no choice falls on it."""
        found = self._lookup(jobs)
        if together and len(found) < len(jobs):
            self._hits.difference_update(found)
            found = {}
        calls, failed = build({key: job for key, job in jobs.items() if key not in found})
        fresh = self.profiler.measure(calls) | failed
        for key, m in fresh.items():
            if not m.ok:
                log.warning("not measured: %s on %s (%s)", key.split("|")[0], _measured_on(key), m.error)
                self._failed[key] = m.error or "no figure"
        self._remember(fresh)
        return found | fresh

    def _key(self, kind: str, provider: Provider, content: str) -> str:
        return f"{kind}|{provider.label}|{_version(provider)}|threads={self.threads}|{content}|{self._at}"

    @cached_property
    def _at(self) -> str:
        """What the figures were measured on: the inputs' shapes and a digest of their values."""
        shapes = ",".join(f"{n}={'x'.join(map(str, np.shape(v)))}" for n, v in sorted(self.feeds.items()))
        return f"at={shapes}@{feeds_digest(self.feeds)}"

    def _block_costs(self, units: Sequence[Sequence[int]], allowed: Sequence[Sequence[int]]) -> list[dict[int, Measurement]]:
        models = [extract(self.model, self.graph, b, name=f"block_{k}") for k, b in enumerate(units)]
        digests = [hashlib.sha256(m.SerializeToString(deterministic=True)).hexdigest() for m in models]
        keys = {(k, p): self._key("block", self.providers[p], digests[k]) for k, ps in enumerate(allowed) for p in ps}
        feeds = _Feeds(self)
        runners: dict[tuple[int, int], Runner] = {}

        def job(k: int, p: int) -> Callable[[], object]:
            block_feeds = feeds.for_block(k, models, allowed, runners)
            if (k, p) not in runners:
                runners[k, p] = _compiled(self.providers[p], models[k])
            runner = runners[k, p]
            return lambda: _raised_by(self.providers[p], runner.run, block_feeds)

        measured = self._cached({key: (lambda k=k, p=p: job(k, p)) for (k, p), key in keys.items()})
        return [{p: measured[keys[k, p]] for p in ps} for k, ps in enumerate(allowed)]

    def _entry_costs(self, classes: Sequence[int], allowed: Sequence[Sequence[int]]
                     ) -> tuple[dict[tuple[int, int], Measurement], dict[tuple[int, int, int], Measurement]]:
        """Per boundary size class c: each provider's cost of a stage that does almost nothing (one Relu
        over c bytes) fed from the host, keyed (p, c); and for each ordered pair (q, p), the cost of such a
        stage on p right after one on q, less q's own, keyed (q, p, c)."""
        used = sorted({p for ps in allowed for p in ps})
        runners: dict[tuple[int, int], Runner] = {}

        def runner(p: int, size: int) -> Runner:
            if (p, size) not in runners:
                runners[p, size] = _raised_by(self.providers[p], self.providers[p].compile,
                                             _entry_model(size // 4, self.model), exclusive=False)
            return runners[p, size]

        def alone(p: int, size: int) -> Callable[[], object]:
            data = {"x": np.zeros(size // 4, np.float32)}
            return lambda: _raised_by(self.providers[p], runner(p, size).run, data)

        def pair(q: int, p: int, size: int) -> Callable[[], object]:
            first, second, data = runner(q, size), runner(p, size), {"x": np.zeros(size // 4, np.float32)}
            return lambda: _raised_by(self.providers[p], second.run, {
                "x": hand_over(_raised_by(self.providers[q], first.run, data)["y"], first, second)})

        sizes = sorted(set(classes))
        keys = {(p, c): self._key("entry", self.providers[p], f"bytes={c}") for p in used for c in sizes}
        pairs = {(q, p, c): self._key("pair", self.providers[p], f"after={self.providers[q].label}@"
                                      f"{_version(self.providers[q])}|bytes={c}")
                 for q in used for p in used if q != p for c in sizes}
        measured = self._cached({key: (lambda p=p, c=c: alone(p, c)) for (p, c), key in keys.items()}
                                | {key: (lambda q=q, p=p, c=c: pair(q, p, c)) for (q, p, c), key in pairs.items()},
                                together=True)
        entry = {pc: measured[key] for pc, key in keys.items()}
        boundary = {(q, p, c): _less(measured[key], entry[q, c]) for (q, p, c), key in pairs.items()}
        return entry, boundary

    def _measure_plans(self, placements: Mapping[str, Placement]) -> dict[str, Measurement]:
        digest = hashlib.sha256(self.model.SerializeToString(deterministic=True)).hexdigest()
        versions = ",".join(f"{p.label}@{_version(p)}" for p in self.providers)
        keys = {name: f"plan|{digest}|{versions}|threads={self.threads}|{self._at}|"
                      f"{_stage_labels(pl, [p.label for p in self.providers])}"
                f"|{','.join(map(str, pl))}" for name, pl in placements.items()}
        found = self._lookup(keys.values())
        missing = {name: pl for name, pl in placements.items() if keys[name] not in found}
        measured = self._confirmed(missing) if missing else {}
        fresh = {keys[name]: m for name, m in measured.items()}
        self._remember(fresh)
        return {name: (found | fresh)[keys[name]] for name in placements}

    def _confirmed(self, placements: Mapping[str, Placement]) -> dict[str, Measurement]:
        """Whole figures, the close contenders timed a second time (a fresh process each, when the timer
        makes processes) and kept at the faster: one process may run a plan 10-20% slower than the next."""
        first = self.time_plans(placements)
        fastest = min(m.ms for m in first.values())
        close = {name: placements[name] for name, m in first.items() if m.ok and m.ms <= fastest * (1 + CONTENDERS)}
        if len(close) < 2:
            return first
        again = self.time_plans(close)
        return {name: _again(m, again[name]) if name in again else m for name, m in first.items()}

    def _improve(self, candidates: dict[str, Placement], whole: dict[str, Measurement], best: str,
                 units: Sequence[Sequence[int]], allowed: Sequence[Sequence[int]], started: float) -> str:
        """Move runs of blocks to another provider (a neighbouring run's first: a merge) while that beats the
        noise and time remains."""
        tried = {tuple(pl) for pl in candidates.values()}
        improved = True
        while improved and time.monotonic() - started < self.budget_s:
            improved = False
            current = candidates[best]
            choice = [current[b[0]] for b in units]
            for alternative in _moves(choice, allowed):
                placement = expand(len(self.graph.nodes), units, alternative)
                if tuple(placement) in tried or time.monotonic() - started >= self.budget_s:
                    continue
                tried.add(tuple(placement))
                name = f"moved {len(tried)}"
                candidates[name] = placement
                result = self._measure_plans({name: placement, best: current})
                whole[name] = result[name]
                margin = max(result[name].spread, result[best].spread, 0.01)
                if result[name].ms < result[best].ms * (1 - margin) and self._accepts(name, placement):
                    best, improved = name, True
                    break
        return best


class _Feeds:
    """Sample values of every tensor, made by running the blocks once in order on a provider each."""

    def __init__(self, search: Search):
        self.search = search
        self.values: dict[str, np.ndarray] = dict(search.feeds)
        self.done = 0

    def for_block(self, k: int, models, allowed, runners: dict[tuple[int, int], Runner]) -> dict[str, np.ndarray]:
        while self.done < k:
            self._run(self.done, models, allowed, runners)
            self.done += 1
        return {i.name: self.values[i.name] for i in models[k].graph.input if i.name in self.values}

    def _run(self, k: int, models, allowed, runners) -> None:
        """Block k's results, from the first provider that runs it; a `ProviderError` naming each
        provider's error when none does (the blocks after it cannot be fed)."""
        feeds = {i.name: self.values[i.name] for i in models[k].graph.input if i.name in self.values}
        errors = []
        for p in allowed[k]:
            provider = self.search.providers[p]
            try:
                if (k, p) not in runners:
                    runners[k, p] = _compiled(provider, models[k])
                results = _raised_by(provider, runners[k, p].run, feeds)
            except ProviderError as error:
                errors.append(str(error))
                continue
            self.values.update({name: np.asarray(v) for name, v in results.items()})
            return
        raise ProviderError(f"no sample values after block {k}, which failed on every provider: {'; '.join(errors)}")


def _raised_by(provider: Provider, call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """`call(*args, **kwargs)`; what it raises comes back as a `ProviderError` that names `provider`."""
    try:
        return call(*args, **kwargs)
    except Exception as error:  # noqa: BLE001 - a runtime may fail in any way; say whose it was
        text = first_line(error)
        raise ProviderError(text if text.startswith(f"{provider.label}:") else f"{provider.label}: {text}") from error


def _compiled(provider: Provider, model: onnx.ModelProto) -> Runner:
    """A block at the provider's precision (int8 quantized first), compiled to share the process."""
    return _raised_by(provider, lambda: provider.compile(provider.lower(model), exclusive=False))


def _version(provider: Provider) -> str:
    """What a provider's figures depend on besides its label: its runtime's version, and for an int8
    variant the calibration its stages were quantized on."""
    calibration = provider.calibration
    return f"{provider.availability.version}" + (f"+calibration={calibration.digest}" if calibration else "")


def allowed_providers(graph: Graph, support: Sequence[Mapping[str, Support]], pinned: Mapping[str, int],
                      block: Sequence[int]) -> list[int]:
    """The providers that run every node of `block`, and to which none of them is pinned elsewhere."""
    names = [graph.nodes[i].name for i in block]
    pins = {pinned[x] for x in names if x in pinned}
    return [p for p, table in enumerate(support) if all(table[x].ok for x in names) and pins <= {p}]


def expand(size: int, units: Sequence[Sequence[int]], choice: Sequence[int]) -> Placement:
    """A provider per block -> a provider per node."""
    placement = [0] * size
    for block, p in zip(units, choice):
        for i in block:
            placement[i] = p
    return placement


def cheapest_path(allowed: Sequence[Sequence[int]], costs: Sequence[Mapping[int, Measurement]],
                  entry: Sequence[Mapping[int, Measurement]],
                  boundary: Sequence[Mapping[tuple[int, int], Measurement]] | None = None) -> list[int]:
    """For each block, a provider, minimising block costs plus the boundary paid wherever the provider
    changes. `entry[k]` and `boundary[k]` are the figures at the size of what enters block k.

    A block's own figure includes one stage entry fed from the host, so consecutive blocks on one provider
    are charged the block figure less that entry, and a block after another provider q the block figure
    with the entry replaced by the boundary from q (when measured). For the same reason an entry is worth
    no more than the provider's cheapest block: a larger entry figure is work the probe stage did, not the
    boundary's price. `allowed` holds only measured providers; a missing entry or boundary is not subtracted."""
    used = {p for ps in allowed for p in ps}
    cheapest = {p: min(costs[k][p].ms for k, ps in enumerate(allowed) if p in ps) for p in used}
    best: dict[int, tuple[float, list[int]]] = {}
    for k, ps in enumerate(allowed):
        step: dict[int, tuple[float, list[int]]] = {}
        for p in ps:
            own = costs[k][p].ms
            probe = entry[k].get(p)  # absent where the entry was not measured: nothing is taken off
            inside = own if probe is None else max(own - min(probe.ms, cheapest[p]), 0.0)  # without its entry
            options = [(own, [p])] if not best else []
            for q, (total, path) in best.items():
                measured = boundary[k].get((q, p)) if boundary else None
                extra = inside if q == p else own if measured is None else inside + measured.ms
                options.append((total + extra, [*path, p]))
            step[p] = min(options, key=lambda o: o[0])
        best = step
    return min(best.values(), key=lambda o: o[0])[1]


def boundary_classes(graph: Graph, units: Sequence[Sequence[int]]) -> list[int]:
    """Per block, the size class of the tensors live where it starts (the graph's inputs, for the first)."""
    live = live_tensors(graph)
    classes = []
    for block in units:
        size, c = sum(nbytes(graph, t) for t in live[block[0]] or graph.inputs), SMALLEST_CLASS
        while c < size:
            c *= 16
        classes.append(c)
    return classes


def _by_class(figures: Mapping[tuple[str, int], Measurement]) -> dict[str, dict[str, float]]:
    """`{"openvino>litert": {"65536": 0.012}}` from figures keyed (..., size class); measured ones only."""
    out: dict[str, dict[str, float]] = {}
    for (name, size), m in figures.items():
        if m.rounds:
            out.setdefault(name, {})[str(size)] = m.ms
    return out


def _moves(choice: Sequence[int], allowed: Sequence[Sequence[int]]) -> list[list[int]]:
    """Alternatives where one run of same-provider blocks goes to another provider that runs all of it: first
    every merge into a neighbouring run's provider (a stage boundary fewer), then the other providers."""
    runs: list[list[int]] = []
    for k, p in enumerate(choice):
        if runs and choice[runs[-1][0]] == p:
            runs[-1].append(k)
        else:
            runs.append([k])
    merges, others = [], []
    for r, run in enumerate(runs):
        neighbours = {choice[runs[n][0]] for n in (r - 1, r + 1) if 0 <= n < len(runs)}
        for target in sorted(set.intersection(*(set(allowed[k]) for k in run)) - {choice[run[0]]}):
            moved = [target if k in run else p for k, p in enumerate(choice)]
            (merges if target in neighbours else others).append(moved)
    return merges + others


def _less(pair: Measurement, first: Measurement) -> Measurement:
    """A pair's figure less its first stage's own: what the boundary costs; a failure when either failed."""
    if not pair.ok or not first.ok:
        return pair if not pair.ok else Measurement.failed(first.error or "the first stage was not measured")
    return Measurement(max(pair.ms - first.ms, 0.0), pair.spread, pair.rounds)


def _again(first: Measurement, second: Measurement) -> Measurement:
    """Two timings of one plan: the faster, or the failure when the second failed."""
    return second if not second.ok else min(first, second, key=lambda m: m.ms)


def _measured_on(key: str) -> str:
    """The provider a figure's key measured (`openvino`), or for a boundary the pair (`openvino>ort-cpu`)."""
    kind, label, *_, content = key.split("|", 4)
    return f"{content.removeprefix('after=').split('@')[0]}>{label}" if kind == "pair" else label


def _finite(ms: float) -> float | None:
    """A figure for JSON: None for a candidate that failed (infinitely slow)."""
    return ms if ms != float("inf") else None


def _unique(candidates: Mapping[str, Placement]) -> dict[str, Placement]:
    seen: dict[tuple[int, ...], str] = {}
    for name, placement in candidates.items():
        seen.setdefault(tuple(placement), name)
    return {name: list(p) for p, name in seen.items()}


def _stage_labels(placement: Sequence[int], labels: Sequence[str]) -> str:
    """`openvino x12 > ort-cpu x3`: the providers along the topological order and how many nodes each runs."""
    runs: list[list[Any]] = []
    for p in placement:
        if runs and runs[-1][0] == p:
            runs[-1][1] += 1
        else:
            runs.append([p, 1])
    return " > ".join(f"{labels[p]} x{n}" for p, n in runs)


def _entry_model(elements: int, like: onnx.ModelProto) -> onnx.ModelProto:
    """A one-Relu model (every provider runs Relu) in the IR version and opset of `like`."""
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [elements])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [elements])
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"], name="entry")], "entry", [x], [y])
    opset = next((o.version for o in like.opset_import if o.domain in ("", "ai.onnx")), 17)
    return helper.make_model(graph, ir_version=like.ir_version, opset_imports=[helper.make_opsetid("", opset)])
