"""The placement interface: each `Placer` returns a typed `Placement`, and its `to_json` is the plan's profile."""

from __future__ import annotations

import pytest

import uhop_onnx
from uhop_onnx.models import cnn
from uhop_onnx.products.optimizer import analyze, build_plan
from uhop_onnx.partitioner.partition import partition
from uhop_onnx.partitioner.first_supported import FirstSupported
from uhop_onnx.partitioner.placer import Placement
from uhop_onnx.runtime.measure import Profiler
from uhop_onnx.partitioner.search import Search, in_process
from uhop_onnx.partitioner.static_placer import StaticCost
from uhop_onnx.providers import REGISTRY, create
from uhop_onnx.products.targets import TargetProvider

from .conftest import assert_matches, random_feeds, reference
from .support import FakeClock, fake_provider

PROFILE_KEYS = {"placement", "chosen", "candidates", "blocks", "entry_ms", "boundary_ms", "failures", "measured",
                "cached", "seconds", "budget_s", "threads", "complete"}


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("UHOP_CACHE_DIR", str(tmp_path / "cache"))


@pytest.fixture
def clock():
    return FakeClock()


@pytest.fixture
def compiled(monkeypatch, clock):
    """Two fake providers charging the fake clock (fake-conv's calls cost 0.5 ms, fake-gemm's 0.2 ms), and
    every runner they compile, by the name of the model it runs."""
    runners: list = []
    for ident, ops, call_ms in (("fake-conv", {"Conv": 1.0, "Gemm": 20.0}, 0.5),
                                ("fake-gemm", {"Conv": 20.0, "Gemm": 1.0}, 0.2)):
        base = fake_provider(ident, ops, call_ms, clock)

        class Recording(base):
            def compile(self, model, *, exclusive=True):
                runner = super().compile(model, exclusive=exclusive)
                runner.name, runner.closed = model.graph.name, False
                runners.append(runner)
                return runner

        monkeypatch.setitem(REGISTRY, ident, Recording)
    return runners


def _measured(clock):
    """The measured placement of cnn() over the fake providers, as `optimize` makes it in process."""
    a = analyze(cnn(), ["fake-conv", "fake-gemm"], sample=True)
    profiler = Profiler(clock=clock, warmup=1)

    def run_plan(choice):
        session = uhop_onnx.InferenceSession(build_plan(a, choice, None))
        return lambda: session.run(None, a.feeds)

    return a, Search(in_process(run_plan, profiler), profiler=profiler).place(a)


def test_the_measured_placement_is_typed_and_its_json_is_the_profile(clock, compiled):
    a, placement = _measured(clock)
    assert isinstance(placement, Placement) and placement.method == "measured"
    assert len(placement.choice) == len(a.graph.nodes) and set(placement.choice) <= {"fake-conv", "fake-gemm"}
    assert placement.plans[placement.chosen].choice == placement.choice
    report = placement.to_json()
    assert set(report) == PROFILE_KEYS and report["placement"] == "measured"
    assert set(report["candidates"]) == set(placement.plans) >= {"first-supported", "fake-gemm first"}
    assert all(set(c) >= {"ms", "spread", "rounds", "error", "stages"} for c in report["candidates"].values())
    assert [b["nodes"] for b in report["blocks"]] == [len(b.nodes) for b in placement.blocks]
    assert sum(b["nodes"] for b in report["blocks"]) == len(a.graph.nodes)
    conv = next(b for b in placement.blocks if a.graph.nodes[b.nodes[0]].op_type == "Conv")
    assert conv.ms["fake-conv"].ms < conv.ms["fake-gemm"].ms
    plan = uhop_onnx.optimize(cnn(), providers=["fake-conv", "fake-gemm"], profiler=Profiler(clock=clock, warmup=1))
    assert plan.profile.keys() == report.keys() and plan.profile["chosen"] == report["chosen"]
    for got, want in zip(plan.profile["blocks"], report["blocks"], strict=True):
        assert got["ms"] == pytest.approx(want["ms"]) and got | {"ms": None} == want | {"ms": None}


def test_typed_boundary_costs_are_what_the_fake_clock_charged(clock, compiled):
    """A pair's boundary is the second stage's figure right after the first, less the first's own: with a
    clock that charges each runner its call cost plus 0.01 ms for the probe's Relu, the boundary into a
    provider is exactly its own probe's cost, at every size class, and the plan's stages carry those figures."""
    a, placement = _measured(clock)
    classes = {b.boundary_bytes for b in placement.blocks}
    own = {"fake-conv": 0.5 + 0.01, "fake-gemm": 0.2 + 0.01}
    assert set(placement.boundaries) == {("fake-conv", "fake-gemm"), ("fake-gemm", "fake-conv")}
    for (before, after), by_size in placement.boundaries.items():
        assert set(by_size) == classes
        for size, figure in by_size.items():
            assert figure.ok and figure.ms == pytest.approx(own[after])
            assert placement.entries[before][size].ms == pytest.approx(own[before])
            assert placement.to_json()["boundary_ms"][f"{before}>{after}"][str(size)] == figure.ms
    stages = [(s.provider, [a.graph.nodes[i].name for i in s.nodes]) for s in partition(a.graph, placement.choice)]
    costs = placement.stage_costs(stages)
    assert len(stages) > 1 and costs[0].boundary_ms is None
    assert all(c.boundary_ms == pytest.approx(own[label]) for c, (label, _) in zip(costs[1:], stages[1:]))


def test_the_search_closes_every_runner_it_compiled(clock, compiled):
    _measured(clock)
    mine = [r for r in compiled if r.name.startswith("block_") or r.name == "entry"]
    assert mine and all(r.closed for r in mine)


def test_first_supported_measures_nothing():
    a = analyze(cnn(), ["openvino", "ort-cpu"])
    placement = FirstSupported().place(a)
    assert placement.method == "first-supported" and placement.to_json() is None
    assert placement.choice == tuple("openvino" for _ in a.graph.nodes)


@pytest.mark.parametrize("fast", ["ort-cpu", "openvino"])
def test_the_static_placer_chooses_by_the_profile_costs(fast):
    """Two providers that run every node: the one the target profile makes a hundred times faster gets the
    whole model, and the bundle's plan built from the choice runs and matches ONNX Runtime."""
    providers = [create("ort-cpu"), create("openvino")]
    a = analyze(cnn(), chosen=providers, sample=True)
    models = {p.label: TargetProvider(p.id, gflops=1000.0 if p.label == fast else 10.0, gbps=50.0, stage_ms=0.1)
              for p in providers}
    placement = StaticCost(models).place(a)
    assert placement.method == "static" and placement.to_json() is None
    assert set(placement.choice) == {fast}
    for block in placement.blocks:
        assert block.ms[fast].ms < min(m.ms for label, m in block.ms.items() if label != fast)
        assert all(m.rounds == 0 for m in block.ms.values()), "an estimate is not a measurement"
    model = cnn()
    plan = build_plan(a, placement.choice, None)
    feeds = random_feeds(model)
    assert_matches(uhop_onnx.InferenceSession(plan).run(None, feeds), reference(model, feeds))

