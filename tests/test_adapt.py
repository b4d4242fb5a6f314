"""Adaptive sessions: a session starts on one plan, tries candidates on its own calls per shape bucket, swaps
only for one faster beyond noise, keeps the decision for the next process, and stays correct throughout."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime
import pytest
from typer.testing import CliRunner

import uhop_onnx
from uhop_onnx.adaptation.serving import EXPLORE_AFTER, FIRST_ROUNDS, MIN_PAIRS, ROUND, Decisions, Serving, round_calls
from uhop_onnx.foundation.cache import cache_dir
from uhop_onnx.cli import app
from uhop_onnx.models import BUILDERS
from uhop_onnx.products.optimizer import optimize
from uhop_onnx.providers import create
from uhop_onnx.runtime.compile import compile_plan
from uhop_onnx.products.session import adaptive, decisions_for

from .conftest import assert_matches, random_feeds, reference
from .support import Slowed

ENCODER = str(Path(__file__).parents[1] / "models" / "example_encoder.onnx")  # free batch and sequence axes


@pytest.fixture(autouse=True)
def _rounds_of_round_calls(monkeypatch):
    """Rounds of `ROUND` calls whatever a call takes: these tests count calls (`round_calls` is tested apart)."""
    monkeypatch.setattr("uhop_onnx.adaptation.serving.ROUND_S", 0.0)


def _wait(condition, seconds: float = 120.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "the background work did not finish in time"
        time.sleep(0.05)


def _settled(serving_or_session) -> bool:
    buckets = serving_or_session.adaptation.values()
    return bool(buckets) and all(b["decision"] for b in buckets)


def _serving(model, starter_delay: float, candidate_delay: float, tmp_path, **options) -> Serving:
    """A `Serving` whose starter (ort-cpu) and one candidate (the same model on openvino) are slowed by the
    given delays."""
    starter = optimize(model, providers=["ort-cpu"], profile=False)
    candidate = optimize(model, providers=["openvino"], profile=False)

    def compile(plan):
        delay = starter_delay if plan is starter else candidate_delay
        return Slowed(compile_plan(plan), delay)

    return Serving(starter, compile, "ort-cpu", lambda stopped, sample: {"openvino": lambda sample: candidate},
                   explore_after_s=0.0, **options)


def _call(serving: Serving, feeds, calls: int):
    for _ in range(calls):
        outputs, _ = serving.run(None, feeds)
    return outputs


def test_a_faster_candidate_replaces_the_serving_plan_and_is_kept(tmp_path):
    model = BUILDERS["cnn"]()
    feeds = random_feeds(model)
    decisions = Decisions(tmp_path / "decisions")
    serving = _serving(model, 0.03, 0.0, tmp_path, decisions=decisions)
    _call(serving, feeds, EXPLORE_AFTER)
    _wait(lambda: "openvino" in str(serving.adaptation) and _trying_or_done(serving))
    for _ in range(4 * MIN_PAIRS * ROUND):
        assert_matches(serving.run(None, feeds)[0], reference(model, feeds))
        if _trying_or_done(serving) and "trying" not in str(serving.adaptation):
            break
    _wait(lambda: _settled(serving))
    bucket = next(iter(serving.adaptation.values()))
    assert bucket["candidates"][0]["state"] == "faster", bucket
    assert bucket["serving"] == "openvino" and "replaced ort-cpu" in bucket["decision"]
    low, high = bucket["candidates"][0]["interval"]
    assert low <= high < 1.0
    # kept when found faster, and again with its decision once every candidate was tried
    _wait(lambda: (kept := decisions.read().get(bucket["bucket"])) and kept[1].adaptation)
    label, plan, calls, retry, refused = decisions.read()[bucket["bucket"]]
    assert label == "openvino" and plan.get_providers() == ["openvino"] and calls >= MIN_PAIRS * ROUND and not retry
    assert serving.run(None, feeds)[1].get_providers() == ["openvino"]
    # the kept plan says how it was chosen, and explain shows it
    assert plan.adaptation[bucket["bucket"]]["decision"] == bucket["decision"]
    shown = CliRunner().invoke(app, ["explain", str(plan.folder)])
    assert shown.exit_code == 0, shown.output
    assert f"adapted at {bucket['bucket']}" in shown.output and "openvino: faster" in shown.output, shown.output
    serving.close()


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(os, "getpriority") or os.getpriority(os.PRIO_PROCESS, 0) >= 10,
                    reason="niceness is POSIX's; a caller at nice 10 or above has its background at its own")
@pytest.mark.parametrize("renew_fails", [False, True])
def test_a_promoted_plan_is_compiled_again_at_the_callers_priority(renew_fails):
    """A runtime's threads take the niceness of the thread that starts them: a candidate compiled in the
    background at nice 10 that wins is compiled again at the caller's priority, and that copy serves; when that
    fails, the first serves on."""
    model = BUILDERS["cnn"]()
    feeds = random_feeds(model)
    starter = optimize(model, providers=["ort-cpu"], profile=False)
    candidate = optimize(model, providers=["litert"], profile=False)
    compiled = []  # the candidate's executors, with the niceness of the thread that compiled each (None: failed)

    def compile(plan):
        if plan is starter:
            return Slowed(compile_plan(plan), 0.03)
        niceness = os.getpriority(os.PRIO_PROCESS, 0)
        if renew_fails and compiled:
            compiled.append((None, niceness))
            raise RuntimeError("no memory left")
        compiled.append((compile_plan(plan), niceness))
        return compiled[-1][0]

    serving = Serving(starter, compile, "ort-cpu", lambda stopped, sample: {"litert": lambda sample: candidate},
                      explore_after_s=0.0)
    caller = os.getpriority(os.PRIO_PROCESS, 0)
    _wait(lambda: (_settled(serving) and len(compiled) == 2) or _step(serving, feeds))
    assert [niceness for _, niceness in compiled] == [10, caller]
    for _ in range(3):
        outputs, plan = serving.run(None, feeds)
        assert_matches(outputs, reference(model, feeds))
    assert plan.get_providers() == ["litert"]
    assert serving.executor is compiled[0 if renew_fails else 1][0]
    serving.close()


# In its own process (TBB's workers live as long as it does): compiles a MatMul on OpenVINO's CPU on a thread at
# nice 10, as the background thread compiles a candidate, after `prime` on the thread of the callers' priority or
# not, runs it on the main thread, and prints the CPU ticks that threads above the process's own niceness spent
# meanwhile (it may run under `nice`).
NICED_TICKS = """
import os, sys, threading
from pathlib import Path

