"""The `uhop-onnx` command: a thin shell over the Python API.

Exit codes: 0 success, 1 a failed check (a stage that failed, a mismatch), 2 bad usage or input.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from .custom_ops.cli import app as kernels_app
from .errors import InputError, UhopError
from .providers.rknn.cli import app as rknn_setup
from .report import ms_order, ms_text
from .serve.cli import serve

app = typer.Typer(name="uhop-onnx", help="Place ONNX models on the fastest mix of providers, and run them.",
                  no_args_is_help=True, pretty_exceptions_enable=False, add_completion=False)
out = Console()
err = Console(stderr=True)

ProvidersOption = Annotated[str | None, typer.Option("--providers", "-p", help="Comma-separated provider ids, in "
                            "preference order (openvino:GPU picks a device). Default: every provider present.")]
JsonOption = Annotated[bool, typer.Option("--json", help="Print JSON instead of tables.")]
ThreadsOption = Annotated[int | None, typer.Option("--threads", min=1, help="Intra-op threads for every provider.")]


def main() -> None:
    try:
        app()
    except UhopError as error:
        err.print(f"[bold red]error:[/] {error}", highlight=False)
        sys.exit(error.exit_code)


LiteRtFp16Option = Annotated[bool, typer.Option("--litert-fp16", help="LiteRT stages keep float16 weights "
                             "(checked against ONNX Runtime within rtol 1e-2, atol 1e-3).")]


def _providers(text: str | None, litert_fp16: bool = False) -> list | None:
    """Provider specs from `--providers` (None: every one present); `--litert-fp16` sets litert's option."""
    specs = [p.strip() for p in text.split(",") if p.strip()] if text else None
    if not litert_fp16:
        return specs
    if specs is None:
        from .providers import REGISTRY

        specs = [ident for ident, cls in REGISTRY.items() if cls().present]
    return [("litert", {"fp16": True}) if s == "litert" else s for s in specs]


def _print_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2) + "\n")


@contextmanager
def _steps(title: str, enabled: bool = True) -> Iterator[Any]:
    """A transient spinner with the current step, on stderr; yields the step callback."""
    if not enabled:
        yield lambda step: None
        return
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                  console=err, transient=True) as progress:
        task = progress.add_task(title)
        yield lambda step: progress.update(task, description=f"{title}: {step}")


@app.command()
def devices(as_json: JsonOption = False) -> None:
    """List every provider uhop-onnx knows, present or not, with the reason and install command when absent."""
    from .providers import devices as known

    rows = [a.to_json() for a in known()]
    if as_json:
        return _print_json(rows)
    table = Table("provider", "present", "version", "device", "reason / install")
    for r in rows:
        note = "" if r["present"] else f"{r['reason']}\n[dim]{r['install']}[/]"
        table.add_row(r["id"], "[green]yes[/]" if r["present"] else "[red]no[/]", r["version"] or "",
                      r["device"] or "", note)
    out.print(table)


@app.command()
def inspect(model: Path, providers: ProvidersOption = None, threads: ThreadsOption = None,
            as_json: JsonOption = False) -> None:
    """Show a model's ops and which provider can run each node, with the reason for every "no"."""
    from .optimizer import analyze

    with _steps("inspecting", not as_json) as step:
        a = analyze(model, _providers(providers), threads=threads, progress=step)
    labels = [p.label for p in a.providers]
    nodes = []
    for node in a.loaded.graph.node:
        kept = node.name in a.graph.index_of
        nodes.append({
            "name": node.name,
            "op": node.op_type if not node.domain else f"{node.domain}.{node.op_type}",
            "support": {label: ({"ok": s[node.name].ok, "reason": s[node.name].reason, "source": s[node.name].source}
                                if kept else {"ok": None, "reason": "removed by simplification", "source": "simplify"})
                        for label, s in zip(labels, a.support)},
        })
    report = {
        "model": str(model),
        "ir_version": a.loaded.ir_version,
        "opsets": {o.domain or "ai.onnx": o.version for o in a.loaded.opset_import},
        "ops": dict(Counter(n["op"] for n in nodes).most_common()),
        "providers": labels,
        "nodes": nodes,
    }
    if as_json:
        return _print_json(report)
    ops = Table("op", "count", title=f"{model.name}: {len(nodes)} nodes")
    for op, count in report["ops"].items():
        ops.add_row(op, str(count))
    out.print(ops)
    matrix = Table("node", "op", *labels, title="who can run what")
    for n in nodes:
        cells = [("[dim]folded[/]" if s["ok"] is None else "[green]yes[/]" if s["ok"] else f"[red]no[/] {s['reason']}")
                 for s in n["support"].values()]
        matrix.add_row(n["name"], n["op"], *cells)
    out.print(matrix)


