"""Reduced precision on this machine: each (runtime, precision) alone and the `auto` plan, side by side.

    python benchmarks/precision.py [--models resnet50,mobilenetv2,encoder] [--rounds 5] [--budget 30]

For a ResNet-50 and a MobileNetV2 at 224x224 and a BERT-like encoder (4 layers, hidden 256, sequence 128),
all from `models/builders.py`: 16 calibration samples and 4 checked inputs from the same generator
(`samples.sample_feeds`) under other seeds. Candidates, each in its own process in alternating rounds
(`uhop_onnx.runtime.measure.time_candidates`): ONNX Runtime fp32 and OpenVINO f32 (the raw runtimes); the whole model
as one stage at a reduced precision: OpenVINO bf16, ONNX Runtime int8 (the QDQ model `quantize_static` makes
from the calibration samples) and int8 dynamic (`quantize_dynamic`), OpenVINO int8 compiling that QDQ model
and OpenVINO int8 from NNCF (`nncf.quantize`, what the openvino provider uses), LiteRT fp32 and LiteRT int8 (the
full-integer `.tflite` our converter writes from the calibration ranges); and the plan
`optimize(precision="auto", tolerance=1e-2)` chooses. Each one's error is measured on the checked inputs
(not in the calibration set) against ONNX Runtime fp32: the worst max abs error, cosine and top-1 agreement
over them, and whether every output is within the tolerance (`max|y - ref| <= 1e-2 * (1 + max|ref|)`). A comment
line per model names the plan auto chose and the fastest plan its own table shows the gate accepted.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
import typer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from uhop_onnx import InferenceSession, optimize  # noqa: E402
from uhop_onnx.products.bench import raw  # noqa: E402
from uhop_onnx.foundation.errors import UhopError, first_line  # noqa: E402
from uhop_onnx.runtime.measure import Candidate, time_candidates  # noqa: E402
from uhop_onnx.foundation.graph import Graph  # noqa: E402
from uhop_onnx.models import encoder, mobilenetv2, resnet50  # noqa: E402
from uhop_onnx.precision import errors, gate  # noqa: E402
from uhop_onnx.providers.quantize import Calibration, quantize_int8  # noqa: E402
from uhop_onnx.foundation.samples import reference_outputs, sample_feeds  # noqa: E402

MODELS = {"resnet50": resnet50, "mobilenetv2": mobilenetv2, "encoder": encoder}
TOLERANCE = 1e-2
# label -> (provider spec, precision, how its int8 model is made: None for the provider's own way)
ONE_STAGE = {"OpenVINO bf16": ("openvino", "bf16", None), "ORT int8": ("ort-cpu", "int8", None),
             "ORT int8 dynamic": (("ort-cpu", {"quantization": "dynamic"}), "int8", None),
             "OpenVINO int8 QDQ": ("openvino", "int8", "static"), "OpenVINO int8 NNCF": ("openvino", "int8", "nncf"),
             "LiteRT fp32": ("litert", "fp32", None), "LiteRT int8": ("litert", "int8", None)}


def one_stage(model_path: Path, spec, precision: str, method: str | None, calibration: Calibration, out: Path) -> Path:
    """The whole model as one stage of the provider `spec` at `precision` (int8 made by `method`, or as
    the provider makes it), saved as a plan folder."""
    from uhop_onnx.providers import create

    variant = create(spec).at_precision(precision, calibration)
    plan = optimize(model_path, providers=[variant.id], profile=False)
    for stage in plan.stages:
        model = plan.stage_model(stage)
        stage.model = quantize_int8(model, calibration, method) if method else variant.lower(model)
        stage.precision = precision
        stage.options = {**variant.options, **({"quantization": method} if method else {})}
    plan.save(out)
    return out


def accuracy(session: InferenceSession, checked: list[dict], references: list[dict]) -> dict:
    """The worst errors over the checked inputs, and whether they are within the tolerance."""
    names = [o.name for o in session.get_outputs()]
    ok, worst = gate([errors(dict(zip(names, session.run(None, x))), ref) for x, ref in zip(checked, references)],
                     TOLERANCE)
    return {"within": ok, **next(iter(worst.values()))}


def bench_model(name: str, work: Path, rounds: int, budget: float, threads: int | None) -> list[dict]:
    model = MODELS[name]()
    path = work / f"{name}.onnx"
    onnx.save(model, path)
    graph = Graph.from_model(model)
    signatures = [graph.signature(n) for n in graph.inputs]
    checked = [sample_feeds(signatures, seed=seed) for seed in range(4)]
    samples = [sample_feeds(signatures, seed=seed) for seed in range(100, 116)]
    np.savez(work / f"{name}-calibration.npz", **{n: np.concatenate([s[n] for s in samples]) for n in graph.inputs})
    references = [reference_outputs(str(path), x) for x in checked]
    calibration = Calibration(model, samples)
    plans, failed = {}, {}
    for label, (spec, precision, method) in ONE_STAGE.items():
        try:
            plans[label] = one_stage(path, spec, precision, method, calibration, work / f"{name}-{label.replace(' ', '-')}")
        except UhopError as error:  # a runtime that cannot build this model at that precision is a row saying so
            failed[label] = first_line(error)
    started = time.perf_counter()
    plan = optimize(path, precision="auto", tolerance=TOLERANCE, calibration=work / f"{name}-calibration.npz",
                    budget=budget, threads=threads)
    seconds = time.perf_counter() - started
    table = {n: c for n, c in plan.profile["candidates"].items() if c.get("ms") is not None and not c.get("rejected")}
    fastest = min(table, key=lambda n: table[n]["ms"])
    chosen = plan.profile["candidates"].get(plan.profile["chosen"], {}).get("ms")
    print(f"<!-- {name}: auto chose {plan.profile['chosen']} ({chosen and round(chosen, 2)} ms in its "
          f"table); the fastest gated plan of its table: {fastest} ({table[fastest]['ms']:.2f} ms, "
          f"{table[fastest]['stages']}); {len(table)} gated plans timed -->", flush=True)
    plan.save(work / f"{name}-auto")
    plans["auto plan"] = work / f"{name}-auto"
    candidates = [raw("ORT fp32", "onnxruntime"), raw("OpenVINO f32", "openvino"),
                  *(Candidate(label, str(folder)) for label, folder in plans.items())]
    figures = time_candidates(candidates, str(path), checked[0], threads, rounds)
    errors_of = {f"{runtime} f{'p' if p == 'ort-cpu' else ''}32": accuracy(
        InferenceSession(path, providers=[p], profile=False), checked, references)
        for runtime, p in (("ORT", "ort-cpu"), ("OpenVINO", "openvino"))}
    for label, folder in plans.items():
        try:
            errors_of[label] = accuracy(InferenceSession(folder), checked, references)
        except UhopError as error:  # built, but the runtime refuses to compile it: a row saying why
            errors_of[label] = {"within": False, "max_abs_error": float("nan"), "cosine": float("nan")}
            figures[label] = {**figures[label], "ms": None, "error": figures[label]["error"] or first_line(error)}
    base = figures["ORT fp32"]["ms"]
    rows = []
    for c in candidates:
        f, e = figures[c.name], errors_of[c.name]
        rows.append({"model": name, "candidate": c.name, "ms": f["ms"], "speedup": base / f["ms"] if f["ms"] else None,
                     "stages": f.get("stages", []), "error": f.get("error"), **e})
    rows[-1]["optimize_seconds"] = round(seconds, 1)
    return rows + [{"model": name, "candidate": label, "ms": None, "speedup": None, "stages": [], "error": why,
                    "within": False, "max_abs_error": float("nan"), "cosine": float("nan")} for label, why in failed.items()]


def print_rows(rows: list[dict]) -> None:
    for r in rows:
        ms = f"{r['ms']:.2f}" if r["ms"] else f"failed: {r['error']}"
        speed = f"{r['speedup']:.2f}x" if r["speedup"] else ""
        top1 = "" if "top1_agrees" not in r else "yes" if r["top1_agrees"] else "no"
        stages = " > ".join(r["stages"]) if r["stages"] else "raw runtime" if r["ms"] else ""
        seconds = f" (optimize {r['optimize_seconds']} s)" if "optimize_seconds" in r else ""
        print(f"| {r['model']} | {r['candidate']}{seconds} | {ms} | {speed} | {r['max_abs_error']:.2g} | "
              f"{r['cosine']:.6f} | {top1} | {'yes' if r['within'] else 'no'} | {stages} |", flush=True)


def main(models: str = typer.Option(",".join(MODELS), help="Comma-separated: " + ", ".join(MODELS)),
         rounds: int = typer.Option(5, help="Alternating rounds per candidate."),
         budget: float = typer.Option(30.0, help="Seconds the auto plan's search may spend improving."),
         threads: int | None = typer.Option(None, help="Intra-op threads."),
         output: Path | None = typer.Option(None, help="Write the rows as JSON here.")) -> None:
    logging.basicConfig(level=logging.WARNING)
    rows = []
    print("| model | candidate | ms | vs ORT fp32 | max abs error | cosine | top-1 | within 1e-2 | stages |")
    print("|---|---|---|---|---|---|---|---|---|", flush=True)
    with tempfile.TemporaryDirectory(prefix="uhop-precision-") as work:
        os.environ["UHOP_CACHE_DIR"] = str(Path(work) / "cache")  # a cold cache: optimize measures everything
        for name in models.split(","):
            model_rows = bench_model(name, Path(work), rounds, budget, threads)
            print_rows(model_rows)
            rows += model_rows
    if output:
        output.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    typer.run(main)