import numpy as np
from onnx import TensorProto, helper, numpy_helper
from uhop_onnx.providers import create
w = numpy_helper.from_array(np.random.default_rng(0).random((512, 512), dtype=np.float32), "w")
graph = helper.make_graph([helper.make_node("MatMul", ["a", "w"], ["y"])], "mm",
                          [helper.make_tensor_value_info("a", TensorProto.FLOAT, [512, 512])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [512, 512])], [w])
model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
caller = os.getpriority(os.PRIO_PROCESS, 0)
if sys.argv[1] == "primed":  # as an adapting session does: on the thread of the callers' priority
    from uhop_onnx.adaptation import priority

    priority.start()
    priority.call(create("openvino", 2).prime)
made = {}
def compile():  # as the background thread compiles a candidate
    os.setpriority(os.PRIO_PROCESS, 0, 10)
    made["runner"] = create("openvino", 2).compile(model)
thread = threading.Thread(target=compile)
thread.start()
thread.join()
def ticks():  # thread -> (its niceness, its CPU ticks)
    seen = {}
    for tid in os.listdir("/proc/self/task"):
        try:  # a thread may end meanwhile
            fields = Path(f"/proc/self/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        seen[tid] = (int(fields[16]), int(fields[11]) + int(fields[12]))
    return seen
before = ticks()
a = np.ones((512, 512), np.float32)
for _ in range(300):
    made["runner"].run({"a": a})
print(sum(t - before.get(tid, (0, 0))[1] for tid, (nice, t) in ticks().items() if nice > caller))
"""


@pytest.mark.skipif(not Path("/proc/self/task").is_dir() or len(os.sched_getaffinity(0)) < 2,
                    reason="reads each thread's niceness and CPU time in Linux's /proc; TBB starts workers on 2+ cores")
@pytest.mark.skipif(os.getpriority(os.PRIO_PROCESS, 0) >= 10,
                    reason="at nice 10 or more the background thread keeps the caller's niceness: nothing to tell apart")
@pytest.mark.skipif(not create("openvino").present, reason="openvino is not installed")
def test_openvinos_shared_threads_primed_first_serve_at_the_callers_priority():
    def niced_ticks(mode: str) -> int:
        done = subprocess.run([sys.executable, "-c", NICED_TICKS, mode], capture_output=True, text=True,
                              timeout=300, cwd=Path(__file__).parents[1])
        assert done.returncode == 0, done.stderr[-3000:]
        return int(done.stdout.split()[-1])

    if niced_ticks("plain") == 0:  # unprimed, TBB's workers start from the compiling thread, at nice 10
        pytest.skip("the machine is too busy for a worker at nice 10 to run: nothing to tell apart")
    assert niced_ticks("primed") == 0


@pytest.mark.slow
def test_a_faster_candidate_serves_at_once_while_later_ones_are_still_prepared(tmp_path):
    model = BUILDERS["cnn"]()
    feeds = random_feeds(model)
    starter = optimize(model, providers=["ort-cpu"], profile=False)
    candidate = optimize(model, providers=["openvino"], profile=False)
    released = threading.Event()

    def later(sample):  # a candidate that takes long to prepare: the faster one must not wait for it
        released.wait(120)
        return optimize(model, providers=["litert"], profile=False)

    def compile(plan):
        return Slowed(compile_plan(plan), 0.03 if plan is starter else 0.0)

    serving = Serving(starter, compile, "ort-cpu", lambda stopped, sample: {"openvino": lambda sample: candidate,
                                                                    "later": later}, explore_after_s=0.0)
    _call(serving, feeds, EXPLORE_AFTER)
    _wait(lambda: next(iter(serving.adaptation.values()))["serving"] == "openvino" or _step(serving, feeds))
    bucket = next(iter(serving.adaptation.values()))
    assert bucket["serving"] == "openvino" and bucket["decision"] is None, bucket  # "later" is still prepared
    released.set()
    serving.close()


def _step(serving: Serving, feeds) -> bool:
    serving.run(None, feeds)
    return False


def _trying_or_done(serving: Serving) -> bool:
    states = [c["state"] for b in serving.adaptation.values() for c in b["candidates"]]
    return bool(states) and "compiling" not in states


def test_a_much_slower_candidate_is_dropped_after_its_first_calls(tmp_path):
    model = BUILDERS["cnn"]()
    feeds = random_feeds(model)
    serving = _serving(model, 0.0, 0.1, tmp_path)
    _call(serving, feeds, EXPLORE_AFTER)
    _wait(lambda: _trying_or_done(serving))
    _call(serving, feeds, 4 * FIRST_ROUNDS * ROUND)
    _wait(lambda: _settled(serving))
    bucket = next(iter(serving.adaptation.values()))
    assert bucket["candidates"][0]["state"] == "slower", bucket
    assert bucket["candidates"][0]["calls"] == FIRST_ROUNDS * ROUND  # stopped after its first rounds, not a full trial
    assert bucket["serving"] == "ort-cpu" and "kept ort-cpu" in bucket["decision"]
    serving.close()


def test_a_round_lasts_round_s_at_each_arms_own_pace(tmp_path, monkeypatch):
    """A fast plan's rounds are many calls (the other arm's runtime threads may spin for tens of ms after its
    last call); a much slower candidate's are few, so that dropping it still costs the caller only its first
    rounds, about `FIRST_ROUNDS` x `ROUND_S`."""
    monkeypatch.setattr("uhop_onnx.adaptation.serving.ROUND_S", 0.2)
    assert round_calls(1e-4) == 2000 and round_calls(1.0) == ROUND
    model = BUILDERS["cnn"]()
    feeds = random_feeds(model)
    serving = _serving(model, 0.0, 0.1, tmp_path)
    _call(serving, feeds, EXPLORE_AFTER)
    _wait(lambda: _trying_or_done(serving))
    started = time.monotonic()
    while not _settled(serving):
        assert time.monotonic() - started < 60, serving.adaptation
        serving.run(None, feeds)
    bucket = next(iter(serving.adaptation.values()))
    assert bucket["candidates"][0]["state"] == "slower", bucket
    assert bucket["candidates"][0]["calls"] == FIRST_ROUNDS * ROUND, bucket  # 4 calls of 0.1 s: its 0.2 s
    assert bucket["calls"] > EXPLORE_AFTER + FIRST_ROUNDS * (ROUND + 2 * ROUND)  # the serving arm's rounds: more
    serving.close()


def test_a_kept_starter_is_served_as_decided_and_a_kept_plan_is_rechecked_against_onnxruntime_alone(tmp_path):
    model = BUILDERS["cnn"]()
    feeds = random_feeds(model)
    decisions = Decisions(tmp_path / "decisions")
    serving = _serving(model, 0.0, 0.1, tmp_path, decisions=decisions)  # the candidate is much slower
    _call(serving, feeds, EXPLORE_AFTER)
    _wait(lambda: _trying_or_done(serving))
    _call(serving, feeds, 4 * FIRST_ROUNDS * ROUND)
    _wait(lambda: _settled(serving) and decisions.table.read())
    serving.close()
    key = next(iter(serving.adaptation))
    assert decisions.read()[key][:2] == ("ort-cpu", None)  # the starter, kept without a copy of its plan
    assert [p for p in decisions.folder.iterdir() if p.is_dir()] == []

    starter = optimize(model, providers=["ort-cpu"], profile=False)

    def untouched(stopped, sample):
        raise AssertionError("a bucket kept on the starter explores nothing")

    again = Serving(starter, compile_plan, "ort-cpu", untouched, explore_after_s=0.0, decided=decisions.read(),
                    recheck="ort-cpu")
    assert_matches(_call(again, feeds, 3 * EXPLORE_AFTER), reference(model, feeds))
    bucket = again.adaptation[key]
    assert bucket["serving"] == "ort-cpu" and "as decided earlier" in bucket["decision"] and not bucket["candidates"]
    again.close()

    kept = optimize(model, providers=["openvino"], profile=False)
    offered = {"litert": lambda sample: pytest.fail("only ONNX Runtime re-checks a kept plan"),
               "ort-cpu": lambda sample: starter}
    third = Serving(starter, compile_plan, "ort-cpu", lambda stopped, sample: offered, explore_after_s=0.0,
                    decided={key: ("openvino", kept, 10, (), {})}, recheck="ort-cpu")
    _call(third, feeds, EXPLORE_AFTER)
    _wait(lambda: _trying_or_done(third) or _step(third, feeds))
    bucket = third.adaptation[key]
    assert [c["label"] for c in bucket["candidates"]] == ["ort-cpu"], bucket
    assert_matches(_call(third, feeds, 2), reference(model, feeds))
    third.close()

    # as a session builds it: started on the kept plan itself, which is re-checked, not explored again
    fourth = Serving(kept, compile_plan, "openvino", lambda stopped, sample: offered, explore_after_s=0.0,
                     decided={key: ("openvino", kept, 10, (), {})}, recheck="ort-cpu",
                     unplaced=lambda: ("ort-cpu", starter), referee=lambda: starter)
    _call(fourth, feeds, EXPLORE_AFTER)
    _wait(lambda: _trying_or_done(fourth) or _step(fourth, feeds))
    assert [c["label"] for c in fourth.adaptation[key]["candidates"]] == ["ort-cpu"], fourth.adaptation
    fourth.close()


def _decide(serving: Serving, feeds) -> dict:
    """Call `serving` until its one bucket has decided; that bucket's record."""
    _call(serving, feeds, EXPLORE_AFTER)
    _wait(lambda: _settled(serving) or _step(serving, feeds))
    return next(iter(serving.adaptation.values()))


