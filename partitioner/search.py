"""Placement by measured cost: the assignment that makes the whole model fastest, found by an anytime search
that stops at its deadline with the best plan found so far. What settles the most comes first:

1. The greedy plan, each provider's own plan (that provider first, the rest filling in) and each whole-model
   plan (`capabilities.whole_model`: a provider our rules refuse nodes only for want of a rank or length)
   are built and timed whole, in alternating rounds: a valid plan at once. The simplest of them (fewest
   stages, then ONNX Runtime alone, then fastest) is the best so far, and the budget goes first to the
   decision that can change it: a plan faster beyond the noise (`profiler.faster`: round by round, in the
   same rounds), the fastest first, is timed again with it, the two alternating round by round, and takes
   its place when faster beyond the noise in two of (at most) three timings (afresh, in fresh processes
   when the timer makes processes: one process may run a plan 10-20% slower than the next).
2. Blocks (`blocks.py`) are timed on the providers that can run them whole, the providers whose own plans
   were fastest first, one block at a time; then each provider's cost of entering a stage, and for each
   ordered pair of providers the cost of a stage on the second right after one on the first (the tensor
   handed over as the session does: left on a device both share, else copied to the host), per size class
   of the tensors live where blocks start (powers of 16 bytes, from 4 KiB): what a boundary of that size
   costs.
3. Once every block has a figure, a dynamic programme over the blocks in topological order picks, for each
   block, the provider that minimises the summed block costs plus the boundaries paid where the provider
   changes; that plan challenges the best so far. While time remains, moving a stage's blocks to another
   provider (a neighbour's first, merging the two) challenges it in turn.
4. With a `gate` (reduced precision), a candidate is a (provider, precision) pair wherever a provider is
   one above (each variant is its own entry in `providers`), and a whole plan is chosen only if the gate
   accepts its outputs: the fastest accepted plan wins; a rejected one is never chosen, however fast.
   When the fastest plan is rejected, plans that keep its providers on a prefix of the blocks where it
   differs from the fastest accepted one (the rest as there) are gated, the longest accepted prefix found
   by bisection, and timed: partial precision, e.g. int8 early in a network and bf16 where int8 errs.
5. A decision the budget ends before it is settled leaves the best so far, and is recorded (`Undecided`:
   which plan looked faster, by how much, on how many rounds, and the budget that would settle it). Last,
   no plan is kept whose interval of round medians lies wholly above another accepted plan's, beyond the
   margin `faster` allows the noise (`below`): of those below it, the one whose slowest round was fastest is.
   A plan chosen untimed (no whole plan was timed within the budget) says so (`Placement.unmeasured`).

With a `worker`, blocks on every provider but ONNX Runtime's CPU (whose compile is the reference's, made in
this process anyway) are lowered, compiled and timed in one worker process (`measure.SearchWorker`), so that a
native crash there costs the block it was building, recorded as its failure with the signal named; the gate
runs there too (a crash rejects the candidate, naming the signal). The sample
values blocks are timed on come from ONNX Runtime's CPU first, each block's runner closed once it ran; the
runners a chunk of blocks is timed with are closed once it is timed.

A measurement that fails (the runtime raises while building or running) is recorded with its error, as
the provider that raised it said it, and is never a figure: a block is placed only where it was
measured, a failed entry or boundary is treated as not measured, and a whole plan that failed is never
chosen; when every whole plan fails, the search raises `MeasurementError` listing each one's error.

Block, entry and boundary figures go to the on-disk cache keyed by content hash, provider, version,
threads and device, with their spread; a cached figure noisier than `NOISY` is measured again. Whole plans
are always timed in the run that compares them, never read from the cache.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any

import numpy as np
import onnx

from uhop_onnx.foundation.cache import JsonTable
from uhop_onnx.foundation.errors import MeasurementError, ProviderError, StageError, first_line, logger
from uhop_onnx.runtime.executor import Executor, hand_over
from uhop_onnx.foundation.inputs import feeds_digest
from uhop_onnx.model.loader import saved, sha256
from uhop_onnx.runtime.measure import LATE, SearchWorker, Unsendable, WorkerFailed
from uhop_onnx.runtime.plan import Stage
from uhop_onnx.runtime.profiler import Measurement, Profiler, build, faster
from uhop_onnx.providers import LAST_RESORT, Provider, Runner, create
from uhop_onnx.runtime.report import stages_summary
from uhop_onnx.foundation.samples import shapes_text
from uhop_onnx.foundation.timing import Deadline

from .blocks import allowed_providers, blocks, boundary_classes, expand
from .capabilities import whole_model
from .extract import extract
from .path import cheapest_path
from .first_supported import first_supported
from .partition import partition
from .placer import Analysis, Block, Candidate, Choice, Effort, Failure, Placement, Undecided

log = logger(__name__)

NOISY = 0.25  # a cached figure whose spread is above this is measured again
CHUNK = 1  # blocks measured together between two looks at the deadline: one, so a worker holds one block's runtime
# at a time (four held the detector's search worker 40-60 MiB higher, in no less time)
IN_PROCESS = LAST_RESORT  # the provider whose blocks are measured in this process even with a worker
BEST = "best so far: "  # the progress step that names the best plan so far and its figure
NOT_MEASURED = "not measured: the budget ran out"
REJECTED = "not timed: outside the accuracy tolerance"
# A whole plan of more stages is not timed: each stage holds its runtime's session and its activations' buffers
# (on the PP-OCR detector a plan of 248 stages, every node the kernels run on them, held 653 MiB, the largest
# process of `optimize`'s tree), and so many crossings lose already on its blocks' figures.
WHOLE_STAGES = 32
FRAGMENTED = "not timed: {} stages, over the {} a whole plan is timed with (its blocks were timed one by one)"
MARGIN = 0.01  # `faster`'s margin: a difference below it is noise
PlanTimer = Callable[[Mapping[str, Choice]], dict[str, Measurement]]  # named choices -> their whole figures
# A choice -> whether its outputs are within the accuracy budget, and its figures (None: nothing to check)
Gate = Callable[[Choice], tuple[bool, dict[str, Any] | None]]


def in_process(run_plan: Callable[[Choice], Callable[[], object]], profiler: Profiler,
               deadline: Deadline | None = None) -> PlanTimer:
    """Time whole plans in this process with `profiler`; `run_plan` makes a call that runs a choice's plan."""
    def time_plans(choices: Mapping[str, Choice]) -> dict[str, Measurement]:
        calls, failed = build({name: (lambda c=c: run_plan(c)) for name, c in choices.items()})
        return profiler.measure(calls, deadline) | failed

    return time_plans


