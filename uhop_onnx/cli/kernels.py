"""`uhop-onnx kernels ...`: benchmark our kernels, and tune them ahead of time for a model."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

app = typer.Typer(help="Our generated C kernels: benchmark and autotune.", no_args_is_help=True,
                  add_completion=False)
out = Console()
err = Console(stderr=True)


@app.command()
def bench(threads: Annotated[str, typer.Option(help="Comma-separated thread counts.")] = "1,2",
          rounds: Annotated[int, typer.Option(min=1, help="Rounds. Each figure is the minimum of the round "
                                                          "medians.")] = 3,
          as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False) -> None:
    """Measure our kernels' GFLOP/s beside numpy and ONNX Runtime.

    The cases are MatMuls and the convolutions of ResNet-18 and MobileNetV2; a naive loop runs them too.
    Each library runs in its own process."""
    from ..products.kernels_bench import LIBRARIES, measure

    counts = tuple(int(t) for t in threads.split(",") if t.strip())
    if not counts or min(counts) < 1:
        raise typer.BadParameter(f"--threads must list positive integers, got {threads!r}")
    with err.status("measuring") as status:
        result = measure(counts, rounds, progress=lambda step: status.update(f"measuring: {step}"))
    if as_json:
        out.print_json(json.dumps(result))
        return
    table = Table(title=f"GFLOP/s (min over {rounds} rounds of medians; each library in its own process)")
    table.add_column("case")
    for t in counts:
        for lib in LIBRARIES:
            table.add_column(f"{lib} {t}t", justify="right")
    for case in result["cases"]:
        cells = [result["threads"][t][lib].get(case) for t in counts for lib in LIBRARIES]
        table.add_row(case, *("-" if c is None else f"{c:.1f}" for c in cells))
    Console(width=max(out.width, 48 + 11 * len(counts) * len(LIBRARIES))).print(table)  # wide enough to read


@app.command()
def tune(model: Annotated[Path, typer.Argument(help="An ONNX model file.", exists=True, dir_okay=False)],
         threads: Annotated[int | None, typer.Option(min=1, help="Threads to tune for (default: all cores).")] = None,
         as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False) -> None:
    """Tune each Conv, Gemm and MatMul of MODEL that kernels would run.

    The fastest schedules are cached for this device."""
    from ..products.kernels_tune import tune_model

    with err.status(f"tuning {model.name}"):
        tuned = tune_model(model, threads)
    if as_json:
        out.print_json(json.dumps(tuned))
        return
    table = Table(title=f"schedules tuned for {model.name} (cached for this device)")
    for column in ("op", "schedule", "GFLOP/s"):
        table.add_column(column)
    for entry in tuned:
        schedule = " ".join(f"{k}={v}" for k, v in entry["schedule"].items())
        table.add_row(entry["op"], schedule, f"{entry['gflops']:.1f}")
    out.print(table)
