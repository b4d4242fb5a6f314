"""Placing and running models: devices, inspect, optimize, run, compare, explain."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from ..runtime.report import precision_text
from ..foundation.samples import shapes_text
from . import shell
from .options import (CalibrationOption, InputsOption, JsonOption, MeasuredInputsOption, MeasuredShapeOption,
                      PrecisionOption, ProvidersOption, QuietOption, SeedOption, ShapeOption, ThreadsOption,
                      ToleranceOption, WideOption, measured_at, provider_specs)
from .render import (fit, out, print_adaptation, print_bundle, print_candidates, print_json, print_replaced,
                     print_stages, steps)


SAVING = 0.05  # the share of `optimize --budget` kept for writing the plan and exiting


def devices(as_json: JsonOption = False, wide: WideOption = False) -> None:
    """List every provider and device uhop-onnx knows, present or not.

    An absent one shows the command that installs it; --wide adds why it is absent."""
    from ..providers import devices as known

    rows = [a.to_json() for a in known()]
    if as_json:
        return print_json(rows)
    table = Table("provider", "device", "present", "version", *(["reason"] if wide else []),
                  title=f"{sum(r['present'] for r in rows)} of {len(rows)} providers and devices present")
    for r in rows:
        version = r["version"] or ""
        cells = [escape(r["id"]), escape(r["device"] or ""), "[green]yes[/]" if r["present"] else "[red]no[/]",
                 escape(version if wide or len(version) <= 24 else version[:23] + "…")]
        table.add_row(*cells, *([escape(r["reason"])] if wide else []))
    out.print(fit(table, 3, 4))
    for r in rows:
        if not r["present"] and r["install"]:
            out.print(f"to install {escape(r['id'])}{escape(':' + r['device']) if r['device'] else ''}: "
                      f"{escape(r['install'])}", highlight=False)
    if not wide:
        out.print("[dim]--wide shows why each absent one is absent[/]")


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
    from ..foundation.inputs import parse_shapes
    from ..products.optimizer import analyze

    shapes = parse_shapes(shape)
    with steps("inspecting", not (as_json or quiet)) as step:
        a = analyze(model, provider_specs(providers), threads=threads, progress=step, shapes=shapes)
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
        return print_json(report)
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
    out.print(fit(ops, 0))
    if unsupported:
        refusals = Table("node", "op", "provider", "why not")
        for n in nodes:
            for label, v in n["support"].items():
                if v["ok"] is False:
                    refusals.add_row(escape(n["name"]), escape(n["op"]), escape(label), escape(v["reason"]))
        out.print(fit(refusals, 0, 3) if refusals.rows else "every provider can run every node")
    elif wide:
        matrix = Table("node", "op", *labels, title="who can run what")
        for n in nodes:
            matrix.add_row(escape(n["name"]), escape(n["op"]), *(
                "[dim]folded[/]" if v["ok"] is None else "[green]yes[/]" if v["ok"] else f"[red]no[/] {escape(v['reason'])}"
                for v in n["support"].values()))
        out.print(matrix, width=10**4)
    else:
        out.print("[dim]--unsupported lists the nodes some provider cannot run, and why; --wide every node[/]")


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
    from ..foundation.files import check_writable
    from ..products.optimizer import optimize as run_optimize

    check_writable(output)
    spent = shell.age() + SAVING * budget if shell.AS_COMMAND else 0.0  # the budget is the whole command's
    with steps("optimizing", not (as_json or quiet), None if no_profile else budget - spent) as step:
        plan = run_optimize(model, provider_specs(providers), profile=not no_profile, threads=threads,
                            budget=max(budget - spent, 0.0), progress=step,
                            **measured_at(shape, inputs, precision, tolerance, calibration))
        step("writing the plan")
        plan.save(output)
    if as_json:
        return print_json(plan.to_json())
    print_stages(plan, title=f"{model.name} -> {output}")
    if plan.profile:
        print_candidates(plan.profile)
    print_adaptation(plan)
    print_replaced(plan)


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

    from ..products.latency import measure_latency

    with steps("running", not as_json) as step:
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
        return print_json(report)
    table = Table("output", "dtype", "shape", "mean", title=f"ran on {escape(', '.join(session.get_providers()))} "
                  f"({escape(source)})")
    for s in summary:
        table.add_row(escape(s["name"]), s["dtype"], str(s["shape"]), "" if s["mean"] is None else f"{s['mean']:.6g}")
    out.print(fit(table, 0))
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
    from ..foundation.compare import compare, tolerance_for, tolerance_text

    with steps("comparing", not as_json) as step:
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
        print_json(report)
    else:
        table = Table("output", "max abs", "max rel", "cosine", "within", title=f"{escape(', '.join(report['providers']))} "
                      f"against {escape(against)} ({escape(source)})", caption=escape(tolerance_text(tolerance)))
        for name, r in rows.items():
            verdict = "[green]yes[/]" if r["ok"] else f"[red]no[/] {escape(r.get('error', ''))}"
            table.add_row(escape(name), _number(r.get("max_abs_error")), _number(r.get("max_rel_error")),
                          _number(r.get("cosine"), ".6f"), verdict)
        out.print(fit(table, 0))
    if not report["ok"]:
        raise typer.Exit(1)


def _number(value: float | None, spec: str = ".3g") -> str:
    return "" if value is None else format(value, spec)


def _session(model: Path, providers: str | None, threads: int | None):
    """A session over a plan folder, or a model placed without timing."""
    from ..products.session import InferenceSession

    return InferenceSession(str(model), providers=provider_specs(providers), profile=False, threads=threads)


def _feeds(session, inputs: Path | None, shapes: list[str] | None, seed: int) -> tuple[dict, str]:
    """The feeds from `--inputs`, else seeded random ones of `--shape`'s shapes, else of the shapes a plan
    folder recorded, else of the model's; and where they came from."""
    from ..foundation.inputs import parse_shapes, profile_feeds

    given = parse_shapes(shapes) or {}
    recorded = session.plan.shapes if inputs is None and session.plan.folder is not None else None
    planned = {name: dims for name, dims in (recorded or {}).items() if name not in given}
    feeds = profile_feeds(session.get_inputs(), {**planned, **given} or None, inputs, seed)
    if inputs is not None:
        return feeds, str(inputs)
    return feeds, f"generated, seed {seed}" + (f"; {shapes_text(planned)} as the plan recorded" if planned else "")


