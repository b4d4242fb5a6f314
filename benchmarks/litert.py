"""LiteRT (our ONNX -> .tflite converter, XNNPACK) beside ONNX Runtime CPU, and the optimized mix.

    python benchmarks/litert.py [--threads 2] [--rounds 3] [--repeats 30] [--mix/--no-mix] [--budget 20]
                                [--only resnet18-224,encoder-vit-tiny]

Models: the reference models at their test sizes, and models of the sizes people deploy (a ResNet-18, a
MobileNet at 224x224, an encoder block whose sequence length equals its hidden size, a ViT-tiny-sized
encoder block, the YOLO-style detector of tests/test_litert.py at 320x320). Each candidate runs in its own process, in alternating
rounds; a round's figure is the median of `--repeats` calls, and a candidate's figure is the minimum over
rounds. Candidates: `onnxruntime` (its own session, nothing of ours), `ort-cpu` (a uhop-onnx session on
ONNX Runtime: the same session overhead as the next two), `litert` (the model placed on LiteRT alone, ops it
lacks on ort-cpu) and `mix` (the plan `uhop_onnx.optimize` measures with every provider present). Ratios are
times relative to `onnxruntime` (below 1: faster). Conversion time is `convert` alone; the litert session's
build time adds loading the interpreter and the check against ONNX Runtime. Last, the conversion time of a
ResNet-50-sized model (26 M weights).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
import typer

ROOT = Path(__file__).resolve().parent.parent
CANDIDATES = ("onnxruntime", "ort-cpu", "litert")


def models() -> dict:
    from uhop_onnx.models import BUILDERS, mobilenet, transformer, yolo_like

    sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT)]
    from kernels import resnet18

    return {
        **{name: build for name, build in BUILDERS.items()},
        "resnet18-224": resnet18,
        "mobilenet-224": lambda: mobilenet(size=224, widths=(32, 64, 128), classes=1000),
        "encoder-128x128": lambda: transformer(seq=128, hidden=128, heads=2),
        "encoder-vit-tiny": lambda: transformer(seq=197, hidden=192, heads=3),
        "yolo-like-320": lambda: yolo_like(size=320),
    }


def open_candidate(candidate: str, path: str, threads: int):
    """The callable session of one candidate: ONNX Runtime itself, or a uhop-onnx session."""
    if candidate == "onnxruntime":
        import onnxruntime as ort

        so = ort.SessionOptions()
        so.intra_op_num_threads, so.inter_op_num_threads = threads, 1
        return ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
    import uhop_onnx

    if candidate == "mix":
        return uhop_onnx.InferenceSession(path, threads=threads)  # the saved, measured plan
    return uhop_onnx.InferenceSession(path, providers=[candidate], profile=False, threads=threads)


def child(candidate: str, path: str, threads: int, repeats: int) -> dict:
    """Median ms per call of one candidate in this process, and how long its session took to build."""
    start = time.perf_counter()
    session = open_candidate(candidate, path, threads)
    built = time.perf_counter() - start
    rng = np.random.default_rng(0)
    feeds = {i.name: rng.standard_normal(i.shape).astype(np.float32) for i in session.get_inputs()}
    for _ in range(3):
        session.run(None, feeds)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        session.run(None, feeds)
        times.append(time.perf_counter() - start)
    stages = [[s.provider, len(s.nodes)] for s in session.plan.stages] if hasattr(session, "plan") else []
    return {"ms": 1000 * float(np.median(times)), "build_s": built, "stages": stages}


def conversion_seconds(path: Path) -> float:
    """Time `convert` takes for the LiteRT stages of the model placed on litert."""
    from uhop_onnx.providers.litert.converter import convert

    import uhop_onnx

    plan = uhop_onnx.optimize(str(path), providers=["litert"], profile=False)
    stages = [plan.stage_model(s) for s in plan.stages if s.provider == "litert"]
    start = time.perf_counter()
    for stage in stages:
        convert(stage)
    return time.perf_counter() - start


def measure(name: str, model: onnx.ModelProto, tmp: Path, threads: int, rounds: int, repeats: int, mix: bool,
            budget: float) -> dict:
    path = tmp / f"{name}.onnx"
    onnx.save(model, path)
    targets = dict.fromkeys(CANDIDATES, path)
    if mix:
        import uhop_onnx

        uhop_onnx.optimize(str(path), threads=threads, budget=budget).save(tmp / f"{name}.plan")
        targets["mix"] = tmp / f"{name}.plan"
    best: dict[str, dict] = {}
    for r in range(rounds):
        order = list(targets) if r % 2 == 0 else list(targets)[::-1]
        for candidate in order:
            done = subprocess.run([sys.executable, __file__, "--child", candidate, str(targets[candidate]),
                                   str(threads), str(repeats)], capture_output=True, text=True, check=True)
            result = json.loads(done.stdout.strip().splitlines()[-1])
            if candidate not in best or result["ms"] < best[candidate]["ms"]:
                best[candidate] = result
    best["convert_s"] = conversion_seconds(path)
    return best


def resnet50_sized_conversion() -> dict:
    """Conversion time of a ResNet-50-sized model: 44 3x3 convolutions of 256 channels (26 M weights)."""
    from uhop_onnx.models import resnet
    from uhop_onnx.providers.litert.converter import convert

    model = resnet(size=224, width=256, blocks=22)
    weights = sum(int(np.prod(t.dims)) for t in model.graph.initializer)
    start = time.perf_counter()
    blob = convert(model)
    return {"weights": weights, "convert_s": time.perf_counter() - start, "tflite_mb": len(blob) / 2**20}


def main(threads: int = 2, rounds: int = 3, repeats: int = 30, mix: bool = True, budget: float = 20.0,
         only: str = "") -> None:
    chosen = {k: v for k, v in models().items() if not only or k in only.split(",")}
    table = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, build in chosen.items():
            table[name] = best = measure(name, build(), Path(tmp), threads, rounds, repeats, mix, budget)
            ort_ms = best["onnxruntime"]["ms"]
            parts = [f"{name:17s} onnxruntime {ort_ms:8.2f} ms"]
            for candidate in ("ort-cpu", "litert", "mix"):
                if candidate in best:
                    parts.append(f"{candidate} {best[candidate]['ms']:8.2f} ms ({best[candidate]['ms'] / ort_ms:4.2f}x)")
            parts.append(f"convert {best['convert_s']:.2f} s, litert session built+checked in "
                         f"{best['litert']['build_s']:.2f} s, litert stages {best['litert']['stages']}")
            if "mix" in best:
                parts.append(f"mix stages {best['mix']['stages']}")
            print(" | ".join(parts), flush=True)
    big = resnet50_sized_conversion()
    print(f"ResNet-50-sized conversion: {big['weights'] / 1e6:.1f} M weights -> {big['tflite_mb']:.0f} MB .tflite "
          f"in {big['convert_s']:.2f} s")
    print(json.dumps({"threads": threads, "models": table, "resnet50_sized": big}))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        print(json.dumps(child(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))))
    else:
        typer.run(main)
