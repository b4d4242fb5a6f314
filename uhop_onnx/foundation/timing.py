"""The timing rules: a call's seconds, the calls a round holds, a round's median, medians' spread, a Deadline."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

Clock = Callable[[], float]  # seconds; a fake one makes tests exact


def seconds(call: Callable[[], object], clock: Clock = time.perf_counter) -> float:
    """How long one `call()` took."""
    start = clock()
    call()
    return clock() - start


def calls_per_round(call: Callable[[], object], target: float, low: int, high: int, warmup: int = 1,
                    clock: Clock = time.perf_counter) -> int:
    """Warm `call` up (`warmup` calls, at least one), then the number of calls that last about `target`
    seconds at the fastest warm-up call's pace, within [`low`, `high`]: the one calibration rule of the
    project (the profiler, the measuring workers and the kernel tuner use it)."""
    fastest = min(seconds(call, clock) for _ in range(max(warmup, 1)))
    return max(low, min(high, int(target / max(fastest, 1e-9))))


def round_median(call: Callable[[], object], calls: int, clock: Clock = time.perf_counter) -> float:
    """The median seconds of `calls` calls of `call()`."""
    return statistics.median(seconds(call, clock) for _ in range(calls))


def spread(medians: list[float]) -> float:
    """How far a candidate's round medians scattered, relative to the lowest: the noise a decision must beat."""
    low = min(medians)
    return (max(medians) - low) / low if low > 0 else 0.0


@dataclass(frozen=True)
class Deadline:
    """A moment on the monotonic clock (`time.monotonic()` seconds) by which work should be done; with `stop`,
    the work is abandoned once `stop()` says so (a session closed): the deadline has then passed, and what
    runs against it (measuring workers) is stopped."""

    at: float
    stop: Callable[[], bool] | None = None

    @classmethod
    def after(cls, seconds: float, stop: Callable[[], bool] | None = None) -> Deadline:
        return cls(time.monotonic() + seconds, stop)

    def left(self) -> float:
        """Seconds left (negative once past)."""
        return self.at - time.monotonic()

    @property
    def abandoned(self) -> bool:
        return self.stop is not None and self.stop()

    @property
    def passed(self) -> bool:
        return self.left() <= 0 or self.abandoned
