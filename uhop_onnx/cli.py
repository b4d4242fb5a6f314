"""The `uhop-onnx` command: a thin shell over the Python API.

Exit codes: 0 success, 1 a failed check (a stage that failed, a mismatch), 2 bad usage or input. Tables fit
80 columns (summaries first; `--wide` for the rest); every text from outside (names, reasons, paths) is printed
as text, never as rich markup. The runtimes' own logs show only with `-v`; warnings are one line each. Progress
goes to stderr, hidden by `--quiet` and `--json`.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
import warnings
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import Progress, ProgressColumn, SpinnerColumn, Task, TextColumn
from rich.table import Table
from rich.text import Text

from .cache_cli import app as cache_app
from .errors import UhopError
from .kernels_cli import app as kernels_app
from .providers.rknn.cli import rknn as rknn_setup
from .report import (
    candidate_error,
    effort_text,
    interval_text,
    ms_order,
    ms_text,
    off_accelerator_lines,
    precision_text,
    stages_summary,
)
from .samples import shapes_text
from .serve.cli import serve

app = typer.Typer(name="uhop-onnx", help="Place ONNX models on the fastest mix of providers, and run them.",
                  no_args_is_help=True, pretty_exceptions_enable=False, add_completion=False,
                  rich_markup_mode="markdown")
out = Console()
err = Console(stderr=True)

ProvidersOption = Annotated[str | None, typer.Option("--providers", "-p", help="Comma-separated provider ids, in "
                            "preference order (openvino:GPU picks a device). Default: every provider present.")]
JsonOption = Annotated[bool, typer.Option("--json", help="Print JSON instead of tables.")]
QuietOption = Annotated[bool, typer.Option("--quiet", "-q", help="No progress on stderr.")]
WideOption = Annotated[bool, typer.Option("--wide", help="Every column and row, not only the summary.")]
ShapeOption = Annotated[list[str] | None, typer.Option("--shape", help="NAME:1x3x224x224, the shape of an input "
                        "to generate (repeatable). Default: a plan folder's recorded shapes, else the model's.")]
InputsOption = Annotated[Path | None, typer.Option("--inputs", "-i", help="An .npz (one array per input), an .npy "
                         "(a one-input model) or an ONNX test_data_set_* folder. Default: seeded random inputs.")]
SeedOption = Annotated[int, typer.Option("--seed", help="Seed of the generated inputs.")]
ThreadsOption = Annotated[int | None, typer.Option("--threads", min=1, help="Intra-op threads for every provider.")]
MeasuredShapeOption = Annotated[list[str] | None, typer.Option("--shape", help="NAME:1x3x640x640, the shape to "
                                "measure an input at (repeatable). Needed for each free dimension but a leading "
                                "one, which is taken as 1.")]
MeasuredInputsOption = Annotated[Path | None, typer.Option("--inputs", "-i", help="Sample inputs to measure on "
                                 "instead of random values: an .npz (one array per input), an .npy (a one-input "
                                 "model) or an ONNX test_data_set_* folder.")]


PrecisionOption = Annotated[str, typer.Option("--precision", help="fp32, auto, bf16, fp16 or int8. With auto, "
                            "every precision the providers offer competes; with bf16, fp16 or int8, that one or "
                            "fp32, per stage. The fastest within --tolerance of ONNX Runtime fp32 wins.")]
ToleranceOption = Annotated[float | None, typer.Option("--tolerance", help="The error allowed per output and "
                            "sample: max|y-ref| <= TOLERANCE*(1+max|ref|). Default: 1e-2.")]
CalibrationOption = Annotated[Path | None, typer.Option("--calibration", help="Calibration samples: an .npz whose "
                              "arrays carry a leading sample axis, or a folder of .npz files (one sample each). "
                              "int8 is tried only with them.")]


def _measured_at(shape: list[str] | None, inputs: Path | None, precision: str = "fp32",
                 tolerance: float | None = None, calibration: Path | None = None) -> dict[str, Any]:
    """`shapes=` and `inputs=` from `--shape` and `--inputs`; `precision=`, `tolerance=`, `calibration=` from
    theirs (left out at the fp32 default)."""
    from .inputs import parse_shapes

    chosen = {"shapes": parse_shapes(shape), "inputs": inputs}
    if precision != "fp32" or tolerance is not None or calibration is not None:
        chosen |= {"precision": precision, "tolerance": tolerance, "calibration": calibration}
    return chosen


IMPORTED = time.monotonic()
VERBOSE = ("-v", "--verbose")
AS_COMMAND = False  # main() sets it: `optimize --budget` then counts from the process's start
SAVING = 0.05  # the share of `optimize --budget` kept for writing the plan and exiting


def main() -> None:
    """The command; `-v` is taken anywhere on the line (`uhop-onnx run model.onnx -v`), as trtexec takes it."""
    global AS_COMMAND
    AS_COMMAND = True
    args = sys.argv[1:]
    if args[:1] == ["exec"]:  # the program's arguments and output are its own: no -v taken, nothing silenced
        app(args=args)
    import signal

    def ended(number: int, frame: object) -> None:
        """SIGTERM or SIGHUP: unwind as Ctrl-C does, so that workers are stopped and temporary files removed,
        and exit with 128 + the signal's number; a second signal ends the process at once."""
        for each in caught:
            signal.signal(each, signal.SIG_DFL)
        raise SystemExit(128 + number)

    caught = [n for n in (signal.SIGTERM, signal.SIGHUP) if signal.getsignal(n) is signal.SIG_DFL]  # nohup's kept
    for number in caught:
        signal.signal(number, ended)
    verbose = any(a in VERBOSE for a in args)
    if verbose:
        args = ["-v", *(a for a in args if a not in VERBOSE)]
    warnings.formatwarning = _one_line
    with _runtimes_silenced(not verbose):
        try:
            app(args=args)
        except UhopError as error:
            err.print(f"[bold red]error:[/] {escape(str(error))}", highlight=False, soft_wrap=True)
            sys.exit(error.exit_code)


