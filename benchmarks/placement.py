"""The optimized plan beside raw runtimes and each provider alone, over the reference models.

    python benchmarks/placement.py [--threads 2] [--rounds 7] [--models mlp,cnn,...] [--json out.json]

Each model is run through `uhop-onnx bench` (`uhop_onnx.products.bench`): every candidate in its own process,
alternating rounds, the minimum of the round medians; ratios are between figures of the same run.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import onnx
import typer
from rich.console import Console
from rich.table import Table

from uhop_onnx.products.bench import bench
from uhop_onnx.models import cnn, hybrid, mlp, mobilenet, resnet, speech, transformer

# Reference models at sizes where a run takes long enough to compare (0.1-20 ms on 2 cores).
MODELS = {
    "mlp": lambda: mlp(batch=32, sizes=(256, 1024, 1024, 10)),
    "cnn": lambda: cnn(size=96),
    "resnet": lambda: resnet(size=64, width=32, blocks=4),
    "mobilenet": lambda: mobilenet(size=128, widths=(32, 64, 128)),
    "transformer": lambda: transformer(seq=64, hidden=128),
    "resnet-deep": lambda: resnet(size=40, width=64, blocks=24),  # about ResNet-50's node count and GFLOPs
    "hybrid": lambda: hybrid(size=64),  # a CNN stem feeding encoder blocks: parts that favour different runtimes
    "speech": lambda: speech(frames=64, mels=64, hidden=128, heads=4, blocks=2),  # a GRU (not in LiteRT) + encoders
}


def main(threads: int = 2, rounds: int = 7, models: str = ",".join(MODELS), budget: float = 60.0,
         json_out: Path | None = typer.Option(None, "--json")) -> None:
    console = Console(width=200)
    results = {}
    with tempfile.TemporaryDirectory() as work:
        for name in models.split(","):
            path = Path(work) / f"{name}.onnx"
            onnx.save(MODELS[name](), path)
            console.print(f"[bold]{name}[/] ...")
            results[name] = bench(path, threads=threads, rounds=rounds, budget=budget)
    table = Table("model", "plan", "plan / best single", "best single", "plan / provider first, rest on ort-cpu",
                  "ort-cpu alone / raw ORT", "openvino alone / raw OV", "optimize cold s", "warm s",
                  title=f"{rounds} alternating rounds, {threads} threads; each candidate in its own process",
                  caption="best single: the fastest provider that runs every node alone")
    for name, r in results.items():
        c = r["candidates"]
        greedy = [f"{k.removesuffix(' alone')} {_ratio(c, 'uhop-onnx plan', k)}" for k, v in c.items()
                  if k.endswith(" alone") and len(v["stages"]) > 1]
        table.add_row(name, " > ".join(r["plan"]), f"{c['uhop-onnx plan']['ratio_to_best_single']:.3f}",
                      (r["best_single"] or "").removesuffix(" alone"), ", ".join(greedy),
                      _ratio(c, "ort-cpu alone", "onnxruntime (raw)"), _ratio(c, "openvino alone", "openvino (raw)"),
                      f"{r['optimize_seconds']['cold']:.1f}", f"{r['optimize_seconds']['warm']:.1f}")
    console.print(table)
    if json_out:
        json_out.write_text(json.dumps(results, indent=1))


def _ratio(candidates: dict, ours: str, raw: str) -> str:
    a, b = candidates.get(ours, {}).get("ms"), candidates.get(raw, {}).get("ms")
    return f"{a / b:.3f}" if a and b else ""


if __name__ == "__main__":
    typer.run(main)
