"""Search the schedule space of one operation by measuring it, and remember the winner per device.

The search is coordinate descent from the default schedule: the micro-kernel (for a convolution, every pairing
of algorithm and micro-kernel), then each cache block in turn, then fewer threads, keeping whatever lowers the
time. Winners are stored as JSON under
`<cache dir>/autotune/<device fingerprint>.json`, keyed by op, shape, dtype and threads; the fingerprint covers
the CPU model and flags, the core count and the library build, so a new machine or compiler tunes afresh.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any
from dataclasses import replace
from pathlib import Path

import numpy as np

from uhop_onnx.foundation.cache import JsonTable, cache_dir, device_fingerprint
from uhop_onnx.foundation.errors import logger
from uhop_onnx.foundation.timing import calls_per_round, round_median

from .library import Library
from .spec import ALGORITHMS, OpSpec, Schedule, check_schedule, default_schedule

log = logger(__name__)


def fingerprint(lib: Library) -> str:
    """A short hash of what makes timings comparable: CPU, cores, machine and the exact library build."""
    return device_fingerprint(lib.path.name)


def cache_file(lib: Library) -> Path:
    return cache_dir() / "autotune" / f"{fingerprint(lib)}.json"


def _key(op: OpSpec, threads: int) -> str:
    return f"{op.key}|threads={threads}"


def table(lib: Library) -> JsonTable:
    """The device's cache of winners; an entry that is not a schedule `lib` runs is ignored (and tuned again)."""
    return JsonTable(cache_file(lib), check=lambda entry: _schedule(lib, entry))


def _schedule(lib: Library, entry: Any) -> Schedule:
    schedule = Schedule(**entry["schedule"])
    if not all(isinstance(v, int) and not isinstance(v, bool)
               for v in (schedule.micro, schedule.mc, schedule.kc, schedule.nc, schedule.threads)):
        raise TypeError(f"schedule {entry['schedule']!r} has a field that is not an integer")
    check_schedule(lib.spec, schedule)
    return schedule


def cached(lib: Library, op: OpSpec, threads: int) -> Schedule | None:
    entry = table(lib).get(_key(op, threads))
    return _schedule(lib, entry) if entry else None


def store(lib: Library, op: OpSpec, threads: int, schedule: Schedule, seconds: float) -> None:
    """Add the winner for `threads` (its own may be fewer) to the device's cache file (rewritten atomically)."""
    table(lib).update({_key(op, threads): {
        "schedule": schedule.to_json(), "seconds": seconds, "gflops": op.flops / seconds / 1e9}})


def schedule_for(lib: Library, op: OpSpec, threads: int, tune: bool = False) -> Schedule:
    """The cached winner for `op`; else a tuned one when `tune`, else the default schedule."""
    found = cached(lib, op, threads)
    if found is not None:
        return found
    return tune_op(lib, op, threads) if tune else default_schedule(lib.spec, op, threads)


def operands(op: OpSpec, rng: np.random.Generator | None = None) -> tuple[np.ndarray, ...]:
    """Random inputs of the shapes `op` names (a transposed operand as a transposed view)."""
    rng = rng or np.random.default_rng(0)

    def rand(*shape):
        return rng.standard_normal(shape).astype(np.float32)

    if op.op == "gemm":
        m, n, k, trans_a, trans_b = op.dims
        return rand(k, m).T if trans_a else rand(m, k), rand(n, k).T if trans_b else rand(k, n)
    n, c, h, w, oc, kh, kw, *_rest, group = op.dims
    return rand(n, c, h, w), rand(oc, c // group, kh, kw), rand(oc)


def prepare(lib: Library, op: OpSpec, schedule: Schedule, args: tuple[np.ndarray, ...]) -> Callable[[], np.ndarray]:
    """A call executing `op` with `schedule` on `args` from `operands`; convolution weights are packed once
    beforehand, as the `kernels` runner packs constant weights."""
    if op.op == "gemm":
        return lambda: lib.gemm(*args, schedule, epilogue=op.epilogue)
    *_, sh, sw, pt, pl, pb, pr, dh, dw, group = op.dims
    x, w, bias = args
    packed = lib.pack(w.reshape(w.shape[0], -1), schedule, group) if schedule.packs_weights else None
    return lambda: lib.conv2d(x, w, schedule, bias=bias, strides=(sh, sw), pads=(pt, pl, pb, pr),
                              dilations=(dh, dw), group=group, epilogue=op.epilogue, packed=packed)


def median_seconds(call: Callable[[], object], budget: float = 0.05) -> float:
    """Median seconds of `call()`, over enough calls to fill about `budget` seconds (at least 3), after a warm-up."""
    return round_median(call, calls_per_round(call, budget, 3, 50))


def measure(lib: Library, op: OpSpec, schedule: Schedule, args: tuple[np.ndarray, ...],
            budget: float = 0.05) -> float:
    """Seconds of `op` with `schedule`: the smaller of two medians, so that a burst of load on a shared
    machine does not reject a good schedule (noise only ever slows a call down)."""
    call = prepare(lib, op, schedule, args)
    return min(median_seconds(call, budget / 2) for _ in range(2))


# Below this many flops per thread a call may run faster on fewer threads: starting one costs tens of
# microseconds, about what a few million flops take. Larger calls keep every thread asked for, so that a burst
# of load on a shared machine during tuning never pins them to one.
SMALL_FLOPS = 10e6


def _neighbours(lib: Library, op: OpSpec, s: Schedule, axis: str) -> list[Schedule]:
    mk = lib.spec.micro[s.micro]
    micros = [replace(s, micro=i, mc=m.mr * max(1, s.mc // m.mr), nc=m.nr * max(1, s.nc // m.nr))
              for i, m in enumerate(lib.spec.micro)]
    if axis == "algo":  # with every micro-kernel: the best one differs between algorithms
        return [replace(m, algo=a) for a in ALGORITHMS for m in (micros if a != "direct" else [s])]
    if axis == "micro":
        return micros
    if axis == "threads":  # on small calls, starting threads can cost more than it saves
        return [replace(s, threads=t) for t in range(1, s.threads)] if op.flops < SMALL_FLOPS * s.threads else []
    if axis == "kc":
        return [replace(s, kc=kc) for kc in (128, 192, 256, 384, 512)]
    if axis == "mc":
        return [replace(s, mc=mk.mr * r) for r in (4, 8, 12, 16, 24, 32)]
    return [replace(s, nc=mk.nr * r) for r in (32, 64, 128, 256)]


def tune_op(lib: Library, op: OpSpec, threads: int, budget: float = 0.05) -> Schedule:
    """The fastest schedule found for `op` on `threads` threads; stored in the device's cache."""
    args = operands(op)
    best = default_schedule(lib.spec, op, threads)
    best_time = measure(lib, op, best, args, budget)
    axes = ("algo", "kc", "mc", "nc", "threads") if op.op == "conv2d" else ("micro", "kc", "mc", "nc", "threads")
    for axis in axes:
        if axis in ("kc", "mc", "nc") and best.algo in ("direct", "implicit-oc") and op.op == "conv2d":
            continue  # no cache blocks to tune: direct has none, implicit-oc runs each tile over all of K
        for candidate in _neighbours(lib, op, best, axis):
            if candidate == best:
                continue
            seconds = measure(lib, op, candidate, args, budget)
            if seconds < best_time:
                best, best_time = candidate, seconds
    log.info("tuned %s on %d threads: %s (%.1f GFLOP/s)", op.key, threads, best, op.flops / best_time / 1e9)
    store(lib, op, threads, best, best_time)
    return best

