"""Adaptive serving: a session's calls, grouped by shape bucket, are shared out between the plan serving them
and candidate plans compiled in the background; a candidate replaces the serving plan of its bucket only when
it is faster beyond noise on the same interleaved calls, and that decision is kept for the next process.

`Serving` is the whole mechanism; without candidates it is one compiled plan.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
import queue
import shutil
import statistics
import threading
import time
import uuid
from collections.abc import Callable, Collection, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from ..foundation.cache import JsonTable
from ..precision import Tolerance, compare
from ..precision.own import FP32_CHECK, describe
from ..foundation.errors import UhopError, first_line, logger, quietly
from ..runtime.executor import Executor, Timing
from ..foundation.graph import declared_outputs, io_signatures
from ..foundation.metadata import ModelMetadata
from . import priority
from ..runtime.plan import Plan, Stage
from ..providers import Provider

log = logger(__name__)

EXPLORE_AFTER = 3  # calls at a bucket before its candidates are prepared, once they took EXPLORE_AFTER_S too
EXPLORE_AFTER_S = 2.0  # seconds of calls at a bucket before it is worth exploring (short programs never pay)
# A round: the calls an arm serves in a row, at least ROUND of them and ROUND_S seconds' worth (at its own pace,
# `round_calls`); its figure is the median of its second half. The first calls share the cores with the other
# arm's runtime threads, still spinning after its last call: ONNX Runtime's spin for about 40 ms (measured on
# a 2-core AMD EPYC: 39 ms of CPU in the 100 ms after a call), where a MobileNetV3 call takes 0.4 ms.
ROUND, ROUND_S = 4, 0.2
FIRST_ROUNDS = 2  # a candidate's rounds before the 1.5x rule judges it
DROP_RATIO = 1.5  # a candidate this much slower than the serving plan stops at once
# A candidate dropped on its first rounds at less than this ratio may have met a burst of noise (seen here: LiteRT
# dropped at 1.66x on a MobileNetV3 it runs in 0.6x ONNX Runtime's time): the next process tries it once more.
RETRY_BELOW = 3.0
MIN_PAIRS, MAX_PAIRS = 8, 30  # paired rounds before a verdict; after the last, "within noise"
WARM_UP = 3  # runs of a compiled candidate on the bucket's sample before it serves
TRIAL_S = 60.0  # how long the background waits for a trial to end before preparing the next candidate
EXACT_BUCKETS = 8  # distinct shape sets kept exact; beyond, free axes are rounded up to powers of two
UNNAMED_S = 60.0  # a kept plan no decision names any more is removed after this long (a reader may be loading it)
BACKGROUND_NICE = 10  # the background thread's niceness

Recipe = Callable[[Mapping[str, np.ndarray]], Plan]  # a bucket's sample feeds -> a candidate plan
# (stopped, the first explored bucket's sample feeds) -> label -> recipe
Candidates = Callable[[Callable[[], bool], Mapping[str, np.ndarray]], Mapping[str, Recipe]]
# An earlier process's decision for a bucket: (label, plan or None for the starter, calls seen when it was decided,
# the candidates to try once more, the candidates ONNX Runtime refused with why)
Decided = tuple[str, Plan | None, int, tuple[str, ...], Mapping[str, str]]


class Arm:
    """A compiled plan that serves calls; closed once retired and no call runs on it. A `refereed` arm (a
    candidate, a plan kept by an earlier process) serves only calls whose floating-point feeds are all finite:
    the referee (ONNX Runtime) serves the others, as runtimes differ on NaN and Inf."""

    def __init__(self, label: str, plan: Plan, executor: Executor, refereed: bool = True):
        self.label, self.plan, self.executor = label, plan, executor
        self.running = 0
        self.retired = False
        self.niced = False  # compiled on the background thread: its runtime's threads run at nice 10
        self.refereed = refereed

    def release(self) -> None:
        """Close the executor if the arm is retired and idle (called under the serving lock)."""
        if self.retired and self.running == 0 and self.executor is not None:
            executor, self.executor = self.executor, None
            executor.close()


@dataclass
class Trial:
    """A candidate's record at one bucket: the medians of its rounds of calls, each paired with the serving
    plan's round just before, and its state: compiling, trying, then `faster`, `slower` (dropped at once when
    1.5x the serving plan's time), `within noise`, `refused` (it failed, or disagreed with ONNX Runtime:
    `error`, and `tolerance` where it was compared) or `untried` (`why`)."""

    label: str
    arm: Arm | None = None
    state: str = "compiling"
    pairs: list[tuple[float, float]] = field(default_factory=list)  # (its round's ms, the serving plan's)
    round_ms: list[float] = field(default_factory=list)  # its calls of the round under way
    round: int = ROUND  # calls per round at its pace (`round_calls`: its warm-up's, then its last round's)
    calls: int = 0  # its calls in its rounds
    error: str = ""
    tolerance: str = ""  # the rule it was held to against ONNX Runtime, in words
    why: str = ""  # why it was not tried
    max_error: float | None = None  # its largest absolute error against ONNX Runtime on the bucket's sample
    dropped: bool = False  # found slower on its first rounds (`DROP_RATIO`)

    def ratio_interval(self) -> tuple[float, float, float]:
        """The median of its/serving time ratios and a distribution-free 95% interval for it."""
        ratios = sorted(mine / theirs for mine, theirs in self.pairs)
        n = len(ratios)
        k = max(0, math.floor(n / 2 - 0.98 * math.sqrt(n)))
        return float(np.median(ratios)), ratios[k], ratios[n - 1 - k]

    def to_json(self) -> dict[str, Any]:
        entry: dict[str, Any] = {"label": self.label, "state": self.state, "calls": self.calls, "ms": None,
                                 "interval": None}
        if self.pairs:
            median, low, high = self.ratio_interval()
            entry["ms"] = round(float(np.median([mine for mine, _ in self.pairs])), 4)
            entry["interval"] = [round(low, 3), round(high, 3)]  # of its time over the serving plan's
        for key in ("error", "tolerance", "why"):
            if getattr(self, key):
                entry[key] = getattr(self, key)
        if self.max_error is not None:
            entry["max_abs_error"] = float(f"{self.max_error:.4g}")
        return entry


@dataclass
class Bucket:
    """The calls at one shape bucket: the arm serving them, the candidates' trials, what was decided."""

    key: str
    current: Arm
    calls: int = 0
    turn: int = 0
    round: int = ROUND  # the serving arm's calls per round at its pace (`round_calls`: its calls' so far, then
    # its last round's)
    last_ms: float = 0.0  # the median of the serving arm's latest round, paired with the candidates' next
    round_ms: list[float] = field(default_factory=list)  # the serving arm's calls of the round under way
    trials: dict[str, Trial] = field(default_factory=dict)
    replaced: list[str] = field(default_factory=list)  # each replacement of its serving plan, said
    decision: str | None = None
    busy_s: float = 0.0  # the time its calls took, all together
    explored: bool = False  # its candidates were asked for
    preparing: bool = False  # its candidates are being compiled, one by one
    settled: bool = False  # decided, and nothing on trial any more
    only: frozenset[str] | None = None  # the candidates tried: those a decision kept earlier is re-checked with
    retrying: bool = False  # it tries the candidates an earlier process dropped on their first rounds, once more
    untried: list[str] | None = None  # once explored, the candidates left untried (none: a decision to keep)
    sample: dict[str, np.ndarray] | None = None
    reference: list[Any] | None = None  # the referee's outputs on `sample`
    refused: dict[str, str] = field(default_factory=dict)  # candidate -> why ONNX Runtime refused it, kept
    unverified: bool = False  # serves a plan kept by an earlier process, not yet compared with the referee
    settle: bool = False  # settled once verified
    verifying: threading.Lock = field(default_factory=threading.Lock)

    def to_json(self) -> dict[str, Any]:
        earlier = [{"label": label, "state": "refused", "calls": 0, "ms": None, "interval": None, "error": why}
                   for label, why in self.refused.items() if label not in self.trials]
        return {"bucket": self.key, "calls": self.calls, "serving": self.current.label,
                "candidates": [t.to_json() for t in self.trials.values()] + earlier,
                "decision": self.decision}

    def decided(self) -> None:
        """Record the decision in the serving plan, as a plan it saves shows it (`explain`)."""
        plan = self.current.plan
        self.current.plan = replace(plan, adaptation={**(plan.adaptation or {}), self.key: self.to_json()})

    def rounds(self) -> list[tuple[Arm, int]]:
        """The serving arm, then each candidate on trial, in turn order, with its calls per round."""
        return [(self.current, self.round),
                *((t.arm, t.round) for t in self.trials.values() if t.state == "trying" and t.arm)]