@pytest.mark.slow
def test_a_candidate_dropped_on_its_first_rounds_at_a_ratio_noise_can_reach_is_tried_once_more_next_time(tmp_path):
    """Dropped at 2x after two rounds (a burst of noise can do that: LiteRT was dropped at 1.66x on a MobileNetV3
    it runs in 0.6x ONNX Runtime's time), the candidate is named in the decision kept; the next process, served as
    decided, tries it once more, then keeps what that trial shows without it."""
    model = BUILDERS["cnn"]()
    feeds = random_feeds(model)
    decisions = Decisions(tmp_path / "decisions")
    first = _serving(model, 0.01, 0.02, tmp_path, decisions=decisions)
    bucket = _decide(first, feeds)
    first.close()
    assert bucket["candidates"][0]["state"] == "slower", bucket
    _wait(lambda: decisions.read())
    label, plan, _, retry, _ = decisions.read()[bucket["bucket"]]
    assert (label, plan, retry) == ("ort-cpu", None, ("openvino",))

    again = _serving(model, 0.01, 0.02, tmp_path, decisions=decisions, decided=decisions.read())
    bucket = _decide(again, feeds)  # dropped again: kept so, not to be tried any more
    again.close()
    assert [c["label"] for c in bucket["candidates"]] == ["openvino"], bucket
    _wait(lambda: not decisions.read()[bucket["bucket"]][3])
    assert decisions.read()[bucket["bucket"]][:2] == ("ort-cpu", None)

    decisions.keep(bucket["bucket"], "ort-cpu", None, 10, ["openvino"])
    third = _serving(model, 0.01, 0.0, tmp_path, decisions=decisions, decided=decisions.read())
    bucket = _decide(third, feeds)  # faster this time: it serves, and is kept
    assert bucket["serving"] == "openvino" and "replaced ort-cpu" in bucket["decision"], bucket
    assert_matches(third.run(None, feeds)[0], reference(model, feeds))
    third.close()
    _wait(lambda: decisions.read()[bucket["bucket"]][0] == "openvino")
    assert not decisions.read()[bucket["bucket"]][3]


