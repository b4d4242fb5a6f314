"""The human side of a plan folder: `report.md`, and the graph coloured by provider (`graph.dot`, `graph.svg`)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .plan import Plan

COLOURS = ["#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1", "#9c755f"]


def write_report(plan: Plan, folder: Path) -> None:
    (folder / "report.md").write_text(markdown(plan))
    dot = graph_dot(plan)
    (folder / "graph.dot").write_text(dot)
    if shutil.which("dot"):
        try:
            svg = subprocess.run(["dot", "-Tsvg"], input=dot, capture_output=True, text=True, timeout=60, check=True)
            (folder / "graph.svg").write_text(svg.stdout)
        except (subprocess.SubprocessError, OSError):
            pass  # the DOT file is there to render by hand


def markdown(plan: Plan) -> str:
    lines = [f"# Plan for `{plan.model_name}`", "",
             f"Model sha256 `{plan.model_hash[:16]}`; placement: {plan.placement}; threads: {plan.threads or 'default'}.", "",
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
    if plan.profile:
        p = plan.profile
        lines += ["", "## Whole plans measured", "",
                  f"Chosen: **{p['chosen']}**. {p['measured']} figures measured, {p['cached']} from the cache, "
                  f"in {p['seconds']} s.", "", "| candidate | ms | spread | stages |", "|---|---|---|---|"]
        for name, c in sorted(p["candidates"].items(), key=lambda kv: ms_order(kv[1]["ms"])):
            failed = f"failed: {c.get('error') or 'no figure'}".replace("|", "\\|")
            figure = ms_text(c["ms"]) if c["ms"] is not None else failed
            lines.append(f"| {name} | {figure} | {c['spread']:.1%} | {c['stages']} |")
    return "\n".join(lines) + "\n"


def graph_dot(plan: Plan) -> str:
    colours = {p: COLOURS[i % len(COLOURS)] for i, p in enumerate(dict.fromkeys(s.label for s in plan.stages))}
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


def ms_order(ms: float | None) -> float:
    """Sort key: a missing figure (a failed candidate) last."""
    return float("inf") if ms is None else ms


def ms_text(value: float | None) -> str:
    return "" if value is None else f"{value:.3f}"