def _age() -> float:
    """Seconds since this process started (from /proc), else since this module was imported."""
    try:
        started = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])  # field 22, in ticks
        return max(float(Path("/proc/uptime").read_text().split()[0]) - started / os.sysconf("SC_CLK_TCK"), 0.0)
    except (OSError, ValueError, IndexError):
        return time.monotonic() - IMPORTED


def _one_line(message, category, filename, lineno, line=None) -> str:
    """A warning as `warning: its first line` (where in uhop-onnx it was raised is no news to the user)."""
    text = str(message).strip().splitlines()
    return f"warning: {text[0] if text else category.__name__}\n"


@contextmanager
def _runtimes_silenced(silenced: bool) -> Iterator[None]:
    """While `silenced`, what native code writes to file descriptor 2 (LiteRT's "Created TensorFlow Lite
    XNNPACK delegate" line, runtimes' C++ logs) goes nowhere, while Python's `sys.stderr` (progress,
    warnings, errors) still reaches the terminal through a copy of the descriptor."""
    if not silenced:
        yield
        return
    sys.stderr.flush()
    kept, null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    original = sys.stderr
    sys.stderr = open(kept, "w", buffering=1, encoding=original.encoding, errors="backslashreplace", closefd=False)
    os.dup2(null, 2)
    os.close(null)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(kept, 2)
        os.close(kept)
        sys.stderr = original


@app.callback()
def _options(verbose: Annotated[bool, typer.Option(*VERBOSE, help="Show the runtimes' own logs and "
                                                   "uhop-onnx's progress log.")] = False) -> None:
    """Place ONNX models on the fastest mix of providers, and run them."""
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "0" if verbose else "3")  # LiteRT's C++ logging
    from .ortlib import set_log_severity

    set_log_severity(2 if verbose else 4)  # not verbose: its errors are raised to us, not logged


def _providers(text: str | None) -> list | None:
    """Provider specs from `--providers` (None: every one present)."""
    return [p.strip() for p in text.split(",") if p.strip()] if text else None


def _print_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2) + "\n")


class _Clock(ProgressColumn):
    """Seconds elapsed and, under a `budget`, seconds left: `12 s, 18 s left`; nothing on the best-plan line."""

    def __init__(self, budget: float | None):
        super().__init__()
        self.budget = budget

    def render(self, task: Task) -> Text:
        if task.fields.get("best"):
            return Text("")
        elapsed = task.elapsed or 0.0
        left = "" if self.budget is None else f", {max(self.budget - elapsed, 0):.0f} s left"
        return Text(f"{elapsed:.0f} s{left}", style="progress.elapsed")


@contextmanager
def _steps(title: str, enabled: bool = True, budget: float | None = None) -> Iterator[Any]:
    """A transient spinner on stderr with the current step, seconds elapsed (and left of `budget`), and on
    a second line the best plan so far (a step starting with `partitioner.search.BEST`); yields the step
    callback. Only on a terminal: elsewhere rich would leave an empty line, above any error that follows."""
    if not (enabled and err.is_interactive):
        yield lambda step: None
        return
    from .partitioner.search import BEST

    with Progress(SpinnerColumn(finished_text=" "), TextColumn("{task.description}"), _Clock(budget),
                  console=err, transient=True) as progress:
        task = progress.add_task(title)
        best = progress.add_task("", visible=False, total=1, completed=1, best=True)

        def step(text: str) -> None:
            if text.startswith(BEST):
                progress.update(best, description=escape(text), visible=True)
            else:
                progress.update(task, description=escape(f"{title}: {text}"))

        yield step


@app.command()
def devices(as_json: JsonOption = False, wide: WideOption = False) -> None:
    """List every provider and device uhop-onnx knows, present or not.

    An absent one shows the command that installs it; --wide adds why it is absent."""
    from .providers import devices as known

    rows = [a.to_json() for a in known()]
    if as_json:
        return _print_json(rows)
    table = Table("provider", "device", "present", "version", *(["reason"] if wide else []),
                  title=f"{sum(r['present'] for r in rows)} of {len(rows)} providers and devices present")
    for r in rows:
        version = r["version"] or ""
        cells = [escape(r["id"]), escape(r["device"] or ""), "[green]yes[/]" if r["present"] else "[red]no[/]",
                 escape(version if wide or len(version) <= 24 else version[:23] + "…")]
        table.add_row(*cells, *([escape(r["reason"])] if wide else []))
    out.print(_fit(table, 3, 4))
    for r in rows:
        if not r["present"] and r["install"]:
            out.print(f"to install {escape(r['id'])}{escape(':' + r['device']) if r['device'] else ''}: "
                      f"{escape(r['install'])}", highlight=False)
    if not wide:
        out.print("[dim]--wide shows why each absent one is absent[/]")


