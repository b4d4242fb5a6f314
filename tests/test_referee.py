"""ONNX Runtime referees every decision: a candidate, and a plan an earlier process kept, serves only once it
agrees with ONNX Runtime running the model itself on the program's own inputs; calls holding NaN or Inf go to
ONNX Runtime; a kept decision is read only when it is what it claims to be (its model, its files, a cache no
other user could write); the decision tables survive hostile contents and concurrent writers."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime
import pytest
from onnx import TensorProto, helper

import uhop_onnx
from uhop_onnx.adaptation.serving import EXPLORE_AFTER, Decisions
from uhop_onnx.foundation.cache import cache_dir, distrust
from uhop_onnx.models import BUILDERS
from uhop_onnx.products.optimizer import optimize
from uhop_onnx.products.session import decisions_for

from .conftest import random_feeds


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("UHOP_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr("uhop_onnx.adaptation.serving.EXPLORE_AFTER_S", 0.0)


def _ort(model, feeds) -> list[np.ndarray]:
    data = model if isinstance(model, (str, Path)) else model.SerializeToString()
    return onnxruntime.InferenceSession(str(data) if isinstance(data, Path) else data,
                                        providers=["CPUExecutionProvider"]).run(None, feeds)


def _same(got, want) -> bool:
    return all(np.array_equal(a, b, equal_nan=True) for a, b in zip(got, want))


def _adds(value: float) -> onnx.ModelProto:
    """y = x + value, x of shape 1x4: two models whose node and tensor names are the same."""
    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "c"], ["y"], name="add")], "adds",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor("c", TensorProto.FLOAT, [1], [value])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)


def _keep(path: Path, bucket: str, label: str, plan, digest: str | None = None) -> Decisions:
    """Keep `plan` for `bucket` as a session on the model at `path` would find it (its digest: `digest`,
    else the model's own)."""
    decisions = decisions_for(str(path), None, None, "device", None)
    if digest is not None:
        decisions.digest = digest
    decisions.keep(bucket, label, plan, 10)
    return decisions


def test_a_forged_kept_plan_is_refused_on_its_first_call_and_onnxruntime_serves_from_then_on(tmp_path, caplog):
    """A plan computing x+2, recorded as made for the model computing x+1 (its digest and file hashes right),
    is compared with ONNX Runtime on the call that would switch to it, dropped with one warning, and the
    refusal is kept."""
    path = tmp_path / "adds.onnx"
    onnx.save(_adds(1.0), path)
    forged = optimize(_adds(2.0), providers=["openvino"], profile=False)
    decisions = _keep(path, "x: 1x4", "openvino", forged)
    feeds = {"x": np.arange(4, dtype=np.float32)[None]}
    with caplog.at_level(logging.WARNING, logger="uhop_onnx"):
        session = uhop_onnx.InferenceSession(str(path))
        for _ in range(50):
            assert _same(session.run(None, feeds), _ort(path, feeds))
    said = [r.getMessage() for r in caplog.records if "refused openvino" in r.getMessage()]
    assert len(said) == 1 and "output 'y' differs from ONNX Runtime's" in said[0] and "x: 1x4" in said[0]
    bucket = session.adaptation["x: 1x4"]
    assert bucket["serving"] == "ort-cpu" and bucket["decision"].startswith("refused openvino"), bucket
    session.close()
    entry = decisions.table.get("x: 1x4")
    assert entry["label"] == "ort-cpu" and "openvino" in entry["refused"], entry
    again = uhop_onnx.InferenceSession(str(path))  # the next process does not switch to it again
    for _ in range(3 * EXPLORE_AFTER):
        assert _same(again.run(None, feeds), _ort(path, feeds))
    assert again.get_providers() == ["ort-cpu"] and again.adaptation["x: 1x4"]["state"] == "decided"
    again.close()


def _cnn_kept_on_openvino(tmp_path):
    """The cnn saved to a file, kept on OpenVINO for its bucket: (model, path, bucket, feeds)."""
    model = BUILDERS["cnn"]()
    path = tmp_path / "cnn.onnx"
    onnx.save(model, path)
    bucket = f"{model.graph.input[0].name}: 1x3x32x32"
    _keep(path, bucket, "openvino", optimize(model, providers=["openvino"], profile=False))
    return model, path, bucket, random_feeds(model)


def test_a_kept_openvino_plan_never_serves_a_call_holding_nan(tmp_path):
    """OpenVINO turns NaN into numbers in the cnn (ONNX Runtime keeps NaN): the kept plan agrees with ONNX
    Runtime on finite calls and serves them; every call holding NaN or Inf is ONNX Runtime's, before the
    switch (a call holding NaN cannot check it) and after."""
    model, path, bucket, feeds = _cnn_kept_on_openvino(tmp_path)
    poisoned = {name: value.copy() for name, value in feeds.items()}
    for value in poisoned.values():
        value.flat[::7] = np.nan
        value.flat[1] = np.inf
    session = uhop_onnx.InferenceSession(str(path))
    mismatches = sum(not _same(session.run(None, poisoned), _ort(path, poisoned)) for _ in range(40))
    assert mismatches == 0 and session.adaptation[bucket]["serving"] == "ort-cpu"
    for _ in range(2):  # the first finite call switches (ONNX Runtime serves it), the next runs on OpenVINO
        outputs, plan = session._serving.run(None, feeds)
    assert plan.get_providers() == ["openvino"]
    np.testing.assert_allclose(outputs[0], _ort(path, feeds)[0], rtol=2e-4, atol=2e-5)
    mismatches = sum(not _same(session.run(None, poisoned), _ort(path, poisoned)) for _ in range(40))
    assert mismatches == 0 and session.adaptation[bucket]["serving"] == "openvino"
    session.close()


def test_a_plan_kept_for_another_model_is_refused(tmp_path, caplog):
    path = tmp_path / "adds.onnx"
    onnx.save(_adds(1.0), path)
    other = optimize(_adds(2.0), providers=["openvino"], profile=False)  # its own digest recorded
    decisions = decisions_for(str(path), None, None, "device", None)
    Decisions(decisions.folder).keep("x: 1x4", "openvino", other, 10)  # kept without this model's digest
    with caplog.at_level(logging.WARNING, logger="uhop_onnx"):
        assert decisions.read() == {}
    assert "made for another model" in caplog.text
    session = uhop_onnx.InferenceSession(str(path))
    assert session.get_providers() == ["ort-cpu"]
    session.close()


def test_a_kept_plan_folder_that_links_out_of_the_cache_is_refused(tmp_path, caplog):
    path = tmp_path / "adds.onnx"
    onnx.save(_adds(1.0), path)
    decisions = _keep(path, "x: 1x4", "openvino", optimize(_adds(1.0), providers=["openvino"], profile=False))
    entry = decisions.table.get("x: 1x4")
    outside = tmp_path / "outside"
    (decisions.folder / entry["plan"]).rename(outside)
    (decisions.folder / entry["plan"]).symlink_to(outside, target_is_directory=True)
    with caplog.at_level(logging.WARNING, logger="uhop_onnx"):
        assert decisions.read() == {}
    assert "symbolic link" in caplog.text


@pytest.mark.parametrize("owner", ["self", "other"])
def test_a_cache_another_user_could_write_is_not_used(tmp_path, monkeypatch, caplog, owner):
    if owner == "other" and os.geteuid() != 0:
        pytest.skip("giving a folder to another user needs root")
    path = tmp_path / "adds.onnx"
    onnx.save(_adds(1.0), path)
    shared = tmp_path / "shared-cache"
    monkeypatch.setenv("UHOP_CACHE_DIR", str(shared))
    _keep(path, "x: 1x4", "openvino", optimize(_adds(1.0), providers=["openvino"], profile=False))
    shared.chmod(0o777)
    if owner == "other":
        os.chown(shared, 65534, 65534)
    assert distrust(shared)
    with caplog.at_level(logging.WARNING, logger="uhop_onnx"):
        session = uhop_onnx.InferenceSession(str(path))
        assert cache_dir() != shared and cache_dir() == cache_dir()
    assert session.get_providers() == ["ort-cpu"]  # the plan kept there is not read
    said = [r.getMessage() for r in caplog.records if str(shared) in r.getMessage()]
    assert len(said) == 1 and "chmod go-w" in said[0], said
    session.close()
    shared.chmod(0o700)
    os.chown(shared, os.geteuid(), os.getegid())
    assert distrust(shared) is None and cache_dir() == shared


def test_a_cache_folder_made_by_uhop_is_private(tmp_path, monkeypatch):
    monkeypatch.setenv("UHOP_CACHE_DIR", str(tmp_path / "a" / "b"))
    umask = os.umask(0o002)  # a user-private-group umask: folders are group-writable by default
    try:
        assert cache_dir() == tmp_path / "a" / "b"
    finally:
        os.umask(umask)
    assert (tmp_path / "a" / "b").stat().st_mode & 0o777 == 0o700 and distrust(tmp_path / "a" / "b") is None


@pytest.mark.parametrize("contents", ["[" * 100000 + "]" * 100000, '{"x: 1x4": ' * 40 + "1" + "}" * 40,
                                      " " * (17 * 1024**2)])
def test_a_hostile_decisions_table_gives_one_warning_and_the_session_runs(tmp_path, caplog, contents):
    path = tmp_path / "adds.onnx"
    onnx.save(_adds(1.0), path)
    folder = decisions_for(str(path), None, None, "device", None).folder
    folder.mkdir(parents=True)
    (folder / "decisions.json").write_text(contents)
    feeds = {"x": np.ones((1, 4), np.float32)}
    with caplog.at_level(logging.WARNING, logger="uhop_onnx"):
        session = uhop_onnx.InferenceSession(str(path))
        for _ in range(EXPLORE_AFTER + 1):  # read once the bucket is to be decided
            assert _same(session.run(None, feeds), _ort(path, feeds))
    assert "decisions.json" in caplog.text and "set aside" in caplog.text
    session.close()


KEEPER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from uhop_onnx.adaptation.serving import Decisions
    from uhop_onnx.products.optimizer import optimize
    from tests.test_referee import _adds
    folder, who, start = Path(sys.argv[1]), sys.argv[2], float(sys.argv[3])
    plan = optimize(_adds(1.0), providers=["ort-cpu"], profile=False)
    decisions = Decisions(folder, "d" * 64)
    while time.time() < start:
        time.sleep(0.005)
    for k in range(25):
        decisions.keep(f"x: {who}x{k}", "ort-cpu", plan, k)
""")


@pytest.mark.slow
def test_two_processes_keeping_decisions_at_once_lose_none_and_orphan_no_plan(tmp_path, tests_in_workers):
    folder = tmp_path / "decisions"
    start = time.time() + 4
    keepers = [subprocess.Popen([sys.executable, "-c", KEEPER, str(folder), who, str(start)]) for who in "ab"]
    assert [k.wait(120) for k in keepers] == [0, 0]
    table = Decisions(folder).table.read()
    assert len(table) == 50
    assert {p.name for p in folder.iterdir() if p.is_dir()} == {e["plan"] for e in table.values()}


@pytest.mark.slow
@pytest.mark.parametrize("name, kind", [("int8-qdq", "qdq"), ("fp16", "fp16")])
def test_a_quantized_or_fp16_model_is_held_to_its_own_precision_and_its_candidates_compete(name, kind):
    """An onnxruntime.quantization QDQ model and an onnxconverter-common fp16 model (of timm's ResNet-18): each
    output is held to the model's own precision (two quantization steps; eight fp16 epsilons of its scale), and
    the OpenVINO and LiteRT candidates a session offers are admitted where they agree to it."""
    pytest.importorskip("timm", reason="timm is not installed")
    from benchmarks.corpus_models import ExportFailed, case

    from uhop_onnx.precision import own

    try:
        path, feeds = case(name)
    except ExportFailed as error:
        pytest.skip(str(error))
    model = onnx.load(path)
    assert own.kind(model) == kind
    rules = own.tolerances(model, lambda: model)
    [rule] = rules.values()
    assert rule == ({"scaled": 8 * float(np.finfo(np.float16).eps)} if kind == "fp16" else
                    {"rtol": 2e-4, "atol": pytest.approx(rule["atol"])}) and rule.get("atol", 1) > 2e-5
    from uhop_onnx.products import explore

    for provider in ("openvino", "litert"):
        decisions = Decisions(path.parent / f"decided-{provider}")
        plan = optimize(str(path), providers=[provider], profile=False)
        if provider not in plan.get_providers():  # placement keeps float16 nodes off both (docs/limits.md)
            continue
        explore.keep(str(path), "bucket", 10, plan, feeds, decisions)
        entry = decisions.table.get("bucket")
        assert "differs" not in json.dumps(entry.get("refused", {})), entry
        assert entry["label"] != "ort-cpu", entry


def test_a_switch_under_calls_from_many_threads_serves_only_what_onnxruntime_agrees_with(tmp_path):
    """Threads calling while the bucket switches to a kept OpenVINO plan, every seventh call holding NaN: each
    call's outputs are ONNX Runtime's (to the fp32 rule where OpenVINO served it), none fails."""
    import threading

    model, path, bucket, feeds = _cnn_kept_on_openvino(tmp_path)
    poisoned = {name: np.where(np.arange(v.size).reshape(v.shape) % 5 == 0, np.nan, v).astype(v.dtype)
                for name, v in feeds.items()}
    wants = {False: _ort(path, feeds), True: _ort(path, poisoned)}
    session = uhop_onnx.InferenceSession(str(path))
    errors = []

    def client(k: int) -> None:
        try:
            for call in range(60):
                nan = (call + k) % 7 == 0
                got = session.run(None, poisoned if nan else feeds)
                if nan:
                    assert _same(got, wants[True])
                else:
                    np.testing.assert_allclose(got[0], wants[False][0], rtol=2e-4, atol=2e-5)
        except Exception as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=client, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]
    assert session.adaptation[bucket]["serving"] == "openvino", session.adaptation
    session.close()