@dataclass
class Search:
    """The measured `Placer`: how whole plans are timed (`time_plans`) and gated, and where figures are kept.
    It stops at `deadline` (default: `budget_s` after `place` starts), and tells each step to `progress`."""

    time_plans: PlanTimer
    profiler: Profiler = field(default_factory=Profiler)
    store: JsonTable | None = None
    budget_s: float = 60.0
    threads: int | None = None
    gate: Gate | None = None
    deadline: Deadline | None = None
    progress: Callable[[str], None] = lambda step: None
    worker: SearchWorker | None = None  # where blocks on providers but `IN_PROCESS`, and the gate, run

    def place(self, analysis: Analysis) -> Placement:
        """The fastest placement found by the deadline; every runner it compiled is closed when it returns."""
        with ExitStack() as runners:
            return _Searching(self, analysis, runners).run()


class _Searching:
    """One search: the analysis it places, the figures it read and measured, and the runners it compiled."""

    def __init__(self, config: Search, a: Analysis, runners: ExitStack):
        self.config, self.runners = config, runners
        self.model, self.graph, self.support, self.pinned = a.simplified, a.graph, a.support, a.pinned
        self.feeds: Mapping[str, np.ndarray] = a.feeds  # the model's inputs every measurement runs on
        self.providers = {p.label: p for p in a.providers}
        self.known: dict[str, Any] = {}  # the cache as read
        self.fresh: dict[str, Any] = {}  # measured in this search
        self.hits: set[str] = set()  # keys whose cached figure this search used
        self.subjects: dict[str, tuple[str, tuple[str, ...]]] = {}  # figure key -> (kind, the providers it is on)
        self.failed: dict[str, str] = {}  # block, entry, pair key -> its error
        self.gated: dict[str, tuple[bool, dict[str, Any] | None]] = {}  # by candidate
        self.deadline = config.deadline or Deadline.after(config.budget_s)
        self.complete = True  # False once a step was left out at the deadline
        self.worker = config.worker
        self.pair_s = 0.0  # how long a timing of two whole plans takes (estimated from the first, then the longest)
        self.undecided: Undecided | None = None  # the decision the budget ended before it settled
        self.unmeasured: str | None = None  # why the plan chosen has no figure

    def run(self) -> Placement:
        started = time.monotonic()
        store = self.config.store
        self.known = store.read() if store else {}
        labels = list(self.providers)
        greedy = self._prefer(labels)  # raises, naming it, when a node runs nowhere
        units = blocks(self.graph, self.support, self.pinned)
        allowed = [allowed_providers(self.graph, self.support, self.pinned, b) for b in units]
        classes = boundary_classes(self.graph, units)
        own = {label: self._prefer([label, *(q for q in labels if q != label)]) for label in labels}
        wholes = {f"{label} whole": (label,) * len(self.graph.nodes) for label in whole_model(self.support, self.pinned)}
        candidates = _unique({"first-supported": greedy} | {f"{label} first": own[label] for label in labels} | wholes)
        self._step(f"timing {len(candidates)} whole plans (each provider first)")
        started_timing = time.monotonic()
        whole = self._measure_plans(candidates)
        self.pair_s = (time.monotonic() - started_timing) * min(1.0, 2 / len(candidates))
        best = self._simplest(candidates, whole)
        fastest = min(whole, key=lambda name: whole[name].ms)
        if whole[fastest].ok and not self._accepts(fastest, candidates[fastest]):
            best = self._mix(candidates, whole, fastest, best, units)
        named = {choice: name for name, choice in candidates.items()}
        ranked = sorted(labels, key=lambda label: whole[named[own[label]]].ms)  # the fastest own plan first
        block_costs = self._block_costs(units, allowed, ranked)
        measured = [[p for p in ps if block_costs[k][p].ok] for k, ps in enumerate(allowed)]
        entry: dict[str, dict[int, Measurement]] = {}
        boundary: dict[tuple[str, str], dict[int, Measurement]] = {}
        if all(measured) and self._in_time():
            self._step("timing the crossings between providers")
            entry, boundary = self._entry_costs(classes, measured)
            entries = [{p: entry[p][c] for p in ps if entry[p][c].ok} for ps, c in zip(measured, classes)]
            crossings = [{pair: by_size[c] for pair, by_size in boundary.items() if by_size[c].ok} for c in classes]
            searched = tuple(expand(units, cheapest_path(measured, block_costs, entries, crossings)))
            if self._in_time():
                best = self._challenge(candidates, whole, best, "searched", searched)
        best = self._improve(candidates, whole, best, units, measured)
        best = self._settled(candidates, whole, best)
        if self.undecided is not None:
            self.undecided = replace(self.undecided, chosen=best)
        placement = Placement(
            "measured", candidates[best], best,
            plans={name: self._candidate(name, candidates[name], m) for name, m in whole.items()},
            blocks=[Block(b, self.graph.nodes[b[0]].name, self.graph.nodes[b[-1]].name, size, costs)
                    for b, size, costs in zip(units, classes, block_costs)],
            entries=entry, boundaries=boundary,
            failures=[Failure(*self.subjects[key], error) for key, error in self.failed.items()],
            effort=Effort(len(self.fresh), len(self.hits), round(time.monotonic() - started, 3),
                          self.config.budget_s, self.config.threads, self.complete),
            undecided=self.undecided,
            unmeasured=None if whole[best].ok else self.unmeasured or f"its timing failed: {whole[best].error}")
        if store:
            store.update(self.fresh)
        return placement

    # -- the best plan so far

    def _step(self, text: str) -> None:
        self.config.progress(text)

    def _in_time(self) -> bool:
        """Whether time remains; if not, the search is marked as stopped at its deadline."""
        if self.deadline.passed:
            self.complete = False
        return self.complete

    def _told(self, name: str, candidates: Mapping[str, Choice], whole: Mapping[str, Measurement]) -> str:
        """`name`, told to `progress` as the best plan so far."""
        figure = whole[name]
        self._step(f"{BEST}{name} ({stages_summary(_stage_labels(candidates[name]))}) {figure.ms:.3f} ms")
        return name

    def _simplest(self, candidates: Mapping[str, Choice], whole: dict[str, Measurement]) -> str:
        """The best of the whole plans timed together: the simplest accepted one (fewest stages, then ONNX
        Runtime alone, then the fastest), unless another is faster beyond the noise, twice; `MeasurementError`
        when none was timed or the gate accepts none."""
        timed = sorted((name for name, m in whole.items() if m.ok), key=lambda name: whole[name].ms)
        late = [name for name, m in whole.items() if m.error == LATE]
        if not timed and self.deadline.abandoned:
            raise MeasurementError("the search was abandoned before any whole plan was timed")
        if not timed and late:
            log.warning("no whole plan could be timed within the budget; the plan is %s, unmeasured (give a "
                        "larger budget)", late[0])
            self.complete = False
            self.unmeasured = (f"no whole plan could be timed within the budget ({self.config.budget_s:g} s); "
                               f"{late[0]} was kept untimed (give a larger budget)")
            return late[0]
        if not timed:
            raise self._none_timed(candidates, whole)
        accepted = [name for name in timed if self._accepts(name, candidates[name])]
        if not accepted:
            raise MeasurementError("every candidate plan was outside the accuracy tolerance: "
                                   + ", ".join(sorted(timed)))
        # the fewest stages; among those, ONNX Runtime alone (what the program would run without us) before the
        # fastest: another must beat it beyond the noise, twice (figures taken under load can favour a runtime
        # whose threads do not spin: a ResNet-18 chosen so for OpenVINO ran 1.7x slower, benchmarks/budget.py)
        baseline = {label for label, p in self.providers.items() if p.id == LAST_RESORT}
        best = min(accepted, key=lambda name: (_stage_count(candidates[name]), not set(candidates[name]) <= baseline,
                                               whole[name].ms))
        for challenger in [name for name in accepted if faster(whole[name], whole[best])]:  # the fastest first
            best = self._decided(candidates, whole, challenger, best, wins=1)
            if best == challenger or not self.complete:
                break
        return self._told(best, candidates, whole)

    def _challenge(self, candidates: dict[str, Choice], whole: dict[str, Measurement], best: str, name: str,
                   choice: Choice) -> str:
        """`name` if the plan of `choice` is accepted by the gate and faster than `best` beyond the noise,
        twice (it joins the candidates either way); else `best`. A choice timed already is not timed again,
        nor one the gate rejects."""
        if choice in candidates.values():
            return best
        candidates[name] = choice
        untimed = self._fragmented(choice) or (None if self._accepts(name, choice) else Measurement.failed(REJECTED))
        if untimed:
            whole[name] = untimed
            return best
        self._step(f"timing the {name} plan ({stages_summary(_stage_labels(choice))}) against {best}")
        if self._decided(candidates, whole, name, best, wins=0) == name:
            return self._told(name, candidates, whole)
        return best

    def _decided(self, candidates: Mapping[str, Choice], whole: dict[str, Measurement], challenger: str,
                 best: str, wins: int) -> str:
        """`challenger` once two timings of the two together found it faster than `best` beyond the noise
        (`wins` of them done already), `best` once two found it not faster, or the first did; `whole` keeps
        their latest figures of the same rounds. When the budget ends first, `best` stands and the decision
        is recorded as undecided."""
        losses = 0
        while wins < 2:
            result = self._timed({challenger: candidates[challenger], best: candidates[best]})
            if result is None:
                self.undecided = self.undecided or self._undecided(whole, challenger, best, 3 - wins - losses)
                return best
            whole.update(result)
            if faster(result[challenger], result[best]):
                wins += 1
                continue
            losses += 1
            if wins == 0 or losses == 2:
                return best
        return challenger

    def _timed(self, choices: Mapping[str, Choice]) -> dict[str, Measurement] | None:
        """Whole plans timed together now (`pair_s` keeps the longest timing of two); None when the budget
        ended before every one was timed."""
        if not self._in_time():
            return None
        started = time.monotonic()
        result = self._measure_plans(choices)
        if any(m.error == LATE for m in result.values()):
            self.complete = False
            return None
        if len(choices) == 2:
            self.pair_s = max(self.pair_s, time.monotonic() - started)
        return result

    def _undecided(self, whole: Mapping[str, Measurement], challenger: str, best: str, timings: int
                   ) -> Undecided | None:
        """The record of the decision between `challenger` and `best` that at most `timings` more timings of
        the two would settle, from their latest figures; None when one has none."""
        a, b = whole.get(challenger), whole.get(best)
        if a is None or b is None or not (a.ok and b.ok):
            return None
        fast, slow = (challenger, best) if a.ms < b.ms else (best, challenger)
        budget = math.ceil((self.config.budget_s + timings * self.pair_s) / 10) * 10
        return Undecided(fast, slow, whole[slow].ms / whole[fast].ms, min(a.rounds, b.rounds), best, float(budget))

    def _settled(self, candidates: Mapping[str, Choice], whole: Mapping[str, Measurement], best: str) -> str:
        """`best`, unless the round medians of accepted plans lie wholly below its own (`below`): then, of
        those, the plan whose slowest round was fastest."""
        lower = [name for name, m in whole.items() if below(m, whole[best]) and self._accepts(name, candidates[name])]
        if not lower:
            return best
        return self._told(min(lower, key=lambda name: whole[name].interval[1]), candidates, whole)

    def _accepts(self, name: str, choice: Choice) -> bool:
        """Whether the gate (if any) accepts the choice's outputs; remembered by candidate name."""
        gate = self.config.gate
        if gate is None:
            return True
        if name not in self.gated:
            self.gated[name] = self._gated(gate, choice)
            if not self.gated[name][0]:
                log.info("candidate %s is outside the accuracy tolerance: %s", name, self.gated[name][1])
        return self.gated[name][0]

    def _gated(self, gate: Gate, choice: Choice) -> tuple[bool, dict[str, Any] | None]:
        """The gate's verdict on `choice`, given in the worker where there is one (the plan it compiles may
        crash natively): a crash is a rejection whose error names the signal."""
        if self.worker is None:
            return gate(choice)
        try:
            return self.worker.call(gate, choice, runtime=_runtimes(self.providers[label] for label in set(choice)))
        except Unsendable:
            return gate(choice)
        except WorkerFailed as crash:
            return False, {"error": str(crash)}

    def _candidate(self, name: str, choice: Choice, figure: Measurement) -> Candidate:
        """A whole plan timed, with the gate's figures of its outputs where it checked them."""
        ok, accuracy = self.gated.get(name, (True, None))
        return Candidate(choice, figure, _stage_labels(choice), accuracy, accuracy is not None and not ok)

    def _none_timed(self, candidates: Mapping[str, Choice], whole: Mapping[str, Measurement]) -> MeasurementError:
        """The error when no whole plan could be timed: the sample shapes, and each candidate's error."""
        shapes = shapes_text(self.feeds)
        listed = "\n".join(f"  {name} ({_stage_labels(candidates[name])}): {m.error}" for name, m in whole.items())
        return MeasurementError(f"no candidate plan could be timed on sample inputs of shapes {shapes}; "
                                f"each one's error:\n{listed}")

    # -- what may run where

    def _prefer(self, order: Sequence[str]) -> Choice:
        return tuple(first_supported(self.graph, {label: self.support[label] for label in order}, self.pinned))

    # -- measuring, through the cache

    def _lookup(self, keys: Iterable[str]) -> dict[str, Measurement]:
        """The figures the cache holds for `keys` (a failure an older version cached is not a figure)."""
        found = {k: Measurement.from_json(self.known[k]) for k in set(keys) if k in self.known}
        found = {k: m for k, m in found.items() if m.ok and m.spread <= NOISY}
        self.hits.update(found)
        return found

    def _remember(self, fresh: Mapping[str, Measurement]) -> None:
        """Keep the figures for the cache; a failure, or a figure of fewer rounds than the profiler's (cut
        short at the deadline), is never cached."""
        rounds = self.config.profiler.rounds
        self.fresh.update({k: m.to_json() for k, m in fresh.items() if m.ok and m.rounds >= rounds})

    def _cached(self, jobs: Mapping[str, Any], together: bool = False,
                measure: Callable[[Mapping[str, Any]], dict[str, Measurement]] | None = None) -> dict[str, Measurement]:
        """Measure the jobs whose keys the cache does not hold (all of them, `together`, unless it holds
        every one: figures that are compared must come from the same rounds) with `measure` (default: `_here`,
        where `jobs` build their call lazily). A job that fails to build or run is a failure, so no choice
        falls on it."""
        found = self._lookup(jobs)
        if together and len(found) < len(jobs):
            self.hits.difference_update(found)
            found = {}
        fresh = (measure or self._here)({key: job for key, job in jobs.items() if key not in found})
        for key, m in fresh.items():
            if not m.ok:
                kind, on = self.subjects[key]
                log.warning("not measured: %s on %s (%s)", kind, ">".join(on), m.error)
                self.failed[key] = m.error or "no figure"
        self._remember(fresh)
        return found | fresh

    def _here(self, jobs: Mapping[str, Callable[[], Callable[[], object]]]) -> dict[str, Measurement]:
        """The calls `jobs` build, timed together in this process."""
        calls, failed = build(jobs)
        return self.config.profiler.measure(calls, self.deadline) | failed

    def _key(self, kind: str, label: str, content: str, after: str | None = None) -> str:
        """The cache key of a figure of `kind` on provider `label` (for a pair, right `after` another)."""
        provider = self.providers[label]
        if after is not None:
            content = f"after={after}@{_version(self.providers[after])}|{content}"
        key = f"{kind}|{label}|{_version(provider)}|threads={self.config.threads}|{content}|{self._at}"
        self.subjects[key] = (kind, (label,) if after is None else (after, label))
        return key

    @cached_property
    def _at(self) -> str:
        """What the figures were measured on: the inputs' shapes and a digest of their values."""
        shapes = ",".join(f"{n}={'x'.join(map(str, np.shape(v)))}" for n, v in sorted(self.feeds.items()))
        return f"at={shapes}@{feeds_digest(self.feeds)}"

    def _block_costs(self, units: Sequence[Sequence[int]], allowed: Sequence[Sequence[str]],
                     order: Sequence[str]) -> list[dict[str, Measurement]]:
        """Each block's figure on each provider allowed to run it, provider by provider in `order`, `CHUNK`
        blocks at a time until the deadline; a figure not measured by then is a failure saying so."""
        models = [extract(self.model, self.graph, b, name=f"block_{k}") for k, b in enumerate(units)]
        digests = [sha256(m) for m in models]
        keys = {(k, p): self._key("block", p, digests[k]) for k, ps in enumerate(allowed) for p in ps}
        feeds = _Feeds(self, models, allowed)

        def timed(p: str) -> Callable[[Mapping[str, int]], dict[str, Measurement]]:
            """How blocks (key -> block) are measured on `p`: in the worker, or here with runners closed
            once they are timed."""
            def here(chunk: Mapping[str, int]) -> dict[str, Measurement]:
                with ExitStack() as closed:
                    return self._here({key: (lambda k=k: job(k, p, closed)) for key, k in chunk.items()})

            if self.worker is None or self.providers[p].id == IN_PROCESS or not self.worker.takes(self.providers[p]):
                return here
            return lambda chunk: feeds.in_worker(self.providers[p], chunk)

        def job(k: int, p: str, closed: ExitStack) -> Callable[[], object]:
            block_feeds = feeds.for_block(k)
            runner = _compiled(self.providers[p], models[k], closed)
            return lambda: _raised_by(self.providers[p], runner.run, block_feeds)

        measured: dict[str, Measurement] = {}
        for p in order:
            mine = [k for k, ps in enumerate(allowed) if p in ps]
            for start in range(0, len(mine), CHUNK):
                if not self._in_time():
                    break
                self._step(f"timing blocks on {p} ({start} of {len(mine)})")
                measured |= self._cached({keys[k, p]: k for k in mine[start:start + CHUNK]}, measure=timed(p))
        unmeasured = Measurement.failed(NOT_MEASURED)
        return [{p: measured.get(keys[k, p], unmeasured) for p in ps} for k, ps in enumerate(allowed)]

    def _entry_costs(self, classes: Sequence[int], allowed: Sequence[Sequence[str]]
                     ) -> tuple[dict[str, dict[int, Measurement]], dict[tuple[str, str], dict[int, Measurement]]]:
        """Per boundary size class c: each provider's cost of a stage that does almost nothing (one Relu
        over c bytes) fed from the host, as entry[p][c]; and for each ordered pair (q, p), the cost of such
        a stage on p right after one on q, less q's own, as boundary[q, p][c]."""
        used = [p for p in self.providers if any(p in ps for ps in allowed)]
        sizes = sorted(set(classes))
        keys = {(p, c): self._key("entry", p, f"bytes={c}") for p in used for c in sizes}
        pairs = {(q, p, c): self._key("pair", p, f"bytes={c}", after=q)
                 for q in used for p in used if q != p for c in sizes}
        stages = {key: (p, c) for (p, c), key in keys.items()} | {key: (q, p, c) for (q, p, c), key in pairs.items()}
        providers = {p: self.providers[p] for p in used}

        def here(todo: Mapping[str, tuple]) -> dict[str, Measurement]:
            return self._here(_entry_jobs(providers, todo, self.model, self.runners))

        def in_worker(todo: Mapping[str, tuple]) -> dict[str, Measurement]:
            try:
                return self.worker.call(_entry_figures, providers, todo, self.model, self.config.profiler,
                                        self.deadline.left(), runtime=_runtimes(providers.values()))
            except Unsendable:
                return here(todo)
            except WorkerFailed as crash:
                return {key: Measurement.failed(str(crash)) for key in todo}

        measured = self._cached(stages, together=True, measure=here if self.worker is None else in_worker)
        entry: dict[str, dict[int, Measurement]] = {}
        for (p, c), key in keys.items():
            entry.setdefault(p, {})[c] = measured[key]
        boundary: dict[tuple[str, str], dict[int, Measurement]] = {}
        for (q, p, c), key in pairs.items():
            boundary.setdefault((q, p), {})[c] = _less(measured[key], entry[q][c])
        return entry, boundary

    def _fragmented(self, choice: Choice) -> Measurement | None:
        """The failure a whole plan of more than `WHOLE_STAGES` stages is recorded with instead of a timing."""
        count = len(partition(self.graph, choice))
        return Measurement.failed(FRAGMENTED.format(count, WHOLE_STAGES)) if count > WHOLE_STAGES else None

    def _measure_plans(self, choices: Mapping[str, Choice]) -> dict[str, Measurement]:
        """Whole plans timed together now (never from the cache: figures compared come from the same rounds); one
        of more than `WHOLE_STAGES` stages fails untimed."""
        over = {name: failure for name, choice in choices.items() if (failure := self._fragmented(choice))}
        timed = {name: choice for name, choice in choices.items() if name not in over}
        return (self.config.time_plans(timed) if timed else {}) | over

    def _improve(self, candidates: dict[str, Choice], whole: dict[str, Measurement], best: str,
                 units: Sequence[Sequence[int]], allowed: Sequence[Sequence[str]]) -> str:
        """Move runs of blocks to another provider (a neighbouring run's first: a merge) while that beats the
        noise and time remains."""
        improved = True
        while improved and self._in_time():
            improved = False
            choice = [candidates[best][b[0]] for b in units]
            for alternative in _moves(choice, allowed):
                placement = tuple(expand(units, alternative))
                if placement in candidates.values() or not self._in_time():
                    continue
                challenger = self._challenge(candidates, whole, best, f"moved {len(candidates) + 1}", placement)
                if challenger != best:
                    best, improved = challenger, True
                    break
        return best

    def _mix(self, candidates: dict[str, Choice], whole: dict[str, Measurement], rejected: str, best: str,
             units: Sequence[Sequence[int]]) -> str:
        """Keep the `rejected` plan's (faster, reduced-precision) providers on a prefix of the blocks where it
        differs from the `best` accepted plan, and the accepted plan's on the rest: the longest prefix the gate
        accepts, found by bisection (half, then quarters, ...). The accepted mixes are timed whole beside
        `best`, and the fastest kept when it beats the noise; a rejected mix is recorded untimed."""
        fast, safe = ([candidates[name][b[0]] for b in units] for name in (rejected, best))
        differ = [k for k in range(len(units)) if fast[k] != safe[k]]
        names = {choice: name for name, choice in candidates.items()}
        passed: dict[str, Choice] = {}
        made = 0
        low, high = 0, len(differ)  # a prefix of `differ` at `fast` that the gate accepts, and one it rejects
        while high - low > 1 and self._in_time():
            middle = (low + high) // 2
            at_fast = set(differ[:middle])
            placement = tuple(expand(units, [(fast if k in at_fast else safe)[k] for k in range(len(units))]))
            if placement not in names:
                made += 1
                names[placement] = f"mixed {made}"
            name = names[placement]
            candidates[name] = placement
            if self._accepts(name, placement):
                passed[name], low = placement, middle
            else:
                whole.setdefault(name, Measurement.failed(REJECTED))
                high = middle
        if not passed:
            return best
        result = self._timed({**passed, best: candidates[best]})
        if result is None:
            return best
        whole.update(result)
        mixed = min(passed, key=lambda name: result[name].ms)
        if faster(result[mixed], result[best]) and self._decided(candidates, whole, mixed, best, wins=1) == mixed:
            return self._told(mixed, candidates, whole)
        return best


