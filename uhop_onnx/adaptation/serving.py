"""Adaptive serving: a session's calls, grouped by shape bucket, are served by one plan per bucket; a bucket
whose calls make exploring pay is handed, with a sample of its own inputs, to the explorer, a process beside
the program (`explorer`), whose decision the session picks up at a call boundary and checks against ONNX
Runtime on the call it switches on, before the new plan serves.

`Serving` is the whole mechanism in the program's process: it compiles only what serves (the starter and,
once decided, the winner; ONNX Runtime again only where the referee is needed), starts no thread, and
changes nothing process-wide. Without `explore` it is one compiled plan.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
import shutil
import subprocess
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from ..foundation.cache import JsonTable
from ..foundation.dtypes import TensorSig
from ..foundation.errors import InputError, UhopError, first_line, logger
from ..precision import Tolerance
from ..runtime.executor import Executor, Timing, as_array
from ..runtime.plan import Plan
from . import explorer

log = logger(__name__)

EXPLORE_AFTER = 3  # calls at a bucket before it is worth exploring, once they took `explore_after_s` too
EXPLORE_AFTER_S = 2.0  # seconds of calls at a bucket before it is (short programs never pay)
EXPLORE_LIVED_S = 30.0  # or seconds since its first call: a program that calls seldom (a server between requests)
EXACT_BUCKETS = 8  # distinct shape sets kept exact; beyond, free axes are rounded up to powers of two
POLL_S = 0.5  # how often a call looks for the explorer's decisions (a stat of their file)
RETRY_S = 30.0  # a bucket the explorer left undecided (it was busy elsewhere, the machine was) is asked again after
EXPLORERS = 3  # explorer processes a session starts at most
# A plan switched to is timed on the program's own calls, against the calls before it: at least CHECK calls and
# CHECK_S seconds of them; it is switched back when its median call is over SLOWER times theirs (the explorer's
# figures may have been taken beside the program's load)
CHECK, CHECK_S, SLOWER = 8, 1.0, 1.05
PACES = 32  # the latest calls of the plan serving a bucket kept for that comparison
UNNAMED_S = 60.0  # a kept plan no decision names any more is removed after this long (a reader may be loading it)


@dataclass
class Explore:
    """What the explorer is given besides the buckets' samples: `job` (source: the model's path, or None for
    `model()`'s bytes; providers, threads, policy, assign), `decisions()` (made when first needed: it hashes
    the model) and the CPU seconds it may spend (`budget_s`)."""

    job: Mapping[str, Any]
    decisions: Callable[[], Decisions]
    model: Callable[[], bytes | None]
    budget_s: float = 60.0


class Arm:
    """A compiled plan that serves calls; closed once retired and no call runs on it. A `refereed` arm (a
    plan the session did not start on as ONNX Runtime itself) serves only calls whose floating-point feeds are
    all finite: the referee (ONNX Runtime) serves the others, as runtimes differ on NaN and Inf."""

    def __init__(self, label: str, plan: Plan, executor: Executor, refereed: bool = True):
        self.label, self.plan, self.executor = label, plan, executor
        self.running = 0
        self.retired = False
        self.refereed = refereed

    def release(self) -> None:
        """Close the executor if the arm is retired and idle (called under the serving lock)."""
        if self.retired and self.running == 0 and self.executor is not None:
            executor, self.executor = self.executor, None
            executor.close()


@dataclass
class Bucket:
    """The calls at one shape bucket: the arm serving them, its state (`serving`, `exploring`, `decided`), and
    what the explorer found (`candidates`) and decided."""

    key: str
    current: Arm | None  # None while it switches (`Serving._switch`)
    calls: int = 0
    busy_s: float = 0.0  # the time its calls took until it was handed to the explorer
    first: float = field(default_factory=time.monotonic)  # when it was first called
    paces: deque = field(default_factory=lambda: deque(maxlen=PACES))  # its latest calls' seconds (`serving`,
    # `checking`)
    before: float = 0.0  # the median call of the plan it switched from (`checking`)
    state: str = "serving"  # then `exploring`, `checking` (a plan switched to is timed), `decided`
    asked: int = 0  # explorers asked about it
    retry_at: float = 0.0  # not asked again before (`time.monotonic`)
    pending: Kept | None = None  # a decision to switch to at its next call
    candidates: list[dict[str, Any]] = field(default_factory=list)
    decision: str | None = None
    switching: threading.Lock = field(default_factory=threading.Lock)

    def to_json(self) -> dict[str, Any]:
        return {"bucket": self.key, "calls": self.calls, "serving": self.current.label if self.current else None,
                "state": self.state, "candidates": list(self.candidates), "decision": self.decision}

    def decided(self, decision: str) -> None:
        """Settled on its serving plan, which records the decision, as a plan it saves shows it (`explain`)."""
        self.state, self.decision = "decided", decision
        plan = self.current.plan
        self.current.plan = replace(plan, adaptation={**(plan.adaptation or {}), self.key: self.to_json()})


class Serving:
    """Runs calls on the plan serving each shape bucket, exactly for the first `EXACT_BUCKETS` shape sets, then with
    free axes rounded up to powers of two. Given `explore`, a bucket called `EXPLORE_AFTER` times for
    `explore_after_s` seconds in all (`EXPLORE_AFTER_S` unless given), or over `EXPLORE_LIVED_S` since its first
    call, is decided: by what an earlier process kept for it, else by the explorer (see `explorer`), given a
    copy of that call's feeds. A decision naming another plan
    is switched to on the bucket's next call with finite array feeds: ONNX Runtime (the referee) runs it, the plan
    serving until then is released (unless another bucket uses it), the new plan is compiled, runs it too, and
    serves from then on only if it agrees (each output held to `tolerances`'s rule); one that does not is refused,
    with one warning, and the refusal kept so that no process tries it again; one that agrees is timed on the calls
    that follow (`_checked`). Buckets decided on the same plan share one compiled copy. A plan other than the
    referee serves only calls whose float feeds are finite (see `Arm`). The referee is ONNX Runtime running the
    model itself: `referee` compiles it and says its plan (the starter is it where `plain`, `compiled` then its
    executor). `run` is thread safe."""

    def __init__(self, starter: Plan, compile: Callable[[Plan], Executor], label: str,
                 explore: Explore | None = None, *, explore_after_s: float | None = None,
                 tolerances: Callable[[], Mapping[str, Tolerance]] = dict,
                 referee: Callable[[], tuple[Plan, Executor]] | None = None, plain: bool = False,
                 compiled: Executor | None = None):
        self._compile, self._explore = compile, explore
        self._tolerances: Callable[[], Mapping[str, Tolerance]] | Mapping[str, Tolerance] = tolerances
        self._explore_after_s = EXPLORE_AFTER_S if explore_after_s is None else explore_after_s
        self._lock = threading.Lock()
        self._fallback = False
        self.starter = self._arm(label, starter, refereed=not plain, compiled=compiled)
        self._make_referee = referee
        self._referee: Arm | None = self.starter if plain else None
        self._refereeing = threading.Lock()
        self._arms: list[Arm] = [self.starter]  # every plan compiled, not retired
        self._buckets: dict[str, Bucket] = {}
        self._exact: set[tuple] = set()
        self._by_shapes: dict[tuple, Bucket] = {}  # exact shapes -> their bucket
        self._last = self.starter
        self._closed = False
        self.decisions: Decisions | None = None  # made when a bucket is first decided (`_keyed`)
        self._read: tuple[int, int] | None = None  # (mtime, size) of the decisions table last read
        self._explorer: subprocess.Popen | None = None
        self._explorers = 0
        self._queued: list[tuple[Bucket, dict[str, np.ndarray]]] = []  # buckets for the next explorer
        self._next_poll = math.inf  # no decision to look for until a bucket was handed to the explorer

    # what the session reads

    @property
    def plan(self) -> Plan:
        """The plan that served the latest call (the starter before any)."""
        return self._last.plan

    @property
    def executor(self) -> Executor:
        return self._last.executor or next(a.executor for a in self._arms if a.executor is not None)

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
        """Per shape bucket: `{"bucket", "calls", "serving", "state", "candidates": [...], "decision"}`."""
        with self._lock:
            return {key: b.to_json() for key, b in self._buckets.items()}

    # running

    def run(self, output_names: Sequence[str] | None, feeds: Mapping[str, Any], *, host: bool = True,
            timings: list[Timing] | None = None) -> tuple[list[Any], Plan]:
        """The outputs, and the plan that computed them."""
        if self._closed:
            raise UhopError("the session is closed: its runtimes were released; make a new session to run again")
        if self._explore is None:  # one plan: nothing to choose
            return self.starter.executor.run(output_names, feeds, host=host, timings=timings), self.starter.plan
        if len(feeds) == 1:  # most models: (name, dims) found in half the time
            for name, value in feeds.items():
                seen: tuple = (name, value.shape if type(value) is np.ndarray else _dims(value))
        else:  # (names, their dims)
            seen = (tuple(feeds), tuple([v.shape if type(v) is np.ndarray else _dims(v) for v in feeds.values()]))
        bucket = self._by_shapes.get(seen) or self._bucket(seen, feeds)
        arm = None
        while arm is None:
            if bucket.pending is not None or bucket.current is None:  # a decision to switch to, or switching
                served = self._switched(bucket, feeds)
                if served is not None and output_names is None and host and timings is None:
                    return served
            current = bucket.current
            # read only where a refereed arm may serve it (None: not read; a switch meanwhile refers the call)
            finite = _finite(feeds) if current is not None and current.refereed else None
            with self._lock:
                arm = bucket.current  # None: another call began switching meanwhile, and is waited for
                refer = arm is not None and arm.refereed and not finite
                if arm is not None and not refer:
                    arm.running += 1
                    self._last = arm
        if refer:  # the referee serves it (see `Arm`)
            referee = self._umpire()
            bucket.calls += 1
            return referee.executor.run(output_names, feeds, host=host, timings=timings), referee.plan
        timed = bucket.state in ("serving", "checking")  # not while it waits for the explorer, nor once decided
        start = time.perf_counter() if timed else 0.0
        try:
            results = arm.executor.run(output_names, feeds, host=host, timings=timings)
        finally:
            self._ended(arm)
        bucket.calls += 1  # for the record: two calls at the same instant may count as one
        if timed:
            self._timed(bucket, arm, time.perf_counter() - start, feeds)
        if time.monotonic() >= self._next_poll:
            self._poll()
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
            if key not in self._buckets:  # on the starter, unless a switch released it (`_switched` compiles it)
                self._buckets[key] = Bucket(key, self.starter if self.starter.executor is not None else None)
            if len(self._by_shapes) < 4 * EXACT_BUCKETS:  # the shapes seen most, found without the lock
                self._by_shapes[seen] = self._buckets[key]
            return self._buckets[key]

    # deciding

    def _timed(self, bucket: Bucket, arm: Arm, seconds: float, feeds: Mapping[str, Any]) -> None:
        """A call `arm` served in `seconds`, at a bucket still undecided: counted toward exploring, or toward
        the check of a plan switched to."""
        bucket.paces.append(seconds)
        if bucket.state == "checking":
            if len(bucket.paces) >= CHECK and sum(bucket.paces) >= CHECK_S:
                self._checked(bucket, arm)
            return
        bucket.busy_s += seconds
        now = time.monotonic()
        if (bucket.state == "serving" and bucket.calls >= EXPLORE_AFTER and now >= bucket.retry_at
                and (bucket.busy_s >= self._explore_after_s or now - bucket.first >= EXPLORE_LIVED_S)):
            self._due(bucket, feeds)

    def _checked(self, bucket: Bucket, arm: Arm) -> None:
        """The plan switched to has served its first calls: it stays unless its median call is over `SLOWER`
        times the plan's before it; then ONNX Runtime serves again, and that is kept."""
        with bucket.switching:
            if bucket.state != "checking" or bucket.current is not arm:
                return
            now = float(np.median(bucket.paces))
            if now <= SLOWER * bucket.before:
                self._settle(bucket, bucket.decision or f"{arm.label}, as decided")
                return
            said = (f"kept ort-cpu: {arm.label}, decided by the explorer, ran the program's calls in "
                    f"{now * 1e3:.3g} ms against {bucket.before * 1e3:.3g} ms before it")
            referee = self._umpire()
            with self._lock:
                bucket.current = referee
                self._retire(arm)
                bucket.decided(said)
        log.info("%s at %s: %s", referee.plan.model_name, bucket.key, said)
        self.decisions.keep(bucket.key, referee.label, None, bucket.calls, candidates=bucket.candidates,
                            decision=said)

    def _due(self, bucket: Bucket, feeds: Mapping[str, Any]) -> None:
        """The bucket's calls make deciding pay: the decision an earlier process kept for it serves from its
        next call, else it is handed to the explorer with a copy of these feeds (finite arrays only)."""
        with self._lock:
            if bucket.state != "serving" or self._closed:
                return
            bucket.state = "exploring"
        try:
            self._keyed()
        except Exception as error:  # noqa: BLE001 - the model's digest failed: the bucket is only not decided
            log.warning("%s: the model could not be hashed to look for decisions (%s); ONNX Runtime serves",
                        bucket.key, first_line(error))
            self._settle(bucket, "kept: the model could not be hashed")
            return
        self._poll(force=True)
        if bucket.state != "exploring" or bucket.pending is not None:
            return
        sample, why = _sampled(feeds, self.starter.plan.inputs)
        if why or bucket.asked >= EXPLORERS:
            self._settle(bucket, f"kept {bucket.current.label}: {why or 'the explorer never got to it'}")
            return
        with self._lock:
            bucket.asked += 1
            self._queued.append((bucket, {name: np.array(value, copy=True) for name, value in sample.items()}))
        self._poll(force=True)

    def _settle(self, bucket: Bucket, decision: str) -> None:
        with self._lock:
            if bucket.current is not None:
                bucket.decided(decision)

    def _keyed(self) -> Decisions:
        """The decisions, made the first time (it hashes the model), their digest then naming the starter's
        plan where it was left blank."""
        if self.decisions is None:
            decisions = self._explore.decisions()
            with self._lock:
                self.decisions = decisions
                if not self.starter.plan.model_hash:
                    self.starter.plan = replace(self.starter.plan, model_hash=decisions.digest)
        return self.decisions

    def _poll(self, force: bool = False) -> None:
        """At a call boundary: the decisions the explorer (or another process) kept since, marked on their
        buckets to be switched to (`pending`); an explorer started for the buckets queued, once none runs."""
        self._next_poll = time.monotonic() + POLL_S
        ended = self._explorer is not None and self._explorer.poll() is not None
        if ended:
            self._explorer = None
        try:
            stat = os.stat(self.decisions.table.path)
            changed = (stat.st_mtime_ns, stat.st_size) != self._read
            self._read = (stat.st_mtime_ns, stat.st_size)
        except OSError:
            changed = False
        if changed or force:
            kept = self.decisions.read()
            with self._lock:
                for key, bucket in self._buckets.items():
                    if bucket.state == "exploring" and bucket.pending is None and key in kept:
                        self._found(bucket, kept[key])
        with self._lock:
            if ended:  # what it left undecided is asked again later
                for bucket in self._buckets.values():
                    if bucket.state == "exploring" and bucket.pending is None and not any(
                            b is bucket for b, _ in self._queued):
                        bucket.state, bucket.retry_at = "serving", time.monotonic() + RETRY_S
            start = self._explorer is None and self._queued and not self._closed
            queued, self._queued = (self._queued, []) if start else ([], self._queued)
            if not any(b.state != "decided" for b in self._buckets.values()):
                self._next_poll = math.inf
        if start:
            self._start_explorer(queued)

    def _found(self, bucket: Bucket, kept: Kept) -> None:
        """A decision for `bucket`: settled on its serving plan, or a plan to switch to (under the lock)."""
        bucket.candidates = list(kept.candidates)
        if kept.plan is None or bucket.current is None:
            bucket.decided(kept.decision or f"kept {bucket.current.label}, as decided")
        else:
            bucket.pending = kept

    def _start_explorer(self, queued: list[tuple[Bucket, dict[str, np.ndarray]]]) -> None:
        """An explorer process for the queued buckets (see `explorer`); should it fail to start, they are kept
        on their plans."""
        job = {**self._explore.job, "folder": str(self.decisions.folder), "digest": self.decisions.digest,
               "budget_s": self._explore.budget_s, "buckets": [{"key": b.key, "calls": b.calls} for b, _ in queued]}
        try:
            self.decisions.folder.mkdir(parents=True, exist_ok=True, mode=0o700)
            process = explorer.start(job, [sample for _, sample in queued],
                                     None if job["source"] else self._explore.model(),
                                     self.decisions.folder / explorer.LOG)
        except (OSError, ValueError, AttributeError) as error:  # AttributeError: no memfd_create here
            log.warning("the explorer could not be started (%s); ONNX Runtime keeps serving", first_line(error))
            for bucket, _ in queued:
                self._settle(bucket, f"kept {bucket.current.label}: the explorer could not be started")
            return
        with self._lock:
            if self._closed:
                process.stdin.close()
                return
            self._explorer, self._explorers = process, self._explorers + 1

    def _switched(self, bucket: Bucket, feeds: Mapping[str, Any]) -> tuple[list[Any], Plan] | None:
        """Switch `bucket` to its pending decision on this call (another caller of the bucket waits meanwhile):
        the referee's outputs and plan to serve this call with (all outputs, on the host), or None where
        another caller switched it, or these feeds cannot check it (not all finite arrays: the next call
        will)."""
        with bucket.switching:
            if bucket.current is None and bucket.pending is None:  # a new bucket: the starter, compiled again
                starter = self._starter()
                with self._lock:
                    bucket.current = starter
                return None
            kept = bucket.pending
            feeds, why = _sampled(feeds, self.starter.plan.inputs)
            if kept is None or bucket.current is None or why:
                return None
            old, referee = bucket.current, self._umpire()
            want = [np.array(w, copy=True) for w in referee.executor.run(None, feeds)]  # not held in its memory
            with self._lock:
                bucket.current = None  # released now unless another bucket or call uses it: one runtime at a time
                self._retire(old)
                if referee is not old:
                    self._retire(referee)
            with self._lock:  # the same plan another bucket serves is not compiled twice
                shared = next((a for a in self._arms if a.executor is not None and _same_stages(a.plan, kept.plan)),
                              None)
                if shared is not None:
                    shared.running += 1
            try:
                arm = shared or self._arm(kept.label, kept.plan)
                got = arm.executor.run(None, feeds)
                from ..precision.own import judged

                why, rule, worst = judged(arm.executor.outputs, got, want, self._rules())
            except Exception as error:  # noqa: BLE001 - a plan that no longer compiles or runs is not served
                arm, why, rule, worst = None, f"it does not run here now ({first_line(error)})", "", 0.0
            finally:
                if shared is not None:
                    self._ended(shared)
            if why and arm is not None and arm is not shared:
                arm.executor.close()
            serving = arm if not why else self._umpire()
            with self._lock:
                bucket.pending, bucket.current = None, serving
                if serving not in self._arms:
                    self._arms.append(serving)
                if not why:  # timed on the calls that follow (`_checked`)
                    bucket.before = float(np.median(bucket.paces)) if bucket.paces else math.inf
                    bucket.state, bucket.decision, bucket.paces = "checking", kept.decision, deque(maxlen=PACES)
                else:
                    bucket.decided(f"refused {kept.label}: {why}, held to {rule}; {serving.label} serves")
            if why:
                log.warning("%s at %s: %s", serving.plan.model_name, bucket.key, bucket.decision)
                self.decisions.keep(bucket.key, serving.label, None, bucket.calls,
                                    refused={**kept.refused, kept.label: f"{why}; held to {rule}"},
                                    candidates=kept.candidates, decision=bucket.decision)
            else:
                log.info("%s at %s: %s serves (max abs error %.3g against ONNX Runtime)", serving.plan.model_name,
                         bucket.key, kept.label, worst)
            return want, referee.plan

    def _starter(self) -> Arm:
        """The starter, compiled again where a switch released it."""
        if not self.starter.refereed:  # ONNX Runtime on the model: the referee
            self.starter = self._umpire()
            return self.starter
        with self._refereeing:
            if self.starter.executor is None:
                starter = self._arm(self.starter.label, self.starter.plan)
                with self._lock:
                    self._arms.append(starter)
                    self.starter = starter
            return self.starter

    def _umpire(self) -> Arm:
        """The referee: ONNX Runtime running the model itself, compiled when needed (on the calling thread)."""
        with self._refereeing:
            referee = self._referee
            if referee is None or referee.executor is None or referee.retired:
                plan, compiled = self._make_referee()
                referee = self._arm("ort-cpu", plan, refereed=False, compiled=compiled)
                with self._lock:
                    if self._closed:
                        referee.executor.close()
                        raise UhopError("the session is closed: its runtimes were released")
                    self._arms.append(referee)
                    self._referee = referee
            return referee

    def _rules(self) -> Mapping[str, Tolerance]:
        """Per output, what a plan is held to against the referee (`precision.own`), worked out once."""
        if callable(self._tolerances):
            self._tolerances = self._tolerances()
        return self._tolerances

    def _retire(self, arm: Arm) -> None:
        """Close `arm` once no bucket serves with it and no call runs on it (under the lock)."""
        if any(arm is b.current for b in self._buckets.values()):
            return
        arm.retired = True
        if arm in self._arms:
            self._arms.remove(arm)
        arm.release()

    def _arm(self, label: str, plan: Plan, refereed: bool = True, compiled: Executor | None = None) -> Arm:
        executor = self._compile(plan) if compiled is None else compiled
        executor.fallback = self._fallback
        return Arm(label, plan, executor, refereed)

    def close(self) -> None:
        """Release every plan's runtimes; an explorer still at work is let go (it ends as its pipe closes)."""
        with self._lock:
            self._closed = True
            arms, self._arms = self._arms, []
            process, self._explorer = self._explorer, None
        if process is not None:
            with contextlib.suppress(OSError):
                process.stdin.close()
        for arm in arms:
            if arm.executor is not None:
                arm.executor.close()
                arm.executor = None


def _sampled(feeds: Mapping[str, Any], inputs: Sequence[TensorSig]) -> tuple[dict[str, np.ndarray] | None, str]:
    """A call's feeds as arrays of the model's declared types (a list of lists, an `OrtValue`, as ONNX Runtime
    takes them), and why they cannot be a bucket's sample or check a switch ("" where they can: all finite,
    within the explorer's cap)."""
    sigs = {sig.name: sig for sig in inputs}
    arrays = {}
    for name, value in feeds.items():
        if type(value) is not np.ndarray:
            sig = sigs.get(name)
            if sig is None or sig.dtype is None or not sig.type.startswith("tensor("):
                return None, "its inputs are not tensors"
            try:
                value = as_array(sig, name, value)
            except InputError:
                return None, "its inputs are not tensors"
            if value.dtype == object:
                return None, "its inputs are not tensors"
        arrays[name] = value
    if sum(v.nbytes for v in arrays.values()) > explorer.SAMPLE_CAP:
        return None, f"its inputs are larger than the explorer's sample cap ({explorer.SAMPLE_CAP >> 20} MiB)"
    return (arrays, "") if _finite(arrays) else (None, "its inputs hold NaN or Inf")


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


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _same_stages(a: Plan, b: Plan) -> bool:
    """Whether two plans run the same stages (by provider and nodes) of the same model."""
    def layout(plan: Plan) -> list[tuple[str, list[str]]]:
        return [(s.label, s.nodes) for s in plan.stages]

    return a.model_hash == b.model_hash and layout(a) == layout(b)


@dataclass(frozen=True)
class Kept:
    """A bucket's decision, as kept: the label and plan serving it (None: ONNX Runtime, the starter), the calls
    seen when it was decided, the plans ONNX Runtime refused (label -> why), what the search found."""

    label: str
    plan: Plan | None
    calls: int
    refused: Mapping[str, str]
    candidates: Sequence[Mapping[str, Any]]
    decision: str


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

    def read(self) -> dict[str, Kept]:
        """Bucket -> what was kept for it, most called first."""
        kept = {}
        if self.folder.is_symlink():
            log.warning("decisions in %s are not read: the folder is a symbolic link", self.folder)
            return kept
        for bucket, entry in sorted(self.table.read().items(), key=lambda item: -item[1]["calls"]):
            try:
                plan = self._plan(entry["plan"]) if entry["plan"] else None
            except UhopError as error:
                log.warning("the plan decided earlier for %s is dropped and decided again: %s", bucket,
                            first_line(error))
                continue
            kept[bucket] = Kept(entry["label"], plan, entry["calls"], dict(entry.get("refused", {})),
                                list(entry.get("candidates", [])), entry.get("decision", ""))
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

    def keep(self, bucket: str, label: str, plan: Plan | None, calls: int, *,
             refused: Mapping[str, str] | None = None, candidates: Sequence[Mapping[str, Any]] = (),
             decision: str = "") -> None:
        """Keep `plan` (None: ONNX Runtime serves on) as the bucket's decision, in place of the one kept before;
        `refused`: the plans ONNX Runtime refused, with why; `candidates`, `decision`: what the search found,
        as a session reports it. The plan is recorded as made for this model (its digest), which `read`
        checks."""
        if plan is not None and self.digest:
            plan = replace(plan, model_hash=self.digest)
        name = "" if plan is None else f"{hashlib.sha256(bucket.encode()).hexdigest()[:12]}-{os.urandom(4).hex()}"
        try:
            if plan is not None:
                plan.save(self.folder / name, report=False)
        except (UhopError, OSError) as error:  # a full disk: the decision is only not kept
            log.warning("could not keep the decision for %s in %s: %s", bucket, self.folder, first_line(error))
            return
        entry = {"label": label, "plan": name, "calls": calls, **({"refused": dict(refused)} if refused else {}),
                 **({"candidates": [dict(c) for c in candidates]} if candidates else {}),
                 **({"decision": decision} if decision else {})}
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
            and isinstance(refused := entry.get("refused", {}), dict)
            and all(isinstance(x, str) for x in [*refused, *refused.values()])
            and isinstance(found := entry.get("candidates", []), list) and all(isinstance(c, dict) for c in found)
            and isinstance(entry.get("decision", ""), str)):
        raise TypeError(f"{entry!r} is not {{label, plan, calls[, refused][, candidates][, decision]}}")
