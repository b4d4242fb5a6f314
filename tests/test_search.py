"""The measured placement, made exact by providers that charge a fake clock for what they run."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import uhop_onnx
from uhop_onnx.models import cnn, mlp, resnet
from uhop_onnx.foundation.errors import MeasurementError
from uhop_onnx.partitioner.path import cheapest_path
from uhop_onnx.partitioner.search import _moves
from uhop_onnx.runtime.profiler import Measurement, Profiler
from uhop_onnx.runtime.profiler import faster as uhop_faster
from uhop_onnx.providers import REGISTRY

from .conftest import assert_matches, random_feeds, reference
from .support import FakeClock, fake_provider, install


@pytest.fixture
def clock():
    return FakeClock()


def optimize(model, clock, tmp_path, **kwargs):
    return uhop_onnx.optimize(model, providers=["fake-conv", "fake-gemm"], profiler=Profiler(clock=clock, warmup=1),
                              **kwargs)


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("UHOP_CACHE_DIR", str(tmp_path / "cache"))


def _singles(plan) -> dict[str, float]:
    return {name: c["ms"] for name, c in plan.profile["candidates"].items() if name.endswith(" first")}


def test_each_provider_gets_what_it_is_fast_at(monkeypatch, clock, tmp_path):
    install(monkeypatch, clock, conv={"Conv": 1.0, "Gemm": 20.0}, gemm={"Conv": 20.0, "Gemm": 1.0})
    model = cnn()
    plan = optimize(model, clock, tmp_path)
    placed = {node: s.provider for s in plan.stages for node in s.nodes}
    assert {placed[n.name] for n in model.graph.node if n.op_type == "Conv"} == {"fake-conv"}
    assert {placed[n.name] for n in model.graph.node if n.op_type == "Gemm"} == {"fake-gemm"}
    chosen = plan.profile["candidates"][plan.profile["chosen"]]["ms"]
    assert chosen < min(_singles(plan).values())
    feeds = random_feeds(model)
    assert_matches(uhop_onnx.InferenceSession(plan).run(None, feeds), reference(model, feeds))
    conv_stage = next(s for s in plan.stages if s.provider == "fake-conv")
    assert conv_stage.alternatives["fake-conv"] < conv_stage.alternatives["fake-gemm"]


def test_expensive_boundaries_keep_one_provider(monkeypatch, clock, tmp_path):
    install(monkeypatch, clock, conv={"Conv": 1.0, "Gemm": 1.5}, gemm={"Conv": 1.3, "Gemm": 1.0}, call_ms=50.0)
    plan = optimize(cnn(), clock, tmp_path)
    assert len(plan.stages) == 1
    assert plan.profile["candidates"][plan.profile["chosen"]]["ms"] <= min(_singles(plan).values())


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(costs=st.lists(st.floats(0.1, 10.0), min_size=4, max_size=4), call_ms=st.floats(0.0, 5.0))
def test_never_slower_than_the_best_single_provider(monkeypatch, tmp_path, costs, call_ms):
    clock = FakeClock()
    install(monkeypatch, clock, conv={"Gemm": costs[0], "MatMul": costs[1]},
            gemm={"Gemm": costs[2], "MatMul": costs[3]}, call_ms=call_ms)
    plan = optimize(mlp(), clock, tmp_path)
    assert plan.profile["candidates"][plan.profile["chosen"]]["ms"] <= min(_singles(plan).values())


def test_cache_hits_and_invalidation(monkeypatch, clock, tmp_path):
    install(monkeypatch, clock, conv={"Conv": 1.0}, gemm={"Gemm": 1.0})
    first = optimize(cnn(), clock, tmp_path)
    assert first.profile["measured"] > 0 and first.profile["cached"] == 0
    again = optimize(cnn(), clock, tmp_path)
    assert again.profile["measured"] == 0 and again.profile["cached"] == first.profile["measured"]
    assert [s.nodes for s in again.stages] == [s.nodes for s in first.stages]
    other_threads = optimize(cnn(), clock, tmp_path, threads=1)
    assert other_threads.profile["cached"] == 0
    monkeypatch.setitem(REGISTRY, "fake-gemm", fake_provider("fake-gemm", {"Gemm": 1.0}, 0.05, clock, version="2"))
    new_version = optimize(cnn(), clock, tmp_path)
    assert 0 < new_version.profile["measured"] < first.profile["measured"]
    assert new_version.profile["cached"] > 0, "figures of the unchanged provider are still used"


def test_explain_shows_alternatives_and_boundaries(monkeypatch, clock, tmp_path):
    from typer.testing import CliRunner

    from uhop_onnx.cli import app

    install(monkeypatch, clock, conv={"Conv": 1.0, "Gemm": 20.0}, gemm={"Conv": 20.0, "Gemm": 1.0})
    plan = optimize(cnn(), clock, tmp_path)
    plan.save(tmp_path / "plan")
    assert (tmp_path / "plan" / "report.md").is_file()
    assert (tmp_path / "plan" / "graph.dot").is_file()
    result = CliRunner().invoke(app, ["explain", str(tmp_path / "plan")], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "fake-gemm" in result.output and "boundary" in result.output


def test_an_entry_figure_above_every_block_does_not_make_blocks_free():
    """Provider 1's probe stage cost more than any of its blocks (the probe did work): its blocks still
    cost what they measured, so the cheaper provider 0 keeps them."""
    ms = lambda x: Measurement(x, 0.0, 5)  # noqa: E731
    costs = [{0: ms(0.04), 1: ms(0.07)}, {0: ms(0.11), 1: ms(0.21)}, {0: ms(0.13), 1: ms(0.31)}]
    assert cheapest_path([[0, 1]] * 3, costs, [{0: ms(0.04), 1: ms(0.3)}] * 3) == [0, 0, 0]


def test_a_dear_boundary_between_two_providers_keeps_one():
    """Entering provider 1 costs 1 ms from the host but 5 ms right after provider 0 (say, a layout change):
    the path stays on provider 0, which it leaves when the pair's boundary is cheap."""
    ms = lambda x: Measurement(x, 0.0, 5)  # noqa: E731
    costs = [{0: ms(1.0), 1: ms(5.0)}, {0: ms(5.0), 1: ms(1.2)}]
    entry = [{0: ms(1.0), 1: ms(1.0)}] * 2
    assert cheapest_path([[0, 1]] * 2, costs, entry, [{(0, 1): ms(5.0), (1, 0): ms(1.0)}] * 2) == [0, 0]
    assert cheapest_path([[0, 1]] * 2, costs, entry, [{(0, 1): ms(0.5), (1, 0): ms(1.0)}] * 2) == [0, 1]


