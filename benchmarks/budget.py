"""Bounded optimize: `uhop-onnx optimize --budget 30` against the unbounded search, on corpus models.

    python benchmarks/budget.py [--budget 30] [--models timm-resnet18,encoder] [--rounds 9] [--repeats 2] [--busy]
                                [--json out.json]

Per model: the wall time of `uhop-onnx optimize --budget B` in its own process (a cold cache of its own), the
plan it chose, and its latency against the plan of the unbounded search (`--budget 100000`, another cold
cache) and against the fastest single runtime (each provider alone, `bench.alone`, that ran every node
itself). Every plan is timed in its own worker process, in alternating rounds (`measure.time_candidates`),
its figure the minimum of its round medians; that timing is repeated `--repeats` times in fresh processes and
each candidate keeps its lowest figure. The bounded plan runs in two processes, an A/A pair whose ratio, printed
beside the others, is the noise between two processes. Where both searches chose the same plan, or the bounded
plan places every node as the fastest single runtime does, the line says so.
Every cold cache starts with the kernels library already built (it is built once per host, not per model: a
first `optimize` on the shipped MobileNet builds it). `--models` takes the models PyPI packages ship (`yolov8n`,
`ocr-det`, `ocr-rec`, `magika`, `vad`: `benchmarks/adapt.py`'s, at the shapes their libraries call them with),
`encoder` (ours) and corpus names (`corpus_models.case`: `timm-resnet18`, `hf-bert@dynamo`, `int8-qdq`...),
measured at their inputs.
`--busy` runs one busy-looping process beside everything, searches and timings alike, for the whole run.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import typer

from uhop_onnx.products.bench import alone
from uhop_onnx.runtime.measure import Candidate, time_candidates
from uhop_onnx.runtime.plan import Plan
from uhop_onnx.providers import resolve
from uhop_onnx.runtime.report import stages_summary

ROOT = Path(__file__).resolve().parent.parent
UNBOUNDED = 100000.0  # seconds: the search runs to its end


def model_case(name: str, folder: Path) -> tuple[str, list[str], dict[str, np.ndarray]]:
    """A model (the shipped encoder, or a corpus model: `corpus_models.case`), the options that give optimize
    its inputs (written to `folder`) and the inputs."""
    sys.path.insert(0, str(ROOT))
    from benchmarks.adapt import MODELS as SHIPPED
    from benchmarks.adapt import model_feeds

    if name in SHIPPED:
        path, feeds = SHIPPED[name][0], model_feeds(name)
        if path is None:
            raise typer.BadParameter(f"{name}: the package that ships it is not installed")
    else:
        from benchmarks.corpus_models import case

        path, feeds = case(name)
    folder.mkdir(parents=True, exist_ok=True)
    np.savez(folder / "inputs.npz", **feeds)
    return str(path), ["--inputs", str(folder / "inputs.npz")], feeds


def optimize(model: str, options: list[str], budget: float, out: Path, cache: Path, kernels: Path | None = None
             ) -> float:
    """Seconds `uhop-onnx optimize` took, in its own process with its own cache (holding a copy of the
    `kernels` library folder, when given)."""
    if kernels is not None and kernels.is_dir():
        shutil.copytree(kernels, cache / "kernels")
    command = [sys.executable, "-c", "from uhop_onnx.cli import main; main()", "optimize", model, "-o", str(out),
               "--budget", str(budget), "--quiet", *options]
    started = time.monotonic()
    done = subprocess.run(command, env={**os.environ, "UHOP_CACHE_DIR": str(cache)}, capture_output=True, text=True)
    seconds = time.monotonic() - started
    if done.returncode:
        raise SystemExit(f"optimize {model} failed: {done.stderr.strip()[-2000:]}")
    return seconds


def chosen(folder: Path) -> str:
    plan = Plan.load(folder)
    stages = " > ".join(f"{s.label} x{len(s.nodes)}" for s in plan.stages)
    return f"{plan.profile['chosen']} ({stages_summary(stages)})"


def same_plan(a: Path, b: Path) -> bool:
    """Whether two plan folders place the same nodes on the same providers, options and precisions."""
    def layout(folder: Path) -> list:
        return [(s.provider, s.options, s.precision, s.nodes) for s in Plan.load(folder).stages]

    return layout(a) == layout(b)


def timed(candidates: list[Candidate], model: str, feeds: dict[str, np.ndarray], rounds: int, repeats: int
          ) -> dict[str, dict]:
    """`time_candidates` run `repeats` times (fresh processes each time): per candidate, the run with the
    lowest figure (one process can run a plan 10-20% slower than the next for its whole life)."""
    runs = [time_candidates(candidates, model, feeds, None, rounds) for _ in range(repeats)]
    return {c.name: min((run[c.name] for run in runs), key=lambda f: f["ms"] or float("inf")) for c in candidates}


def single(figures: dict[str, dict]) -> str | None:
    """The fastest provider alone that ran every node itself (its stages all on that provider)."""
    singles = [name for name, f in figures.items() if name.endswith(" alone") and f["ms"] is not None
               and {stage.rsplit(" x", 1)[0] for stage in f["stages"]} == {name.removesuffix(" alone")}]
    return min(singles, key=lambda name: figures[name]["ms"], default=None)


def ratio(figures: dict[str, dict], a: str, b: str | None) -> float | None:
    """The figure of `a` over that of `b` (minimum round medians of the same rounds); None when one has none."""
    x, y = figures[a]["ms"], figures[b]["ms"] if b else None
    return round(x / y, 3) if x and y else None


def main(budget: float = 30.0, models: str = "timm-resnet18,encoder", rounds: int = 15, repeats: int = 2,
         busy: bool = False, json_out: Path | None = typer.Option(None, "--json")) -> None:
    results = {}
    neighbour = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if busy else None
    try:
        measure_all(budget, models, rounds, repeats, results)
    finally:
        if neighbour:
            neighbour.kill()
            neighbour.wait()
    if json_out:
        json_out.write_text(json.dumps({"busy": busy, "models": results}, indent=2) + "\n")


def measure_all(budget: float, models: str, rounds: int, repeats: int, results: dict) -> None:
    """Each model's two searches and their plans timed, into `results` as they end."""
    with tempfile.TemporaryDirectory(prefix="uhop-budget-") as work:
        warm = Path(work, "warm")
        optimize(str(ROOT / "models" / "example_mobilenet.onnx"), [], 20, Path(work, "warm-plan"), warm)
        present = [p.label for p in resolve(None)]
        for name in models.split(","):
            model, options, feeds = model_case(name, Path(work, name))
            bounded, unbounded = Path(work, name, "bounded"), Path(work, name, "unbounded")
            wall = optimize(model, options, budget, bounded, Path(work, name, "cache-bounded"), warm / "kernels")
            wall_unbounded = optimize(model, options, UNBOUNDED, unbounded, Path(work, name, "cache-unbounded"),
                                      warm / "kernels")
            candidates = [Candidate("bounded", str(bounded)), Candidate("bounded again", str(bounded)),
                          Candidate("unbounded", str(unbounded)), *(alone(f"{p} alone", p) for p in present)]
            figures = timed(candidates, model, feeds, rounds, repeats)
            fastest = single(figures)
            results[name] = r = {
                "model": model, "budget_s": budget, "wall_s": round(wall, 1), "unbounded_wall_s": round(wall_unbounded, 1),
                "plan": chosen(bounded), "unbounded_plan": chosen(unbounded), "same_plan": same_plan(bounded, unbounded),
                "fastest_single": fastest, "ms": {k: f["ms"] and round(f["ms"], 3) for k, f in figures.items()},
                "errors": {k: f["error"] for k, f in figures.items() if f["error"]},
                "bounded/unbounded": ratio(figures, "bounded", "unbounded"),
                "bounded/fastest_single": ratio(figures, "bounded", fastest),
                "unbounded/fastest_single": ratio(figures, "unbounded", fastest),
                "A/A": ratio(figures, "bounded again", "bounded"),
                "same_as_fastest_single": bool(fastest) and figures["bounded"]["stages"] == figures[fastest]["stages"]}
            print(f"{name}: optimize --budget {budget:g} took {r['wall_s']} s (unbounded {r['unbounded_wall_s']} s); "
                  f"plan {r['plan']} vs unbounded {r['unbounded_plan']}{' (the same plan)' if r['same_plan'] else ''}"
                  f"{f' (the bounded plan is {fastest} placed alike)' if r['same_as_fastest_single'] else ''}"
                  f"; ms {r['ms']}; bounded/unbounded {r['bounded/unbounded']}, bounded/{fastest} "
                  f"{r['bounded/fastest_single']}, unbounded/{fastest} {r['unbounded/fastest_single']}; "
                  f"A/A (the bounded plan in two processes) {r['A/A']}"
                  + "".join(f"; {k} failed: {e}" for k, e in r["errors"].items()), flush=True)


if __name__ == "__main__":
    typer.run(main)