def _fit(table: Table, *long: int) -> Table:
    """Short columns kept whole on one line; only the `long` ones (indices) wrap when the terminal is narrow."""
    for k, column in enumerate(table.columns):
        column.no_wrap = k not in long
        column.overflow = "fold"
    return table


@app.command()
def inspect(model: Path, providers: ProvidersOption = None, threads: ThreadsOption = None,
            unsupported: Annotated[bool, typer.Option("--unsupported", help="List the nodes some provider cannot "
                                                      "run, with the reason.")] = False,
            shape: Annotated[list[str] | None, typer.Option("--shape", help="NAME:1x3x640x640, the shape to check an "
                                                            "input at (repeatable). Fixed-shape runtimes answer for "
                                                            "it.")] = None,
            wide: WideOption = False, as_json: JsonOption = False, quiet: QuietOption = False) -> None:
    """Show a model's ops and how many nodes each provider can run.

    --unsupported lists the nodes some provider cannot run, and why. --wide shows every node against every
    provider. --shape gives the input shapes to check at."""
    from .inputs import parse_shapes
    from .optimizer import analyze

    shapes = parse_shapes(shape)
    with _steps("inspecting", not (as_json or quiet)) as step:
        a = analyze(model, _providers(providers), threads=threads, progress=step, shapes=shapes)
    labels = [p.label for p in a.providers]
    nodes = []
    for node in a.loaded.graph.node:
        kept = node.name in a.graph.index_of
        nodes.append({
            "name": node.name,
            "op": node.op_type if not node.domain else f"{node.domain}.{node.op_type}",
            "support": {label: ({"ok": s[node.name].ok, "reason": s[node.name].reason, "source": s[node.name].source}
                                if kept else {"ok": None, "reason": "removed by simplification", "source": "simplify"})
                        for label, s in a.support.items()},
        })
    report = {
        "model": str(model),
        "ir_version": a.loaded.ir_version,
        "opsets": {o.domain or "ai.onnx": o.version for o in a.loaded.opset_import},
        "shapes": {name: list(dims) for name, dims in (shapes or {}).items()},
        "ops": dict(Counter(n["op"] for n in nodes).most_common()),
        "providers": labels,
        "supported": {label: sum(bool(n["support"][label]["ok"]) for n in nodes) for label in labels},
        "nodes": nodes,
    }
    if as_json:
        return _print_json(report)
    kept = sum(n["support"][labels[0]]["ok"] is not None for n in nodes) if labels else 0
    at = f", checked at {shapes_text(report['shapes'])}" if shapes else ""
    out.print(f"{escape(model.name)}: {len(nodes)} nodes, {kept} after simplification{escape(at)}")
    counts = Table("provider", "can run")
    for label, count in report["supported"].items():
        counts.add_row(escape(label), f"{count} of {kept}")
    out.print(counts)
    ops = Table("op", "count", *labels)
    for op, count in report["ops"].items():
        mine = [n for n in nodes if n["op"] == op and n["support"][labels[0]]["ok"] is not None] if labels else []
        ops.add_row(escape(op), str(count), *(str(sum(bool(n["support"][label]["ok"]) for n in mine)) for label in labels))
    out.print("nodes each provider can run, by op:")
    out.print(_fit(ops, 0))
    if unsupported:
        refusals = Table("node", "op", "provider", "why not")
        for n in nodes:
            for label, v in n["support"].items():
                if v["ok"] is False:
                    refusals.add_row(escape(n["name"]), escape(n["op"]), escape(label), escape(v["reason"]))
        out.print(_fit(refusals, 0, 3) if refusals.rows else "every provider can run every node")
    elif wide:
        matrix = Table("node", "op", *labels, title="who can run what")
        for n in nodes:
            matrix.add_row(escape(n["name"]), escape(n["op"]), *(
                "[dim]folded[/]" if v["ok"] is None else "[green]yes[/]" if v["ok"] else f"[red]no[/] {escape(v['reason'])}"
                for v in n["support"].values()))
        out.print(matrix, width=10**4)
    else:
        out.print("[dim]--unsupported lists the nodes some provider cannot run, and why; --wide every node[/]")


@app.command()
def optimize(model: Path, output: Annotated[Path, typer.Option("--output", "-o", help="Plan folder to write.")],
             providers: ProvidersOption = None,
             no_profile: Annotated[bool, typer.Option("--no-profile", help="Place without timing.")] = False,
             threads: ThreadsOption = None,
             budget: Annotated[float, typer.Option("--budget", min=0, help="Seconds optimize may take in all. "
                                                   "It then stops measuring and keeps the best plan found.")]
             = 60.0,
             shape: MeasuredShapeOption = None,
             inputs: MeasuredInputsOption = None, precision: PrecisionOption = "fp32",
             tolerance: ToleranceOption = None, calibration: CalibrationOption = None,
             as_json: JsonOption = False, quiet: QuietOption = False) -> None:
    """Place a model's nodes on providers and write the plan folder.

    Candidate placements are measured within --budget seconds. With --no-profile, each node goes to the first
    provider that can run it."""
    from .files import check_writable
    from .optimizer import optimize as run_optimize

    check_writable(output)
    spent = _age() + SAVING * budget if AS_COMMAND else 0.0  # the budget is the whole command's
    with _steps("optimizing", not (as_json or quiet), None if no_profile else budget - spent) as step:
        plan = run_optimize(model, _providers(providers), profile=not no_profile, threads=threads,
                            budget=max(budget - spent, 0.0), progress=step,
                            **_measured_at(shape, inputs, precision, tolerance, calibration))
        step("writing the plan")
        plan.save(output)
    if as_json:
        return _print_json(plan.to_json())
    _print_stages(plan, title=f"{model.name} -> {output}")
    if plan.profile:
        _print_candidates(plan.profile)
    _print_adaptation(plan)
    _print_replaced(plan)