def _reference(model: Path, session, against: str, feeds: dict, threads: int | None) -> dict:
    """The reference outputs: ONNX Runtime CPU on the original model, or the plan with every stage on `against`."""
    from ..runtime.plan import PLAN_FILE
    from ..providers import parse_spec
    from ..products.session import InferenceSession

    ident, options = parse_spec(against)
    if not (model / PLAN_FILE).is_file():
        if ident == "ort-cpu" and not options:
            from ..foundation.samples import reference_outputs

            return reference_outputs(model, feeds)
        reference = InferenceSession(str(model), providers=[against], profile=False, threads=threads)
    else:
        reference = InferenceSession(session.plan.on(ident, options), threads=threads)
    return dict(zip([o.name for o in reference.get_outputs()], reference.run(None, feeds), strict=True))


def _write_npz(path: Path, arrays: dict) -> None:
    import numpy as np

    from ..foundation.files import atomic_file

    with atomic_file(path, "wb") as handle:
        np.savez(handle, **arrays)


def explain(plan_dir: Annotated[Path, typer.Argument(help="A plan folder written by optimize, or a bundle.")],
            wide: WideOption = False, as_json: JsonOption = False) -> None:
    """Show a plan folder or a bundle: its stages and their providers.

    Also the whole plans that were timed and what adapting sessions decided. For a bundle, also why each node
    off the board's accelerator is there."""
    from ..runtime.plan import Plan

    if (plan_dir / "manifest.json").is_file() or plan_dir.name.endswith(".tar.gz"):
        return print_bundle(plan_dir, "bundle", as_json)
    plan = Plan.load(plan_dir)
    kept = _kept_for(plan_dir)
    if as_json:
        return print_json(plan.to_json() | ({"kept": kept} if kept else {}))
    out.print(escape(plan.summary()))
    if plan.tolerance is not None:
        out.print(escape(precision_text(plan)), highlight=False)
    print_stages(plan, title=str(plan_dir), wide=wide)
    if plan.profile:
        print_candidates(plan.profile)
    _print_kept(kept, plan)
    print_adaptation(plan)
    print_replaced(plan)


def _kept_for(plan_dir: Path) -> dict[str, dict]:
    """Shape bucket -> the decision that keeps this plan folder, where an adapting session kept it in the cache
    (`adapt.Decisions`: beside their `decisions.json`); {} for any other folder."""
    from ..adaptation.serving import Decisions

    folder = plan_dir.resolve()
    decisions = folder.parent / "decisions.json"
    if not decisions.is_file():
        return {}
    return {bucket: entry for bucket, entry in Decisions(folder.parent).table.read().items()
            if entry["plan"] == folder.name}


def _print_kept(kept: dict[str, dict], plan) -> None:
    """Each decision keeping the plan: the bucket, the calls it was made after, what serves and why, and what
    ONNX Runtime refused."""
    for bucket, entry in kept.items():
        why = f" ({escape(entry['decision'])})" if entry.get("decision") else ""
        out.print(f"[bold]kept for {escape(bucket)}[/] by an adapting session after {entry['calls']} calls: "
                  f"{escape(entry['label'])} serves it{why}", highlight=False)
        for label, said in entry.get("refused", {}).items():
            out.print(f"  {escape(label)}: refused: {escape(said)}", highlight=False)