class _Feeds:
    """Sample values of every block's inputs: the blocks run once, in order, through the `Executor`, each on
    the first of its providers that runs it (with a worker, ONNX Runtime's CPU, the reference, before them),
    its runner closed once it ran. With a worker, each block's inputs are written to the worker's folder as the
    run reaches it, and only the values later blocks still read are held (as ONNX Runtime holds a model's
    activations); without one, every block's are held. A block that fails on every one leaves without values
    only the blocks that need its outputs."""

    def __init__(self, search: _Searching, models: Sequence[onnx.ModelProto], allowed: Sequence[Sequence[str]]):
        self.search, self.models, self.allowed = search, models, allowed
        self.failed: dict[int, str] = {}  # block -> its error on every provider, where none ran it
        self.files: dict[int, tuple[str, str]] = {}  # block -> its model and its inputs, saved for the worker
        self.inputs: dict[int, str] = {}  # block -> its inputs' `.npz`, written as the run reached it (a worker)
        self._values: dict[str, Any] | None = None

    def for_block(self, k: int) -> dict[str, Any]:
        """Block k's inputs; a `ProviderError` naming the earlier blocks that failed when one is missing."""
        values = self._computed() if self._values is None else self._values
        if k in self.inputs:
            with np.load(self.inputs[k]) as saved:
                values = {name: saved[name] for name in saved.files}
        names = [i.name for i in self.models[k].graph.input]
        missing = {name for name in names if name not in values}
        if missing:
            causes = [f"block {j} failed on every provider: {error}" for j, error in self.failed.items()
                      if missing & {o.name for o in self.models[j].graph.output}]
            raise ProviderError(f"no sample values for block {k}; {'; '.join(causes)}")
        return {name: values[name] for name in names}

    def in_worker(self, provider: Provider, chunk: Mapping[str, int]) -> dict[str, Measurement]:
        """The figures of blocks (key -> block) on `provider`, measured in the search's worker from their
        saved models and inputs; a block whose inputs are missing is a failure saying why."""
        saved, failed = {}, {}
        for key, k in chunk.items():
            try:
                saved[key] = self._saved(k)
            except (ProviderError, OSError, ValueError) as error:
                failed[key] = Measurement.failed(error)
        worker = self.search.worker
        return failed | (worker.measure(provider, saved, self.search.deadline, self.search.config.profiler)
                          if saved and worker else {})

    def _saved(self, k: int) -> tuple[str, str]:
        """Where block k's model and inputs (an `.npz`) are saved, in the worker's folder."""
        if k not in self.files:
            self.for_block(k)  # its inputs were written as the run reached it
            model = self.search.worker.folder / f"block{k}.onnx"
            saved(self.models[k], model)
            self.files[k] = str(model), self.inputs[k]
        return self.files[k]

    def reached(self, k: int, feeds: Mapping[str, Any]) -> None:
        """Block k's inputs, as the run reached it: written for the worker, where there is one."""
        if self.search.worker is not None:
            path = self.search.worker.folder / f"block{k}.npz"
            np.savez(path, **{name: np.asarray(v) for name, v in feeds.items()})
            self.inputs[k] = str(path)

    def _computed(self) -> dict[str, Any]:
        """The values held (`_Feeds`): every block is run; where one fails everywhere, the blocks downstream
        of it are left out and the rest run again."""
        stages = [Stage(f"block {k}", {}, [n.name for n in m.graph.node], [i.name for i in m.graph.input],
                        [o.name for o in m.graph.output], file="", declared=[]) for k, m in enumerate(self.models)]
        graph, feeds = self.search.graph, self.search.feeds
        held = self.search.worker is None
        reference = create(LAST_RESORT, self.search.config.threads) if self.search.worker else None
        lost: set[str] = set()  # the outputs of the blocks that failed and of those downstream of them
        while True:
            running = [stage for stage in stages if not lost.intersection(stage.outputs)]
            read = {name for stage in running for name in stage.inputs}
            wanted = [name for stage in running for name in stage.outputs if held or name not in read]
            executor = Executor(stages, [_FirstThatRuns(self, k, reference) for k in range(len(stages))],
                                [graph.signature(name) for name in graph.inputs], wanted, {})
            try:
                self._values = {**feeds, **dict(zip(wanted, executor.run(wanted, feeds), strict=True))}
                return self._values
            except StageError as error:
                self.failed[error.stage] = str(error.__cause__ or error)
                lost.update(stages[error.stage].outputs)
                for stage in stages[error.stage + 1:]:
                    if lost.intersection(stage.inputs):
                        lost.update(stage.outputs)