def _print_stages(plan, title: str, wide: bool = False) -> None:
    """The stages; with `wide`, each one's measured alternatives too."""
    table = Table("stage", "provider", "nodes", "first node .. last node", "ms", "boundary ms",
                  *(["alternatives (ms)"] if wide else []), title=escape(title))
    for k, s in enumerate(plan.stages):
        span = s.nodes[0] if len(s.nodes) == 1 else f"{s.nodes[0]} .. {s.nodes[-1]}"
        note = plan.fell_back(k)
        provider = escape(s.label) + (f" [yellow]{escape(note)}[/]" if note else "")
        others = ", ".join(f"{p} {ms:.3f}" for p, ms in sorted(s.alternatives.items(), key=lambda kv: kv[1])
                           if p != s.label)
        table.add_row(str(k), provider, str(len(s.nodes)), escape(span), ms_text(s.cost_ms), ms_text(s.boundary_ms),
                      *([escape(others)] if wide else []))
    out.print(_fit(table, 3, 6))
    if plan.profile:
        out.print("[dim]stage ms: the stage's blocks, each measured alone on its provider; a whole plan's ms "
                  "(below): the plan run end to end in its own process, hand-overs included[/]")


def _print_replaced(plan) -> None:
    """The nodes a provider's build check refused, and where they run instead."""
    where = {node: s.label for s in plan.stages for node in s.nodes}
    for r in plan.replaced:
        out.print(f"[yellow]re-placed[/] {escape(r['node'])}: {r['provider']} failed its build check, now on "
                  f"{where.get(r['node'], '?')} ({escape(r['reason'])})", highlight=False)


def _print_adaptation(plan) -> None:
    """Per shape bucket an adapting session decided on this plan: its decision, then each candidate tried with
    its figure (its time over the serving plan's, a 95% interval), where it stood and what ONNX Runtime held it
    to."""
    for key, bucket in (plan.adaptation or {}).items():
        out.print(f"[bold]adapted at {escape(key)}[/] ({bucket['calls']} calls): "
                  f"{escape(bucket['decision'] or 'not decided yet')}", highlight=False)
        for trial in bucket["candidates"]:
            low, high = trial["interval"] or (None, None)
            figure = f", {low:.3f}-{high:.3f}x the serving plan's time" if low is not None else ""
            why = f": {trial.get('error') or trial.get('why')}" if trial.get("error") or trial.get("why") else ""
            if trial.get("tolerance"):
                error = trial.get("max_abs_error")
                why += f" (held to {trial['tolerance']}{'' if error is None else f'; max abs error {error:.3g}'})"
            out.print(f"  {escape(trial['label'])}: {escape(trial['state'])}{figure}{escape(why)}", highlight=False)


def _print_candidates(profile: dict) -> None:
    """One line per whole plan timed, at the console's width: its figure, the range of its round medians, its
    stages (a long plan summarised) and, in a column of its own, why it failed or its error against fp32;
    stages and errors that do not fit are cut with an ellipsis (`--json` has them whole). Then why the plan
    chosen is unmeasured, where it is."""
    rows = sorted(profile["candidates"].items(), key=lambda kv: ms_order(kv[1]["ms"]))
    cells = [[("* " if name == profile["chosen"] else "") + name, ms_text(c["ms"]), interval_text(c),
              stages_summary(c["stages"]), candidate_error(c)] for name, c in rows]
    headers = ["whole plan", "ms", "range", "stages", "error"][:5 if any(row[4] for row in cells) else 4]
    widths = [max(len(h), *(len(row[k]) for row in cells)) for k, h in enumerate(headers)]
    room = max(out.width, 60) - 3 * len(headers) - 1  # what borders and padding leave
    widths[3] = min(widths[3], max(room - sum(widths[:3]) - (len(headers) > 4) * 16, 12))
    if len(headers) > 4:
        widths[4] = max(room - sum(widths[:4]), 12)
    table = Table(*headers, title="whole plans timed (* this plan)", caption=escape(effort_text(profile)))
    for row, (name, c) in zip(cells, rows):
        texts = [_cut(text, width) for text, width in zip(row, widths)]
        style = "bold green" if name == profile["chosen"] else "red" if c["ms"] is None else ""
        table.add_row(*(Text(text, style=style if k in (0, 4) else "") for k, text in enumerate(texts)))
    for column, width in zip(table.columns, widths):
        column.no_wrap, column.width = True, width
    out.print(table)
    if profile.get("unmeasured"):
        out.print(f"[yellow]this plan is unmeasured:[/] {escape(profile['unmeasured'])}", highlight=False)


def _cut(text: str, width: int) -> str:
    return text if len(text) <= width else text[:width - 1] + "…"


