"""Caches that cannot break a run: entries of the wrong type are ignored, measured again and reported once with
the file's path; a cache folder that cannot be written means no cache, not a crash."""

from __future__ import annotations

import json
import logging
import os

import pytest

import uhop_onnx
from uhop_onnx.foundation.cache import JsonTable, cache_dir
from uhop_onnx.custom_ops import autotune
from uhop_onnx.custom_ops.verify import host_library
from uhop_onnx.models import cnn, mlp
from uhop_onnx.runtime.measure import Measurement
from uhop_onnx.providers import create

from .conftest import assert_matches, random_feeds, reference

PROVIDERS = ["openvino", "ort-cpu"] if create("openvino").present else ["ort-cpu"]


def optimize(model):
    return uhop_onnx.optimize(model, providers=PROVIDERS, budget=300)


def warnings_about(caplog, path) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and str(path) in r.getMessage()]


def test_a_table_ignores_and_reports_invalid_entries_once(tmp_path, caplog):
    path = tmp_path / "table.json"
    path.write_text(json.dumps({"good": {"ms": 1.0, "spread": 0.1, "rounds": 5, "error": None},
                                "bad": {"ms": "fast", "spread": 0, "rounds": 1, "error": None}, "worse": [1, 2]}))
    table = JsonTable(path, check=Measurement.from_json)
    with caplog.at_level(logging.WARNING):
        assert set(table.read()) == {"good"}
        assert set(table.read()) == {"good"}
    (message,) = warnings_about(caplog, path)
    assert "2 invalid entries" in message and "ms is 'fast'" in message
    table.update({"new": {"ms": 2.0, "spread": 0.0, "rounds": 5, "error": None}})
    assert set(json.loads(path.read_text())) == {"good", "new"}  # the invalid ones are gone from the file


@pytest.mark.slow
def test_invalid_profile_entries_are_measured_again(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("UHOP_CACHE_DIR", str(tmp_path))
    first = optimize(mlp())
    (profile,) = (tmp_path / "profiles").glob("*.json")
    entries = json.loads(profile.read_text())
    profile.write_text(json.dumps({key: {"ms": "fast", "spread": None, "rounds": "5"} for key in entries}))
    for plan in (tmp_path / "plans").iterdir():  # the measured plan is cached too: make the search run again
        for f in plan.iterdir():
            f.unlink()
        plan.rmdir()
    with caplog.at_level(logging.WARNING):
        again = optimize(mlp())
    assert again.profile["cached"] == 0 and again.profile["measured"] == first.profile["measured"]
    assert len(warnings_about(caplog, profile)) == 1
    assert all(Measurement.from_json(e) for e in json.loads(profile.read_text()).values())  # rewritten whole
    feeds = random_feeds(mlp())
    assert_matches(uhop_onnx.InferenceSession(again).run(None, feeds), reference(mlp(), feeds))


@pytest.mark.parametrize("kind", ["not a folder", "read-only"])
def test_an_unwritable_cache_folder_means_no_cache(monkeypatch, tmp_path, caplog, kind):
    if kind == "not a folder":
        (tmp_path / "file").write_text("")
        folder = tmp_path / "file" / "cache"
    else:
        if os.geteuid() == 0:
            pytest.skip("root writes into a read-only folder")
        folder = tmp_path / "cache"
        folder.mkdir(mode=0o555)
    monkeypatch.setenv("UHOP_CACHE_DIR", str(folder))
    with caplog.at_level(logging.WARNING):
        plan = optimize(mlp())
    assert plan.profile["measured"] > 0
    assert any("cannot be written" in m for m in warnings_about(caplog, folder))
    feeds = random_feeds(mlp())
    assert_matches(uhop_onnx.InferenceSession(plan).run(None, feeds), reference(mlp(), feeds))


@pytest.mark.skipif(not create("kernels").present, reason="no C compiler for the kernels")
def test_invalid_autotune_entries_are_ignored(caplog):
    model = cnn()
    providers = [("kernels", {}), "ort-cpu"]
    feeds = random_feeds(model)
    session = uhop_onnx.InferenceSession(model, providers=providers, profile=False, threads=1)
    session.run(None, feeds)
    keys = [f"{op}|threads={threads}" for runner in session._executor.runners
            for op, threads in getattr(runner, "schedules", {})]
    assert keys
    path = autotune.cache_file(host_library())
    assert path.is_relative_to(cache_dir())
    bad = [{"schedule": {"micro": 99}}, {"schedule": {"micro": "0", "mc": 72}}, {"schedule": "fast"}, None]
    JsonTable(path).update({key: bad[k % len(bad)] for k, key in enumerate(keys)})
    with caplog.at_level(logging.WARNING):
        again = uhop_onnx.InferenceSession(model, providers=providers, profile=False, threads=1)
        assert_matches(again.run(None, feeds), reference(model, feeds))
    assert len(warnings_about(caplog, path)) == 1
