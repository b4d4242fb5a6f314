"""The search worker's protocol has a channel of its own (what runtimes print cannot pass for a reply), and a
call that hangs is stopped at its deadline and is a failure, never a winner."""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import time

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import uhop_onnx
from uhop_onnx import MeasurementError
from uhop_onnx.foundation.errors import StageError
from uhop_onnx.runtime.measure import Candidate, Measurement, Profiler, SearchWorker, WorkerFailed, time_candidates
from uhop_onnx.models import mlp
from uhop_onnx.products.optimizer import analyze
from uhop_onnx.partitioner.search import Search
from uhop_onnx.providers import REGISTRY
from uhop_onnx.providers.ort import OrtCpu
from uhop_onnx.foundation.timing import Deadline

from .conftest import random_feeds

pytestmark = pytest.mark.usefixtures("tests_in_workers")

# Lines a native library could write to the worker's stdout, each a reply word of the protocol.
CHATTER = b'at "x"\nrounds\nfigures {"x": {"ms": 0.001, "spread": 0, "rounds": 9, "error": null}}\ndone\nfailed "no"\n'


def chatty(value):
    """`value`, after writing protocol-like lines to fd 1 natively (as a runtime's C library would) and from
    Python."""
    os.write(1, CHATTER)
    print(CHATTER.decode(), flush=True)
    return value


class Chatty(OrtCpu):
    """ONNX Runtime's CPU, except that compiling a block prints protocol-like lines to stdout."""

    id = "chatty-cpu"

    def compile(self, model: onnx.ModelProto, *, exclusive: bool = True):
        os.write(1, CHATTER)
        return super().compile(model, exclusive=exclusive)


class HangingQuery(OrtCpu):
    """ONNX Runtime's CPU, except that asking it what it can run never returns."""

    id = "hanging-query"

    def query(self, model: onnx.ModelProto):
        time.sleep(3600)


def hanging_gate(choice):
    """A gate whose run of the candidate plan never returns."""
    time.sleep(3600)


def held() -> tuple[int, int]:
    """The process's id and resident set (KiB)."""
    with open("/proc/self/status") as f:
        return os.getpid(), next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def left_in_a_cycle(mebibytes: int) -> None:
    """`mebibytes` of arrays left in a reference cycle (as a converter's and a runtime's objects are left)."""
    chunks: list = [np.ones(1 << 17) for _ in range(mebibytes)]
    chunks.append(chunks)


class Picky(Exception):
    """An exception whose arguments are not the ones it is made from: it pickles, and does not unpickle."""

    def __init__(self, stage: int, reason: str):
        super().__init__(f"stage {stage}: {reason}")


def raises_picky() -> None:
    raise Picky(3, "refused")


def warns(text: str) -> int:
    logging.getLogger("uhop_onnx.providers.litert").warning("%s", text)
    logging.getLogger("uhop_onnx.providers.litert").info("not sent: %s", text)
    return 7


def raises_a_stage_error() -> None:
    raise StageError("stage 2 (litert, 3 nodes from 'a') failed: no", 2, "litert")


def freed_between_live_chunks(mebibytes: int) -> None:
    """`mebibytes` of C heap written, then freed but one chunk in 16: glibc cannot shrink its heap past the
    chunks left, so the pages freed between them stay resident until the heap is trimmed (as runtimes leave
    theirs)."""
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    chunks = [libc.malloc(1 << 16) for _ in range(16 * mebibytes)]
    for chunk in chunks:
        ctypes.memset(chunk, 1, 1 << 16)
    for k, chunk in enumerate(chunks):
        if k % 16:
            libc.free(ctypes.c_void_p(chunk))


def test_a_worker_serves_one_runtime_and_a_request_for_another_ends_it_first():
    with SearchWorker() as worker:
        first, _ = worker.call(held, runtime="openvino")
        assert worker.call(held, runtime="openvino")[0] == first
        assert worker.call(held)[0] == first  # a request for any runtime
        second, _ = worker.call(held, runtime="litert")
        assert second != first
        with pytest.raises(ProcessLookupError):
            os.kill(first, 0)  # ended, and waited for
        assert worker.call(held, runtime="litert")[0] == second


@pytest.mark.skipif(not hasattr(ctypes.CDLL(None), "malloc_trim"), reason="a C library without malloc_trim")
def test_a_worker_returns_the_heap_a_request_freed_before_the_next():
    with SearchWorker() as worker:
        _, before = worker.call(held)
        worker.call(freed_between_live_chunks, 200)
        _, after = worker.call(held)
    assert after - before < 50 * 1024, (before, after)  # about 190 MiB stays resident untrimmed


def test_a_worker_collects_what_a_request_left_in_reference_cycles_before_the_next():
    with SearchWorker() as worker:
        _, before = worker.call(held)
        worker.call(left_in_a_cycle, 200)
        _, after = worker.call(held)
    assert after - before < 50 * 1024, (before, after)


def test_a_stage_error_raised_in_a_worker_reaches_its_coordinator_whole():
    with SearchWorker() as worker, pytest.raises(StageError, match="stage 2 .*failed: no") as raised:
        worker.call(raises_a_stage_error)
    assert (raised.value.stage, raised.value.provider) == (2, "litert")


def test_an_exception_that_would_not_unpickle_here_comes_as_its_first_line():
    with SearchWorker() as worker, pytest.raises(RuntimeError, match="stage 3: refused"):
        worker.call(raises_picky)