def test_a_boundary_costs_what_its_size_class_costs():
    """The same pair is dear for a wide tensor (block 1) and cheap for a narrow one (block 2): the path
    stays on provider 0 across the wide cut and leaves it at the narrow one."""
    ms = lambda x: Measurement(x, 0.0, 5)  # noqa: E731
    costs = [{0: ms(1.0), 1: ms(5.0)}, {0: ms(3.0), 1: ms(2.0)}, {0: ms(5.0), 1: ms(2.0)}]
    entry = [{0: ms(0.5), 1: ms(0.5)}] * 3
    wide, narrow = {(0, 1): ms(4.0), (1, 0): ms(4.0)}, {(0, 1): ms(0.1), (1, 0): ms(0.1)}
    assert cheapest_path([[0, 1]] * 3, costs, entry, [narrow, wide, narrow]) == [0, 0, 1]


def test_local_moves_try_merges_first_then_other_providers():
    """Runs [0 0] [1] [0]: the middle run merges into provider 0 first; then each run goes to any other
    provider that runs all of its blocks (block 3 runs only on 0, so the last run stays)."""
    allowed = [[0, 1, 2], [0, 1, 2], [0, 1, 2], [0]]
    moves = _moves([0, 0, 1, 0], allowed)
    assert moves[:2] == [[1, 1, 1, 0], [0, 0, 0, 0]]  # the merges: first run into 1, middle run into 0
    assert sorted(moves[2:]) == [[0, 0, 2, 0], [2, 2, 1, 0]]