def test_a_bucket_kept_on_the_starter_is_served_so_when_the_session_started_on_another_buckets_plan():
    kept = optimize(ENCODER, providers=["openvino"], profile=False)

    def untouched(stopped, sample):
        raise AssertionError("a bucket kept on the starter explores nothing")

    serving = Serving(kept, compile_plan, "openvino", untouched, decided={
        "input_ids: 1x8": ("openvino", kept, 10, (), {}), "input_ids: 1x16": ("ort-cpu", None, 5, (), {})},
        recheck="ort-cpu", unplaced=lambda: ("ort-cpu", optimize(ENCODER, providers=["ort-cpu"], profile=False)),
        referee=lambda: optimize(ENCODER, providers=["ort-cpu"], profile=False))
    feeds = {"input_ids": np.arange(16, dtype=np.int64)[None] % 100}
    outputs, plan = serving.run(None, feeds)
    bucket = serving.adaptation["input_ids: 1x16"]
    assert plan.get_providers() == ["ort-cpu"] and "as decided earlier" in bucket["decision"], bucket
    want = onnxruntime.InferenceSession(ENCODER, providers=["CPUExecutionProvider"]).run(None, feeds)
    assert_matches(outputs, want)
    serving.close()


def test_a_budget_spent_before_the_candidates_says_so_and_keeps_nothing(tmp_path):
    model = BUILDERS["cnn"]()
    feeds = random_feeds(model)
    starter = optimize(model, providers=["ort-cpu"], profile=False)

    def slow(stopped, sample):  # asking for the candidates takes the whole budget (a large model)
        until = time.thread_time() + 0.3
        while time.thread_time() < until:
            pass
        return {"openvino": lambda sample: pytest.fail("tried past the budget")}

    decisions = Decisions(tmp_path / "decisions")
    serving = Serving(starter, compile_plan, "ort-cpu", slow, explore_after_s=0.0, budget_s=0.2, decisions=decisions)
    _call(serving, feeds, EXPLORE_AFTER)
    _wait(lambda: _settled(serving))
    bucket = next(iter(serving.adaptation.values()))
    assert "openvino untried (the adapt_budget (0.2 s of CPU) was spent)" in bucket["decision"], bucket
    assert bucket["candidates"] == [{"label": "openvino", "state": "untried", "calls": 0, "ms": None,
                                     "interval": None, "why": "the adapt_budget (0.2 s of CPU) was spent"}]
    serving.close()
    assert not decisions.table.read()  # decided on nothing measured: the next process explores


