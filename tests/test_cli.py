"""The `uhop-onnx` command, run as a user runs it."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import onnx
import pytest

from uhop_onnx.models import EXAMPLE, cnn, speech

from .conftest import assert_matches, reference
from .support import uhop


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("models") / "cnn.onnx"
    onnx.save(cnn(), path)
    return path


def test_devices_json_lists_every_known_provider():
    result = uhop("devices", "--json")
    assert result.returncode == 0, result.stderr
    rows = json.loads(result.stdout)
    assert {"id", "present", "version", "device", "reason", "install"} <= set(rows[0])
    by_id = {(r["id"], r["device"]): r for r in rows}
    assert by_id[("ort-cpu", "CPU")]["present"] is True
    absent = [r for r in rows if not r["present"]]
    assert all(r["reason"] and r["install"] for r in absent)


def test_inspect_reports_ops_and_capabilities(model_path):
    result = uhop("inspect", str(model_path), "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["ops"]["Conv"] == 3
    assert all(node["support"]["ort-cpu"]["ok"] for node in report["nodes"])


def test_optimize_run_explain(model_path, tmp_path):
    plan_dir = tmp_path / "plan"
    result = uhop("optimize", str(model_path), "-o", str(plan_dir), "--no-profile", "--providers", "openvino,ort-cpu")
    assert result.returncode == 0, result.stderr
    assert (plan_dir / "plan.json").is_file()
    feeds = {"input": np.random.default_rng(0).standard_normal((1, 3, 32, 32)).astype(np.float32)}
    np.savez(tmp_path / "in.npz", **feeds)
    result = uhop("run", str(plan_dir), "--inputs", str(tmp_path / "in.npz"), "--output", str(tmp_path / "out.npz"))
    assert result.returncode == 0, result.stderr
    with np.load(tmp_path / "out.npz") as got:
        assert_matches([got["output"]], reference(cnn(), feeds))
    result = uhop("explain", str(plan_dir), "--json")
    assert result.returncode == 0 and json.loads(result.stdout)["stages"][0]["provider"] == "openvino"


@pytest.mark.slow
def test_export_tune_verify(model_path, tmp_path):
    result = uhop("export", str(model_path), "--target", "x86-64", "-o", str(tmp_path / "b"))
    assert result.returncode == 0, result.stderr
    result = uhop("tune", str(tmp_path / "b"), "-o", str(tmp_path / "tuned.tar.gz"), "--budget", "30")
    assert result.returncode == 0, result.stderr
    assert "measured on this host" in result.stdout and "(* this plan)" in result.stdout
    result = uhop("verify", str(tmp_path / "tuned.tar.gz"), "--json")
    assert result.returncode == 0 and json.loads(result.stdout)["ok"], result.stdout


@pytest.mark.slow
def test_bench_counts_only_whole_runners_as_single_providers(tmp_path):
    onnx.save(speech(), tmp_path / "speech.onnx")
    result = uhop("bench", str(tmp_path / "speech.onnx"), "--providers", "litert,openvino", "--threads", "1",
                  "--rounds", "1", "--budget", "5", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    figures = report["candidates"]
    assert [s.split(" x")[0] for s in figures["litert alone"]["stages"]] == ["ort-cpu", "litert"]  # LiteRT has no GRU
    assert figures["onnxruntime (raw)"]["stages"] == [] and figures["uhop-onnx plan"]["stages"]
    assert report["best_single"] in {"openvino alone", "ort-cpu alone"}
    best, plan = figures[report["best_single"]]["ms"], figures["uhop-onnx plan"]
    if plan["ms"] is None:  # optimize timed no whole plan within its 5 s: the row says why, with no figure
        assert plan["unmeasured"] and "ratio_to_best_single" not in plan and not report["failed"]
    else:
        assert plan["ratio_to_best_single"] == pytest.approx(plan["ms"] / best)


def reflect_front_end() -> onnx.ModelProto:
    """A reflect `Pad` over a free batch dimension, which is measured at 1: every run at that shape fails
    (`Pad reflect requires axis length >= 2`)."""
    from onnx import TensorProto, helper, numpy_helper

    pads = numpy_helper.from_array(np.array([1, 0, 1, 1, 1, 0, 1, 1], np.int64), "pads")
    w = numpy_helper.from_array(np.random.default_rng(0).standard_normal((4, 3, 3, 3)).astype(np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("Pad", ["x", "pads"], ["p"], mode="reflect", name="pad"),
         helper.make_node("Conv", ["p", "w"], ["c"], name="conv"), helper.make_node("Relu", ["c"], ["y"], name="relu")],
        "reflect", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["M", 4, 8, 8])], [pads, w])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.slow
def test_optimize_fails_with_each_candidates_error_when_no_plan_runs(tmp_path):
    onnx.save(reflect_front_end(), tmp_path / "reflect.onnx")
    result = uhop("optimize", str(tmp_path / "reflect.onnx"), "-o", str(tmp_path / "plan"), "--providers",
                  "openvino,ort-cpu", "--budget", "30")
    assert result.returncode == 1, result.stderr
    said = " ".join(result.stderr.split())  # as one line, however the console wrapped it
    assert "no candidate plan could be timed on sample inputs of shapes x: 1x3x8x8" in said and "Traceback" not in said
    assert "first-supported (openvino x3): stage 0 (openvino, 3 nodes from 'pad') failed: [CPU] Pad" in said
    assert "ort-cpu first (ort-cpu x3): stage 0 (ort-cpu," in said and "axis length >= 2" in said
    assert not (tmp_path / "plan").exists()


def test_export_of_a_model_that_cannot_run_at_its_sample_shape_is_one_message(tmp_path):
    onnx.save(reflect_front_end(), tmp_path / "reflect.onnx")
    result = uhop("export", str(tmp_path / "reflect.onnx"), "--target", "x86-64", "-o", str(tmp_path / "b"))
    said = " ".join(result.stderr.split())
    assert result.returncode == 2 and "Traceback" not in said
    assert "ONNX Runtime cannot run the model on sample inputs of shapes x: 1x3x8x8" in said
    assert not (tmp_path / "b").exists()


@pytest.mark.slow
def test_bench_exits_1_with_clean_reasons_when_candidates_fail(tmp_path):
    onnx.save(reflect_front_end(), tmp_path / "reflect.onnx")
    args = ["bench", str(tmp_path / "reflect.onnx"), "--providers", "ort-cpu", "--rounds", "1", "--budget", "30"]
    result = uhop(*args, "--json")
    assert result.returncode == 1, result.stderr
    figures = json.loads(result.stdout)["candidates"]
    assert set(figures) == {"onnxruntime (raw)", "ort-cpu alone", "uhop-onnx plan"}
    assert all(f["ms"] is None for f in figures.values())
    assert figures["ort-cpu alone"]["error"].startswith("stage 0 (ort-cpu, 3 nodes from 'pad') failed: ")
    assert figures["uhop-onnx plan"]["error"].startswith("optimize: no candidate plan could be timed")
    assert "axis length >= 2" in figures["onnxruntime (raw)"]["error"]
    table = uhop(*args)
    assert table.returncode == 1 and "3 candidate(s) failed" in table.stderr
    assert "failed:" in table.stdout and "Traceback" not in table.stdout + table.stderr
    assert 'File "' not in table.stdout


@pytest.mark.slow
@pytest.mark.parametrize("args, message", [
    (["optimize", "absent.onnx", "-o", "out"], "no such file"),
    (["inspect", "{model}", "--providers", "warp-drive"], "unknown provider 'warp-drive'"),
    (["run", "{model}", "--inputs", "absent.npz"], "cannot read inputs"),
    (["explain", "."], "not a plan folder"),
])
def test_bad_input_exits_2_with_one_line(model_path, tmp_path, args, message):
    result = uhop(*(a.format(model=model_path) for a in args), cwd=tmp_path)
    assert result.returncode == 2
    assert message in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "out").exists()


def test_bundled_example_is_a_valid_model():
    onnx.checker.check_model(onnx.load(EXAMPLE))


def test_the_command_runs_without_the_serve_extra_and_serve_names_it(tmp_path):
    """The default install has no starlette, uvicorn or tritonclient: every other command works, and `serve`
    stops before any work, naming the extra."""
    blocked = "import sys; sys.modules.update(starlette=None, uvicorn=None, tritonclient=None); "
    script = blocked + "import sys; from uhop_onnx.cli import main; sys.argv = ['uhop-onnx', *sys.argv[1:]]; main()"
    devices = subprocess.run([sys.executable, "-c", script, "devices", "--json"], capture_output=True, text=True,
                             timeout=120)
    assert devices.returncode == 0, devices.stderr
    assert any(row["id"] == "ort-cpu" and row["present"] for row in json.loads(devices.stdout))
    serve = subprocess.run([sys.executable, "-c", script, "serve", str(EXAMPLE)], capture_output=True, text=True,
                           timeout=120)
    said = " ".join(serve.stderr.split())  # rich wraps long lines
    assert serve.returncode == 2, said
    assert "pip install 'uhop-onnx[serve]'" in said and "starlette is not installed" in said


@pytest.mark.slow
def test_quiet_optimize_says_nothing_and_the_runtimes_speak_only_with_v(model_path, tmp_path):
    """`optimize --quiet` writes nothing on stderr (no progress, no runtime's line); running a LiteRT plan
    shows LiteRT's own "XNNPACK delegate" line only with -v."""
    plan = tmp_path / "plan"
    result = uhop("optimize", str(model_path), "-o", str(plan), "--providers", "litert,ort-cpu", "--budget", "20",
                  "--quiet")
    assert result.returncode == 0 and result.stderr == "", result.stderr
    assert uhop_onnx_plan_providers(plan) <= {"litert", "ort-cpu"}
    litert = tmp_path / "litert"
    assert uhop("optimize", str(model_path), "-o", str(litert), "--no-profile", "--providers", "litert",
                "-q").returncode == 0
    assert "XNNPACK" not in uhop("run", str(litert)).stderr
    assert "XNNPACK" in uhop("run", str(litert), "-v").stderr


def uhop_onnx_plan_providers(folder) -> set[str]:
    return {stage["provider"] for stage in json.loads((folder / "plan.json").read_text())["stages"]}