@app.command()
def run(model: Annotated[Path, typer.Argument(help="A plan folder or an .onnx model.")],
        inputs: InputsOption = None, shape: ShapeOption = None,
        output: Annotated[Path | None, typer.Option("--output", "-o", help="Write the outputs to this .npz.")] = None,
        iterations: Annotated[int, typer.Option("--iterations", "-n", min=0, help="Time this many runs: latency "
                                                "p50/p90/p99, throughput and each stage's share.")] = 0,
        warmup: Annotated[int, typer.Option("--warmup", min=0, help="Untimed runs before the timed ones.")] = 1,
        seed: SeedOption = 0, providers: ProvidersOption = None, threads: ThreadsOption = None,
        as_json: JsonOption = False) -> None:
    """Run a plan folder or a model on given or generated inputs.

    Generated inputs take the shapes of --shape, else those a plan folder recorded, else the model's.
    --iterations N times N runs: latency percentiles, throughput and each stage's share."""
    import numpy as np

    from .latency import measure_latency

    with _steps("running", not as_json) as step:
        step("compiling stages")
        session = _session(model, providers, threads)
        feeds, source = _feeds(session, inputs, shape, seed)
        step("running")
        results = dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds), strict=True))
        if iterations:
            step(f"timing {iterations} runs")
            latency = measure_latency(session, feeds, iterations, warmup)
    if output is not None:
        _write_npz(output, results)
    summary = [{"name": k, "dtype": str(v.dtype), "shape": list(v.shape),
                "mean": float(np.mean(v)) if v.size and v.dtype.kind in "fiub" else None} for k, v in results.items()]
    report = {"providers": session.get_providers(), "inputs": source, "outputs": summary}
    if iterations:
        report["latency"] = latency
    if as_json:
        return _print_json(report)
    table = Table("output", "dtype", "shape", "mean", title=f"ran on {escape(', '.join(session.get_providers()))} "
                  f"({escape(source)})")
    for s in summary:
        table.add_row(escape(s["name"]), s["dtype"], str(s["shape"]), "" if s["mean"] is None else f"{s['mean']:.6g}")
    out.print(_fit(table, 0))
    if iterations:
        _print_latency(latency)


def _print_latency(latency: dict) -> None:
    out.print(f"latency over {latency['iterations']} runs ({latency['warmup']} warm-up): p50 {latency['p50_ms']:.3f} ms, "
              f"p90 {latency['p90_ms']:.3f} ms, p99 {latency['p99_ms']:.3f} ms; throughput "
              f"{latency['throughput_per_s']:.1f}/s")
    table = Table("stage", "provider", "nodes", "median ms", "share", caption=f"between stages (hand-over, "
                  f"routing): {latency['between_stages_share']:.1%}")
    for st in latency["stages"]:
        table.add_row(str(st["index"]), escape(st["provider"]), str(st["nodes"]), f"{st['median_ms']:.3f}",
                      f"{st['share']:.1%}")
    out.print(table)


@app.command()
def compare(model: Annotated[Path, typer.Argument(help="A plan folder or an .onnx model.")],
            against: Annotated[str, typer.Option("--against", help="The reference: a provider id. For a model, "
                                                 "ort-cpu is ONNX Runtime on the original model.")] = "ort-cpu",
            inputs: InputsOption = None, shape: ShapeOption = None,
            rtol: Annotated[float | None, typer.Option("--rtol", min=0, help="Relative tolerance. Default: the "
                                                       "rule a reduced-precision plan was gated at, else 1e-4.")]
            = None,
            atol: Annotated[float | None, typer.Option("--atol", min=0, help="Absolute tolerance. Default: the "
                                                       "rule a reduced-precision plan was gated at, else 1e-5.")]
            = None,
            seed: SeedOption = 0, providers: ProvidersOption = None, threads: ThreadsOption = None,
            as_json: JsonOption = False) -> None:
    """Compare a plan's (or a model's) outputs with a reference's.

    Both run on the same inputs. Each output shows its max abs and rel error and its cosine. Exit 1 when one
    is outside --rtol/--atol (as numpy's allclose), or without them outside the rule the plan was gated at."""
    from .compare import compare, tolerance_for, tolerance_text

    with _steps("comparing", not as_json) as step:
        step("compiling stages")
        session = _session(model, providers, threads)
        feeds, source = _feeds(session, inputs, shape, seed)
        step("running")
        names = [o.name for o in session.get_outputs()]
        got = dict(zip(names, session.run(None, feeds), strict=True))
        step(f"running the reference on {against}")
        want = _reference(model, session, against, feeds, threads)
    tolerance = tolerance_for(session.plan.tolerance, rtol, atol)
    rows = {name: compare(got[name], want[name], tolerance) for name in names}
    report = {"model": str(model), "providers": session.get_providers(), "against": against, "inputs": source,
              "tolerance": tolerance, "ok": all(r["ok"] for r in rows.values()), "outputs": rows}
    if as_json:
        _print_json(report)
    else:
        table = Table("output", "max abs", "max rel", "cosine", "within", title=f"{escape(', '.join(report['providers']))} "
                      f"against {escape(against)} ({escape(source)})", caption=escape(tolerance_text(tolerance)))
        for name, r in rows.items():
            verdict = "[green]yes[/]" if r["ok"] else f"[red]no[/] {escape(r.get('error', ''))}"
            table.add_row(escape(name), _number(r.get("max_abs_error")), _number(r.get("max_rel_error")),
                          _number(r.get("cosine"), ".6f"), verdict)
        out.print(_fit(table, 0))
    if not report["ok"]:
        raise typer.Exit(1)