class Serving:
    """Runs calls on the plan serving each shape bucket. Given `candidates` (called once, on the background thread, with
    `stopped` and the first explored bucket's sample feeds: label -> a function building a candidate plan from a
    bucket's sample feeds), a bucket called `EXPLORE_AFTER` times and for `explore_after_s` seconds in all has its
    candidates compiled one at a time on a background thread (at nice 10, within `budget_s` seconds of its CPU time),
    each checked against the referee on the sample and then interleaved with it on real calls, a round each in turn
    (`ROUND`), with no compile beside them. A candidate more than 1.5x slower after its first rounds stops at once; one
    faster beyond noise (the upper end of the interval of its paired time ratios below 1) replaces the serving plan of
    that bucket, atomically: each call runs wholly on one plan. A candidate that won is then compiled again on the
    thread of the callers' priority (`priority`: its runtime's threads took the background's nice 10), between
    trials, and that copy serves in its place. `decisions` keeps each decision made once every
    candidate was tried (and each replacement); given as a function making them (keyed by the model's digest, which it
    computes), it is called on the background thread when it starts, and their digest then names the starter's plan
    where it was left blank. `decided` (bucket -> `Decided`, read from them; plan None: the starter was kept) are
    earlier processes' decisions: a bucket kept on the starter is served by it as decided, and a bucket kept on another
    plan starts on that plan, which serves once the referee agrees on the bucket's first call (`_verify`), and is
    timed against the `recheck` candidate alone (ONNX Runtime by default). Its retry
    labels name the candidates an earlier process dropped on their first rounds at under `RETRY_BELOW` times the
    serving plan's time (noise can do that): the bucket, served as decided, tries those once more, and its decision is
    then kept without them. `unplaced`, given when `starter` is itself a kept plan, builds (label, plan) of the one a
    session starts on when nothing was decided, for the buckets kept on that one. The candidates labelled in
    `per_bucket` make their plan from each bucket's sample (a search measures at it); the others' plans are
    made once and shared by every bucket. The referee is ONNX Runtime running the model itself: `referee` builds it
    (the starter is it where not given); `plain` says the starter a session builds when nothing was decided is it
    too; `tolerances` gives, per output, what a plan is held to against it (`precision.own`). A plan the session
    chose itself serves only calls whose float feeds are finite (see `Arm`). `run` is thread safe."""

    def __init__(self, starter: Plan, compile: Callable[[Plan], Executor], label: str,
                 candidates: Candidates | None = None, *,
                 budget_s: float = 60.0, explore_after_s: float = EXPLORE_AFTER_S,
                 tolerances: Callable[[], Mapping[str, Tolerance]] = dict,
                 decisions: Decisions | Callable[[], Decisions] | None = None,
                 decided: Mapping[str, Decided] | None = None,
                 recheck: str | None = None, unplaced: Callable[[], tuple[str, Plan]] | None = None,
                 referee: Callable[[], Plan] | None = None, plain: bool = False, per_bucket: Collection[str] = ()):
        self._compile, self._candidates, self._per_bucket = compile, candidates, frozenset(per_bucket)
        self._recipes: Mapping[str, Recipe] | None = None  # the candidates, once the background work asked
        self._budget_s, self.decisions = budget_s, decisions
        self._tolerances: Callable[[], Mapping[str, Tolerance]] | Mapping[str, Tolerance] = tolerances
        self._explore_after_s = explore_after_s
        self._lock = threading.Lock()
        self._fallback = False
        self.starter = self._arm(label, starter, refereed=unplaced is not None)
        # ONNX Runtime running the model itself: the starter, unless `referee` builds it (made when first needed)
        self._make_referee, self._plain = referee, plain
        self._referee: Arm | None = None if referee is not None else self.starter
        self._refereeing = threading.Lock()
        self._arms: list[Arm] = [self.starter]  # every plan compiled, not retired; shared where buckets try one plan
        self._decided = dict(decided or {})  # bucket -> what an earlier process decided
        self._recheck, self._unplaced = recheck, unplaced
        self._buckets: dict[str, Bucket] = {}
        self._exact: set[tuple] = set()
        self._by_shapes: dict[tuple, Bucket] = {}  # exact shapes -> their bucket
        self._last = self.starter
        self._jobs: queue.Queue[Bucket | None] = queue.Queue()
        self._spent = 0.0  # CPU seconds of background work: the background thread's and `_renewing_s`
        self._renewing_s = 0.0  # what compiling the winners again took, on the thread of the callers' priority
        self._closed = False
        self._worker: threading.Thread | None = None
        self._niced = False  # the background thread runs at `BACKGROUND_NICE`
        self._promoted: list[tuple[Arm, dict[str, np.ndarray] | None]] = []  # to compile again (`_renew_promoted`)
        # Decisions are written one after another, in the order made (a bucket's later one must win)
        self._keeper = ThreadPoolExecutor(1, thread_name_prefix="uhop-adapt-keep")
        self._keying = threading.Lock()

    def _keyed(self) -> Decisions:
        """`decisions`, made here the first time when given as a function (on a background thread: it hashes
        the model), their digest then naming the starter's plan where it was left blank."""
        with self._keying:
            if callable(self.decisions):
                self.decisions = self.decisions()
                with self._lock:
                    if not self.starter.plan.model_hash:
                        self.starter.plan = replace(self.starter.plan, model_hash=self.decisions.digest)
            return self.decisions

    # what the session reads

    @property
    def plan(self) -> Plan:
        """The plan that served the latest call (the starter before any)."""
        return self._last.plan

    @property
    def executor(self) -> Executor:
        return self._last.executor or self.starter.executor

    @property
    def fallback(self) -> bool:
        return self._fallback

    @fallback.setter
    def fallback(self, on: bool) -> None:
        with self._lock:
            self._fallback = on
            for arm in self._arms:
                if arm.executor is not None:
                    arm.executor.fallback = on

    @property
    def adaptation(self) -> dict[str, dict[str, Any]]:
        """Per shape bucket: `{"bucket", "calls", "serving", "candidates": [...], "decision"}`."""
        with self._lock:
            return {key: b.to_json() for key, b in self._buckets.items()}

    # running

    def run(self, output_names: Sequence[str] | None, feeds: Mapping[str, Any], *, host: bool = True,
            timings: list[Timing] | None = None) -> tuple[list[Any], Plan]:
        """The outputs, and the plan that computed them."""
        if self._closed:
            raise UhopError("the session is closed: its runtimes were released; make a new session to run again")
        if self._candidates is None:  # one plan: nothing to choose or time
            return self.starter.executor.run(output_names, feeds, host=host, timings=timings), self.starter.plan
        if len(feeds) == 1:  # most models: (name, dims) found in half the time
            for name, value in feeds.items():
                seen: tuple = (name, value.shape if type(value) is np.ndarray else _dims(value))
        else:  # (names, their dims)
            seen = (tuple(feeds), tuple([v.shape if type(v) is np.ndarray else _dims(v) for v in feeds.values()]))
        bucket = self._by_shapes.get(seen) or self._bucket(seen, feeds)
        if bucket.settled:  # decided, nothing on trial: its plan serves, untimed
            arm = bucket.current
            if arm.refereed and not _finite(feeds):  # the referee serves it (see `Arm`)
                arm = self._umpire()
                bucket.calls += 1
                return arm.executor.run(output_names, feeds, host=host, timings=timings), arm.plan
            self._last = arm
            if not arm.niced:  # retired by nothing but `close`: uncounted, unlocked
                bucket.calls += 1  # for the record: two calls at the same instant may count as one
                return arm.executor.run(output_names, feeds, host=host, timings=timings), arm.plan
            with self._lock:
                bucket.calls += 1
                arm = self._last = bucket.current
                counted = arm.niced  # a copy compiled again may replace it meanwhile (`_renewed`); no other
                arm.running += counted
            try:
                return arm.executor.run(output_names, feeds, host=host, timings=timings), arm.plan
            finally:
                if counted:
                    self._ended(arm)
        if bucket.unverified:  # checked against the referee on this call before it serves
            served = self._verify(bucket, feeds)
            if served is not None and output_names is None and host and timings is None:
                return served
        # read only where a refereed arm may serve it (None: not read; a trial that began meanwhile refers it)
        finite = _finite(feeds) if bucket.trials or bucket.current.refereed else None
        with self._lock:
            arm = self._turn(bucket) if bucket.trials else bucket.current
            if arm.refereed and not finite:  # the referee serves it (see `Arm`), uncounted in any round
                bucket.calls += 1
                arm = None
            else:
                arm.running += 1
                self._last = arm
        if arm is None:
            referee = self._umpire()
            return referee.executor.run(output_names, feeds, host=host, timings=timings), referee.plan
        start = time.perf_counter()
        try:
            results = arm.executor.run(output_names, feeds, host=host, timings=timings)
        except BaseException:
            self._ended(arm)
            raise
        self._record(bucket, arm, (time.perf_counter() - start) * 1e3, feeds)
        return results, arm.plan

    def _ended(self, arm: Arm) -> None:
        """A run on `arm` (counted in its `running`) is over: it is closed if it was retired meanwhile."""
        with self._lock:
            arm.running -= 1
            arm.release()

    def _bucket(self, seen: tuple, feeds: Mapping[str, Any]) -> Bucket:
        """The bucket of a call's feeds, made at their first call; `seen` then finds it without the lock."""
        shapes = tuple((name, _dims(value)) for name, value in feeds.items())
        with self._lock:
            if shapes not in self._exact and len(self._exact) >= EXACT_BUCKETS:
                shapes = tuple((name, tuple(_pow2(d) for d in dims)) for name, dims in shapes)
            else:
                self._exact.add(shapes)
            key = ", ".join(f"{name}: {'x'.join(map(str, dims)) or 'scalar'}" for name, dims in shapes)
            if key not in self._buckets:
                self._buckets[key] = self._new_bucket(key)
            if len(self._by_shapes) < 4 * EXACT_BUCKETS:  # the shapes seen most, found without the lock
                self._by_shapes[seen] = self._buckets[key]
            return self._buckets[key]

    def _new_bucket(self, key: str) -> Bucket:
        """A bucket at its first call, on what an earlier process decided for it (see the class), else on the
        starter, to be explored; a plan kept by an earlier process serves once the referee agrees (`_verify`)
        (under the lock)."""
        bucket = self._decided_bucket(key) if key in self._decided else Bucket(key, self.starter)
        if bucket.current.refereed:
            bucket.unverified, bucket.settle, bucket.settled = True, bucket.settled, False
        return bucket

    def _decided_bucket(self, key: str) -> Bucket:
        """A bucket on what an earlier process decided for it (under the lock)."""
        label, plan, calls, retry, refused = self._decided.pop(key)
        retry = frozenset(retry)
        unplaced = plan is None and self._unplaced is not None
        if unplaced:  # the session started on another bucket's kept plan
            label, plan = self._built(key, self._unplaced)
            if plan is None:
                return Bucket(key, self.starter)
        arm = self.starter if plan is None else self._kept_arm(key, label, plan)
        if arm is None:  # it no longer compiles: decided again
            return Bucket(key, self.starter)
        if unplaced and self._plain and self._referee in (None, arm):  # ONNX Runtime on the model: the referee
            arm.refereed, self._referee = False, arm
        if plan is None or label == self._recheck:  # nothing was faster than what it would be re-checked against
            if retry:
                bucket = Bucket(key, arm, only=retry, retrying=True)
            else:
                bucket = Bucket(key, arm, decision=f"kept {label}, as decided earlier (at {calls} calls)",
                                explored=True, settled=True)
        else:
            bucket = Bucket(key, arm, only=retry | {self._recheck} if self._recheck else None, retrying=bool(retry))
        bucket.refused = dict(refused)
        return bucket

    def _umpire(self) -> Arm:
        """The referee: ONNX Runtime running the model itself, compiled when first needed (on the calling thread)
        and kept while the session lives."""
        if self._referee is None:
            with self._refereeing:
                if self._referee is None:
                    arm = self._arm(self._recheck or "ort-cpu", self._make_referee(), refereed=False)
                    with self._lock:
                        closed = self._closed
                        if not closed:
                            self._arms.append(arm)
                    if closed:
                        arm.executor.close()
                        raise UhopError("the session is closed: its runtimes were released")
                    self._referee = arm
        return self._referee

    def _rules(self) -> Mapping[str, Tolerance]:
        """Per output, what a plan is held to against the referee (`precision.own`), worked out once."""
        if callable(self._tolerances):
            self._tolerances = self._tolerances()
        return self._tolerances

    def _judged(self, names: Sequence[str], got: Sequence[Any], want: Sequence[Any]) -> tuple[str, str, float]:
        """Outputs `got` against the referee's `want`: (what differs, or "" where all agree; the tolerance of the
        output said, in words; the largest absolute error over the outputs)."""
        rules, worst, said = self._rules(), 0.0, ""
        for name, a, b in zip(names, got, want):
            rule = rules.get(name, FP32_CHECK)
            verdict = compare(a, b, rule)
            worst = max(worst, verdict.get("max_abs_error") or 0.0)
            if not verdict["ok"]:
                error = verdict.get("error") or (f"max abs error {verdict['max_abs_error']:.4g}, "
                                                 f"{verdict['nonfinite']} non-finite mismatches")
                return f"output {name!r} differs from ONNX Runtime's ({error})", describe(rule), worst
            said = said or describe(rule)
        return "", said, worst

    def _verify(self, bucket: Bucket, feeds: Mapping[str, Any]) -> tuple[list[Any], Plan] | None:
        """Compare the plan an earlier process kept for `bucket` with the referee on this call's feeds, before it
        serves. One that disagrees is dropped, with one warning: the referee serves the bucket from now on, and
        the refusal is kept so that no later process tries it again. The outputs to serve this call with, all of
        them on the host; None where another call verified it first, or the feeds hold NaN or Inf (the referee
        serves those in any case) or are not arrays."""
        with bucket.verifying:
            if not bucket.unverified or not _finite(feeds) or not all(type(v) is np.ndarray for v in feeds.values()):
                return None
            arm, referee = bucket.current, self._umpire()
            want = referee.executor.run(None, feeds)
            got = arm.executor.run(None, feeds)
            why, rule, _ = self._judged(arm.executor.outputs, got, want)
            with self._lock:
                bucket.unverified = False
                if not why:
                    bucket.settled = bucket.settle
                    return got, arm.plan
                bucket.refused[arm.label] = f"{why}; held to {rule}"
                bucket.current, bucket.trials, bucket.only = referee, {}, None
                bucket.decision = (f"refused {arm.label}, the plan kept by an earlier process: {why}, held to "
                                   f"{rule}; {referee.label} serves")
                bucket.explored = bucket.settled = True
                bucket.decided()
                self._keep(bucket)
                self._retire(arm)
        log.warning("%s at %s: %s", arm.plan.model_name, bucket.key, bucket.decision)
        return want, referee.plan

    def _built(self, key: str, build: Callable[[], tuple[str, Plan]]) -> tuple[str, Plan | None]:
        """(label, plan) that `build` makes; ("", None) when it fails, so that the bucket is decided again."""
        try:
            return build()
        except Exception as error:  # noqa: BLE001 - without it the bucket is only explored again
            log.warning("%s: the plan it was decided on cannot be built (%s); deciding again", key, first_line(error))
            return "", None

    def _kept_arm(self, key: str, label: str, plan: Plan) -> Arm | None:
        """The arm of a plan decided earlier (the starter's, when the session started on it); None when it no
        longer compiles (under the lock)."""
        try:
            arm = self._compiled(plan) or self._arm(label, plan)
        except Exception as error:  # noqa: BLE001 - a kept decision that no longer compiles is only skipped
            log.warning("%s: the plan decided earlier (%s) does not compile (%s); starting on %s",
                        key, label, first_line(error), self.starter.label)
            return None
        if arm not in self._arms:
            self._arms.append(arm)
        return arm

    def _compiled(self, plan: Plan) -> Arm | None:
        """The arm already serving or trying `plan`'s stages, under whatever label (under the lock)."""
        return next((a for a in self._arms if _same_stages(a.plan, plan)), None)

    def _turn(self, bucket: Bucket) -> Arm:
        """The arm for this call: the candidates on trial take turns with the serving arm (under the lock)."""
        rounds = bucket.rounds()
        turn = bucket.turn % sum(calls for _, calls in rounds)
        bucket.turn = turn + 1
        for arm, calls in rounds:  # the arm whose round this call falls in
            if turn < calls:
                break
            turn -= calls
        return arm

    def _record(self, bucket: Bucket, arm: Arm, ms: float, feeds: Mapping[str, Any]) -> None:
        """A call that `arm` served in `ms`: the arm released, the call counted (and timed in its round while
        candidates are tried), and the bucket's candidates asked for once its calls make exploring pay."""
        with self._lock:
            arm.running -= 1
            arm.release()
            bucket.calls += 1
            if arm is not bucket.current:
                self._timed(bucket, arm, ms)
            elif bucket.trials:  # the serving plan's rounds, which the candidates' pair with
                bucket.round_ms.append(ms)
                if len(bucket.round_ms) == bucket.round:  # the candidate's round next; this arm's next at its pace
                    bucket.last_ms = _figure(bucket.round_ms)
                    bucket.round = round_calls(bucket.last_ms / 1e3)
                    bucket.round_ms, bucket.turn = [], bucket.round
            bucket.busy_s += ms / 1e3
            due = (not bucket.explored and bucket.calls >= EXPLORE_AFTER and bucket.busy_s >= self._explore_after_s
                   and _finite(feeds))  # the sample candidates are checked on must be one they may serve
            explore = due and not self._closed and self._spent < self._budget_s
            if due and not explore:
                bucket.decision, bucket.settled = f"kept {bucket.current.label}: the adapt_budget is spent", True
                bucket.decided()
            if explore:
                bucket.explored = True
                bucket.sample = {name: _copied(value) for name, value in feeds.items()}
                bucket.preparing = True
        if explore:
            self._start_worker()
            self._jobs.put(bucket)

    def _timed(self, bucket: Bucket, arm: Arm, ms: float) -> None:
        """A candidate's call, in its trial's round; a round paired with the serving plan's (under the lock)."""
        trial = next((t for t in bucket.trials.values() if t.arm is arm and t.state == "trying"), None)
        if trial is not None and bucket.last_ms > 0:
            trial.round_ms.append(ms)
            trial.calls += 1
            if len(trial.round_ms) == trial.round:  # the serving arm's round next; this arm's next at its pace
                trial.pairs.append((_figure(trial.round_ms), bucket.last_ms))
                trial.round = round_calls(trial.pairs[-1][0] / 1e3)
                trial.round_ms, bucket.turn = [], 0
                self._judge(bucket, trial)

    def _judge(self, bucket: Bucket, trial: Trial) -> None:
        """A trial's verdict once its calls say enough (one faster serves at once); the bucket's decision once
        no trial runs (under the lock)."""
        n = len(trial.pairs)
        median, low, high = trial.ratio_interval()
        if n >= FIRST_ROUNDS and median > DROP_RATIO:
            trial.state, trial.dropped = "slower", True
        elif n >= MIN_PAIRS and high < 1.0:
            trial.state = "faster"
        elif n >= MIN_PAIRS and low > 1.0:
            trial.state = "slower"
        elif n >= MAX_PAIRS:
            trial.state = "within noise"
        else:
            return
        log.debug("%s: %s is %s (%.3f [%.3f, %.3f] over %d rounds)", bucket.key, trial.label, trial.state,
                  median, low, high, n)
        if trial.state == "faster":
            self._promote(bucket, trial)
        self._settle(bucket)
        if trial.state == "faster" and not bucket.settled:  # kept now too, should the program end first
            bucket.decided()  # the plan kept records the trials so far (`explain`), its decision still to come
            self._keep(bucket)

    def _promote(self, bucket: Bucket, trial: Trial) -> None:
        """`trial`'s plan, found faster, serves the bucket from the next call, and the candidates still to come
        are measured against it (under the lock)."""
        median, low, high = trial.ratio_interval()
        old = bucket.current
        bucket.current, bucket.round, bucket.turn, bucket.round_ms = trial.arm, trial.round, 0, []
        said = (f"{trial.label} replaced {old.label}: {median:.3f}x its time (95% interval {low:.3f}-{high:.3f}) "
                f"over {len(trial.pairs)} interleaved rounds ({trial.calls} of its calls)")
        bucket.replaced.append(said)
        log.info("%s at %s: %s", trial.arm.plan.model_name, bucket.key, said)
        self._retire(old)
        if trial.arm.niced and priority.below(BACKGROUND_NICE):
            self._promoted.append((trial.arm, bucket.sample))

    def _renew_promoted(self) -> None:
        """Compile again each plan promoted since, on the thread of the callers' priority (`_renewed`)."""
        while not self.stopped():
            with self._lock:
                if not self._promoted:
                    return
                arm, sample = self._promoted.pop(0)
            try:
                spent = priority.call(self._renewed, arm, sample)
            except Exception as error:  # noqa: BLE001 - the copy compiled in the background serves on
                log.debug("%s was not compiled again: %s", arm.label, first_line(error))
                continue
            self._renewing_s += spent
            self._spent += spent

    def _renewed(self, arm: Arm, sample: dict[str, np.ndarray] | None) -> float:
        """Compile `arm`'s plan again on this thread, warm it up on `sample` (when given), and serve it wherever
        `arm` serves (should that fail, `arm` serves on); the CPU seconds it took."""
        with self._lock:
            if self.stopped() or not any(b.current is arm for b in self._buckets.values()):
                return 0.0
        begun, new, warm = time.thread_time(), None, False
        try:
            new = self._arm(arm.label, arm.plan)
            for _ in range(WARM_UP if sample is not None else 0):
                new.executor.run(None, sample)
            warm = True
        except Exception as error:  # noqa: BLE001 - the plan compiled in the background serves on
            log.info("%s could not be compiled again at the callers' priority (%s); the copy compiled in the "
                     "background serves on", arm.label, first_line(error))
        with self._lock:
            serving = [b for b in self._buckets.values() if b.current is arm]
            going = new  # a copy that failed, or came too late (the session closed, another plan replaced it)
            if warm and serving and not self._closed:
                new.plan = arm.plan  # with the decision recorded meanwhile
                new.executor.fallback = self._fallback
                for bucket in serving:
                    bucket.current, bucket.turn, bucket.round_ms = new, 0, []
                self._arms.append(new)
                going = arm
                log.debug("%s serves at the callers' priority", new.label)
            if going is not None:
                self._retire(going)
        return time.thread_time() - begun

    def _settle(self, bucket: Bucket) -> None:
        """When no candidate is compiling or on trial, the bucket has its decision (under the lock)."""
        if bucket.preparing or any(t.state in ("compiling", "trying") for t in bucket.trials.values()):
            return
        for trial in bucket.trials.values():
            if trial.arm is not None:
                self._retire(trial.arm)
        bucket.settled = True
        bucket.decision = (bucket.decision or "; then ".join(bucket.replaced)
                           or f"kept {bucket.current.label}: {_outcomes(bucket)}")
        bucket.decided()
        if bucket.replaced or (bucket.untried == [] and (bucket.only is None or bucket.retrying)):
            self._keep(bucket)  # with the decision recorded in its plan

    def _keep(self, bucket: Bucket) -> None:
        """Keep the bucket's serving plan for the next process (None for the starter a session starts on when
        nothing was decided, which it builds itself), written off the caller's thread (under the lock)."""
        if self.decisions is not None and not self._closed:
            starter = ((bucket.current is self.starter and self._unplaced is None)
                       or (bucket.current is self._referee and self._plain))
            retry = [] if bucket.retrying else [
                t.label for t in bucket.trials.values()
                if t.dropped and len(t.pairs) < MIN_PAIRS and t.ratio_interval()[0] < RETRY_BELOW]
            refused = {**bucket.refused, **{t.label: t.error for t in bucket.trials.values()
                                            if t.state == "refused" and t.tolerance}}
            try:
                self._keeper.submit(self._kept, bucket.key, bucket.current.label,
                                    None if starter else bucket.current.plan, bucket.calls, retry, refused)
            except RuntimeError:  # the interpreter is shutting down (a background settle after the program ended)
                log.debug("%s: the program ended before its decision could be kept", bucket.key)

    @quietly()
    def _kept(self, *decision: Any) -> None:
        """`Decisions.keep(*decision)`, on the keeper's thread, once the model's digest keys them."""
        try:
            decisions = self._keyed()
        except Exception as error:  # noqa: BLE001 - the digest failed: the decision is only not kept
            log.warning("could not keep the decision for %s: %s", decision[0], first_line(error))
            return
        decisions.keep(*decision)

    def _retire(self, arm: Arm) -> None:
        """Close `arm` once no bucket serves with it, tries it or warms it up, and no call runs on it (under the
        lock)."""
        used = any(arm is b.current or any(t.arm is arm and t.state in ("compiling", "trying")
                                           for t in b.trials.values()) for b in self._buckets.values())
        if arm is self.starter or arm is self._referee or used:
            return
        arm.retired = True
        if arm in self._arms:
            self._arms.remove(arm)
        arm.release()

    # the background work

    def stopped(self) -> bool:
        """Whether background work should stop: the session closed, or the program is ending."""
        return self._closed or not threading.main_thread().is_alive()

    def _start_worker(self) -> None:
        # Not a daemon: a runtime interrupted inside native code as the interpreter ends aborts the process.
        # It stops at its next step once the main thread has finished (see `stopped`).
        with self._lock:
            if self._worker is None and not self._closed:
                priority.start()
                self._worker = threading.Thread(target=self._work, name="uhop-adapt")
                self._worker.start()

    def _next_job(self) -> Bucket | None:
        while not self.stopped():
            try:
                return self._jobs.get(timeout=0.2)
            except queue.Empty:
                self._renew_promoted()  # a verdict that came after `TRIAL_S`
        return None

    @quietly()  # what the background does stays off a program's stderr: its warnings are said at INFO
    def _work(self) -> None:
        try:  # a background thread of its own priority (Linux: niceness is per thread), unless lower already
            if os.getpriority(os.PRIO_PROCESS, 0) < BACKGROUND_NICE:
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BACKGROUND_NICE)
                self._niced = True
        except (AttributeError, OSError):
            pass
        # the budget counts this thread's CPU time: on a loaded machine a thread at nice 10 waits long for little
        # work, and wall time would spend the budget on the waiting
        begun = time.thread_time()
        if self.decisions is not None:
            try:
                self._keyed()
            except Exception as error:  # noqa: BLE001 - said when a decision is to be kept
                log.debug("the model's digest failed: %s", first_line(error))
        while (bucket := self._next_job()) is not None:
            if self._recipes is None:
                try:
                    self._recipes = dict(self._candidates(self.stopped, bucket.sample))
                except Exception as error:  # noqa: BLE001 - without candidates the session keeps its plan
                    log.warning("no candidate plans can be prepared (%s); the session keeps its plan",
                                first_line(error))
                    self._recipes = {}
                self._spent = time.thread_time() - begun + self._renewing_s
            untried = []
            for label, recipe in self._recipes.items():
                if (label == bucket.current.label or label in bucket.trials or label in bucket.refused
                        or label not in (bucket.only or {label})):
                    continue
                if self.stopped():
                    break
                if self._spent >= self._budget_s:
                    untried.append(label)
                    with self._lock:
                        bucket.trials[label] = Trial(label, state="untried", why=f"the adapt_budget "
                                                     f"({self._budget_s:g} s of CPU) was spent")
                    continue
                with self._lock:
                    trial = bucket.trials[label] = Trial(label)
                try:
                    arm = self._prepared(trial, recipe, bucket)
                except Exception as error:  # noqa: BLE001 - a candidate may fail in any way; it only stops
                    log.info("%s: candidate %s refused: %s", bucket.key, label, first_line(error))
                    with self._lock:
                        trial.state, trial.error = "refused", first_line(error)
                        if trial.arm is not None:  # its plan goes, unless another bucket serves or tries it
                            self._retire(trial.arm)
                    arm = None
                self._spent = time.thread_time() - begun + self._renewing_s
                with self._lock:
                    if arm is not None and trial.state == "compiling":
                        trial.arm, trial.state = arm, "trying"
                        bucket.turn, bucket.round_ms = 0, []  # rounds start together: the serving arm's first
                        bucket.round = round_calls(bucket.busy_s / max(bucket.calls, 1))
                self._await(trial)
                self._renew_promoted()  # beside no trial's calls: the next candidate is prepared after it
            with self._lock:
                bucket.sample, bucket.preparing, bucket.untried = None, False, untried
                self._settle(bucket)

    def _await(self, trial: Trial) -> None:
        """Wait while `trial` runs (up to `TRIAL_S`), so that no compile shares the machine with its calls."""
        deadline = time.monotonic() + TRIAL_S
        while trial.state == "trying" and not self.stopped() and time.monotonic() < deadline:
            time.sleep(0.02)

    def _prepared(self, trial: Trial, recipe: Recipe, bucket: Bucket) -> Arm | None:
        """The candidate's arm for this bucket, compiled or shared with another bucket (a `per_bucket` one's
        only where its plan is the same), run `WARM_UP` times on the bucket's sample and checked there against
        the referee's outputs (an error saying what differs when they disagree); None when its plan is one already tried."""
        # the trial holds its arm from when it is found: another bucket must not close it while it warms up
        with self._lock:  # a plan made once is shared by the buckets
            arm = trial.arm = (None if trial.label in self._per_bucket
                               else next((a for a in self._arms if a.label == trial.label), None))
        if arm is None:
            plan = recipe(bucket.sample)
            with self._lock:
                arm = self._compiled(plan)
                if arm is not None and arm.label != trial.label:
                    trial.state, trial.why = "untried", f"the same plan as {arm.label}"
                    return None
                trial.arm = arm
            if arm is None:
                arm = self._arm(trial.label, plan)
                arm.niced = self._niced
                with self._lock:
                    closed = self._closed
                    if not closed:
                        self._arms.append(arm)
                        trial.arm = arm
                if closed:  # the session closed while it compiled
                    arm.executor.close()
                    raise UhopError("stopped: the session closed")
        if bucket.reference is None:
            bucket.reference = self._umpire().executor.run(None, bucket.sample)
        paces = []
        for _ in range(WARM_UP):
            start = time.perf_counter()
            got = arm.executor.run(None, bucket.sample)
            paces.append(time.perf_counter() - start)
        trial.round = round_calls(min(paces))
        why, trial.tolerance, trial.max_error = self._judged(arm.executor.outputs, got, bucket.reference)
        if why:
            raise UhopError(why)
        return arm

    def _arm(self, label: str, plan: Plan, refereed: bool = True) -> Arm:
        executor = self._compile(plan)
        executor.fallback = self._fallback
        return Arm(label, plan, executor, refereed)

    def close(self) -> None:
        """Stop the background work and release every plan's runtimes."""
        with self._lock:
            self._closed = True
            arms, self._arms = self._arms, []
        self._jobs.put(None)
        self._keeper.shutdown(wait=False)  # the decisions made are still written
        for arm in arms:
            if arm.executor is not None:
                arm.executor.close()
                arm.executor = None


