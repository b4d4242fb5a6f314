"""The plan folder's pictures: `placement.svg` is drawn with no system program; `graph.svg` where `dot` exists."""

from __future__ import annotations

import re
import shutil
import xml.etree.ElementTree as ET

import pytest

import uhop_onnx
from uhop_onnx.models import hybrid
from uhop_onnx.report import placement_svg, provider_colours

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
