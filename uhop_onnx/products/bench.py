"""Side-by-side latency of a model: raw runtimes, each provider alone through uhop-onnx, and the optimized plan.

A command over the measuring engine (`measure.time_candidates`): every candidate lives in its own worker
process, and rounds alternate between them; a candidate's figure is the minimum of its round medians, and
ratios are taken between figures of the same run. This module supplies the workers' builders of its own
kinds of candidate (`raw_runtime`, `provider_alone`), and times `optimize` itself cold and warm. The best
single provider is the fastest that runs every node alone: a provider alone that needs another for some
nodes is listed with its stages, as the greedy plan it is.

A candidate that fails (to build, or in any round) has no figure: its `error` is one line naming the
stage and provider that raised it, as the worker reported it. A plan whose placement `optimize` did not
measure (its `profile["unmeasured"]`) is not timed either: its row says why, as `unmeasured`. Each
provider alone names the providers its plan really used (`ran`), and says so in a `note` where the
provider took no node.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import closing, contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from ..foundation import ortlib
from ..foundation.errors import UhopError
from ..foundation.files import temporary_folder
from ..runtime.measure import Candidate, last_line, stage_labels, time_candidates

RAW = {"onnxruntime": "ort-cpu", "openvino": "openvino"}  # raw runtime -> the provider that wraps it
RAW_BUILD, ALONE_BUILD = "uhop_onnx.products.bench:raw_runtime", "uhop_onnx.products.bench:provider_alone"
PLAN = "uhop-onnx plan"


def raw(name: str, runtime: str) -> Candidate:
    """A candidate running the whole model in `runtime` ("onnxruntime" or "openvino") directly."""
    return Candidate(name, runtime, build=RAW_BUILD)


def alone(name: str, provider: str) -> Candidate:
    """A candidate running the model on `provider` alone (first-supported placement)."""
    return Candidate(name, provider, build=ALONE_BUILD)


def bench(model: str | os.PathLike, providers: list[str] | None = None, threads: int | None = None,
          rounds: int = 7, calls: int | None = None, budget: float = 60.0,
          progress: Callable[[str], None] = lambda step: None, *, shapes=None, inputs=None, precision: str = "fp32",
          tolerance: float | None = None, calibration: str | os.PathLike | None = None) -> dict[str, Any]:
    """Measure every candidate in its own process, in alternating rounds; optimize cold and warm. Every
    candidate, and the optimize runs, measure on the same inputs (`shapes`/`inputs` as `optimize` takes);
    the plan is optimized at `precision` (`tolerance`, `calibration` as `optimize` takes them)."""
    from ..foundation.graph import Graph
    from ..foundation.inputs import measured_shapes, profile_feeds
    from ..model.loader import load
    from ..providers import resolve

    model = str(Path(model).resolve())
    graph = Graph.from_model(load(model))
    feeds = profile_feeds([graph.signature(name) for name in graph.inputs], shapes, inputs)
    present = [p.label for p in resolve(providers, threads)]
    with temporary_folder("bench") as work:
        work = Path(work)
        np.savez(work / "feeds.npz", **feeds)
        reduced = {"precision": precision, "tolerance": tolerance,
                   "calibration": None if calibration is None else str(Path(calibration).resolve())}
        progress("optimizing with a cold cache")
        cold = warm = _optimize_in_process(model, providers, threads, budget, work / "cache", work / "plan",
                                           work / "feeds.npz", reduced)
        if "error" not in cold:
            progress("optimizing with a warm cache")
            warm = _optimize_in_process(model, providers, threads, budget, work / "cache", work / "plan-warm",
                                        work / "feeds.npz", reduced)
        candidates = [raw(f"{r} (raw)", r) for r, w in RAW.items() if w in present]
        candidates += [alone(f"{p} alone", p) for p in present]
        timed = "error" not in cold and not cold.get("unmeasured")
        if timed:
            candidates.append(Candidate(PLAN, str(work / "plan")))
        progress(f"timing {len(candidates)} candidates, {rounds} rounds")
        figures = time_candidates(candidates, model, feeds, threads, rounds, calls)
        if not timed:  # no plan to time, or none optimize measured: its row says why
            figures[PLAN] = {"ms": None, "spread": None, "round_medians_ms": [], "stages": cold.get("stages", []),
                             "error": cold.get("error"), "unmeasured": cold.get("unmeasured")}
    singles = {c.name: figures[c.name] for c in candidates if c.build == ALONE_BUILD
               and figures[c.name]["ms"] is not None
               and all(stage.startswith(f"{c.target} x") for stage in figures[c.name]["stages"])}
    best_single = min(singles.values(), key=lambda f: f["ms"])["ms"] if singles else None
    for c in candidates:
        f = figures[c.name]
        if c.build == ALONE_BUILD and f["stages"]:
            f["ran"] = list(dict.fromkeys(stage.rsplit(" x", 1)[0] for stage in f["stages"]))
            if c.target not in f["ran"]:
                f["note"] = f"ran {', '.join(f['ran'])}: {c.target} took no node"
        if f["ms"] is not None and best_single:
            f["ratio_to_best_single"] = f["ms"] / best_single
        wraps = RAW.get(c.target) if c.build == RAW_BUILD else None
        if wraps and f["ms"] and figures.get(f"{wraps} alone", {}).get("ms"):
            figures[f"{wraps} alone"]["overhead_vs_raw"] = figures[f"{wraps} alone"]["ms"] / f["ms"] - 1
    return {"model": Path(model).name, "shapes": measured_shapes(feeds), "threads": threads, "rounds": rounds,
            "calls_per_round": calls,
            "candidates": figures, "best_single": min(singles, key=lambda n: singles[n]["ms"]) if singles else None,
            "optimize_seconds": {"cold": cold.get("seconds"), "warm": warm.get("seconds")},
            "plan": cold.get("stages", []), "failed": sorted(n for n, f in figures.items() if f["error"])}


def _optimize_in_process(model: str, providers, threads, budget, cache: Path, out: Path, feeds: Path,
                         reduced: dict[str, Any]) -> dict[str, Any]:
    """Time `optimize` on `feeds` in a fresh process with its own cache folder, as a user's first and second
    run: `{"seconds", "stages", "unmeasured"}` (why its placement was not measured, else None), or `{"error"}`
    when it failed (the plan folder is then not written)."""
    env = {**os.environ, "UHOP_CACHE_DIR": str(cache)}
    request = json.dumps({"model": model, "providers": providers, "threads": threads, "budget": budget, "out": str(out),
                          "inputs": str(feeds), **reduced})
    result = subprocess.run([sys.executable, "-P", "-m", "uhop_onnx.products.bench", "optimize", request], env=env,
                            capture_output=True, text=True, timeout=3600)
    lines = result.stdout.strip().splitlines()
    if result.returncode != 0 or not lines:
        return {"error": f"optimize: {last_line(result.stderr) or f'exited with code {result.returncode}'}"}
    return json.loads(lines[-1])


@contextmanager
def raw_runtime(runtime: str, model: str, feeds: dict[str, np.ndarray],
                threads: int | None) -> Iterator[tuple[Callable[[], object], list[str]]]:
    """A measuring worker's candidate: the whole model in `runtime` ("onnxruntime" or "openvino") directly,
    configured as its provider configures it; it has no stages."""
    if runtime == "onnxruntime":
        from ..providers.ort import session_options

        session = ortlib.load().InferenceSession(model, session_options(threads, exclusive=True),
                                                 providers=["CPUExecutionProvider"])
        yield (lambda: session.run(None, feeds)), []
        return
    import openvino as ov

    from ..providers.openvino import OpenVino

    config = OpenVino({"device": "CPU"}, threads).compile_config()
    request = ov.Core().compile_model(model, "CPU", config).create_infer_request()
    yield (lambda: request.infer(feeds, share_inputs=True)), []


@contextmanager
def provider_alone(provider: str, model: str, feeds: dict[str, np.ndarray],
                   threads: int | None) -> Iterator[tuple[Callable[[], object], list[str]]]:
    """A measuring worker's candidate: `model` placed on `provider` alone at the shapes of `feeds`
    (first-supported; the last resort takes what it cannot run), and its stages."""
    from .session import InferenceSession

    shapes = {name: value.shape for name, value in feeds.items()}
    with closing(InferenceSession(model, providers=[provider], profile=False, threads=threads,
                                  shapes=shapes)) as session:
        yield (lambda: session.run(None, feeds)), stage_labels(session.plan)



@contextmanager
def adapted(settle: str, model: str, feeds: dict[str, np.ndarray],
            threads: int | None) -> Iterator[tuple[Callable[[], object], list[str]]]:
    """A measuring worker's candidate: an adaptive session, called on `feeds` until every shape bucket it saw
    has decided (at most `settle` seconds), then as it serves; the stages of the plan it decided on."""
    from .session import InferenceSession

    with closing(InferenceSession(model, threads=threads)) as session:
        deadline = time.monotonic() + float(settle)
        while time.monotonic() < deadline:
            session.run(None, feeds)
            buckets = session.adaptation.values()
            if buckets and all(b["decision"] for b in buckets):
                break
        yield (lambda: session.run(None, feeds)), stage_labels(session.plan)


def _optimize(request: dict) -> None:
    from .optimizer import optimize

    start = time.perf_counter()
    try:
        plan = optimize(request["model"], request["providers"], threads=request["threads"], inputs=request["inputs"],
                        budget=request["budget"], precision=request["precision"], tolerance=request["tolerance"],
                        calibration=request["calibration"])
    except UhopError as error:
        print(json.dumps({"error": f"optimize: {error}"}))
        return
    seconds = time.perf_counter() - start
    plan.save(request["out"], report=False)
    print(json.dumps({"seconds": seconds, "stages": stage_labels(plan),
                      "unmeasured": (plan.profile or {}).get("unmeasured")}))


if __name__ == "__main__":
    command, payload = sys.argv[1], json.loads(sys.argv[2])
    {"optimize": _optimize}[command](payload)
