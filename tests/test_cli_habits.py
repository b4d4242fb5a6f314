"""The command-line habits of Polygraphy, benchmark_app and trtexec: generated inputs, input files, latency
percentiles, `compare`, `--json`, one exit-code rule, 80-column tables, escaped text, the user's umask."""

from __future__ import annotations

import json
import os
import stat

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

import uhop_onnx
from uhop_onnx import InputError
from uhop_onnx.foundation.inputs import parse_shape, read_inputs
from uhop_onnx.models import cnn, mlp

from .conftest import assert_matches, reference
from .support import uhop


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("habits") / "cnn.onnx"
    onnx.save(cnn(), path)
    return path


@pytest.mark.slow
def test_run_generates_seeded_inputs_and_times_the_stages(model_path):
    result = uhop("run", str(model_path), "--providers", "openvino,ort-cpu", "--iterations", "20", "--warmup", "2",
                  "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["inputs"] == "generated, seed 0"
    latency = report["latency"]
    assert latency["iterations"] == 20 and latency["warmup"] == 2
    assert 0 < latency["p50_ms"] <= latency["p90_ms"] <= latency["p99_ms"]
    assert latency["throughput_per_s"] > 0
    assert [s["provider"] for s in latency["stages"]] == ["openvino"]
    assert 0 < latency["stages"][0]["share"] <= 1
    again = json.loads(uhop("run", str(model_path), "--providers", "openvino", "--json").stdout)
    assert again["outputs"] == report["outputs"]  # the same seed, the same inputs
    text = uhop("run", str(model_path), "--iterations", "5")
    assert "p50" in text.stdout and "p99" in text.stdout and "share" in text.stdout


@pytest.mark.slow
def test_run_reads_npy_npz_and_onnx_test_data_sets(model_path, tmp_path):
    x = np.random.default_rng(3).standard_normal((1, 3, 32, 32)).astype(np.float32)
    expected = reference(cnn(), {"input": x})
    np.save(tmp_path / "x.npy", x)
    np.savez(tmp_path / "x.npz", input=x)
    data_set = tmp_path / "model" / "test_data_set_0"
    data_set.mkdir(parents=True)
    (data_set / "input_0.pb").write_bytes(numpy_helper.from_array(x, "input").SerializeToString())
    for source in ("x.npy", "x.npz", "model/test_data_set_0", "model"):
        out = tmp_path / f"out-{source.replace('/', '-')}.npz"
        result = uhop("run", str(model_path), "--inputs", str(tmp_path / source), "--output", str(out))
        assert result.returncode == 0, result.stderr
        with np.load(out) as got:
            assert_matches([got["output"]], expected)


def test_input_files_and_shapes_errors(tmp_path):
    assert parse_shape("input:1x3x640x640") == ("input", (1, 3, 640, 640))
    assert parse_shape("ns:x:2") == ("ns:x", (2,))
    with pytest.raises(InputError, match="expected NAME:DIMS"):
        parse_shape("input:1x3xN")
    np.save(tmp_path / "a.npy", np.zeros(3))
    with pytest.raises(InputError, match="an .npy holds one array, and the model's inputs are a, b"):
        read_inputs(tmp_path / "a.npy", ["a", "b"])
    (tmp_path / "set").mkdir()
    (tmp_path / "set" / "input_0.pb").write_bytes(b"\xff\xff not a tensor")
    with pytest.raises(InputError, match="input_0.pb: not a serialized TensorProto"):
        read_inputs(tmp_path / "set", ["a"])
    (tmp_path / "bad.npz").write_text("text")
    with pytest.raises(InputError, match="cannot read inputs"):
        read_inputs(tmp_path / "bad.npz")


@pytest.mark.slow
def test_run_with_a_shape_of_a_free_dimension(tmp_path):
    model = mlp()
    model.graph.input[0].type.tensor_type.shape.dim[0].dim_param = "batch"
    model.graph.output[0].type.tensor_type.shape.dim[0].dim_param = "batch"
    del model.graph.value_info[:]
    onnx.save(model, tmp_path / "mlp.onnx")
    result = uhop("run", str(tmp_path / "mlp.onnx"), "--shape", "input:3x64", "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["outputs"][0]["shape"] == [3, 10]
    bad = uhop("run", str(tmp_path / "mlp.onnx"), "--shape", "nope:3x64")
    assert bad.returncode == 2 and "the model has no input 'nope'" in bad.stderr
    unset = uhop("run", str(tmp_path / "mlp.onnx"))  # a free leading dimension is 1
    assert unset.returncode == 0 and json.loads(uhop("run", str(tmp_path / "mlp.onnx"), "--json").stdout)[
        "outputs"][0]["shape"] == [1, 10]


def test_compare_reports_each_output_and_fails_outside_the_tolerance(model_path, tmp_path):
    result = uhop("compare", str(model_path), "--providers", "openvino", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    [row] = report["outputs"].values()
    assert report["ok"] and row["max_abs_error"] < 1e-4 and row["cosine"] > 0.9999
    plan = tmp_path / "plan"
    uhop_onnx.optimize(str(model_path), providers=["litert"], profile=False).save(plan)
    data = json.loads((plan / "plan.json").read_text())  # its stages as litert[fp16] saves them
    (plan / "plan.json").write_text(json.dumps({**data, "stages": [{**s, "precision": "fp16"} for s in data["stages"]]}))
    loose = uhop("compare", str(plan), "--atol", "1e-2", "--rtol", "1e-2")
    assert loose.returncode == 0, loose.stdout + loose.stderr
    assert "max abs" in loose.stdout and "cosine" in loose.stdout
    strict = uhop("compare", str(plan), "--atol", "0", "--rtol", "0", "--json")
    assert strict.returncode == 1, strict.stderr
    assert json.loads(strict.stdout)["ok"] is False


@pytest.mark.slow
def test_one_exit_code_rule(tmp_path):
    assert uhop("verify", str(tmp_path / "missing.tar.gz")).returncode == 2
    assert uhop("run", str(tmp_path / "missing.onnx")).returncode == 2
    assert uhop("compare", str(tmp_path / "missing")).returncode == 2
    assert uhop("run").returncode == 2  # click's usage error


@pytest.mark.slow
def test_verbose_anywhere_on_the_line_shows_the_logs(model_path):
    quiet = uhop("run", str(model_path), "--providers", "ort-cpu")
    assert quiet.returncode == 0 and "INFO" not in quiet.stderr
    for args in (("-v", "run", str(model_path)), ("run", str(model_path), "-v")):
        loud = uhop(*args, "--providers", "ort-cpu")
        assert loud.returncode == 0 and "INFO uhop_onnx" in loud.stderr, loud.stderr


@pytest.mark.slow
def test_tables_fit_80_columns_and_text_is_not_markup(model_path):
    devices = uhop("devices")
    assert devices.returncode == 0
    assert max(map(len, devices.stdout.splitlines())) <= 80
    assert "uhop-onnx[litert]" in devices.stdout or all(a.present for a in uhop_onnx.devices() if a.id == "litert")
    inspected = uhop("inspect", str(model_path))
    assert max(map(len, inspected.stdout.splitlines())) <= 80
    assert len(inspected.stdout.splitlines()) < 40
    refused = uhop("inspect", str(model_path), "--unsupported", "--providers", "kernels")
    assert "why not" in refused.stdout and "is not in" in refused.stdout
    assert "[E:onnxruntime" not in inspected.stderr + refused.stderr


def test_markup_in_an_error_is_printed_as_text(tmp_path):
    bad = tmp_path / "[bold]model.onnx"
    bad.write_bytes(b"not onnx")
    result = uhop("inspect", str(bad))
    assert result.returncode == 2
    assert "[bold]model.onnx" in result.stderr


def test_files_and_folders_follow_the_umask(tmp_path):
    plan = uhop_onnx.optimize(mlp(), providers=["ort-cpu"], profile=False)
    old = os.umask(0o022)
    try:
        plan.save(tmp_path / "plan")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "plan").stat().st_mode) == 0o755
    assert stat.S_IMODE((tmp_path / "plan" / "plan.json").stat().st_mode) == 0o644
    from uhop_onnx.foundation.files import atomic_file

    old = os.umask(0o077)
    try:
        with atomic_file(tmp_path / "private.txt") as handle:
            handle.write("x")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "private.txt").stat().st_mode) == 0o600


def test_plan_repr_summary_and_html():
    plan = uhop_onnx.optimize(mlp(), providers=["openvino", "ort-cpu"], profile=False)
    text = repr(plan)
    assert text.startswith("<Plan 'mlp' first-supported: openvino x") and len(text) < 200
    assert "openvino" in plan.summary() and "1 stage(s)" in plan.summary()
    html = plan._repr_html_()
    assert "<table>" in html and "openvino" in html and "<svg" in html