def _outcomes(bucket: Bucket) -> str:
    """What became of each candidate of a bucket kept on its plan, in words."""
    said = []
    for trial in bucket.trials.values():
        if trial.state == "refused":
            said.append(f"{trial.label} refused ({trial.error}{f'; held to {trial.tolerance}' if trial.tolerance else ''})")
        elif trial.state == "untried":
            said.append(f"{trial.label} untried ({trial.why})")
        else:
            ratio = f" ({trial.ratio_interval()[0]:.2f}x its time)" if trial.pairs else ""
            said.append(f"{trial.label} {trial.state}{ratio}")
    return "; ".join(said) or "no candidate to try"


def _finite(feeds: Mapping[str, Any]) -> bool:
    """Whether no floating-point array among `feeds` holds NaN or Inf, by the sum of its squares (NaN and Inf
    carry through it; values so large that it overflows count as not finite: such a call goes to the referee
    too; float16 is summed in float32). Values that are not arrays are taken as finite."""
    for value in feeds.values():
        if type(value) is np.ndarray and value.dtype.kind == "f":
            with np.errstate(over="ignore", invalid="ignore"):
                if value.itemsize < 4:
                    total = np.add.reduce(value, None, np.float32)
                else:
                    flat = value.reshape(-1)
                    total = np.dot(flat, flat)
            if not math.isfinite(total):
                return False
    return True