class _FirstThatRuns(Runner):
    """Block k on the first that runs it of the `reference` (if any, and present) and its providers,
    compiled for this one run and closed; its results are host arrays."""

    def __init__(self, feeds: _Feeds, k: int, reference: Provider | None):
        self.feeds, self.k, self.reference = feeds, k, reference

    def run(self, feeds: Mapping[str, Any]) -> dict[str, Any]:
        errors = []
        self.feeds.reached(self.k, feeds)
        search, model = self.feeds.search, self.feeds.models[self.k]
        providers = [search.providers[label] for label in self.feeds.allowed[self.k]]
        if self.reference is not None and self.reference.present:
            providers.insert(0, self.reference)
        for provider in providers:
            try:
                with ExitStack() as closed:
                    runner = _compiled(provider, model, closed)
                    results = _raised_by(provider, runner.run, feeds)
                    return {name: runner.to_host(value) for name, value in results.items()}
            except ProviderError as error:
                errors.append(str(error))
        raise ProviderError("; ".join(errors))


def _compiled(provider: Provider, model: onnx.ModelProto, closed: ExitStack) -> Runner:
    """A block compiled on `provider` at its precision (int8 quantized first) to share the process, closed
    with `closed`."""
    return closed.enter_context(_raised_by(provider, lambda: provider.compile(provider.lower(model), exclusive=False)))


