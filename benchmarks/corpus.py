"""The measured plan of each corpus model beside ONNX Runtime CPU, at the shape it was measured at.

    python benchmarks/corpus.py [--models all|default|NAME,...] [--exporters torchscript,dynamo,file]
                                [--threads 2] [--rounds 7] [--budget 10] [--json out.json] [--markdown out.md]

Per model: its nodes, the candidate the measured search chose, the plan's stages, and the plan's latency over
ONNX Runtime's. The plan and raw ONNX Runtime are timed by `uhop_onnx.runtime.measure.time_candidates`, each in its own
process, in alternating rounds, the minimum of the round medians. Models come from
`benchmarks/corpus_models.py` (cached exports; the first run builds them).
"""

from __future__ import annotations

import inspect
import json
import logging
import sys
import tempfile
from pathlib import Path

import onnx
import typer
from rich.console import Console
from rich.table import Table

import uhop_onnx
from uhop_onnx.products.bench import raw
from uhop_onnx.runtime.measure import Candidate, time_candidates

sys.path.insert(0, str(Path(__file__).parent))
import corpus_models as corpus  # noqa: E402 -- beside this script

COLUMNS = ("model", "exporter", "nodes", "chosen", "stages", "plan ms", "ORT ms", "plan / ORT")


def cases(models: str, exporters: list[str]):
    """(name, exporter, spec, path-or-error) for the chosen models; a case a package is missing for is left out."""
    for s in corpus.TORCH_MODELS:
        if (models == "all" or (models == "default" and s.default) or s.name in models.split(",")) \
                and not corpus.missing(s):
            for exporter in exporters:
                if exporter in corpus.EXPORTERS:
                    yield s.name, exporter, s, lambda s=s, e=exporter: corpus.exported(s, e)
    if "file" in exporters:
        for f in corpus.FILES:
            if models in ("all", "default") or f.name in models.split(","):
                yield f.name, "file", f.inputs_spec, lambda f=f: corpus.written(f)


def measure(name: str, exporter: str, s, path: Path, threads: int, rounds: int, budget: float) -> dict:
    """Optimize `path` with measured placement at the spec's first shape, then time the plan beside raw ONNX
    Runtime at that shape."""
    shapes = s.shapes(0)
    options = {"shapes": shapes} if "shapes" in inspect.signature(uhop_onnx.optimize).parameters else {}
    plan = uhop_onnx.optimize(str(path), profile=True, threads=threads, budget=budget, **options)
    row = {"model": name, "exporter": exporter, "nodes": len(onnx.load(path, load_external_data=False).graph.node),
           "chosen": (plan.profile or {}).get("chosen"),
           "stages": " > ".join(f"{st.label} x{len(st.nodes)}" for st in plan.stages), "shapes": shapes}
    with tempfile.TemporaryDirectory(prefix="uhop-corpus-") as work:
        plan.save(Path(work) / "plan")
        figures = time_candidates([raw("ort", "onnxruntime"), Candidate("plan", str(Path(work) / "plan"))],
                                  str(path), s.feeds(0), threads, rounds)
    row["plan_ms"], row["ort_ms"] = figures["plan"]["ms"], figures["ort"]["ms"]
    row["errors"] = {k: f["error"] for k, f in figures.items() if f["error"]}
    row["ratio"] = row["plan_ms"] / row["ort_ms"] if row["plan_ms"] and row["ort_ms"] else None
    return row


def main(models: str = "default", exporters: str = "torchscript,dynamo,file", threads: int = 2, rounds: int = 7,
         budget: float = 10.0, json_out: Path | None = typer.Option(None, "--json"),
         markdown: Path | None = typer.Option(None, "--markdown")) -> None:
    logging.basicConfig(level=logging.WARNING)
    console = Console(width=220)
    rows = []
    for name, exporter, s, build in cases(models, exporters.split(",")):
        console.print(f"[bold]{name}[/] ({exporter}) ...")
        try:
            rows.append(measure(name, exporter, s, build(), threads, rounds, budget))
        except corpus.ExportFailed as e:
            rows.append({"model": name, "exporter": exporter, "error": f"export: {str(e).splitlines()[0]}"})
        except Exception as e:  # noqa: BLE001 -- a model the product fails on is a row that says so
            rows.append({"model": name, "exporter": exporter, "error": f"{type(e).__name__}: {str(e).splitlines()[0]}"})
    table = Table(*COLUMNS, title=f"measured plan vs ONNX Runtime CPU, {threads} threads, {rounds} alternating rounds")
    for r in rows:
        table.add_row(*_cells(r))
    console.print(table)
    if json_out:
        json_out.write_text(json.dumps(rows, indent=1))
    if markdown:
        lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
        lines += ["| " + " | ".join(_cells(r)) + " |" for r in rows]
        markdown.write_text("\n".join(lines) + "\n")


def _cells(r: dict) -> list[str]:
    if "error" in r:
        return [r["model"], r["exporter"], "", "", r["error"][:120], "", "", ""]
    ms = lambda v: f"{v:.3f}" if v else "failed"  # noqa: E731
    return [r["model"], r["exporter"], str(r["nodes"]), str(r["chosen"]), r["stages"], ms(r["plan_ms"]),
            ms(r["ort_ms"]), f"{r['ratio']:.2f}" if r["ratio"] else "; ".join(r["errors"].values())[:120]]


if __name__ == "__main__":
    typer.run(main)