def test_what_a_call_logs_as_a_warning_is_logged_by_its_coordinator(caplog):
    with SearchWorker() as worker, caplog.at_level(logging.INFO, logger="uhop_onnx"):
        assert worker.call(warns, "shape arithmetic left unfolded: folder bug") == 7
    said = [(r.name, r.levelno, r.getMessage()) for r in caplog.records if r.name.startswith("uhop_onnx.providers")]
    assert said == [("uhop_onnx.providers.litert", logging.WARNING, "shape arithmetic left unfolded: folder bug")]


def test_a_model_the_search_workers_simplification_leaves_as_it_was_is_the_loaded_model_itself():
    """Simplified in the search's worker, a model nothing was taken from comes back as the loaded model, not a
    copy of its weights held beside it for the whole search."""
    path = os.path.join(os.path.dirname(__file__), "..", "models", "example_mobilenet.onnx")
    with SearchWorker() as worker:
        a = analyze(path, ["ort-cpu"], worker=worker)
    assert a.simplified is a.loaded


@pytest.mark.slow
def test_what_a_call_prints_on_stdout_is_not_taken_for_its_reply():
    with SearchWorker() as worker:
        assert worker.call(chatty, {"answer": 42}) == {"answer": 42}
        assert worker.call(chatty, "again") == "again"


@pytest.mark.slow
def test_what_a_runtime_prints_while_blocks_are_timed_is_not_taken_for_figures(tmp_path):
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "relu", [x], [y])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), tmp_path / "b.onnx")
    np.savez(tmp_path / "b.npz", x=np.ones(4, np.float32))
    with SearchWorker() as worker:
        figures = worker.measure(Chatty(), {"b": (str(tmp_path / "b.onnx"), str(tmp_path / "b.npz"))},
                                 Deadline.after(120), Profiler(rounds=2, max_rounds=2, warmup=1))
    assert set(figures) == {"b"} and figures["b"].ok and figures["b"].rounds == 2, figures


@pytest.mark.slow
def test_a_call_that_hangs_is_stopped_past_its_deadline_and_the_next_call_gets_a_new_worker():
    with SearchWorker(Deadline.after(0.0), grace=1.0) as worker:
        started = time.monotonic()
        with pytest.raises(WorkerFailed, match="did not answer within 1 s and was stopped"):
            worker.call(time.sleep, 3600)
        assert time.monotonic() - started < 30
        worker.deadline = None
        assert worker.call(chatty, 7) == 7


def test_a_call_is_stopped_as_soon_as_its_search_is_abandoned():
    abandoned = threading.Event()
    with SearchWorker(Deadline.after(3600.0, abandoned.is_set)) as worker:
        threading.Timer(0.5, abandoned.set).start()
        started = time.monotonic()
        with pytest.raises(WorkerFailed, match="the search was abandoned"):
            worker.call(time.sleep, 3600)
        assert time.monotonic() - started < 30


def test_whole_plans_stop_being_timed_when_the_search_is_abandoned(tmp_path):
    """Abandoned as the first worker starts: no round is timed, and each plan is a failure, never a winner."""
    model = mlp()
    uhop_onnx.optimize(model, providers=["ort-cpu"], profile=False).save(tmp_path / "plan", report=False)
    abandoned = threading.Event()
    threading.Timer(0.2, abandoned.set).start()
    started = time.monotonic()
    figures = time_candidates([Candidate(name, str(tmp_path / "plan")) for name in ("a", "b")], None,
                              random_feeds(model), 1, 1000, 2000, deadline=Deadline.after(3600.0, abandoned.is_set))
    assert time.monotonic() - started < 60
    assert all(f["ms"] is None and f["error"] for f in figures.values()), figures


def test_an_abandoned_optimize_stops_at_its_next_step():
    """Abandoned before it begins, it raises, even where the cache holds its plan."""
    uhop_onnx.optimize(mlp(), providers=["ort-cpu"], budget=5)
    with pytest.raises(uhop_onnx.UhopError, match="the search was abandoned"):
        uhop_onnx.optimize(mlp(), providers=["ort-cpu"], budget=5, stop=lambda: True)


def test_a_gate_that_hangs_rejects_its_candidate_and_is_never_chosen(caplog):
    analysis = analyze(mlp(), ["ort-cpu"], sample=True)
    with SearchWorker(Deadline.after(0.0), grace=1.0) as worker, caplog.at_level(logging.INFO), \
            pytest.raises(MeasurementError, match="outside the accuracy tolerance"):
        Search(lambda choices: {name: Measurement(1.0, 0.0, 5) for name in choices}, gate=hanging_gate,
               worker=worker, budget_s=120).place(analysis)
    assert "did not answer within 1 s" in caplog.text


def test_optimize_finishes_when_asking_a_runtime_what_it_can_run_hangs(monkeypatch):
    """The provider whose query hangs runs nothing, each node's reason saying it did not answer in time."""
    monkeypatch.setitem(REGISTRY, HangingQuery.id, HangingQuery)
    monkeypatch.setattr("uhop_onnx.runtime.measure.CALL_GRACE_SECONDS", 1.0)
    started = time.monotonic()
    plan = uhop_onnx.optimize(mlp(), providers=[HangingQuery.id, "ort-cpu"], budget=2)
    assert time.monotonic() - started < 60
    assert {s.provider for s in plan.stages} == {"ort-cpu"}
    reasons = [r["reason"] for r in plan.replaced if r["provider"] == HangingQuery.id]
    assert reasons and all("did not answer within" in r for r in reasons), plan.replaced
