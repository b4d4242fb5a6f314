"""The human side of a plan folder: `report.md`; `placement.svg`, drawn here with no system program (every
node coloured by provider, and a timeline of the stages with their measured times); and the graph for
Graphviz (`graph.dot`, and `graph.svg` where Graphviz's `dot` is installed)."""

from __future__ import annotations

import shutil
import subprocess
from html import escape
from pathlib import Path
from typing import TYPE_CHECKING

from ..foundation.errors import first_line, logger
from ..foundation.samples import shapes_text

if TYPE_CHECKING:
    from .plan import Plan

log = logger(__name__)

COLOURS = ["#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1", "#9c755f"]


def write_report(plan: Plan, folder: Path) -> None:
    (folder / "report.md").write_text(markdown(plan))
    (folder / "placement.svg").write_text(placement_svg(plan))
    dot = graph_dot(plan)
    (folder / "graph.dot").write_text(dot)
    if not shutil.which("dot"):
        log.info("graph.svg not drawn: Graphviz's dot is not installed (placement.svg shows the placement)")
        return
    try:
        svg = subprocess.run(["dot", "-Tsvg"], input=dot, capture_output=True, text=True, timeout=60, check=True)
        (folder / "graph.svg").write_text(svg.stdout)
    except (subprocess.SubprocessError, OSError) as error:
        log.warning("graph.svg not drawn: dot failed (%s); graph.dot is there to render by hand", error)


def provider_colours(plan: Plan) -> dict[str, str]:
    return {p: COLOURS[i % len(COLOURS)] for i, p in enumerate(dict.fromkeys(s.label for s in plan.stages))}