def _number(value: float | None, spec: str = ".3g") -> str:
    return "" if value is None else format(value, spec)


def _session(model: Path, providers: str | None, threads: int | None):
    """A session over a plan folder, or a model placed without timing."""
    from .session import InferenceSession

    return InferenceSession(str(model), providers=_providers(providers), profile=False, threads=threads)


def _feeds(session, inputs: Path | None, shapes: list[str] | None, seed: int) -> tuple[dict, str]:
    """The feeds from `--inputs`, else seeded random ones of `--shape`'s shapes, else of the shapes a plan
    folder recorded, else of the model's; and where they came from."""
    from .inputs import parse_shapes, profile_feeds

    given = parse_shapes(shapes) or {}
    recorded = session.plan.shapes if inputs is None and session.plan.folder is not None else None
    planned = {name: dims for name, dims in (recorded or {}).items() if name not in given}
    feeds = profile_feeds(session.get_inputs(), {**planned, **given} or None, inputs, seed)
    if inputs is not None:
        return feeds, str(inputs)
    return feeds, f"generated, seed {seed}" + (f"; {shapes_text(planned)} as the plan recorded" if planned else "")


def _reference(model: Path, session, against: str, feeds: dict, threads: int | None) -> dict:
    """The reference outputs: ONNX Runtime CPU on the original model, or the plan with every stage on `against`."""
    from .plan import PLAN_FILE
    from .providers import parse_spec
    from .session import InferenceSession

    ident, options = parse_spec(against)
    if not (model / PLAN_FILE).is_file():
        if ident == "ort-cpu" and not options:
            from .samples import reference_outputs

            return reference_outputs(model, feeds)
        reference = InferenceSession(str(model), providers=[against], profile=False, threads=threads)
    else:
        reference = InferenceSession(session.plan.on(ident, options), threads=threads)
    return dict(zip([o.name for o in reference.get_outputs()], reference.run(None, feeds), strict=True))


def _write_npz(path: Path, arrays: dict) -> None:
    import numpy as np

    from .files import atomic_file

    with atomic_file(path, "wb") as handle:
        np.savez(handle, **arrays)


@app.command()
def explain(plan_dir: Annotated[Path, typer.Argument(help="A plan folder written by optimize, or a bundle.")],
            wide: WideOption = False, as_json: JsonOption = False) -> None:
    """Show a plan folder or a bundle: its stages and their providers.

    Also the whole plans that were timed and what adapting sessions decided. For a bundle, also why each node
    off the board's accelerator is there."""
    from .plan import Plan

    if (plan_dir / "manifest.json").is_file() or plan_dir.name.endswith(".tar.gz"):
        return _print_bundle(plan_dir, "bundle", as_json)
    plan = Plan.load(plan_dir)
    kept = _kept_for(plan_dir)
    if as_json:
        return _print_json(plan.to_json() | ({"kept": kept} if kept else {}))
    out.print(escape(plan.summary()))
    if plan.tolerance is not None:
        out.print(escape(precision_text(plan)), highlight=False)
    _print_stages(plan, title=str(plan_dir), wide=wide)
    if plan.profile:
        _print_candidates(plan.profile)
    _print_kept(kept, plan)
    _print_adaptation(plan)
    _print_replaced(plan)


def _kept_for(plan_dir: Path) -> dict[str, dict]:
    """Shape bucket -> the decision that keeps this plan folder, where an adapting session kept it in the cache
    (`adapt.Decisions`: beside their `decisions.json`); {} for any other folder."""
    from .adapt import Decisions

    folder = plan_dir.resolve()
    decisions = folder.parent / "decisions.json"
    if not decisions.is_file():
        return {}
    return {bucket: entry for bucket, entry in Decisions(folder.parent).table.read().items()
            if entry["plan"] == folder.name}


def _print_kept(kept: dict[str, dict], plan) -> None:
    """Each decision keeping the plan: the bucket, the calls it was made after, what serves, what ONNX Runtime
    refused and what the next session tries again; and where the plan records no trials there, why."""
    for bucket, entry in kept.items():
        out.print(f"[bold]kept for {escape(bucket)}[/] by an adapting session after {entry['calls']} calls: "
                  f"{escape(entry['label'])} serves it", highlight=False)
        for label, why in entry.get("refused", {}).items():
            out.print(f"  {escape(label)}: refused: {escape(why)}", highlight=False)
        if entry.get("retry"):
            out.print(f"  the next session tries {escape(', '.join(entry['retry']))} again", highlight=False)
        if bucket not in (plan.adaptation or {}):
            out.print("  [dim]the plan records no trials there: it was kept once found faster, before the other "
                      "candidates were tried[/]")


