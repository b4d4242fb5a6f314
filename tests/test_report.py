"""The plan folder's pictures: `placement.svg` is drawn with no system program; `graph.svg` where `dot` exists."""

from __future__ import annotations

import re
import shutil
import xml.etree.ElementTree as ET

import pytest

import uhop_onnx
from uhop_onnx.models import hybrid
from uhop_onnx.runtime.report import placement_svg, provider_colours

SVG = "{http://www.w3.org/2000/svg}"


@pytest.fixture(scope="module")
def plan():
    names = [n.name for n in hybrid().graph.node]
    assign = {n: ("litert" if "/attn/" in n else "openvino") for n in names}
    return uhop_onnx.optimize(hybrid(), providers=["openvino", "litert", "ort-cpu"], assign=assign, profile=False)


def _rects(svg: str):
    root = ET.fromstring(svg)
    return [(r, r.findtext(f"{SVG}title") or "") for r in root.iter(f"{SVG}rect")]


def test_every_node_is_drawn_in_its_providers_colour(plan):
    colours = provider_colours(plan)
    rects = _rects(placement_svg(plan))
    drawn = {re.match(r"(.+) \(", title).group(1): r.get("fill") for r, title in rects if ": stage " in title}
    expected = {node: colours[stage.label] for stage in plan.stages for node in stage.nodes}
    assert drawn == expected
    assert len(set(drawn.values())) == 2


def test_the_timeline_is_as_wide_as_the_measured_times(plan):
    for k, stage in enumerate(plan.stages):
        stage.cost_ms, stage.boundary_ms = 1.0 + k, (0.5 if k else None)
    try:
        svg = placement_svg(plan)
    finally:
        for stage in plan.stages:
            stage.cost_ms = stage.boundary_ms = None
    bars = {title.split(":")[0]: float(r.get("width")) for r, title in _rects(svg) if title.startswith(("stage ", "entering"))}
    assert len([b for b in bars if b.startswith("stage")]) == len(plan.stages)
    assert bars["stage 1 on litert"] == pytest.approx(2 * bars["stage 0 on openvino"], rel=0.02)
    assert bars["entering stage 1"] == pytest.approx(bars["stage 0 on openvino"] / 2, rel=0.02)
    assert "ms measured" in svg
    assert "as wide as their node counts" in placement_svg(plan)


def test_a_saved_plan_holds_the_picture_without_graphviz(plan, tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")  # no dot
    plan.save(tmp_path / "plan")
    assert ET.parse(tmp_path / "plan" / "placement.svg").getroot().tag == f"{SVG}svg"
    assert "placement.svg" in (tmp_path / "plan" / "report.md").read_text()
    assert not (tmp_path / "plan" / "graph.svg").exists() and (tmp_path / "plan" / "graph.dot").is_file()


@pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz's dot is not installed")
def test_graphviz_draws_the_graph_where_dot_exists(plan, tmp_path):
    plan.save(tmp_path / "plan")
    assert ET.parse(tmp_path / "plan" / "graph.svg").getroot().tag == f"{SVG}svg"


PROFILE = {"chosen": "ort-cpu first", "measured": 40, "cached": 12, "seconds": 29.8, "budget_s": 30.0,
           "complete": False, "candidates": {
               "ort-cpu first": {"ms": 2.5, "spread": 0.1, "interval": [2.5, 2.75], "stages": "ort-cpu x58"},
               "searched": {"ms": 2.6, "spread": 0.3, "interval": [2.6, 3.4],
                            "stages": " > ".join(["kernels x2", "openvino x1"] * 20)},
               "litert first": {"ms": None, "spread": 0.0, "interval": None, "stages": "litert x58",
                                "error": "stage 0 (litert, 58 nodes from 'conv') failed: " + "why " * 60}}}


def test_a_long_plan_is_summarised():
    from uhop_onnx.runtime.report import stages_summary

    assert stages_summary("ort-cpu x2 > litert x67") == "ort-cpu x2 > litert x67"
    assert stages_summary(" > ".join(["kernels x2"] * 29)) == "kernels x58 over 29 stages"
    assert stages_summary("kernels x2 > openvino x1 > kernels x3 > openvino x4") == \
        "kernels x5, openvino x5 over 4 stages"


def test_whole_plans_are_one_line_each_at_80_columns():
    """A failed candidate's error has a column of its own, and no row wraps; the report says the search
    stopped at its budget."""
    import io

    from rich.console import Console

    from uhop_onnx.cli.render import print_candidates
    from uhop_onnx.runtime.report import effort_text

    printed = io.StringIO()
    print_candidates(PROFILE, Console(file=printed, width=80))
    lines = printed.getvalue().splitlines()
    assert max(map(len, lines)) <= 80
    rows = [line for line in lines if line.startswith("│")]
    assert len(rows) == 3 and sum("failed" in row for row in rows) == 1
    assert any("kernels x40, openvi" in row for row in rows), "a long plan is summarised"
    assert "stopped at the budget" in effort_text(PROFILE)
