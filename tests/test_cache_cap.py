"""An honest cache: models known by the hash of their bytes, a damaged plan dropped and measured again once,
a size cap that removes the least recently used entries first, entries whole under concurrent writers, and
`uhop-onnx cache info|prune|clear`."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time

import numpy as np
import onnx
import pytest
from onnx import numpy_helper
from typer.testing import CliRunner

import uhop_onnx
from uhop_onnx.foundation import cache
from uhop_onnx.foundation.cache import cache_dir, clear, entries, file_digest, parse_size, prune
from uhop_onnx.cli import app
from uhop_onnx.foundation.errors import InputError
from uhop_onnx.models import mlp
from uhop_onnx.runtime.plan import Plan

from .conftest import assert_matches, random_feeds, reference


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("UHOP_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("UHOP_CACHE_MAX", raising=False)


def optimize(path):
    return uhop_onnx.optimize(str(path), providers=["ort-cpu"], budget=1)


def other_weights(model: onnx.ModelProto) -> onnx.ModelProto:
    """`model` with every weight plus one: another model of exactly the same size."""
    changed = onnx.ModelProto()
    changed.CopyFrom(model)
    for init in changed.graph.initializer:
        init.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(init) + 1, init.name))
    return changed


def replace_keeping_size_and_mtime(path, model: onnx.ModelProto) -> None:
    """Write `model` over `path` in place, then give it back its size and modification time (as `cp -p`)."""
    before = path.stat()
    data = model.SerializeToString()
    assert len(data) == before.st_size
    path.write_bytes(data)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = path.stat()
    assert (after.st_size, after.st_mtime_ns, after.st_ino) == (before.st_size, before.st_mtime_ns, before.st_ino)


def test_a_model_replaced_by_one_of_the_same_size_and_time_gets_a_new_plan(tmp_path, monkeypatch):
    monkeypatch.setattr(cache, "RACY_S", 0.0)  # remember digests of files written a moment ago
    monkeypatch.setattr(cache, "LARGE", 0)  # and of small files
    path = tmp_path / "m.onnx"
    onnx.save(mlp(), path)
    first = optimize(path)
    assert json.loads((cache_dir() / "model-hashes.json").read_text())[str(path.resolve())][1] == first.model_hash
    replace_keeping_size_and_mtime(path, other_weights(mlp()))
    second = optimize(path)
    assert second.model_hash != first.model_hash and len(list((cache_dir() / "plans").iterdir())) == 2
    feeds = random_feeds(mlp())
    assert_matches(uhop_onnx.InferenceSession(second).run(None, feeds), reference(other_weights(mlp()), feeds))


def test_a_model_whose_external_data_was_replaced_gets_a_new_plan(tmp_path):
    path = tmp_path / "m.onnx"

    def save(model):
        (tmp_path / "w.bin").unlink(missing_ok=True)
        onnx.save(model, path, save_as_external_data=True, all_tensors_to_one_file=True, location="w.bin",
                  size_threshold=0)
        return path.read_bytes()

    kept = save(mlp())
    first = optimize(path)
    assert save(other_weights(mlp())) == kept  # the model file is the same; its weights beside it are not
    second = optimize(path)
    assert second.model_hash != first.model_hash
    feeds = random_feeds(mlp())
    assert_matches(uhop_onnx.InferenceSession(second).run(None, feeds), reference(other_weights(mlp()), feeds))


def test_a_digest_is_remembered_only_for_the_same_version_of_the_file(tmp_path, monkeypatch):
    monkeypatch.setattr(cache, "LARGE", 0)  # small files are hashed each time
    path = tmp_path / "m.onnx"
    path.write_bytes(b"first")
    assert file_digest(path) == file_digest(path)
    assert not (cache_dir() / "model-hashes.json").exists()  # written a moment ago: its times may not tell yet
    monkeypatch.setattr(cache, "RACY_S", 0.0)
    one = file_digest(path)
    assert json.loads((cache_dir() / "model-hashes.json").read_text())[str(path)][1] == one
    before = path.stat()
    path.write_bytes(b"other")
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert file_digest(path) != one


def test_a_damaged_cached_plan_is_dropped_and_measured_again_once(tmp_path, caplog):
    path = tmp_path / "m.onnx"
    onnx.save(mlp(), path)
    optimize(path)
    [folder] = (cache_dir() / "plans").iterdir()
    [stage] = folder.glob("stage_*.onnx")
    data = bytearray(stage.read_bytes())
    data[len(data) // 2] ^= 1
    stage.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING):
        again = optimize(path)
    assert [m for m in caplog.messages if "fails its check" in m and str(folder) in m]
    feeds = random_feeds(mlp())
    assert_matches(uhop_onnx.InferenceSession(again).run(None, feeds), reference(mlp(), feeds))
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        third = optimize(path)  # the rebuilt entry is whole: reused without a warning
    assert not [m for m in caplog.messages if "fails its check" in m]
    assert Plan.load(folder).stages[0].sha256 == third.stages[0].sha256


def test_sizes_are_read_as_bytes_or_with_a_unit(monkeypatch):
    assert [parse_size(t) for t in ("1024", "500M", "2G", "1.5k", "2GiB")] == [1024, 500 * 2**20, 2 * 2**30, 1536,
                                                                               2 * 2**30]
    with pytest.raises(InputError, match="UHOP_CACHE_MAX='lots' is not a size"):
        parse_size("lots")
    assert cache.cache_cap() == 2 * 2**30
    monkeypatch.setenv("UHOP_CACHE_MAX", "10M")
    assert cache.cache_cap() == 10 * 2**20


def fill(kind: str, name: str, size: int, used: float) -> None:
    path = cache_dir() / kind / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"x" * size)
    os.utime(path, (used, used))


def test_prune_removes_the_least_recently_used_first_and_leaves_writes_under_way():
    now = time.time()
    fill("quantized", "old.onnx", 4000, now - 300)
    fill("litert", "older.tflite", 4000, now - 400)
    fill("quantized", "recent.onnx", 4000, now - 100)
    fill("plans", ".staging-under-way", 9000, now - 500)  # another process writing
    (cache_dir() / "rknn-venv").mkdir()
    (cache_dir() / "rknn-venv" / "python").write_bytes(b"x" * 9000)
    cache.touch(cache_dir() / "litert" / "older.tflite")  # used now
    report = prune(8500)
    assert [r["path"] for r in report["removed"]] == [str(cache_dir() / "quantized" / "old.onnx")]
    assert (report["before"], report["bytes"], report["cap"]) == (12000, 8000, 8500)
    assert {e.path.name for e in entries()} == {"older.tflite", "recent.onnx"}
    assert (cache_dir() / "plans" / ".staging-under-way").exists() and (cache_dir() / "rknn-venv").exists()
    assert clear()["bytes"] == 0 and entries() == []


def test_optimize_keeps_the_cache_under_its_cap(tmp_path, monkeypatch):
    fill("quantized", "stale.onnx", 300_000, time.time() - 3600)
    monkeypatch.setenv("UHOP_CACHE_MAX", "200K")  # room for the plan (about 120 KB), not for both
    path = tmp_path / "m.onnx"
    onnx.save(mlp(), path)
    optimize(path)
    assert not (cache_dir() / "quantized" / "stale.onnx").exists()
    assert sum(e.bytes for e in entries()) <= 200 * 1024 and list((cache_dir() / "plans").iterdir())


WRITER = """
import sys, onnx, uhop_onnx
plan = uhop_onnx.optimize(sys.argv[1], providers=["ort-cpu"], budget=1)
"""


@pytest.mark.slow
def test_plans_written_by_several_processes_at_once_stay_whole(tmp_path):
    path = tmp_path / "m.onnx"
    onnx.save(mlp(), path)
    env = {**os.environ, "UHOP_CACHE_DIR": str(cache_dir())}
    writers = [subprocess.Popen([sys.executable, "-c", WRITER, str(path)], env=env) for _ in range(3)]
    assert [w.wait(timeout=120) for w in writers] == [0, 0, 0]
    folders = list((cache_dir() / "plans").iterdir())
    assert folders and not [f for f in folders if f.name.startswith(".")]  # no staging folder left
    for folder in folders:  # one, unless the source changed meanwhile (its hash is in the key)
        plan = Plan.load(folder)
        assert all(plan.stage_model(s) is not None for s in plan.stages)  # every file matches its sha256


def test_cli_cache_info_prune_and_clear():
    fill("quantized", "a.onnx", 3000, time.time() - 200)
    fill("plans", "b", 0, time.time())
    fill("quantized", "c.onnx", 2000, time.time() - 100)
    runner = CliRunner()
    shown = runner.invoke(app, ["cache", "info", "--json"])
    assert shown.exit_code == 0, shown.output
    info = json.loads(shown.output)
    assert info["folder"] == str(cache_dir()) and info["bytes"] == 5000 and info["cap"] == 2 * 2**30
    assert info["kinds"] == {"plans": {"entries": 1, "bytes": 0}, "quantized": {"entries": 2, "bytes": 5000}}
    text = runner.invoke(app, ["cache", "info"], env={"COLUMNS": "80"})
    assert text.exit_code == 0 and "4.9 KiB in 3 entries, cap 2.0 GiB" in text.output and "quantized" in text.output
    pruned = runner.invoke(app, ["cache", "prune", "--max", "2500", "--json"])
    assert [r["path"].endswith("a.onnx") for r in json.loads(pruned.output)["removed"]] == [True]
    bad = runner.invoke(app, ["cache", "prune", "--max", "big"])
    assert isinstance(bad.exception, InputError) and "--max='big' is not a size" in str(bad.exception)
    cleared = runner.invoke(app, ["cache", "clear"])
    assert cleared.exit_code == 0 and "removed 2 entries" in cleared.output and entries() == []