def test_boundaries_are_measured_per_provider_pair(monkeypatch, clock, tmp_path):
    install(monkeypatch, clock, conv={"Conv": 1.0, "Gemm": 20.0}, gemm={"Conv": 20.0, "Gemm": 1.0})
    plan = optimize(cnn(), clock, tmp_path)
    pairs = plan.profile["boundary_ms"]
    assert {"fake-conv>fake-gemm", "fake-gemm>fake-conv"} <= set(pairs)
    classes = {b["boundary_bytes"] for b in plan.profile["blocks"]}
    assert all(set(by_size) == {str(c) for c in classes} for by_size in pairs.values())
    first_block = {b["first"]: b for b in plan.profile["blocks"]}
    for before, stage in zip(plan.stages, plan.stages[1:]):
        size = first_block[stage.nodes[0]]["boundary_bytes"]
        assert stage.boundary_ms == pairs[f"{before.provider}>{stage.provider}"][str(size)]


def _has(op: str) -> Callable[[onnx.ModelProto], bool]:
    return lambda model: any(n.op_type == op for n in model.graph.node)


def test_a_failed_measurement_is_never_a_winner(monkeypatch, clock, tmp_path):
    """fake-gemm would be the fastest at everything, but raises on every stage with a Conv: its blocks with
    a Conv are recorded as its failures, no stage with a Conv lands on it, and its own plan (everything on
    it) failed, so it is not chosen."""
    install(monkeypatch, clock, conv={"Conv": 5.0, "Gemm": 5.0}, gemm={"Conv": 1.0, "Gemm": 1.0})
    monkeypatch.setitem(REGISTRY, "fake-gemm", fake_provider("fake-gemm", {"Conv": 1.0, "Gemm": 1.0}, 0.05, clock,
                                                               fails=_has("Conv")))
    model = cnn()
    plan = optimize(model, clock, tmp_path)
    report = plan.profile
    assert report["candidates"][report["chosen"]]["error"] is None
    failed = report["candidates"]["fake-gemm first"]
    assert failed["ms"] is None and failed["rounds"] == 0 and "fake-gemm cannot run" in failed["error"]
    assert "fake-gemm" in failed["error"].split(" failed:")[0], "the error names the stage's provider"
    blocks = [f for f in report["failures"] if f["kind"] == "block"]
    assert blocks and {f["on"] for f in blocks} == {"fake-gemm"}
    assert all(f["error"].startswith("fake-gemm: fake-gemm cannot run") for f in blocks)
    placed = {node: s.provider for s in plan.stages for node in s.nodes}
    assert {placed[n.name] for n in model.graph.node if n.op_type == "Conv"} == {"fake-conv"}
    assert any(p == "fake-gemm" for p in placed.values()), "it still gets the Gemm it is fast at"
    feeds = random_feeds(model)
    assert_matches(uhop_onnx.InferenceSession(plan).run(None, feeds), reference(model, feeds))


def test_a_block_that_cannot_be_fed_blames_the_provider_that_failed(monkeypatch, clock, tmp_path):
    """fake-conv, the first provider, raises on every stage: the sample values the later blocks need come
    from the next provider that runs the earlier blocks, so no figure of fake-gemm is lost to it and no
    failure is reported against fake-gemm or the last resort."""
    install(monkeypatch, clock, conv={}, gemm={"Conv": 1.0, "Gemm": 1.0})
    monkeypatch.setitem(REGISTRY, "fake-conv", fake_provider("fake-conv", {}, 0.05, clock, fails=lambda m: True))
    plan = optimize(cnn(), clock, tmp_path)
    report = plan.profile
    assert {f["error"].split(":")[0] for f in report["failures"]} == {"fake-conv"}
    assert {f["on"] for f in report["failures"] if f["kind"] == "block"} == {"fake-conv"}
    assert not [f for f in report["failures"] if f["kind"] == "pair"], "crossings are timed only between " \
        "providers that ran blocks"
    assert all("fake-gemm" in b["ms"] for b in report["blocks"])
    assert {s.provider for s in plan.stages} == {"fake-gemm"}


