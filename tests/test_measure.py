"""The measuring engine: the one calibration rule, workers that build only what `uhop_onnx.` names, plans
saved for timing without reports."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

import uhop_onnx
from uhop_onnx import InputError
from uhop_onnx.runtime.measure import Candidate, time_candidates
from uhop_onnx.models import mlp
from uhop_onnx.foundation.timing import calls_per_round, round_median

from .conftest import random_feeds


class Clock:
    """A clock that each reading moves on by `step` seconds: every timed call lasts `step`."""

    def __init__(self, step: float):
        self.now, self.step = 0.0, step

    def __call__(self) -> float:
        self.now += self.step
        return self.now


def test_calls_per_round_fill_the_target_within_bounds():
    clock = Clock(0.002)  # every call takes 2 ms on this clock
    assert calls_per_round(lambda: None, 0.02, 1, 25, clock=clock) == 10
    assert calls_per_round(lambda: None, 0.02, 1, 5, clock=clock) == 5
    assert calls_per_round(lambda: None, 0.001, 3, 50, clock=clock) == 3
    assert round_median(lambda: None, 4, clock) == pytest.approx(0.002)


def test_a_builder_outside_uhop_onnx_is_refused():
    with pytest.raises(InputError, match="'os:system' must be 'uhop_onnx.<module>:<function>'"):
        Candidate("shell", "true", build="os:system")
    request = {"candidate": {"name": "shell", "target": "true", "build": "subprocess:run"}, "model": None,
               "feeds": "absent.npz", "threads": 1, "calls": 1}
    said = subprocess.run([sys.executable, "-m", "uhop_onnx.runtime.measure", "worker", json.dumps(request)],
                          capture_output=True, text=True, timeout=120).stdout
    assert "subprocess:run" in said and "ready" not in said


def test_a_saved_plan_is_timed_in_its_own_worker(tmp_path):
    model = mlp()
    plan = uhop_onnx.optimize(model, providers=["ort-cpu"], profile=False)
    plan.save(tmp_path / "plan", report=False)
    assert not (tmp_path / "plan" / "report.md").exists() and (tmp_path / "plan" / "plan.json").is_file()
    figures = time_candidates([Candidate("plan", str(tmp_path / "plan")),
                               Candidate("missing", str(tmp_path / "nowhere"))], None, random_feeds(model), 1, 2, 2)
    assert figures["plan"]["error"] is None and np.isfinite(figures["plan"]["ms"])
    assert figures["plan"]["stages"] == [f"ort-cpu x{len(plan.stages[0].nodes)}"]
    assert len(figures["plan"]["round_medians_ms"]) == 2
    assert figures["missing"]["ms"] is None and "not a plan folder" in figures["missing"]["error"]


@pytest.mark.parametrize("one_by_one", [False, True])
def test_workers_start_one_by_one_when_asked(tmp_path, monkeypatch, one_by_one):
    """One by one, a worker starts once the one before it said it is ready (an adaptive session measuring
    while it warms up then has the machine to itself); else all start at once."""
    import uhop_onnx.runtime.measure as measure

    model = mlp()
    uhop_onnx.optimize(model, providers=["ort-cpu"], profile=False).save(tmp_path / "plan", report=False)
    events: list[tuple[str, str]] = []
    spawn, reply = measure._spawn, measure._reply

    def spawned(command, log):
        events.append(("start", json.loads(command[1])["candidate"]["name"]))
        return spawn(command, log)

    def replied(worker, replies, word, log):
        said = reply(worker, replies, word, log)
        if word == "ready":
            events.append(("ready", ""))
        return said

    monkeypatch.setattr(measure, "_spawn", spawned)
    monkeypatch.setattr(measure, "_reply", replied)
    figures = time_candidates([Candidate("a", str(tmp_path / "plan")), Candidate("b", str(tmp_path / "plan"))],
                              None, random_feeds(model), 1, 2, 2, one_by_one=one_by_one)
    assert all(f["error"] is None for f in figures.values())
    if one_by_one:
        assert events == [("start", "a"), ("ready", ""), ("start", "b"), ("ready", "")]
    else:
        assert events[:2] == [("start", "a"), ("start", "b")]


def test_workers_import_the_installed_package_not_a_uhop_onnx_folder_in_the_working_directory(tmp_path,
                                                                                            monkeypatch):
    """Run from a source checkout after a plain `pip install .`, `python -m` put the checkout's `uhop_onnx/`
    (whose providers live elsewhere in the source) before the installed package: every worker failed with
    "No module named 'uhop_onnx.providers'"."""
    model = mlp()
    uhop_onnx.optimize(model, providers=["ort-cpu"], profile=False).save(tmp_path / "plan", report=False)
    (tmp_path / "checkout" / "uhop_onnx").mkdir(parents=True)
    (tmp_path / "checkout" / "uhop_onnx" / "__init__.py").write_text("raise ImportError('the checkout, shadowing')\n")
    monkeypatch.chdir(tmp_path / "checkout")
    figures = time_candidates([Candidate("plan", str(tmp_path / "plan"))], None, random_feeds(model), 1, 2, 2)
    assert figures["plan"]["error"] is None and np.isfinite(figures["plan"]["ms"]), figures["plan"]