def placement_svg(plan: Plan, width: int = 800, per_row: int = 50) -> str:
    """An SVG of the plan: a legend, one square per node (in run order, coloured by its stage's provider;
    hover for its name, op and stage), and the stages on a timeline, as wide as their measured ms (boundary
    hand-over in grey) or, for a plan placed without timing, as their node counts."""
    colours = provider_colours(plan)
    cell = (width - 20) // per_row
    nodes = [(k, node) for k, stage in enumerate(plan.stages) for node in plan.stage_model(stage).graph.node]
    rows = -(-len(nodes) // per_row)
    top = 50 + 20 * -(-len(colours) // 4)
    parts = [f'<text x="10" y="22" font-size="15" font-weight="bold">{escape(plan.model_name)}: '
             f'{len(plan.stages)} stage(s), {len(nodes)} nodes, placement {escape(plan.placement)}</text>']
    for i, (label, colour) in enumerate(colours.items()):
        x, y = 10 + (i % 4) * 190, 40 + (i // 4) * 20
        parts.append(f'<rect x="{x}" y="{y}" width="12" height="12" fill="{colour}"/>'
                     f'<text x="{x + 18}" y="{y + 11}" font-size="12">{escape(label)}</text>')
    for i, (k, node) in enumerate(nodes):
        x, y = 10 + (i % per_row) * cell, top + (i // per_row) * cell
        stage = plan.stages[k]
        parts.append(f'<rect x="{x}" y="{y}" width="{cell - 2}" height="{cell - 2}" fill="{colours[stage.label]}">'
                     f'<title>{escape(node.name)} ({escape(node.op_type)}): stage {k} on {escape(stage.label)}</title></rect>')
    y = top + rows * cell + 30
    measured = all(s.cost_ms is not None for s in plan.stages)
    spans = [((s.boundary_ms or 0.0) if measured else 0.0, s.cost_ms if measured else float(len(s.nodes)))
             for s in plan.stages]
    total = sum(a + b for a, b in spans) or 1.0
    scale = (width - 20) / total
    caption = (f"stages on a timeline: {ms_text(total)} ms measured, stage by stage (grey: entering a stage from "
               "another provider)" if measured else "stages in run order, as wide as their node counts (not measured)")
    parts.append(f'<text x="10" y="{y - 8}" font-size="12">{escape(caption)}</text>')
    x = 10.0
    for k, (stage, (boundary, cost)) in enumerate(zip(plan.stages, spans)):
        if boundary:
            parts.append(f'<rect x="{x:.1f}" y="{y}" width="{boundary * scale:.1f}" height="24" fill="#bbbbbb">'
                         f'<title>entering stage {k}: {ms_text(boundary)} ms</title></rect>')
            x += boundary * scale
        figure = f"{ms_text(cost)} ms" if measured else f"{len(stage.nodes)} nodes"
        parts.append(f'<rect x="{x:.1f}" y="{y}" width="{max(cost * scale, 1):.1f}" height="24" '
                     f'fill="{colours[stage.label]}"><title>stage {k} on {escape(stage.label)}: {figure}, '
                     f'{len(stage.nodes)} nodes from {escape(stage.nodes[0])}</title></rect>')
        label = next((t for t in (f"{k} {stage.label} {figure}", f"{k} {stage.label}", str(k))
                      if len(t) * 6.5 + 6 < cost * scale), "")  # what fits, at about 6.5 px a character
        if label:
            parts.append(f'<text x="{x + 3:.1f}" y="{y + 16}" font-size="11" fill="white">{escape(label)}</text>')
        x += cost * scale
    height = y + 40
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
            f'viewBox="0 0 {width} {height}" font-family="sans-serif">\n<rect width="100%" height="100%" fill="white"/>\n'
            + "\n".join(parts) + "\n</svg>\n")


def markdown(plan: Plan) -> str:
    lines = [f"# Plan for `{plan.model_name}`", "",
             f"Model sha256 `{plan.model_hash[:16]}`; placement: {plan.placement}; threads: {plan.threads or 'default'}; "
             f"measured at {shapes_text(plan.shapes)}.", "",
             "![nodes coloured by provider, and the stages on a timeline](placement.svg)", "",
             "| stage | provider | nodes | first node | ms | boundary ms | alternatives (ms) |", "|---|---|---|---|---|---|---|"]
    for k, s in enumerate(plan.stages):
        alternatives = ", ".join(f"{p} {ms:.3f}" for p, ms in sorted(s.alternatives.items(), key=lambda kv: kv[1]))
        lines.append(f"| {k} | {s.label}{plan.fell_back(k)} | {len(s.nodes)} "
                     f"| `{s.nodes[0]}` | {ms_text(s.cost_ms)} | {ms_text(s.boundary_ms)} | {alternatives} |")
    if plan.replaced:
        where = {node: s.label for s in plan.stages for node in s.nodes}
        lines += ["", "## Re-placed after a failed build check", "", "| node | refused by | now on | reason |",
                  "|---|---|---|---|"]
        lines += [f"| `{r['node']}` | {r['provider']} | {where.get(r['node'], '')} | {r['reason'].replace('|', '/')}"
                  " |" for r in plan.replaced]
    if plan.tolerance is not None:
        lines += ["", "## Precision", "", precision_text(plan)]
    if plan.profile:
        p = plan.profile
        unmeasured = f" It is unmeasured: {p['unmeasured']}." if p.get("unmeasured") else ""
        lines += ["", "## Whole plans measured", "", f"Chosen: **{p['chosen']}**.{unmeasured} {effort_text(p)}.", "",
                  "| candidate | ms | interval (ms) | stages | error |", "|---|---|---|---|---|"]
        for name, c in sorted(p["candidates"].items(), key=lambda kv: ms_order(kv[1]["ms"])):
            error = candidate_error(c).replace("|", "\\|")
            lines.append(f"| {name} | {ms_text(c['ms'])} | {interval_text(c)} | {stages_summary(c['stages'])} "
                         f"| {error} |")
    return "\n".join(lines) + "\n"


def effort_text(profile: dict) -> str:
    """`40 block figures measured, 12 from the cache; searched 26.1 s (budget 30.0 s in all)` (and when the
    search stopped at its budget, that it did, and the decision it left unsettled: `undecided_text`)."""
    budget = profile.get("budget_s")
    undecided = profile.get("undecided")
    stopped = (f"; {undecided_text(undecided)}" if undecided else
               "; stopped at the budget, the best plan so far kept" if profile.get("complete") is False else "")
    return (f"{profile['measured']} block figures measured, {profile['cached']} from the cache; searched "
            f"{profile['seconds']} s" + (f" (budget {budget:.1f} s in all)" if budget is not None else "") + stopped)


def undecided_text(undecided: dict) -> str:
    """A decision the budget ended before it settled: which plan looked faster, by how much, on how many
    rounds, which was chosen and why, and the budget that would settle it."""
    faster, slower, chosen = undecided["faster"], undecided["slower"], undecided["chosen"]
    why = ("it was chosen: its slowest round beat the other's fastest" if chosen == faster else
           f"{slower} stands: their rounds overlap" if chosen == slower else
           f"{chosen} was chosen: no plan's rounds lie wholly below its own")
    rounds = undecided["rounds"]
    return (f"stopped at the budget before a decision was settled: {faster} looked {undecided['ratio']:.2f}x as "
            f"fast as {slower} over {rounds} round{'s' * (rounds != 1)}; {why}; --budget {undecided['budget_s']:g} "
            "would settle it")


def stages_summary(stages: str, limit: int = 3) -> str:
    """`openvino x12 > ort-cpu x3` as it is up to `limit` stages; a longer plan as its providers' node counts
    over its stage count: `kernels x58 over 29 stages`, `ort-cpu x40, litert x18 over 13 stages`."""
    runs = [part.rsplit(" x", 1) for part in stages.split(" > ") if part]
    if len(runs) <= limit:
        return stages
    totals: dict[str, int] = {}
    for provider, count in runs:
        totals[provider] = totals.get(provider, 0) + int(count)
    return ", ".join(f"{p} x{n}" for p, n in totals.items()) + f" over {len(runs)} stages"


def interval_text(candidate: dict) -> str:
    """`2.51-2.73`: a whole plan's lowest and highest round median; '' for a failed one."""
    low_high = candidate.get("interval")
    return "" if not low_high else f"{low_high[0]:.3g}-{low_high[1]:.3g}"


def candidate_error(candidate: dict) -> str:
    """A whole plan's error in one line: why it failed, or its worst error against fp32 where it was gated."""
    if candidate["ms"] is None:
        return "failed: " + first_line(candidate.get("error") or "no figure")
    return candidate_accuracy(candidate)


def graph_dot(plan: Plan) -> str:
    colours = provider_colours(plan)
    lines = ["digraph plan {", "  rankdir=TB; node [shape=box, style=filled, fontcolor=white, fontsize=10];"]
    writer: dict[str, str] = {}
    edges = []
    for k, stage in enumerate(plan.stages):
        lines.append(f'  subgraph cluster_{k} {{ label="stage {k}: {stage.label}"; color="{colours[stage.label]}";')
        for node in plan.stage_model(stage).graph.node:
            ident = f"n{len(writer)}_{k}"
            lines.append(f'    {ident} [label="{_escape(node.name)}\\n{node.op_type}", fillcolor="{colours[stage.label]}"];')
            edges += [(name, ident) for name in node.input if name]
            writer.update(dict.fromkeys((o for o in node.output if o), ident))
        lines.append("  }")
    lines += [f"  {writer[src]} -> {dst};" for src, dst in edges if src in writer]
    return "\n".join(lines + ["}"]) + "\n"


def _escape(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"')


def accuracy_text(accuracy: dict[str, dict] | None) -> str:
    """`logits: max abs 0.012, max rel 0.8%, cosine 0.99995, top-1 agrees` per output; '' for none."""
    parts = []
    for name, a in (accuracy or {}).items():
        if not isinstance(a, dict):  # the plan did not run: {"error": why}
            parts.append(f"{name}: {a}")
            continue
        if a.get("error"):
            parts.append(f"{name}: {a['error']}")
            continue
        top1 = "" if "top1_agrees" not in a else ", top-1 agrees" if a["top1_agrees"] else ", top-1 differs"
        parts.append(f"{name}: max abs {a['max_abs_error']:.3g}, max rel {a['max_rel_error']:.2%}, "
                     f"cosine {a['cosine']:.6f}{top1}")
    return "; ".join(parts)


def candidate_accuracy(candidate: dict) -> str:
    """A whole plan's worst error against fp32 where it was gated, marked when the gate rejected it."""
    text = accuracy_text(candidate.get("accuracy"))
    return f"rejected: {text}" if candidate.get("rejected") else text


def precision_text(plan: Plan) -> str:
    """What precision each stage runs at, the tolerance it was gated with, and the worst error it showed."""
    counts: dict[str, int] = {}
    for s in plan.stages:
        counts[s.precision] = counts.get(s.precision, 0) + len(s.nodes)
    where = ", ".join(f"{p} {n} nodes" for p, n in counts.items())
    measured = accuracy_text(plan.accuracy) or "every stage fp32, nothing to check"
    return f"precision: {where}; gated at tolerance {plan.tolerance:g} against ONNX Runtime fp32: {measured}"


def ms_order(ms: float | None) -> float:
    """Sort key: a missing figure (a failed candidate) last."""
    return float("inf") if ms is None else ms


def ms_text(value: float | None) -> str:
    return "" if value is None else f"{value:.3f}"



def off_accelerator_lines(off: dict | None, width: int = 80) -> list[str]:
    """A bundle manifest's `off_accelerator` as one line per reason (wrapped at `width`): how many nodes, where
    they went, their ops, and why they are not on the board's accelerator; [] where every node is on it."""
    import textwrap
    from collections import Counter

    if not off:
        return []
    groups: dict[tuple[str, str, str], Counter] = {}
    for entry in off["nodes"]:
        groups.setdefault((entry["on"], entry["kind"], entry["reason"]), Counter())[entry["op"]] += 1
    count = len(off["nodes"])
    lines = [f"{count} node{'s' if count != 1 else ''} off {off['provider']}:" if count
             else f"every node is on {off['provider']}"]
    for (on, kind, reason), ops in groups.items():
        nodes = sum(ops.values())
        names = ", ".join(op if n == 1 else f"{op} x{n}" for op, n in ops.most_common())
        text = f"{nodes} on {on} ({names}): {kind}: {reason}"
        lines += textwrap.wrap(text, width, initial_indent="  ", subsequent_indent="    ")
    return lines
