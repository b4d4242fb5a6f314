"""A runtime that crashes natively during a search costs the block it was building, not
the process; and what a search cannot fit in this host's memory is refused, named, before it is allocated.
"""

from __future__ import annotations

import ctypes
import logging
import os

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import uhop_onnx
from uhop_onnx import InputError, MeasurementError
from uhop_onnx.foundation.errors import TooLargeError
from uhop_onnx.runtime.measure import Measurement, Profiler, SearchWorker
from uhop_onnx.models import mlp
from uhop_onnx.products.optimizer import analyze
from uhop_onnx.partitioner.search import Search
from uhop_onnx.providers import REGISTRY
from uhop_onnx.providers.ort import OrtCpu
from uhop_onnx.foundation.samples import check_runs_fit
from uhop_onnx.foundation.timing import Deadline

pytestmark = pytest.mark.usefixtures("tests_in_workers")


class Crashing(OrtCpu):
    """ONNX Runtime's CPU, except that compiling a model whose graph is named as `crashes` says kills the
    process natively: SIGABRT (`os.abort`) or SIGSEGV (a read of address 0)."""

    id = "crashing-cpu"
    crashes = {"block_0": "abort"}  # graph name -> how compiling it crashes

    def compile(self, model: onnx.ModelProto, *, exclusive: bool = True):
        how = self.crashes.get(model.graph.name)
        if how == "abort":
            os.abort()
        if how == "segfault":
            ctypes.string_at(0)
        return super().compile(model, exclusive=exclusive)


def _relu(name: str) -> onnx.ModelProto:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], name, [x], [y])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def test_a_block_that_crashes_its_worker_is_its_failure_and_the_others_are_measured(tmp_path):
    blocks = {}
    for name in ("first", "crashes", "last"):
        onnx.save(_relu(name), tmp_path / f"{name}.onnx")
        np.savez(tmp_path / f"{name}.npz", x=np.ones(4, np.float32))
        blocks[name] = (str(tmp_path / f"{name}.onnx"), str(tmp_path / f"{name}.npz"))
    provider = Crashing()
    provider.crashes = {"crashes": "segfault"}
    with SearchWorker() as worker:
        figures = worker.measure(provider, blocks, Deadline.after(120), Profiler(rounds=2, max_rounds=2, warmup=1))
    assert figures["first"].ok and figures["last"].ok
    assert not figures["crashes"].ok
    said = "crashing-cpu: the worker was killed by SIGSEGV while building and first running it"
    assert said in figures["crashes"].error


def test_optimize_finishes_when_a_runtime_aborts_on_a_block(monkeypatch):
    """The crashing provider's block 0 is a recorded failure naming SIGABRT; the plan is still made, and runs."""
    monkeypatch.setitem(REGISTRY, Crashing.id, Crashing)
    model = mlp()
    plan = uhop_onnx.optimize(model, providers=[Crashing.id, "ort-cpu"], budget=120)
    failures = [f for f in plan.profile["failures"] if f["kind"] == "block" and "SIGABRT" in f["error"]]
    assert failures and failures[0]["on"] == Crashing.id, plan.profile["failures"]
    assert plan.stages


class CrashingQuery(OrtCpu):
    """ONNX Runtime's CPU, except that asking it what it can run aborts the process."""

    id = "crashing-query"

    def query(self, model: onnx.ModelProto):
        os.abort()


def test_optimize_finishes_when_asking_a_runtime_what_it_can_run_aborts(monkeypatch):
    """The provider whose query aborts runs nothing, each node's reason naming SIGABRT; the plan is made."""
    monkeypatch.setitem(REGISTRY, CrashingQuery.id, CrashingQuery)
    plan = uhop_onnx.optimize(mlp(), providers=[CrashingQuery.id, "ort-cpu"], budget=120)
    assert {s.provider for s in plan.stages} == {"ort-cpu"}
    reasons = [r["reason"] for r in plan.replaced if r["provider"] == CrashingQuery.id]
    assert reasons and all("SIGABRT" in r for r in reasons), plan.replaced


def aborting_gate(choice):
    """A gate whose run of the candidate plan aborts the process."""
    os.abort()


def test_a_gate_that_aborts_rejects_its_candidate_naming_the_signal(caplog):
    """The gate runs in the search's worker: each candidate it crashed on is rejected, the error naming
    SIGABRT, and the search ends in a named error instead of taking the process with it."""
    analysis = analyze(mlp(), ["ort-cpu"], sample=True)
    with SearchWorker() as worker, caplog.at_level(logging.INFO), \
            pytest.raises(MeasurementError, match="outside the accuracy tolerance"):
        Search(lambda choices: {name: Measurement(1.0, 0.0, 5) for name in choices}, gate=aborting_gate,
               worker=worker, budget_s=120).place(analysis)
    assert "the worker was killed by SIGABRT" in caplog.text


def _tiles(repeats: int) -> onnx.ModelProto:
    """y = x + max(tile(x, (1, repeats))): an intermediate `repeats` times the size of its input."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 8])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 8])
    r = helper.make_tensor("r", TensorProto.INT64, [2], [1, repeats])
    nodes = [helper.make_node("Tile", ["x", "r"], ["big"], name="tile"),
             helper.make_node("ReduceMax", ["big"], ["m"], name="max", keepdims=1, axes=[1]),
             helper.make_node("Add", ["x", "m"], ["y"], name="add")]
    graph = helper.make_graph(nodes, "tiles", [x], [y], initializer=[r])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def test_a_run_too_large_for_this_host_is_refused_before_it_is_allocated(tmp_path):
    """An intermediate of 32 TiB at the given shapes (its input is 32 KiB): the refusal names the node, the
    bytes and what to give instead, before anything ran; at a small shape the same model fits."""
    model = _tiles(1 << 30)
    with pytest.raises(InputError, match=r"node tile reads and writes 3.28e\+04 GiB; 1 runs at once .*--shape"):
        check_runs_fit(model, {"x": (1024, 8)}, 1)
    check_runs_fit(_tiles(4), {"x": (1024, 8)}, 3)
    path = tmp_path / "tiles.onnx"
    onnx.save(model, path)
    with pytest.raises(TooLargeError, match="more than the"):
        uhop_onnx.optimize(str(path), providers=["ort-cpu"], shapes={"x": (1024, 8)}, budget=30)
    # measured on calibration samples, it is said as it is (not as a mistake in the samples' form)
    samples = tmp_path / "calibration.npz"
    np.savez(samples, x=np.zeros((2, 1024, 8), np.float32))
    with pytest.raises(TooLargeError, match=r"^at x: 1024x8, node tile .*more than the"):
        uhop_onnx.optimize(str(path), providers=["ort-cpu"], precision="int8", calibration=str(samples), budget=30)