@app.command()
def bench(model: Path, providers: ProvidersOption = None, threads: ThreadsOption = None,
          rounds: Annotated[int, typer.Option(min=1, help="Alternating rounds per candidate.")] = 7,
          budget: Annotated[float, typer.Option(min=0, help="Seconds for the measured search.")] = 60.0,
          shape: MeasuredShapeOption = None, inputs: MeasuredInputsOption = None, precision: PrecisionOption = "fp32",
          tolerance: ToleranceOption = None, calibration: CalibrationOption = None,
          as_json: JsonOption = False, quiet: QuietOption = False) -> None:
    """Time raw runtimes, each provider alone and the optimized plan.

    Each candidate runs in its own process, in alternating rounds. Exit 1 when a candidate failed (its error
    is in the table and the JSON)."""
    from .bench import bench as run_bench

    with _steps("benchmarking", not (as_json or quiet)) as step:
        result = run_bench(model, _providers(providers), threads=threads, rounds=rounds, budget=budget, progress=step,
                           **_measured_at(shape, inputs, precision, tolerance, calibration))
    if as_json:
        _print_json(result)
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


class ExportFormat(StrEnum):
    bundle = "bundle"
    triton = "triton"


@app.command()
def export(model: Path,
           output: Annotated[Path, typer.Option("--output", "-o", help="A new folder. A bundle may also be a "
                                                "file ending .tar.gz.")],
           target: Annotated[str | None, typer.Option("--target", "-t", help="Board profile: rk3588, jetson-orin, "
                                                      "x86-64, x86-64-v4, arm64, intel-npu, or a JSON profile's "
                                                      "path.")] = None,
           fmt: Annotated[ExportFormat, typer.Option("--format", help="bundle: each stage in its runtime's own "
                                                     "format, for a board. triton: a Triton model repository.")]
           = ExportFormat.bundle,
           providers: ProvidersOption = None, threads: ThreadsOption = None,
           sign: Annotated[Path | None, typer.Option("--sign", help="Sign the bundle's manifest with this Ed25519 "
                                                     "private key (from `uhop-onnx keygen`).")] = None,
           shape: MeasuredShapeOption = None, inputs: MeasuredInputsOption = None,
           max_batch: Annotated[int, typer.Option(min=0, help="Triton only: batch up to N requests dynamically "
                                                  "(needs a free first dimension). 0: no batching.")] = 0,
           max_delay_ms: Annotated[float | None, typer.Option(min=0, help="Triton only: how long a batch waits "
                                                              "for more requests.")] = None,
           precision: PrecisionOption = "fp32", tolerance: ToleranceOption = None,
           calibration: CalibrationOption = None, as_json: JsonOption = False, quiet: QuietOption = False) -> None:
    """Write a deployment bundle for a board, or a Triton repository."""
    if fmt is ExportFormat.triton:
        from .triton import export_triton

        if shape or inputs:
            raise typer.BadParameter("--shape and --inputs size bundles; for a Triton repository, run `uhop-onnx "
                                     "optimize MODEL -o PLAN --shape ...` and export the plan folder",
                                     param_hint="--shape")

        with _steps("exporting", not (as_json or quiet)):
            written = export_triton(model, output, providers=_providers(providers), threads=threads,
                                    max_batch=max_batch, max_delay_ms=max_delay_ms)
        if as_json:
            return _print_json({"format": "triton", "repository": str(written)})
        out.print(f"Triton model repository written to {escape(str(written))}")
        return
    if max_batch or max_delay_ms is not None:
        raise typer.BadParameter("--max-batch and --max-delay-ms apply to --format triton", param_hint="--max-batch")
    if target is None:
        raise typer.BadParameter("--target is required for bundles (rk3588, jetson-orin, x86-64, x86-64-v4, arm64, "
                                 "intel-npu, or a JSON profile)", param_hint="--target")
    from .export import export_bundle

    with _steps("exporting", not (as_json or quiet)) as step:
        written = export_bundle(model, target, output, providers=_providers(providers), threads=threads,
                                progress=step, sign=sign,
                                **_measured_at(shape, inputs, precision, tolerance, calibration))
    _print_bundle(written, f"{'signed ' if sign else ''}bundle for {target}", as_json)


@app.command()
def keygen(name: Annotated[Path, typer.Option("--output", "-o", help="NAME: writes NAME.key (private, mode "
                                              "0600) and NAME.pub (public).")],
           as_json: JsonOption = False) -> None:
    """Write a new Ed25519 key pair (PEM) to sign bundles with.

    Sign with `export --sign NAME.key`; check with `verify --key NAME.pub`."""
    from .bundle.signature import keygen as write_pair

    private, public = write_pair(name)
    if as_json:
        return _print_json({"private": str(private), "public": str(public)})
    out.print(f"private key: {escape(str(private))} (keep it secret; it signs bundles)\npublic key:  "
              f"{escape(str(public))} (give it to "
              "whoever loads the bundles: `verify --key`, `load_bundle(path, key=...)`)")


@app.command()
def tune(bundle: Annotated[Path, typer.Argument(help="A bundle folder or .tar.gz.")],
         output: Annotated[Path, typer.Option("--output", "-o", help="A new folder, or a file ending .tar.gz.")],
         threads: ThreadsOption = None,
         budget: Annotated[float, typer.Option("--budget", min=0, help="Seconds the measured search may spend "
                                               "improving the plan.")] = 60.0,
         shape: MeasuredShapeOption = None, inputs: MeasuredInputsOption = None,
         calibration: CalibrationOption = None, as_json: JsonOption = False) -> None:
    """Place a bundle's model again by measuring it on this board.

    It measures on the bundle's sample inputs, unless --shape or --inputs gives others, and writes a new
    bundle. A reduced-precision bundle's precision and tolerance compete again (int8 only with
    --calibration)."""
    from .export import tune_bundle

    with _steps("tuning", not as_json) as step:
        written = tune_bundle(bundle, output, threads=threads, budget=budget, progress=step,
                              calibration=calibration, **_measured_at(shape, inputs))
    _print_bundle(written, f"tuned from {bundle}", as_json)