def _entry_jobs(providers: Mapping[str, Provider], stages: Mapping[str, tuple], like: onnx.ModelProto,
                closed: ExitStack) -> dict[str, Callable[[], Callable[[], object]]]:
    """The jobs that time one-Relu stages (`_entry_model`, in the IR and opset of `like`): per key, `(p, c)`
    is such a stage over c bytes on provider p fed from the host, `(q, p, c)` one on p right after one on q
    (the tensor handed over as the session does). Runners are compiled once per provider and size, closed
    with `closed`."""
    runners: dict[tuple[str, int], Runner] = {}

    def runner(p: str, size: int) -> Runner:
        if (p, size) not in runners:
            provider, model = providers[p], _entry_model(size // 4, like)
            runners[p, size] = closed.enter_context(_raised_by(provider, provider.compile, model, exclusive=False))
        return runners[p, size]

    def alone(p: str, size: int) -> Callable[[], object]:
        data = {"x": np.zeros(size // 4, np.float32)}
        return lambda: _raised_by(providers[p], runner(p, size).run, data)

    def pair(q: str, p: str, size: int) -> Callable[[], object]:
        first, second, data = runner(q, size), runner(p, size), {"x": np.zeros(size // 4, np.float32)}
        return lambda: _raised_by(providers[p], second.run, {
            "x": hand_over(_raised_by(providers[q], first.run, data)["y"], first, second)})

    return {key: (lambda s=stage: alone(*s) if len(s) == 2 else pair(*s)) for key, stage in stages.items()}


def _entry_figures(providers: Mapping[str, Provider], stages: Mapping[str, tuple], like: onnx.ModelProto,
                   profiler: Profiler, seconds: float) -> dict[str, Measurement]:
    """`_entry_jobs`' stages timed together with `profiler` for at most `seconds`: what a search worker runs."""
    with ExitStack() as closed:
        calls, failed = build(_entry_jobs(providers, stages, like, closed))
        return profiler.measure(calls, Deadline.after(seconds)) | failed


def _raised_by(provider: Provider, call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """`call(*args, **kwargs)`; what it raises comes back as a `ProviderError` that names `provider`."""
    try:
        return call(*args, **kwargs)
    except Exception as error:  # noqa: BLE001 - a runtime may fail in any way; say whose it was
        text = first_line(error)
        raise ProviderError(text if text.startswith(f"{provider.label}:") else f"{provider.label}: {text}") from error


def _runtimes(providers: Iterable[Provider]) -> str:
    """The runtimes `providers` load, as a worker serving them is known by (`SearchWorker.call`)."""
    return "+".join(sorted({p.id for p in providers}))


def _version(provider: Provider) -> str:
    """What a provider's figures depend on besides its label: its runtime's version, and for an int8
    variant the calibration its stages were quantized on."""
    calibration = provider.calibration
    return f"{provider.availability.version}" + (f"+calibration={calibration.digest}" if calibration else "")


def _moves(choice: Sequence[str], allowed: Sequence[Sequence[str]]) -> list[list[str]]:
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
        targets = set.intersection(*(set(allowed[k]) for k in run)) - {choice[run[0]]}
        for target in [p for p in allowed[run[0]] if p in targets]:
            moved = [target if k in run else p for k, p in enumerate(choice)]
            (merges if target in neighbours else others).append(moved)
    return merges + others


def below(a: Measurement, b: Measurement, margin: float = MARGIN) -> bool:
    """Whether `a`'s round medians lie wholly below `b`'s, by more than `margin`: its slowest round beat the
    other's fastest (figures of one round are their own interval)."""
    return a.ok and b.ok and a.interval[1] < b.interval[0] * (1 - margin)


def _less(pair: Measurement, first: Measurement) -> Measurement:
    """A pair's figure less its first stage's own: what the boundary costs; a failure when either failed."""
    if not pair.ok or not first.ok:
        return pair if not pair.ok else Measurement.failed(first.error or "the first stage was not measured")
    return Measurement(max(pair.ms - first.ms, 0.0), pair.spread, pair.rounds)


def _unique(candidates: Mapping[str, Choice]) -> dict[str, Choice]:
    seen: dict[Choice, str] = {}
    for name, choice in candidates.items():
        seen.setdefault(choice, name)
    return {name: choice for choice, name in seen.items()}


def _runs(choice: Sequence[str]) -> list[list[Any]]:
    """[provider, node count] per run of the same provider along the topological order."""
    runs: list[list[Any]] = []
    for p in choice:
        if runs and runs[-1][0] == p:
            runs[-1][1] += 1
        else:
            runs.append([p, 1])
    return runs


def _stage_labels(choice: Sequence[str]) -> str:
    """`openvino x12 > ort-cpu x3`: the providers along the topological order and how many nodes each runs."""
    return " > ".join(f"{p} x{n}" for p, n in _runs(choice))


def _stage_count(choice: Sequence[str]) -> int:
    return len(_runs(choice))


def _entry_model(elements: int, like: onnx.ModelProto) -> onnx.ModelProto:
    """A one-Relu model (every provider runs Relu) in the IR version and opset of `like`."""
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [elements])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [elements])
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"], name="entry")], "entry", [x], [y])
    opset = next((o.version for o in like.opset_import if o.domain in ("", "ai.onnx")), 17)
    return helper.make_model(graph, ir_version=like.ir_version, opset_imports=[helper.make_opsetid("", opset)])
