"""`bench`: raw runtimes, each provider alone and the optimized plan, timed side by side."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from ..runtime.report import ms_order, ms_text, stages_summary
from ..foundation.samples import shapes_text
from .options import (CalibrationOption, JsonOption, MeasuredInputsOption, MeasuredShapeOption, PrecisionOption,
                      ProvidersOption, QuietOption, ThreadsOption, ToleranceOption, measured_at, provider_specs)
from .render import err, out, print_json, steps


def bench(model: Path, providers: ProvidersOption = None, threads: ThreadsOption = None,
          rounds: Annotated[int, typer.Option(min=1, help="Alternating rounds per candidate.")] = 7,
          budget: Annotated[float, typer.Option(min=0, help="Seconds for the measured search.")] = 60.0,
          shape: MeasuredShapeOption = None, inputs: MeasuredInputsOption = None, precision: PrecisionOption = "fp32",
          tolerance: ToleranceOption = None, calibration: CalibrationOption = None,
          as_json: JsonOption = False, quiet: QuietOption = False) -> None:
    """Time raw runtimes, each provider alone and the optimized plan.

    Each candidate runs in its own process, in alternating rounds. Exit 1 when a candidate failed (its error
    is in the table and the JSON)."""
    from ..products.bench import bench as run_bench

    with steps("benchmarking", not (as_json or quiet)) as step:
        result = run_bench(model, provider_specs(providers), threads=threads, rounds=rounds, budget=budget, progress=step,
                           **measured_at(shape, inputs, precision, tolerance, calibration))
    if as_json:
        print_json(result)
    else:
        _print_bench(result, threads)
    if result["failed"]:
        err.print(f"[bold red]error:[/] {len(result['failed'])} candidate(s) failed: {', '.join(result['failed'])}",
                  highlight=False, soft_wrap=True)
        raise typer.Exit(1)


def _print_bench(result: dict, threads: int | None) -> None:
    table = Table("candidate", "min of round medians (ms)", "vs best single provider", "overhead vs raw", "stages",
                  title=escape(f"{result['model']} at {shapes_text(result['shapes'])}: {result['rounds']} alternating "
                               f"rounds, threads={threads or 'default'}"),
                  caption=escape(f"best single provider (runs every node alone): {result['best_single'] or 'none'}"))
    for name, f in sorted(result["candidates"].items(), key=lambda kv: ms_order(kv[1]["ms"])):
        ratio = f.get("ratio_to_best_single")
        overhead = f.get("overhead_vs_raw")
        table.add_row(escape(name) + (f" [yellow]({escape(f['note'])})[/]" if f.get("note") else ""), _figure(f),
                      "" if ratio is None else f"{ratio:.3f}", "" if overhead is None else f"{overhead:+.1%}",
                      "" if len(f["stages"]) <= 1 else escape(stages_summary(" > ".join(f["stages"]))))
    out.print(table)
    for name in result["failed"]:
        if "\n" in result["candidates"][name]["error"]:
            out.print(f"{escape(name)}: {escape(result['candidates'][name]['error'])}", highlight=False)
    seconds = result["optimize_seconds"]
    if seconds["cold"] is not None:
        out.print(f"optimize: {seconds['cold']:.1f} s with a cold cache, {seconds['warm']:.1f} s warm; "
                  f"plan: {escape(' > '.join(result['plan']))}")


def _figure(candidate: dict) -> str:
    """A bench row's figure: its ms, else why it has none (it failed, or optimize did not measure the plan)."""
    if candidate["ms"] is not None:
        return ms_text(candidate["ms"])
    if candidate.get("unmeasured"):
        return f"[yellow]unmeasured:[/] {_short(candidate['unmeasured'])}"
    return f"[red]failed:[/] {_short(candidate['error'])}"


def _short(error: str | None, limit: int = 160) -> str:
    """A table cell's reason: the error's first line, cut to `limit`, with no markup."""
    line = (error or "no figure").strip().splitlines()[0]
    return escape(line if len(line) <= limit else line[:limit - 3] + "...")
