"""Adaptive sessions: a session serves ONNX Runtime, hands a shape bucket whose calls make deciding pay to the
explorer (a process beside the program), switches to a decision at a call boundary once ONNX Runtime agrees
on that call, keeps it only if the program's own calls run no slower, and changes nothing process-wide."""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime
import pytest

import uhop_onnx
from uhop_onnx.adaptation import explorer
from uhop_onnx.products import explore
from uhop_onnx.adaptation.serving import EXPLORE_AFTER, EXPLORE_LIVED_S, Decisions, Serving
from uhop_onnx.foundation.cache import cache_dir
from uhop_onnx.models import BUILDERS
from uhop_onnx.products.optimizer import optimize
from uhop_onnx.products.session import adaptive, decisions_for
from uhop_onnx.runtime.compile import compile_plan

from .conftest import assert_matches, random_feeds, reference
from .support import Slowed

ENCODER = str(Path(__file__).parents[1] / "models" / "example_encoder.onnx")  # free batch and sequence axes


@pytest.fixture(autouse=True)
def _at_once(tmp_path, monkeypatch):
    """A private cache; buckets decided after `EXPLORE_AFTER` calls, however short; a switch checked after
    `CHECK` calls."""
    monkeypatch.setenv("UHOP_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr("uhop_onnx.adaptation.serving.EXPLORE_AFTER_S", 0.0)
    monkeypatch.setattr("uhop_onnx.adaptation.serving.CHECK_S", 0.0)


def _cnn(tmp_path) -> tuple[onnx.ModelProto, Path, dict, str]:
    """The cnn saved to a file, its feeds and its bucket."""
    model = BUILDERS["cnn"]()
    path = tmp_path / "cnn.onnx"
    onnx.save(model, path)
    return model, path, random_feeds(model), f"{model.graph.input[0].name}: 1x3x32x32"


def _kept_on_openvino(tmp_path) -> tuple[onnx.ModelProto, Path, dict, Decisions]:
    """The cnn, its feeds, and the decisions that keep its bucket on OpenVINO."""
    model, path, feeds, bucket = _cnn(tmp_path)
    decisions = decisions_for(str(path), None, None, "device", None)
    decisions.keep(bucket, "openvino first", optimize(model, providers=["openvino"], profile=False), 10,
                   decision="openvino first: faster")
    return model, path, feeds, decisions


def _state(session) -> dict:
    return next(iter(session.adaptation.values()))


def _slowed(provider: str, path: Path):
    """An adapting `Serving` on the model at `path` whose plans on `provider` take 20 ms longer a call."""
    def compile(plan, **given):
        return Slowed(compile_plan(plan, **given), 0.02 if provider in plan.get_providers() else 0.0)

    return adaptive(str(path), None, None, "device", compile, budget_s=60.0, assign=None, strict=False)


def test_a_session_serves_onnxruntime_then_switches_to_a_kept_decision_once_its_bucket_pays(tmp_path):
    model, path, feeds, _ = _kept_on_openvino(tmp_path)
    want = reference(model, feeds)
    serving = _slowed("ort-cpu", path)  # OpenVINO is then the faster on the program's calls too
    for _ in range(EXPLORE_AFTER):  # a one-shot script never leaves ONNX Runtime
        assert_matches(serving.run(None, feeds)[0], want)
        assert serving.plan.get_providers() == ["ort-cpu"]
    assert_matches(serving.run(None, feeds)[0], want)  # switched on this call, ONNX Runtime's outputs served
    state = next(iter(serving.adaptation.values()))
    assert state["state"] == "checking" and state["serving"] == "openvino first", state
    assert serving.starter.executor is None  # released: one runtime at a time
    for _ in range(9):
        assert_matches(serving.run(None, feeds)[0], want)
    assert serving.plan.get_providers() == ["openvino"]
    state = next(iter(serving.adaptation.values()))
    assert state["state"] == "decided" and state["serving"] == "openvino first", state
    assert state["decision"] == "openvino first: faster"
    serving.close()


def test_a_kept_plan_slower_on_the_programs_own_calls_is_switched_back_and_that_is_kept(tmp_path):
    """The explorer's figures may have been taken beside the program's load: the program's calls decide."""
    model, path, feeds, decisions = _kept_on_openvino(tmp_path)

    def serving() -> Serving:
        return _slowed("openvino", path)

    first = serving()
    for _ in range(EXPLORE_AFTER + 1 + 8):
        assert_matches(first.run(None, feeds)[0], reference(model, feeds))
    state = next(iter(first.adaptation.values()))
    assert state["serving"] == "ort-cpu" and "ran the program's calls in" in state["decision"], state
    first.run(None, feeds)
    assert first.plan.get_providers() == ["ort-cpu"]
    first.close()
    [entry] = decisions.table.read().values()
    assert entry["label"] == "ort-cpu" and entry["plan"] == ""
    again = serving()
    for _ in range(EXPLORE_AFTER + 2):
        again.run(None, feeds)
    state = next(iter(again.adaptation.values()))
    assert state["state"] == "decided" and state["serving"] == "ort-cpu", state
    again.close()


def test_a_damaged_kept_plan_is_dropped_with_a_warning_and_onnxruntime_serves(tmp_path, caplog):
    model, path, feeds, decisions = _kept_on_openvino(tmp_path)
    entry = next(iter(decisions.table.read().values()))
    stage = next((decisions.folder / entry["plan"]).glob("*.onnx"))
    data = bytearray(stage.read_bytes())
    data[len(data) // 2] ^= 0xFF
    stage.write_bytes(bytes(data))
    session = uhop_onnx.InferenceSession(str(path))
    with caplog.at_level("WARNING"):
        for _ in range(EXPLORE_AFTER + 2):
            assert_matches(session.run(None, feeds), reference(model, feeds))
    assert session.get_providers() == ["ort-cpu"] and "dropped and decided again" in caplog.text
    session.close()
    assert str(cache_dir()) in str(decisions.folder)  # kept in the cache, under its cap


def test_a_plan_the_explorer_found_disagreeing_with_onnxruntime_is_refused_and_kept_so(tmp_path):
    """The explorer referees its own choice on the program's sample before keeping it."""
    from .test_referee import _adds

    path = tmp_path / "adds.onnx"
    onnx.save(_adds(1.0), path)
    forged = optimize(_adds(2.0), providers=["openvino"], profile=False)
    decisions = decisions_for(str(path), None, None, "device", None)
    sample = {"x": np.arange(4, dtype=np.float32)[None]}
    explore.keep(str(path), "x: 1x4", 10, forged, sample, decisions)
    [entry] = decisions.table.read().values()
    assert entry["label"] == "ort-cpu" and entry["plan"] == ""
    assert "differs from ONNX Runtime's" in next(iter(entry["refused"].values()))
    assert entry["decision"].startswith("refused")


def test_the_searchs_plans_are_reported_against_the_one_chosen():
    profile = {"chosen": "ort-cpu first", "candidates": {
        "ort-cpu first": {"ms": 10.0, "interval": [10.0, 11.0]},
        "openvino first": {"ms": 10.5, "interval": [10.5, 12.0]},
        "litert first": {"ms": 20.0, "interval": [20.0, 21.0]},
        "kernels first": {"ms": None, "interval": None, "error": "the budget ran out"},
        "int8": {"ms": 5.0, "interval": [5.0, 6.0], "rejected": True, "accuracy": {"y": 0.3}}}}
    states = {c["label"]: c["state"] for c in explore.candidates(profile)}
    assert states == {"ort-cpu first": "serving", "openvino first": "within noise", "litert first": "slower",
                      "kernels first": "untried", "int8": "refused"}


def test_one_explorer_per_model_and_cache(tmp_path):
    """An explorer finding another at work on the same decisions ends at once, leaving them to it."""
    folder = tmp_path / "decisions"
    folder.mkdir()
    with open(folder / ".explorer.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        job = {"source": ENCODER, "providers": None, "threads": None, "policy": "device", "assign": {},
               "options": {}, "folder": str(folder), "digest": "", "budget_s": 10.0,
               "buckets": [{"key": "input_ids: 1x8", "calls": 3}]}
        process = explorer.start(job, [{"input_ids": np.zeros((1, 8), np.int64)}], None, folder / "log")
        assert process.wait(timeout=60) == 0
    assert "another process explores" in (folder / "log").read_text()
    assert not (folder / "decisions.json").exists()


# A program whose session explores at once; it prints the explorer's process id, then waits.
PROGRAM = """
import json, logging, os, signal, sys, threading, time
import numpy as np
import onnxruntime
import uhop_onnx.adaptation.serving as serving
serving.EXPLORE_AFTER_S = 0.0

def state():
    tids = os.listdir("/proc/self/task")
    return {"threads": threading.active_count(), "fd2": list(os.fstat(2))[:2],
            "last_resort": len(logging.lastResort.filters), "handlers": len(logging.getLogger().handlers),
            "signals": [str(signal.getsignal(s)) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD)],
            "nice": sorted({os.getpriority(os.PRIO_PROCESS, int(t)) for t in tids}),
            "sched": sorted({os.sched_getscheduler(int(t)) for t in tids})}

import uhop_onnx
before = state()
session = uhop_onnx.InferenceSession(sys.argv[1])
x = {"input_ids": np.arange(8, dtype=np.int64)[None] % 50}
while session._serving._explorer is None:
    session.run(None, x)
session.run(None, x)
print(json.dumps({"explorer": session._serving._explorer.pid, "before": before, "after": state()}), flush=True)
if sys.argv[2] == "exit":
    sys.exit(0)
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[0] not in "ZX"
    except OSError:
        return False


def _program(tmp_path, how: str) -> tuple[subprocess.Popen, dict]:
    env = {**os.environ, "TMPDIR": str(tmp_path / "tmp")}
    (tmp_path / "tmp").mkdir(exist_ok=True)
    process = subprocess.Popen([sys.executable, "-c", PROGRAM, ENCODER, how], stdout=subprocess.PIPE, text=True,
                               env=env)
    return process, json.loads(process.stdout.readline())


def test_an_exploring_session_changes_nothing_process_wide_and_its_program_exits_at_once(tmp_path):
    process, said = _program(tmp_path, "exit")
    begun = time.monotonic()
    assert process.wait(timeout=30) == 0
    assert time.monotonic() - begun < 2.0  # exit does not wait for the explorer
    assert said["before"] == said["after"], said  # no thread, fd 2, logging, signal or priority changed
    deadline = time.monotonic() + 5
    while _alive(said["explorer"]):
        assert time.monotonic() < deadline, "the explorer outlived its program"
        time.sleep(0.05)


@pytest.mark.parametrize("number", [signal.SIGKILL, pytest.param(signal.SIGTERM, marks=pytest.mark.slow),
                                    pytest.param(signal.SIGHUP, marks=pytest.mark.slow)])
def test_an_explorer_and_what_it_started_end_with_their_program_however_it_ends(tmp_path, number):
    process, said = _program(tmp_path, "wait")
    time.sleep(3.0)  # its search under way: workers started, temporary files written
    process.send_signal(number)
    process.wait(timeout=30)
    deadline = time.monotonic() + 10
    while _alive(said["explorer"]) or list((tmp_path / "tmp").glob("uhop-*")):  # not a runtime's own files
        assert time.monotonic() < deadline, (f"left behind: explorer alive {_alive(said['explorer'])}, "
                                             f"{list((tmp_path / 'tmp').glob('uhop-*'))}")
        time.sleep(0.1)
    leftovers = subprocess.run(["pgrep", "-f", str(tmp_path)], capture_output=True, text=True).stdout.split()
    assert not leftovers


@pytest.mark.slow
def test_the_explorer_decides_a_bucket_and_the_session_serves_its_decision(tmp_path):
    """End to end on a program that leaves the machine idle between calls: the bucket is decided within the
    search's budget, and whatever serves then agrees with ONNX Runtime."""
    model, path, feeds, _ = _cnn(tmp_path)
    want = reference(model, feeds)
    session = uhop_onnx.InferenceSession(str(path), adapt_budget=40.0)
    deadline = time.monotonic() + 180
    while _state_or_none(session) != "decided":
        assert time.monotonic() < deadline, session.adaptation
        assert_matches(session.run(None, feeds), want)
        time.sleep(0.05)
    state = _state(session)
    assert [c for c in state["candidates"] if c["state"] == "serving"], state
    assert_matches(session.run(None, feeds), want)
    [entry] = session._serving.decisions.table.read().values()
    assert entry["decision"] == state["decision"] or state["decision"].startswith(entry["label"])
    session.close()


def _state_or_none(session) -> str | None:
    buckets = list(session.adaptation.values())
    return buckets[0]["state"] if buckets else None


def test_adapt_off_keeps_one_plan():
    model = BUILDERS["cnn"]()
    feeds = random_feeds(model)
    options = onnxruntime.SessionOptions()
    options.add_session_config_entry("uhop.adapt", "0")
    session = uhop_onnx.InferenceSession(model.SerializeToString(), options, profile=False)
    for _ in range(EXPLORE_AFTER + 2):
        assert_matches(session.run(None, feeds), reference(model, feeds))
    assert session.adaptation == {}
    options.add_session_config_entry("uhop.adapt", "maybe")
    with pytest.raises(uhop_onnx.InputError, match="uhop.adapt"):
        uhop_onnx.InferenceSession(model.SerializeToString(), options)


@pytest.mark.parametrize("adapt", [True, False])
def test_a_closed_session_says_so_when_run(adapt):
    model = BUILDERS["cnn"]()
    feeds = random_feeds(model)
    session = uhop_onnx.InferenceSession(model.SerializeToString(), adapt=adapt, profile=adapt)
    session.run(None, feeds)
    session.close()
    with pytest.raises(uhop_onnx.UhopError, match="the session is closed"):
        session.run(None, feeds)


class _ClosingFeed:
    """An input whose first reading closes `session`: a `close` on another thread overtaking the call."""

    def __init__(self, array, session):
        self.array, self.session = array, session

    @property
    def shape(self):
        self.session.close()
        return self.array.shape


def test_a_call_that_close_overtakes_says_so():
    model = BUILDERS["cnn"]()
    feeds = random_feeds(model)
    session = uhop_onnx.InferenceSession(model.SerializeToString())
    session.run(None, feeds)
    with pytest.raises(uhop_onnx.UhopError, match="closed while this call ran"):
        session.run(None, {name: _ClosingFeed(value, session) for name, value in feeds.items()})


def test_a_plan_is_not_adapted_unless_asked():
    model = BUILDERS["cnn"]()
    plan = optimize(model, providers=["ort-cpu"], profile=False)
    session = uhop_onnx.InferenceSession(plan)
    session.run(None, random_feeds(model))
    assert session.adaptation == {}
    with pytest.raises(uhop_onnx.InputError, match="needs the model"):
        uhop_onnx.InferenceSession(plan, adapt=True)


def test_shape_buckets_are_exact_then_rounded_up_to_powers_of_two(monkeypatch):
    monkeypatch.setattr("uhop_onnx.adaptation.serving.EXPLORE_AFTER_S", 1e9)  # nothing explored
    serving = adaptive(ENCODER, None, None, "device", compile_plan, budget_s=60.0, assign=None, strict=False)
    for seq in range(1, 13):
        serving.run(None, {"input_ids": np.arange(seq, dtype=np.int64)[None] % 100})
    keys = list(serving.adaptation)
    assert "input_ids: 1x3" in keys and "input_ids: 1x16" in keys and "input_ids: 1x9" not in keys
    serving.close()


def test_a_bucket_called_seldom_is_explored_once_it_was_first_called_long_enough_ago(monkeypatch):
    """A server between requests: its calls never add up to `EXPLORE_AFTER_S`, yet it lives long enough to gain."""
    due = []
    monkeypatch.setattr("uhop_onnx.adaptation.serving.EXPLORE_AFTER_S", 1e9)  # its calls never add up to it
    monkeypatch.setattr(Serving, "_due", lambda self, bucket, feeds: due.append(bucket.key))
    serving = adaptive(ENCODER, None, None, "device", compile_plan, budget_s=60.0, assign=None, strict=False)
    feeds = {"input_ids": np.arange(4, dtype=np.int64)[None]}
    for _ in range(EXPLORE_AFTER + 2):
        serving.run(None, feeds)
    assert due == []
    bucket = next(iter(serving._buckets.values()))
    bucket.first -= EXPLORE_LIVED_S  # its first call that long ago
    serving.run(None, feeds)
    assert due == [bucket.key]
    serving.close()


def test_a_call_of_several_inputs_is_bucketed_by_each(monkeypatch):
    monkeypatch.setattr("uhop_onnx.adaptation.serving.EXPLORE_AFTER_S", 1e9)
    io = [onnx.helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, ["n"]) for name in "aby"]
    graph = onnx.helper.make_graph([onnx.helper.make_node("Add", ["a", "b"], ["y"])], "add", io[:2], io[2:])
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)], ir_version=8)
    serving = adaptive(model, None, None, "device", compile_plan, budget_s=60.0, assign=None, strict=False)
    for n in (3, 5, 3):
        [y], _ = serving.run(None, {"a": np.ones(n, np.float32), "b": np.full(n, 2, np.float32)})
        np.testing.assert_array_equal(y, np.full(n, 3, np.float32))
    assert {key: b["calls"] for key, b in serving.adaptation.items()} == {"a: 3, b: 3": 2, "a: 5, b: 5": 1}
    serving.close()


