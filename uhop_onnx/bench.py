"""Side-by-side latency of a model: raw runtimes, each provider alone through uhop-onnx, and the optimized plan.

Every candidate lives in its own worker process. The coordinator asks the workers for one round each in
turn, in a fresh (seeded) order every round and with a pause between them, so that no candidate always
follows one whose runtime leaves threads spinning; a round is several calls and reports their median.
A candidate's figure is the minimum of its round medians, and ratios are taken between figures of the
same run. The best single provider is the fastest that runs every node alone: a provider alone that
needs another for some nodes is listed with its stages, as the greedy plan it is.

A candidate that fails (to build, or in any round) has no figure: its `error` is one line naming the
stage and provider that raised it, as the worker reported it.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .errors import UhopError, first_line

SETTLE_SECONDS = 0.05  # between candidates: worker threads the previous one left spinning go to sleep
RAW = {"onnxruntime": "ort-cpu", "openvino": "openvino"}  # raw runtime -> the provider that wraps it


@dataclass(frozen=True)
class Candidate:
    """What a worker runs: `kind` is "raw" (a runtime directly), "alone" (one provider) or "plan"."""

    name: str
    kind: str
    target: str  # runtime name, provider id, or plan folder
    wraps: str | None = None  # for raw runtimes: the provider id whose overhead they measure


def bench(model: str | os.PathLike, providers: list[str] | None = None, threads: int | None = None,
          rounds: int = 7, calls: int | None = None, budget: float = 60.0,
          progress: Callable[[str], None] = lambda step: None, *, shapes=None, inputs=None, precision: str = "fp32",
          tolerance: float | None = None, calibration: str | os.PathLike | None = None) -> dict[str, Any]:
    """Measure every candidate in its own process, in alternating rounds; optimize cold and warm. Every
    candidate, and the optimize runs, measure on the same inputs (`shapes`/`inputs` as `optimize` takes);
    the plan is optimized at `precision` (`tolerance`, `calibration` as `optimize` takes them)."""
    from .graph import Graph
    from .inputs import measured_shapes, profile_feeds
    from .loader import load
    from .providers import resolve

    model = str(Path(model).resolve())
    graph = Graph.from_model(load(model))
    feeds = profile_feeds([graph.signature(name) for name in graph.inputs], shapes, inputs)
    present = [p.label for p in resolve(providers, threads)]
    with tempfile.TemporaryDirectory(prefix="uhop-bench-") as work:
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
        candidates = [Candidate(f"{r} (raw)", "raw", r, wraps=w) for r, w in RAW.items() if w in present]
        candidates += [Candidate(f"{p} alone", "alone", p) for p in present]
        if "error" not in cold:
            candidates.append(Candidate("uhop-onnx plan", "plan", str(work / "plan")))
        progress(f"timing {len(candidates)} candidates, {rounds} rounds")
        figures = time_candidates(candidates, model, feeds, threads, rounds, calls)
        if "error" in cold:  # no plan to time: its figure is optimize's error
            figures["uhop-onnx plan"] = {"ms": None, "spread": None, "round_medians_ms": [], "stages": [],
                                         "error": cold["error"]}
    singles = {c.name: figures[c.name] for c in candidates if c.kind == "alone" and figures[c.name]["ms"] is not None
               and all(stage.startswith(f"{c.target} x") for stage in figures[c.name]["stages"])}
    best_single = min(singles.values(), key=lambda f: f["ms"])["ms"] if singles else None
    for c in candidates:
        f = figures[c.name]
        if f["ms"] is not None and best_single:
            f["ratio_to_best_single"] = f["ms"] / best_single
        if c.wraps and f["ms"] and figures.get(f"{c.wraps} alone", {}).get("ms"):
            figures[f"{c.wraps} alone"]["overhead_vs_raw"] = figures[f"{c.wraps} alone"]["ms"] / f["ms"] - 1
    return {"model": Path(model).name, "shapes": measured_shapes(feeds), "threads": threads, "rounds": rounds,
            "calls_per_round": calls,
            "candidates": figures, "best_single": min(singles, key=lambda n: singles[n]["ms"]) if singles else None,
            "optimize_seconds": {"cold": cold.get("seconds"), "warm": warm.get("seconds")},
            "plan": cold.get("stages", []), "failed": sorted(n for n, f in figures.items() if f["error"])}


def _optimize_in_process(model: str, providers, threads, budget, cache: Path, out: Path, feeds: Path,
                         reduced: dict[str, Any]) -> dict[str, Any]:
    """Time `optimize` on `feeds` in a fresh process with its own cache folder, as a user's first and second
    run: `{"seconds", "stages"}`, or `{"error"}` when it failed (the plan folder is then not written)."""
    env = {**os.environ, "UHOP_CACHE_DIR": str(cache)}
    request = json.dumps({"model": model, "providers": providers, "threads": threads, "budget": budget, "out": str(out),
                          "inputs": str(feeds), **reduced})
    result = subprocess.run([sys.executable, "-m", "uhop_onnx.bench", "optimize", request], env=env,
                            capture_output=True, text=True, timeout=3600)
    lines = result.stdout.strip().splitlines()
    if result.returncode != 0 or not lines:
        return {"error": f"optimize: {_last_line(result.stderr) or f'exited with code {result.returncode}'}"}
    return json.loads(lines[-1])


def time_plans_in_processes(plans: dict[str, Any], feeds: dict[str, np.ndarray], threads: int | None,
                            rounds: int = 5) -> dict[str, Any]:
    """Whole plans timed each in its own process on `feeds`, in alternating rounds -> `Measurement` per name
    (infinite for a plan that failed)."""
    from .partitioner.profiler import Measurement

    with tempfile.TemporaryDirectory(prefix="uhop-plans-") as work:
        candidates = []
        for k, (name, plan) in enumerate(plans.items()):
            plan.save(Path(work) / f"plan{k}")
            candidates.append(Candidate(name, "plan", str(Path(work) / f"plan{k}")))
        figures = time_candidates(candidates, None, feeds, threads, rounds)
    return {name: Measurement(f["ms"], f["spread"], len(f["round_medians_ms"])) if f["ms"] is not None
            else Measurement.failed(f["error"]) for name, f in figures.items()}


def time_candidates(candidates: list[Candidate], model: str | None, feeds: dict[str, np.ndarray],
                    threads: int | None, rounds: int, calls: int | None = None) -> dict[str, dict]:
    """Each candidate in its own worker process, run on `feeds`; rounds alternate between them, in a
    rotating order."""
    workers, logs = {}, {}
    shared = tempfile.NamedTemporaryFile(prefix="uhop-feeds-", suffix=".npz", delete=False)
    with shared:
        np.savez(shared, **feeds)
    for c in candidates:
        request = json.dumps({"candidate": c.__dict__, "model": model, "feeds": shared.name, "threads": threads,
                              "calls": calls})
        logs[c.name] = tempfile.TemporaryFile(mode="w+")
        workers[c.name] = subprocess.Popen([sys.executable, "-m", "uhop_onnx.bench", "worker", request],
                                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=logs[c.name], text=True)
    medians: dict[str, list[float]] = {c.name: [] for c in candidates}
    stages: dict[str, list[str]] = {c.name: [] for c in candidates}
    errors: dict[str, str] = {}
    try:
        for name, worker in workers.items():
            try:
                stages[name] = json.loads(_reply(worker, "ready", logs[name]))
            except WorkerFailed as failure:
                errors[name] = str(failure)
        names = [c.name for c in candidates if c.name not in errors]
        order = random.Random(0)
        for _ in range(rounds if names else 0):
            for name in order.sample(names, len(names)):
                if name in errors:
                    continue
                time.sleep(SETTLE_SECONDS)
                try:
                    workers[name].stdin.write("round\n")
                    workers[name].stdin.flush()
                    medians[name].append(float(_reply(workers[name], "median", logs[name])))
                except (WorkerFailed, BrokenPipeError) as failure:
                    errors[name] = str(failure) if isinstance(failure, WorkerFailed) else "the worker exited"
    finally:
        for name, worker in workers.items():
            if worker.poll() is None:
                worker.stdin.close()
                worker.wait(timeout=60)
            logs[name].close()
        os.unlink(shared.name)
    return {name: {"ms": min(m) if m and name not in errors else None,
                   "spread": (max(m) - min(m)) / min(m) if m and name not in errors else None,
                   "round_medians_ms": m, "stages": stages[name], "error": errors.get(name)}
            for name, m in medians.items()}


class WorkerFailed(Exception):
    """A worker reported a failure, or exited; the message is its one-line reason."""


def _reply(worker: subprocess.Popen, word: str, log) -> str:
    """The rest of the worker's next line that starts with `word` (other lines are runtime chatter)."""
    for line in worker.stdout:
        if line.startswith(word):
            return line[len(word):].strip()
        if line.startswith("failed "):
            raise WorkerFailed(json.loads(line[len("failed "):]))
    log.seek(0)
    raise WorkerFailed(_last_line(log.read()) or f"the worker exited with code {worker.wait()}")


