"""Bounded optimize: `uhop-onnx optimize --budget 30` against the unbounded search, on corpus models.

    python benchmarks/budget.py [--budget 30] [--models timm-resnet18,encoder] [--rounds 9] [--json out.json]

Per model: the wall time of `uhop-onnx optimize --budget B` in its own process (a cold cache of its own), the
plan it chose, and that plan's latency over the plan of the unbounded search (`--budget 100000`, another cold
cache), both plans timed each in its own worker process, in alternating rounds (`measure.time_candidates`):
the ratio is the median over rounds of the bounded plan's round median over the unbounded one's in the same
round (where both chose the same plan, which the line says, it shows only the noise between two processes).
Every cold cache starts with the kernels library already built (it is built once per host, not per model: a
first `optimize` on the shipped MobileNet builds it). `--models` takes `encoder` (the shipped one) and corpus names
(`corpus_models.case`: `timm-resnet18`, `hf-bert@dynamo`, `int8-qdq`...), measured at their inputs.
"""

from __future__ import annotations

import json
import os
import statistics
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import typer

from uhop_onnx.measure import Candidate, time_candidates
from uhop_onnx.plan import Plan
from uhop_onnx.report import stages_summary

ROOT = Path(__file__).resolve().parent.parent
UNBOUNDED = 100000.0  # seconds: the search runs to its end
ENCODER = ROOT / "models" / "example_encoder.onnx"


def model_case(name: str, folder: Path) -> tuple[str, list[str], dict[str, np.ndarray]]:
    """A model (the shipped encoder, or a corpus model: `corpus_models.case`), the options that give optimize
    its inputs (written to `folder`) and the inputs."""
    if name == "encoder":
        path, feeds = ENCODER, {"input_ids": np.random.default_rng(0).integers(0, 64, (1, 128)).astype(np.int64)}
    else:
        sys.path.insert(0, str(ROOT))
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


def main(budget: float = 30.0, models: str = "timm-resnet18,encoder", rounds: int = 15,
         json_out: Path | None = typer.Option(None, "--json")) -> None:
    results = {}
    with tempfile.TemporaryDirectory(prefix="uhop-budget-") as work:
        warm = Path(work, "warm")
        optimize(str(ROOT / "models" / "example_mobilenet.onnx"), [], 20, Path(work, "warm-plan"), warm)
        for name in models.split(","):
            model, options, feeds = model_case(name, Path(work, name))
            bounded, unbounded = Path(work, name, "bounded"), Path(work, name, "unbounded")
            wall = optimize(model, options, budget, bounded, Path(work, name, "cache-bounded"), warm / "kernels")
            wall_unbounded = optimize(model, options, UNBOUNDED, unbounded, Path(work, name, "cache-unbounded"),
                                      warm / "kernels")
            figures = time_candidates([Candidate("bounded", str(bounded)), Candidate("unbounded", str(unbounded))],
                                      None, feeds, None, rounds)
            ms = {k: f["ms"] and round(f["ms"], 3) for k, f in figures.items()}
            pairs = zip(figures["bounded"]["round_medians_ms"], figures["unbounded"]["round_medians_ms"])
            ratio = statistics.median(b / u for b, u in pairs) if None not in ms.values() else None
            results[name] = {"model": model, "budget_s": budget, "wall_s": round(wall, 1),
                             "unbounded_wall_s": round(wall_unbounded, 1), "plan": chosen(bounded),
                             "unbounded_plan": chosen(unbounded), "same_plan": same_plan(bounded, unbounded),
                             "ms": ms, "ratio": ratio and round(ratio, 3)}
            r = results[name]
            print(f"{name}: optimize --budget {budget:g} took {r['wall_s']} s (unbounded {r['unbounded_wall_s']} s); "
                  f"plan {r['plan']} vs unbounded {r['unbounded_plan']}"
                  f"{' (the same plan: the ratio is the noise between two processes)' if r['same_plan'] else ''}: "
                  f"{ms['bounded']} ms vs {ms['unbounded']} ms, median ratio per round {r['ratio']}", flush=True)
    if json_out:
        json_out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    typer.run(main)