def _dims(value: Any) -> tuple[int, ...]:
    """A feed's shape: an array's, an `OrtValue`'s, a sequence's length; () for anything else."""
    shape = getattr(value, "shape", None)
    if type(shape) is tuple:  # an array's: most calls
        return shape
    if callable(shape):  # an OrtValue
        shape = shape()
    if shape is None:
        return (len(value),) if isinstance(value, (list, tuple)) else ()
    return tuple(shape)


def _copied(value: Any) -> Any:
    """A copy of a feed that the caller may change or free: arrays, `OrtValue`s (read on the host), sequences."""
    if isinstance(value, (list, tuple)):
        return [np.array(v, copy=True) for v in value]
    if callable(getattr(value, "numpy", None)):
        return np.array(value.numpy(), copy=True)
    return None if value is None else np.array(value, copy=True)


def round_calls(call_s: float) -> int:
    """Calls per round at a serving pace of `call_s` seconds a call: `ROUND`, or `ROUND_S` seconds' worth."""
    return max(ROUND, math.ceil(ROUND_S / max(call_s, 1e-6)))


def _figure(round_ms: list[float]) -> float:
    """A round's figure: the median of its second half (see `ROUND`)."""
    return statistics.median(round_ms[len(round_ms) // 2:])


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _same_stages(a: Plan, b: Plan) -> bool:
    def layout(plan: Plan) -> list[tuple[str, list[str]]]:
        return [(s.label, s.nodes) for s in plan.stages]

    return a.model_hash == b.model_hash and layout(a) == layout(b)


def whole_model(loaded: onnx.ModelProto, data: bytes | str, name: str, digest: str, provider: Provider) -> Plan:
    """`loaded` (its structure, as `uhop_onnx.load_as_read` gives it, with `data`, the bytes it was read from
    or its path; `digest`, its `model_digest`) as one stage on `provider`, an ONNX Runtime one, unsimplified:
    what the runtime itself would run, built without placing anything (the model whole is parsed from `data`
    when first needed)."""
    inputs, outputs = io_signatures(loaded)
    stage = Stage(provider=provider.id, options=dict(provider.options), nodes=[n.name for n in loaded.graph.node],
                  inputs=[i.name for i in loaded.graph.input], outputs=[o.name for o in outputs],
                  file=f"stage_00_{provider.id}.onnx", declared=declared_outputs(loaded), data=data)
    return Plan(model_name=name, model_hash=digest, inputs=inputs, outputs=outputs,
                providers=[{"id": provider.id, "options": dict(provider.options),
                            "version": provider.availability.version}],
                stages=[stage], metadata=ModelMetadata.of(loaded), placement="whole")


class Decisions:
    """What earlier processes decided for one model, host and set of providers: per shape bucket, the label
    and the plan (saved beside `decisions.json` in `folder`) that serves it, or None where the starter was
    kept (nothing faster), and the candidates ONNX Runtime refused. A kept plan is read only when it is what it
    claims: a folder inside `folder` (no link), made for this model (its digest), each stage file matching the
    sha256 recorded; one that is not, or no longer loads, is dropped with a warning and decided again. Whatever
    it reads still serves only once the referee agrees (`Serving`)."""

    def __init__(self, folder: Path, digest: str = ""):
        self.folder, self.digest = folder, digest  # the model's `cache.model_digest`
        self.table = JsonTable(folder / "decisions.json", check=_decision)

    def read(self) -> dict[str, Decided]:
        """Bucket -> its `Decided`, most called first."""
        kept = {}
        if self.folder.is_symlink():
            log.warning("decisions in %s are not read: the folder is a symbolic link", self.folder)
            return kept
        for bucket, entry in sorted(self.table.read().items(), key=lambda item: -item[1]["calls"]):
            retry, refused = tuple(entry.get("retry", ())), dict(entry.get("refused", {}))
            if not entry["plan"]:
                kept[bucket] = (entry["label"], None, entry["calls"], retry, refused)
                continue
            try:
                plan = self._plan(entry["plan"])
            except UhopError as error:
                log.warning("the plan decided earlier for %s is dropped and decided again: %s", bucket,
                            first_line(error))
            else:
                kept[bucket] = (entry["label"], plan, entry["calls"], retry, refused)
        return kept

    def _plan(self, name: str) -> Plan:
        """The kept plan folder `name`, checked (see the class)."""
        folder = self.folder / name
        if folder.is_symlink() or not folder.resolve().is_relative_to(self.folder.resolve()):
            raise UhopError(f"{folder}: refused: a symbolic link (a kept plan must lie in {self.folder})")
        plan = Plan.load(folder)
        if self.digest and plan.model_hash != self.digest:
            raise UhopError(f"{folder}: refused: made for another model (sha256 {plan.model_hash[:12]}, this "
                            f"model's is {self.digest[:12]})")
        for stage in plan.stages:  # each stage file read now, against its sha256
            plan.stage_model(stage)
        return plan

    def keep(self, bucket: str, label: str, plan: Plan | None, calls: int, retry: Sequence[str] = (),
             refused: Mapping[str, str] | None = None) -> None:
        """Keep `plan` (None: the starter) as the bucket's decision, in place of the one kept before; `retry`:
        the candidates the next process tries once more; `refused`: those ONNX Runtime refused, with why. The
        plan is recorded as made for this model (its digest), which `read` checks."""
        if plan is not None and self.digest:
            plan = replace(plan, model_hash=self.digest)
        name = "" if plan is None else f"{hashlib.sha256(bucket.encode()).hexdigest()[:12]}-{uuid.uuid4().hex[:8]}"
        try:
            if plan is not None:
                plan.save(self.folder / name, report=False)
        except (UhopError, OSError) as error:  # a full disk: the decision is only not kept
            log.warning("could not keep the decision for %s in %s: %s", bucket, self.folder, first_line(error))
            return
        entry = {"label": label, "plan": name, "calls": calls, **({"retry": list(retry)} if retry else {}),
                 **({"refused": dict(refused)} if refused else {})}
        replaced = self.table.update({bucket: entry}).get(bucket)
        if replaced and replaced["plan"]:  # unnamed from now: a reader may be loading it (see `_prune`)
            with contextlib.suppress(OSError):
                os.utime(self.folder / replaced["plan"])
        self._prune()

    def _prune(self) -> None:
        """Remove the plans no decision has named for `UNNAMED_S` seconds (a reader may be loading one)."""
        named = {entry["plan"] for entry in self.table.read().values()}
        for folder in self.folder.iterdir():
            try:  # a name starting with "." is a plan being written (no decision names one so)
                unused = (folder.is_dir() and not folder.name.startswith(".") and folder.name not in named
                          and time.time() - folder.stat().st_mtime > UNNAMED_S)
            except OSError:  # removed by another process meanwhile
                continue
            if unused:
                shutil.rmtree(folder, ignore_errors=True)


def _decision(entry: Any) -> None:
    if not (isinstance(entry, dict) and isinstance(entry.get("label"), str) and isinstance(entry.get("calls"), int)
            and isinstance(entry.get("plan"), str) and "/" not in entry["plan"] and not entry["plan"].startswith(".")
            and isinstance(retry := entry.get("retry", []), list) and all(isinstance(x, str) for x in retry)
            and isinstance(refused := entry.get("refused", {}), dict)
            and all(isinstance(x, str) for x in [*refused, *refused.values()])):
        raise TypeError(f"{entry!r} is not {{label, plan, calls[, retry][, refused]}}")
