"""`run` from many threads at once, as ONNX Runtime allows: 8 threads x 50 calls on one session (each
provider present here, a plan mixing providers) and on one bundle, every result compared with ONNX Runtime.
"""

from __future__ import annotations

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import onnx
import pytest

import uhop_onnx
from uhop_onnx.models import cnn, mlp
from uhop_onnx.providers import REGISTRY, create
from uhop_onnx.precision import FP32_TOLERANCE, compare
from uhop_onnx.providers.rknn.table import FP16_TOLERANCE

from .conftest import reference

THREADS, CALLS = 8, 50


def hammer(session, model: onnx.ModelProto, tolerance: dict = FP32_TOLERANCE) -> None:
    """Each thread runs its own input CALLS times; every result must be ONNX Runtime's for that input."""
    name = model.graph.input[0].name
    shape = [d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim]
    rng = np.random.default_rng(0)
    inputs = [rng.standard_normal(shape).astype(np.float32) for _ in range(THREADS)]
    expected = [reference(model, {name: x}) for x in inputs]

    def calls(t: int) -> int:
        good = 0
        for _ in range(CALLS):
            got = session.run(None, {name: inputs[t]})
            good += all(compare(a, e, tolerance)["ok"] for a, e in zip(got, expected[t], strict=True))
        return good

    with ThreadPoolExecutor(THREADS) as pool:
        assert sum(pool.map(calls, range(THREADS))) == THREADS * CALLS


PRESENT = [p for p in ("openvino", "litert", "kernels", "ort-cpu") if create(p).present]


@pytest.mark.parametrize("provider", PRESENT)
def test_one_session_from_many_threads(provider):
    model = cnn()
    session = uhop_onnx.InferenceSession(model, providers=[provider], profile=False)
    assert provider in session.get_providers()
    hammer(session, model)


@pytest.mark.slow
@pytest.mark.skipif(not REGISTRY["rknn"]({"simulate": True}).present, reason="no rknn-toolkit2 environment")
def test_the_rknn_simulator_from_many_threads():
    model = cnn()
    session = uhop_onnx.InferenceSession(model, providers=[("rknn", {"simulate": True})], profile=False)
    hammer(session, model, FP16_TOLERANCE)


def test_a_plan_mixing_providers_from_many_threads():
    model = cnn()
    cycle = [p for p in PRESENT if p != "ort-cpu"] + ["ort-cpu"]
    convs = [n.name for n in model.graph.node if n.op_type == "Conv"]  # every provider runs a Conv
    assign = {name: cycle[k % len(cycle)] for k, name in enumerate(convs)}
    session = uhop_onnx.InferenceSession(model, providers=cycle, assign=assign, profile=False)
    assert set(session.get_providers()) == set(cycle[:len(convs)]) and len(cycle[:len(convs)]) > 1
    hammer(session, model)


@pytest.mark.skipif("openvino" not in PRESENT, reason="openvino is not installed")
def test_a_bundle_from_many_threads(tmp_path):
    model = cnn()
    mixed = [p for p in ("openvino", "kernels", "ort-cpu") if p in PRESENT]  # providers of the x86-64 target
    convs = [n.name for n in model.graph.node if n.op_type == "Conv"]
    assign = {name: mixed[k % len(mixed)] for k, name in enumerate(convs)}
    folder = uhop_onnx.export_bundle(model, "x86-64", tmp_path / "bundle", providers=mixed, assign=assign)
    bundle = uhop_onnx.load_bundle(folder)
    assert set(bundle.get_providers()) == set(mixed)
    hammer(bundle, model)


@pytest.mark.skipif("kernels" not in PRESENT, reason="no C compiler for the kernels")
def test_kernels_tune_each_op_once_when_first_called_from_many_threads(monkeypatch, tmp_path):
    """Concurrent first calls would time each other's searches; one searches while the others wait."""
    from uhop_onnx.custom_ops import autotune

    searched = []
    tune_op = autotune.tune_op
    monkeypatch.setattr(autotune, "cache_file", lambda lib: tmp_path / "autotune.json")
    monkeypatch.setattr(autotune, "tune_op", lambda lib, op, *rest, **kw: searched.append(op.key) or
                        tune_op(lib, op, *rest, **kw))
    model = mlp()
    session = uhop_onnx.InferenceSession(model, providers=[("kernels", {"tune": True}), "ort-cpu"], profile=False,
                                         threads=1)
    hammer(session, model)
    assert searched and len(searched) == len(set(searched))


FIRST_CALLS = """
import threading
import openvino as ov
from uhop_onnx.models import cnn
from uhop_onnx.providers import create

create("openvino").compile(cnn())
start = threading.Barrier(8)

def first_call():
    start.wait()
    ov.Type.f32.to_dtype()  # what `infer` calls on every input

threads = [threading.Thread(target=first_call) for _ in range(8)]
for t in threads:
    t.start()
for t in threads:
    t.join()
"""


@pytest.mark.skipif("openvino" not in PRESENT, reason="openvino is not installed")
def test_openvino_first_calls_from_many_threads_do_not_deadlock():
    """OpenVINO's binding deadlocks when a process's first `Type.to_dtype()` calls come from several threads at
    once (27 of 30 fresh processes hung here); compiling a runner makes that first call, so no `infer` can."""
    for _ in range(2):
        done = subprocess.run([sys.executable, "-c", FIRST_CALLS], capture_output=True, text=True, timeout=120,
                              check=False)
        assert done.returncode == 0, done.stderr[-2000:]