@app.command()
def optimize(model: Path, output: Annotated[Path, typer.Option("--output", "-o", help="Plan folder to write.")],
             providers: ProvidersOption = None,
             no_profile: Annotated[bool, typer.Option("--no-profile", help="Place without timing.")] = False,
             threads: ThreadsOption = None,
             budget: Annotated[float, typer.Option("--budget", min=0, help="Seconds the measured search may "
                                                   "spend improving the plan.")] = 60.0,
             litert_fp16: LiteRtFp16Option = False, as_json: JsonOption = False) -> None:
    """Place a model's nodes on providers and write the plan folder."""
    from .optimizer import optimize as run_optimize

    with _steps("optimizing", not as_json) as step:
        plan = run_optimize(model, _providers(providers, litert_fp16), profile=not no_profile, threads=threads,
                            budget=budget, progress=step)
        step("writing the plan")
        plan.save(output)
    if as_json:
        return _print_json(plan.to_json())
    _print_stages(plan, title=f"{model.name} -> {output}")
    if plan.profile:
        _print_candidates(plan.profile)
    _print_replaced(plan)


def _print_stages(plan, title: str) -> None:
    table = Table("stage", "provider", "nodes", "first node .. last node", "ms", "boundary ms", "alternatives (ms)",
                  title=title)
    for k, s in enumerate(plan.stages):
        span = s.nodes[0] if len(s.nodes) == 1 else f"{s.nodes[0]} .. {s.nodes[-1]}"
        note = plan.fell_back(k)
        provider = s.label + (f" [yellow]{note}[/]" if note else "")
        others = ", ".join(f"{p} {ms:.3f}" for p, ms in sorted(s.alternatives.items(), key=lambda kv: kv[1])
                           if p != s.label)
        table.add_row(str(k), provider, str(len(s.nodes)), span, ms_text(s.cost_ms), ms_text(s.boundary_ms), others)
    out.print(table)


def _print_replaced(plan) -> None:
    """The nodes a provider's build check refused, and where they run instead."""
    where = {node: s.label for s in plan.stages for node in s.nodes}
    for r in plan.replaced:
        out.print(f"[yellow]re-placed[/] {escape(r['node'])}: {r['provider']} failed its build check, now on "
                  f"{where.get(r['node'], '?')} ({escape(r['reason'])})", highlight=False)


def _print_candidates(profile: dict) -> None:
    table = Table("whole plan", "ms", "spread", "stages", title=f"measured whole (chosen: {profile['chosen']}; "
                  f"{profile['measured']} measured, {profile['cached']} cached, {profile['seconds']} s)")
    for name, c in sorted(profile["candidates"].items(), key=lambda kv: ms_order(kv[1]["ms"])):
        mark = "[bold green]" if name == profile["chosen"] else ""
        figure = ms_text(c["ms"]) if c["ms"] is not None else f"[red]failed:[/] {_short(c.get('error'))}"
        table.add_row(f"{mark}{name}", figure, f"{c['spread']:.1%}", c["stages"])
    out.print(table)


@app.command()
def run(model: Annotated[Path, typer.Argument(help="A plan folder or an .onnx model.")],
        inputs: Annotated[Path, typer.Option("--inputs", "-i", help="An .npz file with one array per model input.")],
        output: Annotated[Path | None, typer.Option("--output", "-o", help="Write the outputs to this .npz.")] = None,
        providers: ProvidersOption = None, threads: ThreadsOption = None, litert_fp16: LiteRtFp16Option = False,
        as_json: JsonOption = False) -> None:
    """Run a plan folder or a model on the inputs of an .npz file."""
    import numpy as np

    from .session import InferenceSession

    feeds = _read_npz(inputs)
    with _steps("running", not as_json) as step:
        step("compiling stages")
        session = InferenceSession(str(model), providers=_providers(providers, litert_fp16), profile=False,
                                   threads=threads)
        step("running")
        results = dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds), strict=True))
    if output is not None:
        _write_npz(output, results)
    summary = [{"name": k, "dtype": str(v.dtype), "shape": list(v.shape),
                "mean": float(np.mean(v)) if v.size and v.dtype.kind in "fiub" else None} for k, v in results.items()]
    if as_json:
        return _print_json({"providers": session.get_providers(), "outputs": summary})
    table = Table("output", "dtype", "shape", "mean", title=f"ran on {', '.join(session.get_providers())}")
    for s in summary:
        table.add_row(s["name"], s["dtype"], str(s["shape"]), "" if s["mean"] is None else f"{s['mean']:.6g}")
    out.print(table)