def _print_bundle(bundle: Path, title: str, as_json: bool = False) -> None:
    manifest = _manifest_of(bundle)
    if as_json:
        return _print_json({"bundle": str(bundle), "manifest": manifest})
    out.print(escape(f"{title}: {bundle} ({manifest['placement']})"), highlight=False, soft_wrap=True)
    table = Table("stage", "provider", "format", "nodes", "files")
    for k, s in enumerate(manifest["stages"]):
        table.add_row(str(k), escape(s["provider"]), escape(s["artifact"]["format"]), str(len(s["nodes"])),
                      escape(", ".join(s["artifact"]["files"])))
    out.print(_fit(table, 0))
    for line in off_accelerator_lines(manifest.get("off_accelerator")):
        out.print(escape(line), highlight=False)
    if manifest.get("profile"):
        _print_candidates(manifest["profile"])


def _manifest_of(bundle: Path) -> dict:
    from .bundle.manifest import read_manifest, unpacked

    with unpacked(bundle) as folder:
        return read_manifest(folder)


@app.command()
def verify(bundle: Annotated[Path, typer.Argument(help="A bundle folder or .tar.gz.")],
           key: Annotated[Path | None, typer.Option("--key", help="The signer's public key (NAME.pub): the "
                                                    "manifest must carry a valid signature by it.")] = None,
           allow_unrun: Annotated[bool, typer.Option("--allow-unrun", help="Succeed even when no stage can run "
                                                     "here (only the hashes are then checked).")] = False,
           as_json: JsonOption = False) -> None:
    """Check a bundle's hashes and signature, then run its stages here.

    --key checks the signature. Each stage this host can run is compared with ONNX Runtime. Exit 1 on a
    mismatch or tampering, or when no stage could run here (unless --allow-unrun)."""
    from .verify import verify_bundle

    with _steps("verifying", not as_json):
        report = verify_bundle(bundle, key=key, allow_unrun=allow_unrun)
    if as_json:
        _print_json(report)
    else:
        _print_signature(report["signature"])
        for problem in report["files"]:
            out.print(f"[red]tampered:[/] {escape(str(problem))}")
        table = Table("stage", "provider", "ran here", "how", "result", title=escape(str(bundle)))
        for s in report["stages"]:
            result = {True: "[green]match[/]", False: f"[red]mismatch[/] {escape(s.get('error', ''))}",
                      None: "not checked"}[s["ok"]]
            label = s["provider"] + ("" if s.get("precision", "fp32") == "fp32" else f"[{s['precision']}]")
            table.add_row(str(s["index"]), escape(label), "yes" if s["ran"] else "no", escape(s["how"]), result)
        if report["stages"]:
            out.print(table)
        for name, o in (report["outputs"] or {}).items():
            out.print(f"output {escape(name)}: {'[green]matches[/]' if o['ok'] else '[red]differs[/]'} the reference "
                      f"(max abs error {o.get('max_abs_error')})")
        if report.get("unrun"):
            out.print(f"[{'yellow' if allow_unrun else 'red'}]no stage could run here[/]: only the hashes were "
                      "checked" + ("" if allow_unrun else "; pass --allow-unrun to accept that"))
    if not report["ok"]:
        raise typer.Exit(1)


def _print_signature(signature: dict) -> None:
    if signature["ok"]:
        out.print("[green]signature valid[/]: the manifest, and through its hashes every file, is as the key's "
                  "owner signed it")
    elif signature["ok"] is False:
        out.print(f"[red]tampered:[/] {escape(signature['error'])}")
    elif signature["signed"]:
        out.print("[yellow]signed, signature not checked[/]: give --key PUB to check it; the hashes alone prove "
                  "only that no file was corrupted")
    else:
        out.print("[yellow]unsigned[/]: the hashes prove only that no file was corrupted, not who made the bundle "
                  "(sign with `export --sign KEY`, check with `verify --key PUB`)")


# Sub-commands that live beside what they serve.
setup_app = typer.Typer(help="Install the toolkits some providers need.", no_args_is_help=True)
@app.command("exec", context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
             add_help_option=False)
def exec_program(ctx: typer.Context) -> None:
    """Run a Python program with uhop-onnx's session as onnxruntime's.

    As `uhop-onnx exec -- python app.py ARGS`. UHOP_PRECISION and UHOP_TOLERANCE set its sessions' precision
    and tolerance."""
    from .exec import main as run_program

    raise typer.Exit(run_program(ctx.args, prog="uhop-onnx exec"))


setup_app.command("rknn", short_help="Create the rknn-toolkit2 environment that RKNN stages need.")(rknn_setup)
app.add_typer(setup_app, name="setup")
app.add_typer(kernels_app, name="kernels")
app.add_typer(cache_app, name="cache")
app.command("serve", short_help="Serve a model over the Open Inference Protocol (KServe v2 REST).")(serve)


if __name__ == "__main__":
    main()