def test_the_budget_counts_work_not_waiting():
    """A background thread kept waiting (at nice 10 on a loaded machine) has spent none of its budget."""
    model = BUILDERS["cnn"]()
    feeds = random_feeds(model)
    starter = optimize(model, providers=["ort-cpu"], profile=False)
    candidate = optimize(model, providers=["openvino"], profile=False)

    def waited(stopped, sample):
        time.sleep(0.3)
        return {"openvino": lambda sample: candidate}

    serving = Serving(starter, compile_plan, "ort-cpu", waited, explore_after_s=0.0, budget_s=0.2)
    _call(serving, feeds, EXPLORE_AFTER)
    _wait(lambda: _trying_or_done(serving) or _step(serving, feeds))
    assert [c["label"] for c in next(iter(serving.adaptation.values()))["candidates"]] == ["openvino"]
    serving.close()


# In its own process (its stderr as a program's, logging configured as the argument says): a session whose
# candidate is a search with no budget, which warns of what it could not measure, on the background thread.
QUIET_BACKGROUND = """
import logging, sys, time

from tests.conftest import random_feeds
from uhop_onnx.adaptation.serving import Serving
from uhop_onnx.foundation.errors import logger
from uhop_onnx.models import BUILDERS
from uhop_onnx.products.optimizer import optimize
from uhop_onnx.runtime.compile import compile_plan

if sys.argv[1] != "none":
    logging.basicConfig(level=getattr(logging, sys.argv[1]), format="%(levelname)s %(threadName)s: %(message)s")
model = BUILDERS["cnn"]()
feeds = random_feeds(model)
starter = optimize(model, providers=["ort-cpu"], profile=False)
logger("uhop_onnx.products.optimizer").warning("said on the caller's thread")

def search(sample):
    logging.getLogger("another.library").warning("its budget warning")
    return optimize(model, providers=["ort-cpu", "openvino"], inputs=dict(sample), budget=0.0)

def candidates(stopped, sample):
    return {"search": search}

serving = Serving(starter, compile_plan, "ort-cpu", candidates, explore_after_s=0.0)
deadline = time.monotonic() + 120
tried = []
while not tried and time.monotonic() < deadline:
    serving.run(None, feeds)
    time.sleep(0.01)  # the background, at nice 10, gets the CPU
    tried = [c for b in serving.adaptation.values() for c in b["candidates"] if c["state"] != "compiling"]
print(tried)
serving.close()
"""


@pytest.mark.slow
@pytest.mark.parametrize("configured", ["none", "WARNING", "INFO"])
def test_the_background_warns_at_info_off_a_programs_stderr(configured, tmp_path):
    """What the background warns of (a search whose budget ran out) is said at INFO: on stderr only where the
    program shows INFO records; the same warning on the caller's thread stays a warning. Another library's
    warning there shows only where the program configured logging."""
    done = subprocess.run([sys.executable, "-c", QUIET_BACKGROUND, configured], capture_output=True, text=True,
                          timeout=300, cwd=Path(__file__).parents[1],
                          env={**os.environ, "UHOP_CACHE_DIR": str(tmp_path)})  # a search cached would not warn
    assert done.returncode == 0 and "'search'" in done.stdout, done.stderr[-3000:]
    said = [line for line in done.stderr.splitlines() if "budget" in line or "caller's thread" in line]
    assert said, done.stderr[-3000:]
    assert "said on the caller's thread" in said[0] and (configured == "none" or said[0].startswith("WARNING"))
    theirs = [line for line in said[1:] if "its budget warning" in line]
    ours = [line for line in said[1:] if line not in theirs]
    assert theirs == ([] if configured == "none" else ["WARNING uhop-adapt: its budget warning"]), said
    if configured == "INFO":
        assert ours and all(line.startswith("INFO uhop-adapt: ") for line in ours), said
    else:
        assert not ours, said


def test_a_candidate_whose_outputs_differ_is_refused(tmp_path):
    model = BUILDERS["cnn"]()
    other = BUILDERS["cnn"](seed=9)  # the same graph with other weights
    feeds = random_feeds(model)
    starter = optimize(model, providers=["ort-cpu"], profile=False)
    wrong = optimize(other, providers=["ort-cpu"], profile=False)
    serving = Serving(starter, compile_plan, "ort-cpu", lambda stopped, sample: {"wrong": lambda sample: wrong},
                      explore_after_s=0.0)
    _call(serving, feeds, EXPLORE_AFTER)
    _wait(lambda: _settled(serving))
    candidate = next(iter(serving.adaptation.values()))["candidates"][0]
    assert candidate["state"] == "refused" and "differs from ONNX Runtime's" in candidate["error"], candidate
    assert candidate["tolerance"] == "|y - ref| <= 2e-05 + 0.0002 x |ref|"
    serving.close()