def _read_npz(path: Path) -> dict:
    from .files import read_npz

    try:
        return read_npz(path)
    except (OSError, ValueError) as error:
        raise InputError(f"{path}: cannot read inputs ({error}); give an .npz written by numpy.savez") from None


def _write_npz(path: Path, arrays: dict) -> None:
    import numpy as np

    from .files import atomic_file

    with atomic_file(path, "wb") as handle:
        np.savez(handle, **arrays)


@app.command()
def explain(plan_dir: Annotated[Path, typer.Argument(help="A plan folder written by optimize.")],
            as_json: JsonOption = False) -> None:
    """Show a plan: its stages, providers, and the tensors that cross between them."""
    from .plan import Plan

    plan = Plan.load(plan_dir)
    if as_json:
        return _print_json(plan.to_json())
    out.print(f"[bold]{plan.model_name}[/] ({plan.model_hash[:12]}), placement: {plan.placement}, "
              f"providers: {', '.join(p['id'] for p in plan.providers)}")
    _print_stages(plan, title=str(plan_dir))
    if plan.profile:
        _print_candidates(plan.profile)
    _print_replaced(plan)


@app.command()
def bench(model: Path, providers: ProvidersOption = None, threads: ThreadsOption = None,
          rounds: Annotated[int, typer.Option(min=1, help="Alternating rounds per candidate.")] = 7,
          budget: Annotated[float, typer.Option(min=0, help="Seconds for the measured search.")] = 60.0,
          as_json: JsonOption = False) -> None:
    """Time raw runtimes, each provider alone and the optimized plan, each in its own process, side by side.
    Exit 1 when a candidate failed (its error in the table and the JSON)."""
    from .bench import bench as run_bench

    with _steps("benchmarking", not as_json) as step:
        result = run_bench(model, _providers(providers), threads=threads, rounds=rounds, budget=budget, progress=step)
    if as_json:
        _print_json(result)
    else:
        _print_bench(result, threads)
    if result["failed"]:
        err.print(f"[bold red]error:[/] {len(result['failed'])} candidate(s) failed: {', '.join(result['failed'])}",
                  highlight=False)
        raise typer.Exit(1)


def _print_bench(result: dict, threads: int | None) -> None:
    table = Table("candidate", "min of round medians (ms)", "vs best single provider", "overhead vs raw", "stages",
                  title=f"{result['model']}: {result['rounds']} alternating rounds, threads={threads or 'default'}",
                  caption=f"best single provider (runs every node alone): {result['best_single'] or 'none'}")
    for name, f in sorted(result["candidates"].items(), key=lambda kv: ms_order(kv[1]["ms"])):
        ratio = f.get("ratio_to_best_single")
        overhead = f.get("overhead_vs_raw")
        table.add_row(name, ms_text(f["ms"]) if f["ms"] is not None else f"[red]failed:[/] {_short(f['error'])}",
                      "" if ratio is None else f"{ratio:.3f}", "" if overhead is None else f"{overhead:+.1%}",
                      _stages_summary(f["stages"]))
    out.print(table)
    for name in result["failed"]:
        if "\n" in result["candidates"][name]["error"]:
            out.print(f"{escape(name)}: {escape(result['candidates'][name]['error'])}", highlight=False)
    seconds = result["optimize_seconds"]
    if seconds["cold"] is not None:
        out.print(f"optimize: {seconds['cold']:.1f} s with a cold cache, {seconds['warm']:.1f} s warm; "
                  f"plan: {' > '.join(result['plan'])}")


def _short(error: str | None, limit: int = 160) -> str:
    """A table cell's reason: the error's first line, cut to `limit`, with no markup."""
    line = (error or "no figure").strip().splitlines()[0]
    return escape(line if len(line) <= limit else line[:limit - 3] + "...")


def _stages_summary(stages: list[str]) -> str:
    """`ort-cpu x2 > litert x67`, or for a longer plan its providers and stage count."""
    if len(stages) <= 1:
        return ""
    if len(stages) <= 3:
        return " > ".join(stages)
    return f"{', '.join(dict.fromkeys(s.split(' x')[0] for s in stages))}: {len(stages)} stages"


class ExportFormat(StrEnum):
    bundle = "bundle"
    triton = "triton"


