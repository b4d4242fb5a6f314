"""A session's latency in this process, as benchmark_app and trtexec report it: percentiles over timed runs
after warm-up ones, throughput, and each stage's share of the time."""

from __future__ import annotations

import time
from typing import Any

import numpy as np


def measure_latency(session, feeds: dict[str, Any], iterations: int, warmup: int = 1) -> dict[str, Any]:
    """Run `session` `warmup` times untimed, then `iterations` times timed, one after another."""
    for _ in range(warmup):
        session.run(None, feeds)
    totals, per_stage = [], np.zeros((iterations, len(session.plan.stages)))
    start = time.perf_counter()
    for i in range(iterations):
        began = time.perf_counter()
        _, timings = session.run_with_timings(None, feeds)
        totals.append(time.perf_counter() - began)
        for k, stage_start, stage_end in timings:
            per_stage[i, k] += stage_end - stage_start
    wall = time.perf_counter() - start
    ms = np.asarray(totals) * 1e3
    spent = float(np.sum(totals))
    stages = [{"index": k, "provider": s.label, "nodes": len(s.nodes),
               "median_ms": float(np.median(per_stage[:, k]) * 1e3), "share": float(per_stage[:, k].sum() / spent)}
              for k, s in enumerate(session.plan.stages)]
    return {
        "iterations": iterations, "warmup": warmup,
        "p50_ms": float(np.percentile(ms, 50)), "p90_ms": float(np.percentile(ms, 90)),
        "p99_ms": float(np.percentile(ms, 99)), "mean_ms": float(ms.mean()), "min_ms": float(ms.min()),
        "throughput_per_s": iterations / wall,
        "stages": stages,
        "between_stages_share": max(0.0, 1 - sum(s["share"] for s in stages)),
    }
