"""Providers that fail at run time: the error names the stage and provider; `fallback=True` re-runs the stage
on ort-cpu for that call only, warns once per stage, counts it in `plan.fallbacks` (in memory), and an
explicit `plan.save` (and `explain`) records the counts; `run` never writes to disk.

The failing provider is a real `Provider`: it computes its stage with onnx's reference evaluator, then
raises or returns a wrong shape, as a broken device or driver would. It is registered for each test only.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, ClassVar

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from uhop_onnx import InferenceSession, StageError
from uhop_onnx.providers import REGISTRY, Provider, Runner
from uhop_onnx.providers.capability import CapabilityTable, OpRule

from .conftest import assert_matches, reference
from .support import count_closes


class FaultyRunner(Runner):
    """Computes the stage correctly, then fails the way `mode` says ("flaky": every other call)."""

    def __init__(self, model: onnx.ModelProto, mode: str):
        from onnx.reference import ReferenceEvaluator

        self.evaluator = ReferenceEvaluator(model)
        self.outputs = [o.name for o in model.graph.output]
        self.mode = mode
        self.calls = 0

    def run(self, feeds: Mapping[str, Any]) -> dict[str, Any]:
        results = dict(zip(self.outputs, self.evaluator.run(None, dict(feeds))))
        self.calls += 1
        if self.mode == "flaky" and self.calls % 2 == 0:
            return results
        if self.mode in ("raise", "flaky"):
            raise RuntimeError("device lost while running the stage")
        return {name: value[..., None] for name, value in results.items()}  # one axis too many


class Faulty(Provider):
    """Runs Relu and Sigmoid, and fails at run time."""

    id = "faulty"
    install = "nothing to install"
    table = CapabilityTable(provider="faulty", rules=(OpRule("Relu"), OpRule("Sigmoid")),
                            dtypes=frozenset({"float"}), domains={"": (7, 28)})
    mode: ClassVar[str] = "raise"

    def probe(self) -> tuple[str, str]:
        return "1.0", "cpu"

    def compile(self, model: onnx.ModelProto, *, exclusive: bool = True) -> Runner:
        return FaultyRunner(model, self.mode)


@pytest.fixture(params=["raise", "wrong-shape"])
def faulty(request, monkeypatch):
    monkeypatch.setitem(REGISTRY, Faulty.id, Faulty)
    monkeypatch.setattr(Faulty, "mode", request.param)
    return request.param


def chain() -> onnx.ModelProto:
    """x -> Relu (faulty) -> Neg (ort-cpu) -> Sigmoid (faulty) -> y: three stages."""
    nodes = [helper.make_node("Relu", ["x"], ["a"], name="relu"), helper.make_node("Neg", ["a"], ["b"], name="neg"),
             helper.make_node("Sigmoid", ["b"], ["y"], name="sigmoid")]
    graph = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


FEEDS = {"x": np.linspace(-1, 1, 6, dtype=np.float32).reshape(2, 3)}


def test_the_plan_uses_the_faulty_provider(faulty):
    session = InferenceSession(chain(), providers=["faulty"], profile=False)
    assert [(s.provider, s.nodes) for s in session.plan.stages] == [
        ("faulty", ["relu"]), ("ort-cpu", ["neg"]), ("faulty", ["sigmoid"])]


def test_failure_names_the_stage_and_provider(faulty):
    session = InferenceSession(chain(), providers=["faulty"], profile=False)
    with pytest.raises(StageError, match=r"stage 0 \(faulty\b.*relu") as raised:
        session.run(None, FEEDS)
    assert raised.value.stage == 0
    expected = "device lost" if faulty == "raise" else r"shape \[2, 3, 1\], expected \[2, 3\]"
    assert raised.match(expected)
    assert session.plan.fallbacks == {}


def test_stage_error_provider_is_the_provider_id(faulty):
    session = InferenceSession(chain(), providers=["faulty"], profile=False)
    with pytest.raises(StageError) as raised:
        session.run(None, FEEDS)
    assert raised.value.provider == "faulty"


def test_fallback_reruns_on_ort_cpu_warns_once_per_stage_and_counts_it(faulty, tmp_path):
    session = InferenceSession(chain(), providers=["faulty"], profile=False, fallback=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = session.run(None, FEEDS)
        second = session.run(None, FEEDS)
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(messages) == 2, messages  # one per failing stage, not one per call
    assert "stage 0" in messages[0] and "faulty" in messages[0] and "ort-cpu" in messages[0]
    assert "stage 2" in messages[1]
    assert all(w.filename == __file__ for w in caught)  # pointed at the caller's line
    expected = reference(chain(), FEEDS)
    assert_matches(first, expected)
    assert_matches(second, expected)
    assert sorted(session.plan.fallbacks) == [0, 2]
    assert {k: (v["provider"], v["count"]) for k, v in session.plan.fallbacks.items()} == {
        0: ("ort-cpu", 2), 2: ("ort-cpu", 2)}
    assert ("device lost" if faulty == "raise" else "shape") in session.plan.fallbacks[0]["last_error"]
    assert session.get_providers() == ["faulty", "ort-cpu"]  # where the plan placed its stages
    assert [s.provider for s in session.plan.stages] == ["faulty", "ort-cpu", "faulty"]

    folder = session.plan.save(tmp_path / "plan")
    saved = json.loads((folder / "plan.json").read_text())["fallbacks"]
    assert {k: v["count"] for k, v in saved.items()} == {"0": 2, "2": 2}
    shown = subprocess.run([sys.executable, "-m", "uhop_onnx.cli", "explain", str(folder)], capture_output=True,
                           text=True, timeout=300, check=False, env={**os.environ, "COLUMNS": "250"})
    assert shown.returncode == 0, shown.stderr
    assert "fell back to ort-cpu 2 times" in shown.stdout


def test_fallback_is_per_call_not_sticky(monkeypatch):
    """A stage that fails every other call runs on its own provider again once it works."""
    monkeypatch.setitem(REGISTRY, Faulty.id, Faulty)
    monkeypatch.setattr(Faulty, "mode", "flaky")
    session = InferenceSession(chain(), providers=["faulty"], profile=False, fallback=True)
    with pytest.warns(RuntimeWarning):
        for _ in range(4):
            assert_matches(session.run(None, FEEDS), reference(chain(), FEEDS))
    runner = session._executor.runners[0]
    assert isinstance(runner, FaultyRunner) and runner.calls == 4  # tried on its own provider every call
    assert session.plan.fallbacks[0]["count"] == 2


def test_run_writes_nothing_and_a_read_only_plan_folder_still_runs(faulty, tmp_path):
    folder = InferenceSession(chain(), providers=["faulty"], profile=False).plan.save(tmp_path / "plan")
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    for path in (*folder.iterdir(), folder):
        path.chmod(0o555 if path.is_dir() else 0o444)
    try:
        session = InferenceSession(folder, fallback=True)
        with pytest.warns(RuntimeWarning, match="re-running it on ort-cpu"):
            assert_matches(session.run(None, FEEDS), reference(chain(), FEEDS))
        assert session.plan.fallbacks[0]["count"] == 1
    finally:
        folder.chmod(0o755)
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before
    # Loaded again, the plan runs on its own providers: the stage fails and is re-run again.
    with pytest.warns(RuntimeWarning, match="re-running it on ort-cpu"):
        InferenceSession(folder, fallback=True).run(None, FEEDS)


def test_fallback_from_many_threads_counts_every_call(monkeypatch):
    """The last resort is compiled once, under a lock, and every call's fallback is counted."""
    monkeypatch.setitem(REGISTRY, Faulty.id, Faulty)
    session = InferenceSession(chain(), providers=["faulty"], profile=False, fallback=True)
    expected = reference(chain(), FEEDS)

    def calls(_):
        for _ in range(25):
            assert_matches(session.run(None, FEEDS), expected)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(calls, range(8)))
    assert len([w for w in caught if issubclass(w.category, RuntimeWarning)]) == 2
    assert {k: v["count"] for k, v in session.plan.fallbacks.items()} == {0: 200, 2: 200}
    assert sorted(session._executor.on_failure.runners) == [0, 2]