@app.command()
def export(model: Path,
           output: Annotated[Path, typer.Option("--output", "-o", help="A new folder, or a file ending .tar.gz "
                                                "(bundles); a new folder (Triton repositories).")],
           target: Annotated[str | None, typer.Option("--target", "-t", help="Board profile: rk3588, jetson-orin, "
                                                      "x86-64, arm64, intel-npu, or a JSON profile's path.")] = None,
           fmt: Annotated[ExportFormat, typer.Option("--format", help="bundle: stages in their runtimes' own formats "
                                                     "for a board; triton: a Triton model repository.")]
           = ExportFormat.bundle,
           providers: ProvidersOption = None, threads: ThreadsOption = None,
           sign: Annotated[Path | None, typer.Option("--sign", help="Sign the bundle's manifest with this Ed25519 "
                                                     "private key (from `uhop-onnx keygen`).")] = None) -> None:
    """Write a deployment bundle for a board, or a Triton model repository."""
    if fmt is ExportFormat.triton:
        from .triton import export_triton

        with _steps("exporting"):
            written = export_triton(model, output, providers=_providers(providers), threads=threads)
        out.print(f"Triton model repository written to {written}")
        return
    if target is None:
        raise typer.BadParameter("--target is required for bundles (rk3588, jetson-orin, x86-64, arm64, intel-npu, "
                                 "or a JSON profile)", param_hint="--target")
    from .export import export_bundle

    with _steps("exporting") as step:
        written = export_bundle(model, target, output, providers=_providers(providers), threads=threads,
                                progress=step, sign=sign)
    _print_bundle(written, f"{'signed ' if sign else ''}bundle for {target}")


@app.command()
def keygen(name: Annotated[Path, typer.Option("--output", "-o", help="Writes NAME.key (private, mode 0600) and "
                                              "NAME.pub (public).")]) -> None:
    """Write a new Ed25519 key pair (PEM) to sign bundles with: `export --sign NAME.key`, `verify --key NAME.pub`."""
    from .bundle.signature import keygen as write_pair

    private, public = write_pair(name)
    out.print(f"private key: {private} (keep it secret; it signs bundles)\npublic key:  {public} (give it to "
              "whoever loads the bundles: `verify --key`, `load_bundle(path, key=...)`)")


@app.command()
def tune(bundle: Annotated[Path, typer.Argument(help="A bundle folder or .tar.gz.")],
         output: Annotated[Path, typer.Option("--output", "-o", help="A new folder, or a file ending .tar.gz.")],
         threads: ThreadsOption = None,
         budget: Annotated[float, typer.Option("--budget", min=0, help="Seconds the measured search may spend "
                                               "improving the plan.")] = 60.0) -> None:
    """On the board: place a bundle's model again by measuring it here, and write the new bundle."""
    from .export import tune_bundle

    with _steps("tuning") as step:
        written = tune_bundle(bundle, output, threads=threads, budget=budget, progress=step)
    _print_bundle(written, f"tuned from {bundle}")


def _print_bundle(bundle: Path, title: str) -> None:
    manifest = _manifest_of(bundle)
    table = Table("stage", "provider", "format", "nodes", "files", title=f"{title}: {bundle} ({manifest['placement']})")
    for k, s in enumerate(manifest["stages"]):
        table.add_row(str(k), s["provider"], s["artifact"]["format"], str(len(s["nodes"])), ", ".join(s["artifact"]["files"]))
    out.print(table)
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
    """Check a bundle's signature (with --key) and hashes, then run every stage this host can run and compare
    with ONNX Runtime."""
    from .verify import verify_bundle

    with _steps("verifying", not as_json):
        report = verify_bundle(bundle, key=key, allow_unrun=allow_unrun)
    if as_json:
        _print_json(report)
    else:
        _print_signature(report["signature"])
        for problem in report["files"]:
            out.print(f"[red]tampered:[/] {problem}")
        table = Table("stage", "provider", "ran here", "how", "result", title=str(bundle))
        for s in report["stages"]:
            result = {True: "[green]match[/]", False: f"[red]mismatch[/] {s.get('error', '')}", None: "not checked"}[s["ok"]]
            table.add_row(str(s["index"]), s["provider"], "yes" if s["ran"] else "no", s["how"], result)
        if report["stages"]:
            out.print(table)
        for name, o in (report["outputs"] or {}).items():
            out.print(f"output {name}: {'[green]matches[/]' if o['ok'] else '[red]differs[/]'} the reference "
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
        out.print(f"[red]tampered:[/] {signature['error']}")
    elif signature["signed"]:
        out.print("[yellow]signed, signature not checked[/]: give --key PUB to check it; the hashes alone prove "
                  "only that no file was corrupted")
    else:
        out.print("[yellow]unsigned[/]: the hashes prove only that no file was corrupted, not who made the bundle "
                  "(sign with `export --sign KEY`, check with `verify --key PUB`)")


# Sub-commands that live beside what they serve.
setup_app = typer.Typer(help="Install the toolkits some providers need.", no_args_is_help=True)
setup_app.add_typer(rknn_setup)
app.add_typer(setup_app, name="setup")
app.add_typer(kernels_app, name="kernels")
app.command("serve")(serve)


if __name__ == "__main__":
    main()
