"""Timing candidates fairly on a shared machine: warm up, then alternate candidates in rounds.

Each round times every candidate once (a few calls, their median), in a fresh (seeded) order each round,
so that a slow phase of the machine, or the threads a runtime leaves spinning, hit every candidate alike. A candidate's figure is the minimum of its
round medians; `spread` is how far its round medians scattered, the noise a decision must beat. A
candidate that raises is a failure (infinitely slow, with its error), never a figure.
"""

from __future__ import annotations

import math
import random
import statistics
import time
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from uhop_onnx.errors import first_line

K = TypeVar("K", bound=Hashable)


@dataclass(frozen=True)
class Measurement:
    """Milliseconds per call: the minimum of the round medians, and the relative spread of those medians;
    for a failure, infinity and the error."""

    ms: float
    spread: float
    rounds: int
    error: str | None = None

    @classmethod
    def failed(cls, error: BaseException | str) -> Measurement:
        return cls(math.inf, 0.0, 0, error if isinstance(error, str) else first_line(error))

    @property
    def ok(self) -> bool:
        return self.error is None and math.isfinite(self.ms)

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
    """Measures callables in alternating rounds. `clock` returns seconds (a fake one makes tests exact)."""

    rounds: int = 5
    max_rounds: int = 9  # rounds keep coming while the spread is above `noisy`
    noisy: float = 0.25
    warmup: int = 2
    round_seconds: float = 0.02  # calls per round are chosen so a round of one candidate lasts about this long
    max_calls: int = 25
    clock: Callable[[], float] = time.perf_counter

    def measure(self, candidates: Mapping[K, Callable[[], object]]) -> dict[K, Measurement]:
        """A figure per candidate; one that raises (in any round) is a failure and leaves the rounds."""
        failed: dict[K, Measurement] = {}
        calls: dict[K, int] = {}
        for k, call in candidates.items():
            try:
                calls[k] = self._calibrate(call)
            except Exception as error:  # noqa: BLE001 - a runtime may fail in any way; that is its figure
                failed[k] = Measurement.failed(error)
        medians: dict[K, list[float]] = {k: [] for k in calls}
        order = random.Random(0)
        for r in range(self.max_rounds if medians else 0):
            for k in order.sample(list(medians), len(medians)):
                try:
                    medians[k].append(self._round(candidates[k], calls[k]))
                except Exception as error:  # noqa: BLE001
                    failed[k] = Measurement.failed(error)
                    del medians[k]
            if not medians or r + 1 >= self.rounds and max(_spread(m) for m in medians.values()) <= self.noisy:
                break
        measured = {k: Measurement(min(m) * 1e3, _spread(m), len(m)) for k, m in medians.items()}
        return {k: measured.get(k) or failed[k] for k in candidates}

    def _calibrate(self, call: Callable[[], object]) -> int:
        """Warm up, and pick how many calls make one round."""
        seconds = min(self._time(call) for _ in range(max(self.warmup, 1)))
        return max(1, min(self.max_calls, int(self.round_seconds / max(seconds, 1e-9))))

    def _round(self, call: Callable[[], object], calls: int) -> float:
        return statistics.median(self._time(call) for _ in range(calls))

    def _time(self, call: Callable[[], object]) -> float:
        start = self.clock()
        call()
        return self.clock() - start


def _spread(medians: list[float]) -> float:
    low = min(medians)
    return (max(medians) - low) / low if low > 0 else 0.0


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