def test_fallback_is_off_by_default(faulty):
    with pytest.raises(StageError):
        InferenceSession(chain(), providers=["faulty"], profile=False).run(None, FEEDS)


def test_a_failing_last_resort_is_not_retried(monkeypatch):
    """ort-cpu failing at run time (a Reshape to an impossible shape) is reported, even with fallback."""
    nodes = [helper.make_node("Reshape", ["x", "shape"], ["y"], name="reshape")]
    graph = helper.make_graph(nodes, "bad", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n"]),
                                             helper.make_tensor_value_info("shape", TensorProto.INT64, [1])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["m"])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    session = InferenceSession(model, providers=["ort-cpu"], profile=False, fallback=True)
    with pytest.raises(StageError, match=r"stage 0 \(ort-cpu") as raised:
        session.run(None, {"x": np.ones(6, np.float32), "shape": np.array([4], np.int64)})
    assert raised.value.stage == 0


def test_a_stage_that_fails_on_ort_cpu_too_names_both_failures(monkeypatch):
    """Relu on the faulty provider, given an input ort-cpu refuses too (a feed of the wrong rank for the stage)."""
    monkeypatch.setitem(REGISTRY, Faulty.id, Faulty)
    session = InferenceSession(chain(), providers=["faulty"], profile=False, fallback=True)
    monkeypatch.setattr(session._executor, "_check_feeds", lambda feeds: dict(feeds))  # let a bad shape through
    with pytest.warns(RuntimeWarning), pytest.raises(StageError, match=r"stage 0 .*device lost.*re-run on ort-cpu"):
        session.run(None, {"x": np.ones((2, 3, 4), np.float32)})


def test_closing_a_session_closes_every_runner_it_compiled(monkeypatch):
    """The stages' runners and the last resort's compiled on failure are closed with the session."""
    monkeypatch.setitem(REGISTRY, Faulty.id, Faulty)
    closed: list[Runner] = []
    count_closes(monkeypatch, closed)
    session = InferenceSession(chain(), providers=["faulty"], profile=False, fallback=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        session.run(None, FEEDS)
    compiled = [*session._executor.runners, *session._executor.on_failure.runners.values()]
    assert len(compiled) == 5 and not closed
    session.close()
    assert sorted(map(id, closed)) == sorted(map(id, compiled))
    session.close()  # a second close does nothing
    assert len(closed) == 5


def test_stages_compiled_before_one_that_cannot_be_are_closed(monkeypatch):
    monkeypatch.setitem(REGISTRY, Faulty.id, Faulty)
    closed: list[Runner] = []
    count_closes(monkeypatch, closed)
    refuse = Faulty.compile

    def compile(self, model, *, exclusive=True):
        if model.graph.node[0].op_type == "Sigmoid":
            raise RuntimeError("no memory left on the device")
        return refuse(self, model, exclusive=exclusive)

    monkeypatch.setattr(Faulty, "compile", compile)
    with pytest.raises(StageError, match=r"stage 2 \(faulty, 1 nodes from 'sigmoid'\) could not be compiled"):
        InferenceSession(chain(), providers=["faulty"], profile=False)
    assert len(closed) == 2  # the faulty Relu stage and the ort-cpu Neg stage