def _branches() -> onnx.ModelProto:
    """Two branches from one input, joined at the end: blocks a1, a2, b1, b2, sum, in that order."""
    from onnx import TensorProto, helper

    v = lambda name: helper.make_tensor_value_info(name, TensorProto.FLOAT, [4])  # noqa: E731
    nodes = [helper.make_node("Abs", ["x"], ["a1"], name="a1"), helper.make_node("Neg", ["a1"], ["a2"], name="a2"),
             helper.make_node("Exp", ["x"], ["b1"], name="b1"), helper.make_node("Neg", ["b1"], ["b2"], name="b2"),
             helper.make_node("Sum", ["a2", "b2"], ["y"], name="sum")]
    return helper.make_model(helper.make_graph(nodes, "branches", [v("x")], [v("y")]),
                             opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def test_a_block_that_fails_everywhere_leaves_only_its_dependents_unmeasured(monkeypatch, clock, tmp_path):
    """Block a1 fails on every provider: a2 and sum, which need its outputs, are not measured (the error says
    why), while the other branch's blocks after it are measured on both providers; the plan is still made."""
    install(monkeypatch, clock, conv={}, gemm={})
    for ident in ("fake-conv", "fake-gemm"):
        monkeypatch.setitem(REGISTRY, ident, fake_provider(ident, {}, 0.05, clock,
                                                           fails=lambda m: m.graph.name == "block_0"))
    model = _branches()
    plan = optimize(model, clock, tmp_path)
    blocks = {b["first"]: b for b in plan.profile["blocks"]}
    assert set(blocks) == {"a1", "a2", "b1", "b2", "sum"}
    assert {first for first, b in blocks.items() if set(b["ms"]) == {"fake-conv", "fake-gemm"}} == {"b1", "b2"}
    assert not blocks["a1"]["ms"] and not blocks["a2"]["ms"] and not blocks["sum"]["ms"]
    errors = [f["error"] for f in plan.profile["failures"] if f["kind"] == "block"]
    assert sum("no sample values for block 1; block 0 failed on every provider: " in e for e in errors) == 2
    feeds = {"x": np.linspace(-2, 2, 4, dtype=np.float32)}
    assert_matches(uhop_onnx.InferenceSession(plan).run(None, feeds), reference(model, feeds))


def test_failed_entries_and_boundaries_are_failures_not_free(monkeypatch, clock, tmp_path):
    """fake-gemm cannot run the probe stage (the one-Relu entry model): its entry and every pair it is in
    are recorded as failures, and no boundary figure (least of all a zero one) is made of them."""
    install(monkeypatch, clock, conv={"Conv": 1.0, "Gemm": 20.0}, gemm={"Conv": 20.0, "Gemm": 1.0})
    monkeypatch.setitem(REGISTRY, "fake-gemm", fake_provider("fake-gemm", {"Conv": 20.0, "Gemm": 1.0}, 0.05, clock,
                                                               fails=lambda m: m.graph.name == "entry"))
    model = cnn()
    plan = optimize(model, clock, tmp_path)
    report = plan.profile
    kinds = {(f["kind"], f["on"]) for f in report["failures"]}
    assert {("entry", "fake-gemm"), ("pair", "fake-conv>fake-gemm"), ("pair", "fake-gemm>fake-conv")} <= kinds
    assert "fake-gemm" not in report["entry_ms"]
    assert not [pair for pair in report["boundary_ms"] if "fake-gemm" in pair]
    assert "fake-gemm" in {s.provider for s in plan.stages}, "its blocks were measured, and it is fast at Gemm"
    feeds = random_feeds(model)
    assert_matches(uhop_onnx.InferenceSession(plan).run(None, feeds), reference(model, feeds))


def test_every_candidate_failing_raises_with_each_error(monkeypatch, clock, tmp_path):
    install(monkeypatch, clock, conv={}, gemm={})
    for ident in ("fake-conv", "fake-gemm", "ort-cpu"):
        monkeypatch.setitem(REGISTRY, ident, fake_provider(ident, {}, 0.05, clock, fails=_has("Gemm")))
    with pytest.raises(MeasurementError) as raised:
        optimize(cnn(), clock, tmp_path)
    message = str(raised.value)
    assert raised.value.exit_code == 1
    for candidate in ("first-supported", "fake-gemm first"):
        assert f"\n  {candidate} (" in message
    assert "(fake-gemm, " in message and "fake-gemm cannot run" in message


def test_a_missing_entry_figure_takes_nothing_off():
    """Provider 1's entry was not measured: its blocks cost their whole figure, so the consecutive blocks
    where it is a little cheaper (0.9 against 1.0, with 0.5 of entry) stay on provider 0."""
    ms = lambda x: Measurement(x, 0.0, 5)  # noqa: E731
    costs = [{0: ms(1.0), 1: ms(0.9)}] * 3
    assert cheapest_path([[0, 1]] * 3, costs, [{0: ms(0.5)}] * 3) == [0, 0, 0]
    assert cheapest_path([[0, 1]] * 3, costs, [{0: ms(0.5), 1: ms(0.5)}] * 3) == [1, 1, 1]


def test_the_profiler_records_a_call_that_raises_as_a_failure(clock):
    calls = {"n": 0}

    def flaky():
        calls["n"] += 1
        clock.now += 0.001
        if calls["n"] > 4:
            raise RuntimeError("Exception from src/inference/src/cpp/infer_request.cpp:224:\n[CPU] it broke")

    def steady():
        clock.now += 0.002

    figures = Profiler(clock=clock, warmup=1, max_calls=1).measure({"flaky": flaky, "steady": steady})
    assert not figures["flaky"].ok and figures["flaky"].error == "[CPU] it broke"
    assert figures["steady"].ok and figures["steady"].ms == pytest.approx(2.0)


def _placed(plan) -> dict[str, str]:
    return {node: s.provider for s in plan.stages for node in s.nodes}


def test_a_provider_list_keeps_every_node_it_runs(monkeypatch, clock, tmp_path):
    """The last resort is far faster at everything, but was not listed: every node stays on fake-conv, and no
    candidate, block figure or move puts one on ort-cpu. Listed, ort-cpu competes and wins."""
    install(monkeypatch, clock, conv={"Conv": 5.0, "Gemm": 5.0}, gemm={})
    monkeypatch.setitem(REGISTRY, "ort-cpu", fake_provider("ort-cpu", {"Conv": 0.1, "Gemm": 0.1}, 0.01, clock))
    profiler = Profiler(clock=clock, warmup=1)
    model = cnn()
    plan = uhop_onnx.optimize(model, providers=["fake-conv"], profiler=profiler)
    assert set(_placed(plan).values()) == {"fake-conv"}
    assert all("ort-cpu" not in c["stages"] for c in plan.profile["candidates"].values())
    assert all(set(b["ms"]) == {"fake-conv"} for b in plan.profile["blocks"])
    feeds = random_feeds(model)
    assert_matches(uhop_onnx.InferenceSession(plan).run(None, feeds), reference(model, feeds))
    listed = uhop_onnx.optimize(model, providers=["fake-conv", "ort-cpu"], profiler=profiler)
    assert set(_placed(listed).values()) == {"ort-cpu"}


def test_the_unlisted_last_resort_takes_only_what_no_listed_provider_runs(monkeypatch, clock, tmp_path):
    """fake-conv has no Gemm: the Gemm goes to ort-cpu, the fastest at everything; every other node stays on
    fake-conv, in a measured placement and without one; a node assigned to ort-cpu goes there."""
    install(monkeypatch, clock, conv={"Conv": 5.0}, gemm={})
    monkeypatch.setitem(REGISTRY, "fake-conv", fake_provider("fake-conv", {"Conv": 5.0}, 0.05, clock,
                                                               refuses=frozenset({"Gemm"})))
    monkeypatch.setitem(REGISTRY, "ort-cpu", fake_provider("ort-cpu", {"Conv": 0.1, "Gemm": 0.1}, 0.01, clock))
    model = cnn()
    ops = {n.name: n.op_type for n in model.graph.node}
    conv = next(name for name, op in ops.items() if op == "Conv")
    for plan in (uhop_onnx.optimize(model, providers=["fake-conv"], profiler=Profiler(clock=clock, warmup=1)),
                 uhop_onnx.optimize(model, providers=["fake-conv"], profile=False)):
        placed = _placed(plan)
        assert {placed[n] for n, op in ops.items() if op == "Gemm"} == {"ort-cpu"}
        assert {p for n, p in placed.items() if ops[n] != "Gemm"} == {"fake-conv"}
    assigned = uhop_onnx.optimize(model, providers=["fake-conv"], assign={conv: "ort-cpu"},
                                  profiler=Profiler(clock=clock, warmup=1))
    assert _placed(assigned)[conv] == "ort-cpu"


def test_inspect_says_why_the_unlisted_last_resort_does_not_take_a_node():
    from uhop_onnx.products.optimizer import analyze

    a = analyze(cnn(), ["kernels"])
    last = a.support["ort-cpu"]
    conv = next(n.name for n in a.graph.nodes if n.op_type == "Conv")
    assert not last[conv].ok and last[conv].source == "list" and "(kernels)" in last[conv].reason
    assert all(s.ok for s in analyze(cnn(), ["kernels", "ort-cpu"]).support["ort-cpu"].values())


@pytest.mark.slow
@pytest.mark.parametrize("provider, model", [("litert", resnet), ("kernels", lambda: matmul(1024))])
def test_a_listed_provider_that_runs_every_node_keeps_them_all(provider, model):
    """Real runtimes, timed for real (one round): a ResNet on LiteRT and a 1024 MatMul on our kernels stay
    whole on the listed provider, and match ONNX Runtime."""
    if not REGISTRY[provider]().present:
        pytest.skip(f"{provider} is not present here")
    model = model()
    plan = uhop_onnx.optimize(model, providers=[provider], profiler=Profiler(rounds=1, max_rounds=1, warmup=1),
                              budget=0)
    assert [s.provider for s in plan.stages] == [provider]
    feeds = random_feeds(model)
    assert_matches(uhop_onnx.InferenceSession(plan).run(None, feeds), reference(model, feeds))


def matmul(size: int) -> onnx.ModelProto:
    from onnx import TensorProto, helper, numpy_helper

    w = numpy_helper.from_array(np.random.default_rng(0).standard_normal((size, size)).astype(np.float32), "w")
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"], name="matmul")], "matmul",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [size, size])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [size, size])], [w])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("profile", [True, False])
def test_a_stage_that_fails_its_build_check_is_re_placed(monkeypatch, clock, tmp_path, profile):
    """fake-conv is preferred for everything, but what it builds of a Gemm fails its check: the Gemm nodes go
    to fake-gemm, the next provider that runs them, with or without measuring; the plan says why, in
    plan.json, report.md and explain."""
    from typer.testing import CliRunner

    from uhop_onnx.cli import app

    install(monkeypatch, clock, conv={"Conv": 1.0, "Gemm": 1.0}, gemm={"Conv": 20.0, "Gemm": 20.0})
    monkeypatch.setitem(REGISTRY, "fake-conv", fake_provider("fake-conv", {"Conv": 1.0, "Gemm": 1.0}, 0.05, clock,
                                                               miscompiles=frozenset({"Gemm"})))
    model = cnn()
    plan = optimize(model, clock, tmp_path, profile=profile)
    placed = _placed(plan)
    gemms = [n.name for n in model.graph.node if n.op_type == "Gemm"]
    assert {placed[n] for n in gemms} == {"fake-gemm"}
    assert {placed[n.name] for n in model.graph.node if n.op_type == "Conv"} == {"fake-conv"}
    assert [(r["node"], r["provider"]) for r in plan.replaced] == [(n, "fake-conv") for n in gemms]
    assert all(r["reason"].startswith("fails the build check: fake-conv: the built stage differs")
               for r in plan.replaced)
    feeds = random_feeds(model)
    assert_matches(uhop_onnx.InferenceSession(plan).run(None, feeds), reference(model, feeds))
    plan.save(tmp_path / "plan")
    assert uhop_onnx.Plan.load(tmp_path / "plan").replaced == plan.replaced
    assert "Re-placed after a failed build check" in (tmp_path / "plan" / "report.md").read_text()
    shown = CliRunner().invoke(app, ["explain", str(tmp_path / "plan")], env={"COLUMNS": "200"})
    assert shown.exit_code == 0 and f"re-placed {gemms[0]}: fake-conv failed its build check, now on fake-gemm" \
        in shown.output


def test_a_node_that_fails_the_check_of_a_listed_provider_may_go_to_the_last_resort(monkeypatch, clock, tmp_path):
    """Only fake-conv is listed, and its check fails on Gemm: no listed provider runs the Gemm any more, so
    the unlisted last resort takes it, and only it."""
    install(monkeypatch, clock, conv={}, gemm={})
    monkeypatch.setitem(REGISTRY, "fake-conv", fake_provider("fake-conv", {}, 0.05, clock,
                                                               miscompiles=frozenset({"Gemm"})))
    model = cnn()
    placed = _placed(uhop_onnx.optimize(model, providers=["fake-conv"], profiler=Profiler(clock=clock, warmup=1)))
    assert {n.op_type for n in model.graph.node if placed[n.name] == "ort-cpu"} == {"Gemm"}


def test_a_plan_within_noise_of_the_simplest_is_not_preferred(monkeypatch, clock, tmp_path):
    """Without a cost to enter a stage, each provider is a little faster at one op: the searched mix is cheaper by
    its figures, but by less than the noise margin, so the one-stage plan is kept."""
    install(monkeypatch, clock, conv={"Conv": 0.99, "Gemm": 1.0, "Relu": 0.0},
            gemm={"Conv": 1.0, "Gemm": 0.99, "Relu": 0.0}, call_ms=0.0)
    plan = optimize(cnn(), clock, tmp_path)
    candidates = plan.profile["candidates"]
    assert candidates["searched"]["stages"].count(" > ") > 0
    assert candidates["searched"]["ms"] < candidates[plan.profile["chosen"]]["ms"]
    assert len(plan.stages) == 1


def test_a_plan_of_more_stages_than_a_whole_plan_is_timed_with_is_recorded_untimed(monkeypatch, clock, tmp_path):
    """Past `WHOLE_STAGES`, the searched mix (each provider at what it is fast at) is not timed whole: the report
    says so with its stage count, and a plan of fewer stages is chosen, timed."""
    from uhop_onnx.partitioner import search

    install(monkeypatch, clock, conv={"Conv": 1.0, "Gemm": 20.0}, gemm={"Conv": 20.0, "Gemm": 1.0})
    monkeypatch.setattr(search, "WHOLE_STAGES", 1)
    plan = optimize(cnn(), clock, tmp_path)
    candidates = plan.profile["candidates"]
    assert candidates["searched"]["ms"] is None
    assert candidates["searched"]["error"].startswith("not timed: 2 stages, over the 1 a whole plan is timed with")
    assert len(plan.stages) == 1 and candidates[plan.profile["chosen"]]["ms"] is not None
    assert all(c["stages"].count(" > ") == 0 for c in candidates.values() if c["ms"] is not None)


def test_faster_compares_round_by_round():
    def figure(*medians):
        return Measurement(min(medians), (max(medians) - min(medians)) / min(medians), len(medians),
                           medians=medians)

    simple = figure(10.0, 10.2, 10.1, 13.0, 10.0)
    assert not uhop_faster(figure(9.9, 10.3, 9.8, 12.0, 9.95), simple), "one round slower: within the noise"
    assert uhop_faster(figure(9.0, 9.1, 9.0, 11.5, 9.0), simple), "a slow round slows both alike"
    assert uhop_faster(figure(9.0, 9.1, 10.5, 11.5, 9.0), simple), "one outlier round of five forgiven"
    assert not uhop_faster(figure(9.0, 10.5, 10.5, 11.5, 9.0), simple), "two are not"
    assert not uhop_faster(figure(9.0, 10.5, 9.0), figure(10.0, 10.2, 10.1)), "nor one of three"
    assert not uhop_faster(Measurement(9.0, 0.3, 5), Measurement(10.0, 0.3, 5)), "apart: beyond the larger spread"
    assert uhop_faster(Measurement(9.0, 0.05, 5), Measurement(10.0, 0.05, 5))


def test_with_no_time_left_the_search_keeps_a_whole_plan(monkeypatch, clock, tmp_path):
    """At budget 0 only each provider's own plan is timed (one round each): a one-stage plan is chosen, no
    block is measured, and the profile says the search stopped at its budget."""
    install(monkeypatch, clock, conv={"Conv": 1.0, "Gemm": 20.0}, gemm={"Conv": 20.0, "Gemm": 1.0})
    plan = optimize(cnn(), clock, tmp_path, budget=0)
    assert len(plan.stages) == 1 and plan.profile["complete"] is False
    assert plan.profile["measured"] == 0 and not any(b["ms"] for b in plan.profile["blocks"])
    assert "searched" not in plan.profile["candidates"]


@pytest.mark.slow
def test_the_budget_bounds_the_whole_call():
    """Real providers and clock, a cold cache: optimize(budget=5) returns well within three times the budget
    (it aims at 5 s plus the measurement under way) with a plan that runs."""
    import time

    model = resnet()
    started = time.monotonic()
    plan = uhop_onnx.optimize(model, budget=5)
    assert time.monotonic() - started < 15
    assert plan.profile["budget_s"] == 5
    feeds = random_feeds(model)
    assert_matches(uhop_onnx.InferenceSession(plan).run(None, feeds), reference(model, feeds))