def test_shape_buckets_are_exact_then_rounded_up_to_powers_of_two():
    starter = optimize(ENCODER, providers=["ort-cpu"], profile=False)
    serving = Serving(starter, compile_plan, "ort-cpu", lambda stopped, sample: {})
    for seq in range(1, 13):
        serving.run(None, {"input_ids": np.arange(seq, dtype=np.int64)[None] % 100})
    keys = list(serving.adaptation)
    assert "input_ids: 1x3" in keys and "input_ids: 1x16" in keys and "input_ids: 1x9" not in keys
    serving.close()


def test_a_call_of_several_inputs_is_bucketed_by_each():
    io = [onnx.helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, ["n"]) for name in "aby"]
    graph = onnx.helper.make_graph([onnx.helper.make_node("Add", ["a", "b"], ["y"])], "add", io[:2], io[2:])
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)], ir_version=8)
    serving = Serving(optimize(model, providers=["ort-cpu"], profile=False), compile_plan, "ort-cpu",
                      lambda stopped, sample: {})
    for n in (3, 5, 3):
        [y], _ = serving.run(None, {"a": np.ones(n, np.float32), "b": np.full(n, 2, np.float32)})
        np.testing.assert_array_equal(y, np.full(n, 3, np.float32))
    assert {key: b["calls"] for key, b in serving.adaptation.items()} == {"a: 3, b: 3": 2, "a: 5, b: 5": 1}
    serving.close()


@pytest.mark.slow
def test_a_search_at_another_buckets_shapes_gets_its_own_plan():
    """A candidate whose plan depends on the bucket's sample (the measured search) is made again at each
    bucket: the plan found at one bucket's shapes is not served at another's just because they share a label."""
    starter = optimize(ENCODER, providers=["ort-cpu"], profile=False)
    found = {4: optimize(ENCODER, providers=["openvino"], profile=False),
             8: optimize(ENCODER, providers=["litert"], profile=False)}

    def compile(plan):
        return Slowed(compile_plan(plan), 0.02 if plan is starter else 0.0)

    serving = Serving(starter, compile, "ort-cpu",
                      lambda stopped, sample: {"search": lambda sample: found[sample["input_ids"].shape[1]]},
                      explore_after_s=0.0, per_bucket={"search"})
    for seq in (4, 8):
        feeds = {"input_ids": np.arange(seq, dtype=np.int64)[None] % 100}
        _call(serving, feeds, EXPLORE_AFTER)
        _wait(lambda: (b := serving.adaptation.get(f"input_ids: 1x{seq}")) and b["decision"] or _step(serving, feeds))
    served = {key: b["serving"] for key, b in serving.adaptation.items()}
    assert served == {"input_ids: 1x4": "search", "input_ids: 1x8": "search"}, serving.adaptation
    for seq, plan in found.items():
        served = serving.run(None, {"input_ids": np.arange(seq, dtype=np.int64)[None] % 100})[1]
        assert [(s.provider, s.nodes) for s in served.stages] == [(s.provider, s.nodes) for s in plan.stages]
    serving.close()


def test_a_plan_another_bucket_is_warming_up_is_not_closed_by_this_buckets_verdict(monkeypatch):
    """Bucket 1x8 warms up the plan bucket 1x4 is trying (the same plan, shared); 1x4's verdict (dropped)
    must leave it open until 1x8's trial is over."""
    monkeypatch.setattr("uhop_onnx.adaptation.serving.TRIAL_S", 0.3)  # the background goes on to 1x8 while 1x4's trial runs
    starter = optimize(ENCODER, providers=["ort-cpu"], profile=False)
    candidate = optimize(ENCODER, providers=["openvino"], profile=False)
    warming, release = threading.Event(), threading.Event()

    class Held(Slowed):
        def run(self, output_names, feeds, **kwargs):
            if threading.current_thread().name == "uhop-adapt" and feeds["input_ids"].shape[1] == 8:
                warming.set()
                release.wait(60)
            return super().run(output_names, feeds, **kwargs)

    def compile(plan):
        return Slowed(compile_plan(plan), 0.0) if plan is starter else Held(compile_plan(plan), 0.05)

    serving = Serving(starter, compile, "ort-cpu", lambda stopped, sample: {"x": lambda sample: candidate},
                      explore_after_s=0.0)
    short, long = ({"input_ids": np.arange(n, dtype=np.int64)[None] % 60} for n in (4, 8))
    _call(serving, short, EXPLORE_AFTER)
    _wait(lambda: "trying" in str(serving.adaptation))
    _call(serving, long, EXPLORE_AFTER)
    _wait(warming.is_set)
    _wait(lambda: serving.adaptation["input_ids: 1x4"]["decision"] or _step(serving, short))  # dropped there
    release.set()
    _wait(lambda: serving.adaptation["input_ids: 1x8"]["candidates"][0]["state"] != "compiling")
    trial = serving.adaptation["input_ids: 1x8"]["candidates"][0]
    assert trial["state"] != "refused", trial
    serving.close()