def _last_line(text: str) -> str:
    """The last line of a log that says something: a traceback's own `Error: message` line."""
    return next((line.strip()[:400] for line in reversed(text.splitlines()) if line.strip()), "")


def _runner(candidate: dict, model: str | None, feeds: dict, threads: int | None
            ) -> tuple[Callable[[], object], list[str]]:
    """Build the candidate's session; return one call of it and its stages (`openvino x12`; none when raw)."""
    kind, target = candidate["kind"], candidate["target"]
    if kind == "raw" and target == "onnxruntime":
        from .providers.ort import session_options
        import onnxruntime as ort

        session = ort.InferenceSession(model, session_options(threads, exclusive=True),
                                       providers=["CPUExecutionProvider"])
        return lambda: session.run(None, feeds), []
    if kind == "raw" and target == "openvino":
        import openvino as ov

        config = {"PERFORMANCE_HINT": "LATENCY", "INFERENCE_PRECISION_HINT": "f32"}
        if threads:
            config["INFERENCE_NUM_THREADS"] = threads
        request = ov.Core().compile_model(model, "CPU", config).create_infer_request()
        return lambda: request.infer(feeds, share_inputs=True), []
    from .session import InferenceSession

    if kind == "alone":
        session = InferenceSession(model, providers=[target], profile=False, threads=threads)
    else:
        session = InferenceSession(target, threads=threads)
    return lambda: session.run(None, feeds), _stages(session.plan)


def _stages(plan) -> list[str]:
    """`openvino x12` per stage of a plan: its provider and how many nodes it runs."""
    return [f"{s.label} x{len(s.nodes)}" for s in plan.stages]


def _worker(request: dict) -> None:
    from .inputs import read_inputs

    feeds = read_inputs(request["feeds"])
    try:
        call, stages = _runner(request["candidate"], request["model"], feeds, request["threads"])
        warm = [_seconds(call) for _ in range(3)]
        calls = request["calls"] or max(3, min(50, int(0.05 / max(min(warm), 1e-6))))
        print("ready", json.dumps(stages), flush=True)
        for line in sys.stdin:
            if line.strip() != "round":
                break
            print("median", statistics.median(_seconds(call) * 1e3 for _ in range(calls)), flush=True)
    except Exception as error:  # noqa: BLE001 - any failure is this candidate's result, told in one line
        print("failed", json.dumps(first_line(error)), flush=True)


def _seconds(call: Callable[[], object]) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


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
    plan.save(request["out"])
    print(json.dumps({"seconds": seconds, "stages": _stages(plan)}))


if __name__ == "__main__":
    command, payload = sys.argv[1], json.loads(sys.argv[2])
    {"worker": _worker, "optimize": _optimize}[command](payload)
