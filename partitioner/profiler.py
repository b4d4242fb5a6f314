"""Timing candidates fairly on a shared machine: warm up, then alternate candidates in rounds.

Each round times every candidate once (a few calls, their median), in a fresh (seeded) order each round,
so that a slow phase of the machine, or the threads a runtime leaves spinning, hit every candidate alike. A candidate's figure is the minimum of its
round medians; `spread` is how far its round medians scattered, the noise a decision must beat.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass
from typing import TypeVar

K = TypeVar("K", bound=Hashable)


@dataclass(frozen=True)
class Measurement:
    """Milliseconds per call: the minimum of the round medians, and the relative spread of those medians."""

    ms: float
    spread: float
    rounds: int

    def to_json(self) -> dict[str, float]:
        return {"ms": self.ms, "spread": self.spread, "rounds": self.rounds}


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
        keys = list(candidates)
        if not keys:
            return {}
        calls = {k: self._calibrate(candidates[k]) for k in keys}
        medians: dict[K, list[float]] = {k: [] for k in keys}
        order = random.Random(0)
        for r in range(self.max_rounds):
            for k in order.sample(keys, len(keys)):
                medians[k].append(self._round(candidates[k], calls[k]))
            if r + 1 >= self.rounds and max(_spread(m) for m in medians.values()) <= self.noisy:
                break
        return {k: Measurement(min(m) * 1e3, _spread(m), len(m)) for k, m in medians.items()}

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