def test_a_replaced_decision_leaves_no_plan_behind(tmp_path, monkeypatch):
    monkeypatch.setattr("uhop_onnx.adaptation.serving.UNNAMED_S", 0.0)
    model = BUILDERS["cnn"]()
    decisions = Decisions(tmp_path / "decisions")
    for label in ("openvino", "ort-cpu"):
        decisions.keep("x: 1x3x32x32", label, optimize(model, providers=[label], profile=False), 10)
    entry = decisions.table.get("x: 1x3x32x32")
    assert entry["label"] == "ort-cpu"
    assert [p.name for p in decisions.folder.iterdir() if p.is_dir()] == [entry["plan"]]


def test_a_bucket_called_with_lists_or_ortvalues_is_sampled_as_arrays_of_the_declared_types(tmp_path):
    """Magika calls its model with a list of lists of ints, as ONNX Runtime takes them: the explorer is handed
    arrays of the model's declared types, and a sequence input is not sampled at all."""
    from uhop_onnx.adaptation.serving import _sampled
    from uhop_onnx.foundation.dtypes import TensorSig

    sigs = [TensorSig("bytes", "tensor(int32)", [1, 4]), TensorSig("seq", "seq(tensor(float))", None)]
    arrays, why = _sampled({"bytes": [[1, 2, 3, 4]]}, sigs)
    assert why == "" and arrays["bytes"].dtype == np.int32 and arrays["bytes"].shape == (1, 4)
    value = onnxruntime.OrtValue.ortvalue_from_numpy(np.ones((1, 4), np.int32))
    assert _sampled({"bytes": value}, sigs)[0]["bytes"].tolist() == [[1, 1, 1, 1]]
    assert _sampled({"seq": [np.ones(2, np.float32)]}, sigs) == (None, "its inputs are not tensors")
    assert _sampled({"bytes": np.array([np.nan], np.float32)}, sigs)[1] == "its inputs hold NaN or Inf"


