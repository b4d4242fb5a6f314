"""The measuring engine in one process: figures from alternating rounds (`Profiler`), compared (`faster`)."""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from ..foundation.errors import first_line
from ..foundation.timing import Clock, Deadline, calls_per_round, round_median, spread

K = TypeVar("K", bound=Hashable)


@dataclass(frozen=True)
class Measurement:
    """Milliseconds per call: the minimum of the round medians, and the relative spread of those medians;
    for a failure, infinity and the error. `medians` (ms, in round order) are kept in memory only, for
    comparing candidates timed in the same rounds."""

    ms: float
    spread: float
    rounds: int
    error: str | None = None
    medians: tuple[float, ...] = field(default=(), compare=False, repr=False)

    @classmethod
    def of(cls, medians_ms: list[float]) -> Measurement:
        """The figure of a candidate's round medians (ms): their minimum, and their spread."""
        return cls(min(medians_ms), spread(medians_ms), len(medians_ms), medians=tuple(medians_ms))

    @classmethod
    def failed(cls, error: BaseException | str) -> Measurement:
        return cls(math.inf, 0.0, 0, error if isinstance(error, str) else first_line(error))

    @property
    def ok(self) -> bool:
        return self.error is None and math.isfinite(self.ms)

    @property
    def interval(self) -> tuple[float, float]:
        """The lowest and highest round median (ms)."""
        return self.ms, max(self.medians, default=self.ms * (1 + self.spread))

    def to_json(self) -> dict[str, float | str | None]:
        return {"ms": self.ms, "spread": self.spread, "rounds": self.rounds, "error": self.error}

    @classmethod
    def from_json(cls, entry: Any) -> Measurement:
        """A figure as `to_json` wrote it; `TypeError` naming the field when it is not one (a cache entry)."""
        m = cls(**entry)
        for name, kinds in (("ms", (int, float)), ("spread", (int, float)), ("rounds", (int,)),
                            ("error", (str, type(None)))):
            value = getattr(m, name)
            if not isinstance(value, kinds) or isinstance(value, bool):
                raise TypeError(f"{name} is {value!r}")
        return m


@dataclass
class Profiler:
    """Measures callables in this process: warm up, then alternate candidates in rounds. Each round times every
    candidate once (a few calls, their median), in a fresh (seeded) order each round, so that a slow phase of
    the machine, or the threads a runtime leaves spinning, hit every candidate alike. A candidate's figure is
    the minimum of its round medians; `spread` is how far its round medians scattered, the noise a decision
    must beat. A candidate that raises is a failure (infinitely slow, with its error), never a figure.
    Candidates timed in the same rounds are compared round by round (`faster`). `clock` returns seconds (a
    fake one makes tests exact)."""

    rounds: int = 5
    max_rounds: int = 9  # rounds keep coming while the spread is above `noisy`
    noisy: float = 0.25
    warmup: int = 2
    round_seconds: float = 0.02  # calls per round are chosen so a round of one candidate lasts about this long
    max_calls: int = 25
    clock: Clock = time.perf_counter

    def measure(self, candidates: Mapping[K, Callable[[], object]], deadline: Deadline | None = None
                ) -> dict[K, Measurement]:
        """A figure per candidate; one that raises (in any round) is a failure and leaves the rounds. Past
        the `deadline`, no round starts after the first."""
        failed: dict[K, Measurement] = {}
        calls: dict[K, int] = {}
        for k, call in candidates.items():
            try:
                calls[k] = calls_per_round(call, self.round_seconds, 1, self.max_calls, self.warmup, self.clock)
            except Exception as error:  # noqa: BLE001 - a runtime may fail in any way; that is its figure
                failed[k] = Measurement.failed(error)
        medians: dict[K, list[float]] = {k: [] for k in calls}
        order = random.Random(0)
        for r in range(self.max_rounds if medians else 0):
            for k in order.sample(list(medians), len(medians)):
                try:
                    medians[k].append(round_median(candidates[k], calls[k], self.clock))
                except Exception as error:  # noqa: BLE001
                    failed[k] = Measurement.failed(error)
                    del medians[k]
            if not medians or r + 1 >= self.rounds and max(spread(m) for m in medians.values()) <= self.noisy:
                break
            if deadline is not None and deadline.passed:
                break
        measured = {k: Measurement.of([x * 1e3 for x in m]) for k, m in medians.items()}
        return {k: measured.get(k) or failed[k] for k in candidates}


def faster(a: Measurement, b: Measurement, margin: float = 0.01) -> bool:
    """Whether `a` is faster than `b` beyond the noise. Timed in the same rounds (3 or more), round by
    round: `a`'s median over `b`'s in the same round stays below 1 - `margin` in every round (one outlier
    round forgiven from 5 rounds on: a plan 5-8% faster lost one round in two timings of five on a shared
    VM), so a machine that slows down for a while slows both alike. Otherwise the figures must differ by more
    than the larger spread (and `margin`)."""
    if not (a.ok and b.ok):
        return a.ok
    if len(a.medians) == len(b.medians) >= 3:
        ratios = sorted(x / y for x, y in zip(a.medians, b.medians))
        return ratios[-2 if len(ratios) >= 5 else -1] < 1 - margin
    return a.ms < b.ms * (1 - max(a.spread, b.spread, margin))


def build(jobs: Mapping[K, Callable[[], Callable[[], object]]]) -> tuple[dict[K, Callable[[], object]],
                                                                         dict[K, Measurement]]:
    """The calls that `jobs` make, and a failure for each job that could not make its call."""
    calls, failed = {}, {}
    for key, job in jobs.items():
        try:
            calls[key] = job()
        except Exception as error:  # noqa: BLE001 - a runtime may refuse to build in any way
            failed[key] = Measurement.failed(error)
    return calls, failed