@pytest.mark.slow
def test_session_starts_on_onnx_runtime_then_adapts_and_stays_correct_from_many_threads():
    model = BUILDERS["mobilenet"]()
    feeds = [random_feeds(model, seed) for seed in range(4)]
    expected = [reference(model, f) for f in feeds]
    session = uhop_onnx.InferenceSession(model.SerializeToString(), providers=["ort-cpu", "openvino"],
                                         adapt_budget=20.0)
    assert session.get_providers() == ["ort-cpu"] and len(session.plan.stages) == 1
    errors, calls = [], [0] * 4

    def client(k: int) -> None:
        try:
            deadline = time.monotonic() + 120
            while not _settled(session) and time.monotonic() < deadline:
                assert_matches(session.run(None, feeds[k]), expected[k])
                calls[k] += 1
        except Exception as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=client, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]
    adaptation = session.adaptation
    assert len(adaptation) == 1
    bucket = next(iter(adaptation.values()))
    assert bucket["calls"] == sum(calls)
    labels = {c["label"] for c in bucket["candidates"]}
    assert "openvino" in labels, bucket
    session.close()


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


def test_a_plan_is_not_adapted_unless_asked(tmp_path):
    model = BUILDERS["cnn"]()
    plan = optimize(model, providers=["ort-cpu"], profile=False)
    session = uhop_onnx.InferenceSession(plan)
    session.run(None, random_feeds(model))
    assert session.adaptation == {}
    with pytest.raises(uhop_onnx.InputError, match="needs the model"):
        uhop_onnx.InferenceSession(plan, adapt=True)


def _kept_on_openvino(tmp_path) -> tuple[onnx.ModelProto, Path, dict, Path]:
    """The cnn saved to a file, its feeds, and the folder of decisions that keep it on OpenVINO."""
    model = BUILDERS["cnn"]()
    path = tmp_path / "cnn.onnx"
    onnx.save(model, path)
    bucket = f"{model.graph.input[0].name}: 1x3x32x32"
    decisions = decisions_for(str(path), None, None, "device", None)
    decisions.keep(bucket, "openvino", optimize(model, providers=["openvino"], profile=False), 10)
    return model, path, random_feeds(model), decisions.folder