def test_the_explorers_job_names_the_model_file_and_carries_bytes_only_for_a_model_given_as_bytes(tmp_path):
    model, path, feeds, _ = _cnn(tmp_path)
    on_file = adaptive(str(path), None, None, "device", compile_plan, budget_s=60.0, assign=None, strict=False)
    assert on_file._explore.job["source"] == str(path.resolve()) and on_file._explore.model() is None
    in_memory = adaptive(model.SerializeToString(), None, None, "device", compile_plan, budget_s=60.0,
                         assign=None, strict=False)
    assert in_memory._explore.job["source"] is None
    assert in_memory._explore.model() == model.SerializeToString()
    json.dumps(in_memory._explore.job)  # what the explorer is handed is plain data
    on_file.close()
    in_memory.close()


def test_the_explorer_sees_the_cores_another_process_keeps_busy():
    """What decides whether the explorer's timings are the candidates' or the program's: a process spinning on
    one core shows as about one core busy, over the explorer's own work."""
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.5)
        begun = explore._machine()
        time.sleep(1.0)
        busy = explore._others_busy(begun)
    finally:
        spinner.kill()
        spinner.wait()
    assert 0.7 < busy < 1.0 + os.cpu_count(), busy


def test_buckets_decided_on_the_same_plan_share_one_compiled_copy_of_it(tmp_path):
    """A model called at several shapes, each bucket kept on the same OpenVINO plan: it is compiled once."""
    plan = optimize(ENCODER, providers=["openvino"], profile=False)
    decisions = decisions_for(ENCODER, None, None, "device", None)
    for seq in (8, 16):
        decisions.keep(f"input_ids: 1x{seq}", "openvino first", plan, 10)
    serving = adaptive(ENCODER, None, None, "device", compile_plan, budget_s=60.0, assign=None, strict=False)
    model = onnx.load(ENCODER)
    for seq in (8, 16):
        feeds = {"input_ids": np.arange(seq, dtype=np.int64)[None] % 50}
        for _ in range(EXPLORE_AFTER + 2):
            assert_matches(serving.run(None, feeds)[0], reference(model, feeds))
    assert {b["serving"] for b in serving.adaptation.values()} == {"openvino first"}, serving.adaptation
    assert len([a for a in serving._arms if a.executor is not None and a.label == "openvino first"]) == 1
    serving.close()


def test_a_program_that_turns_onnxruntimes_memory_arena_off_starts_on_onnxruntime_so(tmp_path):
    """RapidOCR turns the arena off (its inputs come in many shapes): left on, its process held 1.5x the memory."""
    model, path, feeds, _ = _cnn(tmp_path)
    options = onnxruntime.SessionOptions()
    options.enable_cpu_mem_arena = False
    session = uhop_onnx.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    assert_matches(session.run(None, feeds), reference(model, feeds))
    [stage] = session.plan.stages
    assert stage.options.get("enable_cpu_mem_arena") is False
    runner = session._serving.starter.executor.runners[0]
    assert runner.session.get_session_options().enable_cpu_mem_arena is False
    session.close()