def test_a_kept_decision_starts_the_next_session_and_a_damaged_one_is_dropped(tmp_path, caplog):
    model, path, feeds, folder = _kept_on_openvino(tmp_path)
    again = uhop_onnx.InferenceSession(str(path))
    assert again.get_providers() == ["openvino"]  # it starts on what was decided
    assert_matches(again.run(None, feeds), reference(model, feeds))
    again.close()
    entry = next(iter(Decisions(folder).table.read().values()))
    stage = next((folder / entry["plan"]).glob("*.onnx"))
    data = bytearray(stage.read_bytes())
    data[len(data) // 2] ^= 0xFF
    stage.write_bytes(bytes(data))
    with caplog.at_level("WARNING"):
        third = uhop_onnx.InferenceSession(str(path))
    assert third.get_providers() == ["ort-cpu"] and "dropped and decided again" in caplog.text
    assert_matches(third.run(None, feeds), reference(model, feeds))
    third.close()
    assert str(cache_dir()) in str(folder)  # kept in the cache, under its cap


def test_a_kept_plan_is_rechecked_against_the_model_as_onnxruntime_runs_it(tmp_path, monkeypatch):
    """The re-check's ONNX Runtime is the model as given, unsimplified (what the program would run without
    uhop-onnx), not the simplified model on ONNX Runtime, which can run slower there."""
    monkeypatch.setenv("UHOP_CACHE_DIR", str(tmp_path / "cache"))
    _, path, feeds, _ = _kept_on_openvino(tmp_path)
    session = uhop_onnx.InferenceSession(str(path))
    assert session.get_providers() == ["openvino"]
    recheck = session._serving._candidates(lambda: False, feeds)["ort-cpu"](feeds)
    [stage] = recheck.stages
    assert stage.data == str(path.resolve()) and stage.nodes == [n.name for n in uhop_onnx.load(path).graph.node]
    session.close()


def test_a_replaced_decision_leaves_no_plan_behind(tmp_path, monkeypatch):
    monkeypatch.setattr("uhop_onnx.adaptation.serving.UNNAMED_S", 0.0)
    model = BUILDERS["cnn"]()
    decisions = Decisions(tmp_path / "decisions")
    for label in ("openvino", "ort-cpu"):
        decisions.keep("x: 1x3x32x32", label, optimize(model, providers=[label], profile=False), 10)
    entry = decisions.table.get("x: 1x3x32x32")
    assert entry["label"] == "ort-cpu"
    assert [p.name for p in decisions.folder.iterdir() if p.is_dir()] == [entry["plan"]]


def test_a_decision_settled_as_the_program_ends_is_not_an_error(tmp_path):
    """A background settle after the interpreter began to shut down cannot schedule its write: it is let go."""
    model = BUILDERS["cnn"]()
    starter = optimize(model, providers=["ort-cpu"], profile=False)
    serving = Serving(starter, compile_plan, "ort-cpu", lambda stopped, sample: {}, decisions=Decisions(tmp_path / "d"))
    serving.run(None, random_feeds(model))
    serving._keeper.shutdown()  # as at interpreter shutdown: new futures are refused
    serving._keep(next(iter(serving._buckets.values())))
    assert not serving.decisions.table.read()
    serving.close()


@pytest.mark.slow
def test_a_model_of_a_size_nothing_was_kept_for_starts_before_its_digest_and_keeps_its_decision(tmp_path,
                                                                                                  monkeypatch):
    """On a cold cache the starter compiles and serves before the model is hashed (on the background thread,
    once the session explores); the digest then names the starter's plan and keys the decision, which the next
    session (same size: it waits for the digest) starts on."""
    from uhop_onnx.foundation.cache import model_digest

    monkeypatch.setenv("UHOP_CACHE_DIR", str(tmp_path / "cache"))

    model = BUILDERS["cnn"]()
    path = tmp_path / "cnn.onnx"
    onnx.save(model, path)
    feeds = random_feeds(model)
    session = uhop_onnx.InferenceSession(str(path), adapt_budget=0.01)
    assert callable(session._serving.decisions) and not session.plan.model_hash  # keyed once it explores
    assert_matches(session.run(None, feeds), reference(model, feeds))
    deadline = time.monotonic() + 120
    while not session.plan.model_hash:  # it explores after EXPLORE_AFTER_S of calls
        assert time.monotonic() < deadline, "the session never explored"
        session.run(None, feeds)
    assert session.plan.model_hash == model_digest(str(path))
    folder = session._serving.decisions.folder
    assert folder.name.startswith(f"{path.stat().st_size}-")
    bucket = next(iter(session.adaptation))
    session.close()
    Decisions(folder).keep(bucket, "openvino", optimize(model, providers=["openvino"], profile=False), 10)
    again = uhop_onnx.InferenceSession(str(path))
    assert isinstance(again._serving.decisions, Decisions) and again.get_providers() == ["openvino"]
    again.close()


def test_float16_nodes_go_to_openvino_only_in_a_candidate_checked_on_the_programs_inputs():
    """OpenVINO computes float16 graphs in f32 between ops, so placement keeps float16 nodes off it; an adapting
    session tries it with them as a candidate of its own, whose outputs are checked on the bucket's sample."""
    from onnxconverter_common import float16

    model = float16.convert_float_to_float16(BUILDERS["cnn"](), keep_io_types=True)
    feeds = random_feeds(model)
    placed = optimize(model, providers=["openvino", "ort-cpu"], profile=False)
    assert "openvino" not in {s.provider for s in placed.stages if len(s.nodes) > 1}, placed.stages
    session = adaptive(model, ["ort-cpu", "openvino"], None, "device", compile_plan, budget_s=60.0, assign=None,
                       strict=False)
    label = "openvino (float16 checked)"
    recipe = session._candidates(lambda: False, feeds)[label]
    plan = recipe(feeds)
    assert {s.provider for s in plan.stages if len(s.nodes) > 1} == {"openvino"}, plan.stages
    executor = compile_plan(plan)
    assert_matches(executor.run(None, feeds), reference(model, feeds))
    executor.close()
    serving = Serving(session.starter.plan, compile_plan, "ort-cpu", lambda stopped, sample: {label: recipe},
                      explore_after_s=0.0)
    _wait(lambda: _step(serving, feeds) or _trying_or_done(serving))
    trial = next(iter(serving.adaptation.values()))["candidates"][0]
    assert trial["label"] == label and trial["state"] != "refused", trial
    serving.close()
    session.close()


def test_candidates_are_made_at_the_programs_inputs_where_a_fixed_shape_runtime_takes_shape_arithmetic():
    """The shipped encoder computes its shapes from free dimensions (Shape, Gather, Concat, as exporters write
    it): LiteRT, which converts at fixed shapes, takes it whole only when asked at the program's inputs (asked
    without them, it took 5 of 11 stages, the rest left to ONNX Runtime)."""
    feeds = {"input_ids": np.random.default_rng(0).integers(0, 64, (1, 12), dtype=np.int64)}
    session = adaptive(ENCODER, ["litert", "ort-cpu"], None, "device", compile_plan, budget_s=60.0, assign=None,
                       strict=False)
    plan = session._candidates(lambda: False, feeds)["litert"](feeds)
    assert [s.provider for s in plan.stages] == ["litert"], plan.stages
    with compile_plan(plan) as executor:
        assert_matches(executor.run(None, feeds), reference(onnx.load(ENCODER), feeds))
    session.close()
