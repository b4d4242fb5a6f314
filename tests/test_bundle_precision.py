"""Bundles at reduced precision: the target profile's (provider, precision) pairs under its static cost model,
the plan gated here, each stage's precision and the gate's tolerance in the manifest, and verify held to it."""

from __future__ import annotations

import json
import os
import shutil
import warnings

import numpy as np
import pytest

import uhop_onnx
from uhop_onnx.foundation.errors import UhopError
from uhop_onnx.models import cnn
from uhop_onnx.products.targets import load_target, target_from_json

from .conftest import reference
from .host import INT8_TOLERANCE, openvino_capabilities

pytest.importorskip("openvino")

INPUT = "input"
HOST_BF16 = "BF16" in openvino_capabilities()  # whether OpenVINO computes bf16 on this CPU


def samples(count: int, seed: int) -> dict[str, np.ndarray]:
    """`count` samples of the CNN's input, stacked on a leading sample axis (as a calibration .npz holds them)."""
    return {INPUT: np.random.default_rng(seed).standard_normal((count, 3, 32, 32)).astype(np.float32)}


def manifest_of(bundle) -> dict:
    return json.loads((bundle / "manifest.json").read_text())


def within(got: np.ndarray, want: np.ndarray, tolerance: float) -> bool:
    """The precision gate's rule: max|y - ref| <= tolerance * (1 + max|ref|)."""
    return float(np.abs(got - want).max()) <= tolerance * (1 + float(np.abs(want).max()))


def held_out_within(bundle, tolerance: float) -> None:
    """The loaded bundle's outputs on inputs from neither the calibration nor the gate are within `tolerance`
    of ONNX Runtime fp32 on the original model."""
    model, loaded = cnn(), uhop_onnx.load_bundle(bundle)
    for seed in (101, 102, 103):
        feeds = {INPUT: samples(1, seed)[INPUT]}
        got, want = loaded.run(None, feeds)[0], reference(model, feeds)[0]
        assert within(got, want, tolerance), float(np.abs(got - want).max())
        assert not np.array_equal(got, want)  # computed at the reduced precision, not in fp32


def tightened(bundle, tmp_path) -> dict:
    """`verify_bundle` of a copy whose reduced-precision stages are held to 1e-9 (the manifest lists no hash of
    itself, so the unsigned copy is consistent)."""
    copy = tmp_path / "tight"
    shutil.copytree(bundle, copy)
    manifest = manifest_of(copy)
    for stage in manifest["stages"]:
        if stage["precision"] != "fp32":
            stage["tolerance"] = {"scaled": 1e-9}
    (copy / "manifest.json").write_text(json.dumps(manifest))
    return uhop_onnx.verify_bundle(copy)


def test_bf16_bundle_carries_its_precision_and_the_gate_tolerance(tmp_path):
    bundle = uhop_onnx.export_bundle(cnn(), "x86-64-v4", tmp_path / "b", providers=["openvino"], precision="bf16")
    manifest = manifest_of(bundle)
    [stage] = manifest["stages"]
    assert (stage["precision"], stage["gated"], stage["tolerance"]) == ("bf16", True, {"scaled": 1e-2})
    assert stage["artifact"]["options"]["precision"] == "bf16"  # the IR compiles with the bf16 hint
    assert manifest["tolerance"] == {"scaled": 1e-2}
    gate = manifest["precision"]
    assert gate["choice"] == "bf16" and gate["ungated"] == [] and gate["samples"] == 4
    measured = gate["accuracy"]["output"]["max_abs_error"]
    assert 0 < measured < 1e-2 * (1 + 10)  # what was measured here, recorded beside the tolerance
    held_out_within(bundle, 1e-2)
    report = uhop_onnx.verify_bundle(bundle)
    assert report["ok"], report
    assert report["stages"][0]["ran"] and report["stages"][0]["how"] == "openvino-ir natively"
    assert (report["stages"][0]["precision"], report["stages"][0]["tolerance"]) == ("bf16", {"scaled": 1e-2})
    failed = tightened(bundle, tmp_path)
    assert not failed["ok"] and failed["stages"][0]["ok"] is False


@pytest.mark.parametrize("provider, fmt", [("openvino", "openvino-ir"), ("ort-cpu", "onnx")])
def test_int8_bundle_with_calibration(provider, fmt, tmp_path):
    """int8 from calibration samples, gated here at INT8_TOLERANCE: a random-weight CNN's int8 error is about
    0.02 of the output scale with AVX-512 VNNI, 0.07-0.09 where the int8 kernels saturate."""
    bundle = uhop_onnx.export_bundle(cnn(), "x86-64-v4", tmp_path / "b", providers=[provider], precision="int8",
                                     tolerance=INT8_TOLERANCE, calibration=samples(8, seed=1))
    manifest = manifest_of(bundle)
    [stage] = manifest["stages"]
    assert (stage["precision"], stage["gated"], stage["tolerance"]) == ("int8", True, {"scaled": INT8_TOLERANCE})
    assert stage["artifact"]["format"] == fmt
    assert manifest["precision"]["calibrated"] and manifest["precision"]["samples"] == 8
    # what the stage was built from: its QDQ model, the artifact itself for ONNX Runtime
    import onnx

    qdq = onnx.load(bundle / stage["built_from"])
    assert {"QuantizeLinear", "DequantizeLinear"} <= {n.op_type for n in qdq.graph.node}
    assert "QuantizeLinear" not in {n.op_type for n in onnx.load(bundle / stage["reference"]).graph.node}
    if fmt == "onnx":
        assert stage["built_from"] == stage["artifact"]["files"][0]
    held_out_within(bundle, INT8_TOLERANCE)
    assert uhop_onnx.verify_bundle(bundle)["ok"]
    assert not tightened(bundle, tmp_path)["ok"]


def test_int8_without_calibration_warns_and_stays_fp32(tmp_path):
    with pytest.warns(UserWarning, match="int8 variants are not tried without calibration"):
        bundle = uhop_onnx.export_bundle(cnn(), "x86-64-v4", tmp_path / "b", providers=["openvino"],
                                         precision="int8")
    manifest = manifest_of(bundle)
    assert [s["precision"] for s in manifest["stages"]] == ["fp32"]
    assert manifest["tolerance"] == {"rtol": 1e-4, "atol": 1e-5}
    assert uhop_onnx.verify_bundle(bundle)["ok"]


def test_a_plan_outside_the_gate_gives_up_its_precision(tmp_path):
    """At a tolerance int8 cannot meet, the int8 plan is rejected (recorded) and the bundle is fp32."""
    bundle = uhop_onnx.export_bundle(cnn(), "x86-64-v4", tmp_path / "b", providers=["ort-cpu"], precision="int8",
                                     tolerance=1e-5, calibration=samples(4, seed=1))
    manifest = manifest_of(bundle)
    assert [s["precision"] for s in manifest["stages"]] == ["fp32"]
    [rejected] = manifest["precision"]["rejected"]
    assert rejected["gave_up"] == "int8" and rejected["stages"] == "ort-cpu[int8] x13"
    assert rejected["accuracy"]["output"]["max_abs_error"] > 1e-5 * (1 + 1)


def test_a_stage_that_cannot_run_here_is_accepted_ungated(tmp_path):
    """TensorRT fp16 on the Jetson profile: nothing here runs it, so it is taken on the profile's word."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # gated on generated samples
        bundle = uhop_onnx.export_bundle(cnn(), "jetson-orin", tmp_path / "b", providers=["ort-tensorrt"],
                                         precision="fp16")
    manifest = manifest_of(bundle)
    [stage] = manifest["stages"]
    assert (stage["provider"], stage["precision"], stage["gated"]) == ("ort-tensorrt", "fp16", False)
    assert stage["tolerance"] == {"scaled": 1e-2} and manifest["precision"]["ungated"] == [0]
    assert stage["artifact"]["options"]["ep_options"]["trt_fp16_enable"] is True  # the board builds it at fp16
    report = uhop_onnx.verify_bundle(bundle, allow_unrun=True)
    assert report["ok"] and not report["stages"][0]["ran"]


def test_the_static_model_offers_only_what_the_profile_declares(tmp_path):
    """The AVX2 profile declares no bf16: nothing offers it, and the bundle is fp32."""
    assert "bf16" not in load_target("x86-64").providers[0].precisions
    with pytest.warns(UserWarning, match="no provider here offers it"):
        bundle = uhop_onnx.export_bundle(cnn(), "x86-64", tmp_path / "b", providers=["openvino"], precision="bf16")
    assert [s["precision"] for s in manifest_of(bundle)["stages"]] == ["fp32"]


def test_profiles_declare_bf16_only_where_the_cpu_has_it():
    profile = {"name": "old-cpu", "arch": "x86_64", "isa": ["avx2"],
               "providers": [{"id": "openvino", "options": {"device": "CPU"}, "precisions": {"bf16": 1.8}}]}
    with pytest.raises(UhopError, match="avx512_bf16"):
        target_from_json(profile, "old-cpu")
    assert target_from_json({**profile, "isa": ["avx2", "amx_bf16"]}, "new-cpu").providers[0].precisions
    with pytest.raises(UhopError, match="speed factor"):
        target_from_json({**profile, "providers": [{"id": "ort-cpu", "precisions": {"int8": 0}}]}, "bad")
    with pytest.raises(UhopError, match="not one of"):
        target_from_json({**profile, "providers": [{"id": "ort-cpu", "precisions": {"int4": 2}}]}, "bad")
    gpu = {**profile, "providers": [{"id": "openvino", "options": {"device": "GPU"}, "precisions": {"bf16": 1.2}}]}
    assert target_from_json(gpu, "gpu").providers[0].precisions == {"bf16": 1.2}  # not the CPU's isa


def test_cli_export_at_bf16(tmp_path):
    from typer.testing import CliRunner

    from uhop_onnx.cli import app

    model = tmp_path / "cnn.onnx"
    import onnx

    onnx.save(cnn(), model)
    result = CliRunner().invoke(app, ["export", str(model), "--target", "x86-64-v4", "-o", str(tmp_path / "b"),
                                      "--providers", "openvino", "--precision", "bf16", "--tolerance", "0.02",
                                      "--json"])
    assert result.exit_code == 0, result.output
    [stage] = manifest_of(tmp_path / "b")["stages"]
    assert (stage["precision"], stage["tolerance"]) == ("bf16", {"scaled": 0.02})
    verified = CliRunner().invoke(app, ["verify", str(tmp_path / "b")])
    assert verified.exit_code == 0 and "openvino[bf16]" in verified.output, verified.output


def test_litert_int8_bundle_is_full_integer(tmp_path):
    """LiteRT int8 on the arm64 profile: the converter's full-integer `.tflite`, run here by LiteRT."""
    from uhop_onnx.providers.litert.runner import interpreter_module

    if not uhop_onnx.providers.create("litert").present:
        pytest.skip("LiteRT is not installed here")
    bundle = uhop_onnx.export_bundle(cnn(), "arm64", tmp_path / "b", providers=["litert"], precision="int8",
                                     tolerance=5e-2, calibration=samples(8, seed=1))
    [stage] = manifest_of(bundle)["stages"]
    assert (stage["precision"], stage["gated"], stage["artifact"]["format"]) == ("int8", True, "tflite")
    interpreter = interpreter_module().Interpreter(model_content=(bundle / stage["artifact"]["files"][0]).read_bytes())
    assert np.int8 in {t["dtype"] for t in interpreter.get_tensor_details()}
    held_out_within(bundle, 5e-2)
    assert uhop_onnx.verify_bundle(bundle)["ok"]
    assert not tightened(bundle, tmp_path)["ok"]


@pytest.mark.skipif(not os.environ.get("UHOP_SLOW"), reason="about 45 s in Rockchip's toolkit: UHOP_SLOW=1")
def test_rknn_int8_bundle_carries_its_calibration(tmp_path):
    """RKNN int8 on the rk3588 profile: gated in Rockchip's simulator; the toolkit quantizes on the board's
    side from the calibration file the stage carries, which verify rebuilds the stage from."""
    from uhop_onnx.providers.rknn.setup import is_ready

    if not is_ready():
        pytest.skip("the rknn-toolkit2 environment is absent: uhop-onnx setup rknn")
    bundle = uhop_onnx.export_bundle(cnn(), "rk3588", tmp_path / "b", providers=["rknn"], precision="int8",
                                     tolerance=5e-2, calibration=samples(4, seed=1))
    [stage] = manifest_of(bundle)["stages"]
    assert (stage["precision"], stage["gated"], "dtype" in stage["options"]) == ("int8", True, False)
    carried = [f for f in stage["artifact"]["files"] if f.endswith(".calibration.npz")]
    with np.load(bundle / carried[0]) as data:
        assert data[INPUT].shape == (4, 1, 3, 32, 32)
    report = uhop_onnx.verify_bundle(bundle)
    assert report["ok"] and "simulator" in report["stages"][0]["how"], report


def test_a_bundle_of_the_previous_schema_still_loads(tmp_path):
    """A `uhop-onnx.bundle/2` manifest (fp32 stages, rtol/atol tolerances) is a /3 one."""
    bundle = uhop_onnx.export_bundle(cnn(), "x86-64", tmp_path / "b", providers=["ort-cpu"])
    manifest = manifest_of(bundle)
    assert manifest["schema"] == "uhop-onnx.bundle/3"
    (bundle / "manifest.json").write_text(json.dumps({**manifest, "schema": "uhop-onnx.bundle/2"}))
    feeds = {INPUT: samples(1, seed=5)[INPUT]}
    np.testing.assert_allclose(uhop_onnx.load_bundle(bundle).run(None, feeds)[0], reference(cnn(), feeds)[0],
                               rtol=1e-4, atol=1e-5)
    assert uhop_onnx.verify_bundle(bundle)["ok"]


def test_without_shapes_the_bundle_is_sized_by_the_calibration_samples(tmp_path):
    """A model with free spatial dimensions: none given, the calibration samples' shapes are the bundle's."""
    model = cnn()
    dims = model.graph.input[0].type.tensor_type.shape.dim
    dims[2].dim_param, dims[3].dim_param = "height", "width"
    with pytest.raises(uhop_onnx.UhopError, match="height"):
        uhop_onnx.export_bundle(model, "x86-64-v4", tmp_path / "none", providers=["openvino"], precision="bf16")
    bundle = uhop_onnx.export_bundle(model, "x86-64-v4", tmp_path / "b", providers=["openvino"], precision="bf16",
                                     calibration=samples(4, seed=1))
    manifest = manifest_of(bundle)
    assert manifest["shapes"] == {INPUT: [1, 3, 32, 32]}
    assert [s["precision"] for s in manifest["stages"]] == ["bf16"]
    with np.load(bundle / manifest["samples"]["inputs"]) as data:
        assert data[INPUT].shape == (1, 3, 32, 32)


def test_measured_on_the_board_the_search_and_its_gate_decide(tmp_path):
    """measure=True: this host is the board; the measured search over its variants chooses, gated as optimize.
    A host whose OpenVINO computes no bf16 has no bf16 variant to measure: the bundle is fp32, as it says."""
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        bundle = uhop_onnx.export_bundle(cnn(), "x86-64-v4", tmp_path / "b", providers=["openvino"], measure=True,
                                         budget=300, precision="bf16", calibration=samples(4, seed=1))
    manifest = manifest_of(bundle)
    assert manifest["placement"] == "measured on this host for target x86-64-v4"
    timed = {c["stages"] for c in manifest["profile"]["candidates"].values()}
    assert "openvino:CPU x13" in timed and ("openvino:CPU[bf16] x13" in timed) == HOST_BF16, timed
    assert HOST_BF16 or any("no provider here offers it" in str(w.message) for w in said)
    for stage in manifest["stages"]:
        assert stage["tolerance"] == ({"scaled": 1e-2} if stage["precision"] != "fp32" else {"rtol": 1e-4,
                                                                                           "atol": 1e-5})
    assert uhop_onnx.verify_bundle(bundle)["ok"]


def test_a_precision_a_bundle_format_cannot_hold_is_named(tmp_path):
    profile = target_from_json({"name": "mine", "arch": "x86_64", "isa": ["avx2"], "providers": [
        {"id": "kernels", "options": {"arch": "x86_64"}, "precisions": {"int8": 2.0}}]}, "mine")
    with pytest.raises(uhop_onnx.UhopError, match="declares kernels at int8, which its bundle stages"):
        uhop_onnx.export_bundle(cnn(), profile, tmp_path / "b", precision="int8", calibration=samples(2, seed=1))
    assert not (tmp_path / "b").exists()


def test_tensorrt_int8_carries_its_calibration_table(tmp_path, monkeypatch):
    """By configuration (no GPU here): the table ONNX Runtime's TensorRT EP reads is in the bundle, and the
    board's loader puts it in its engine cache under the name the stage's EP options give it."""
    from uhop_onnx.providers.ort import OrtTensorRT

    bundle = uhop_onnx.export_bundle(cnn(), "jetson-orin", tmp_path / "b", providers=["ort-tensorrt"],
                                     precision="int8", tolerance=5e-2, calibration=samples(4, seed=1))
    [stage] = manifest_of(bundle)["stages"]
    assert (stage["precision"], stage["gated"]) == ("int8", False)
    options = stage["artifact"]["options"]["ep_options"]
    assert options["trt_int8_enable"] and not any(k.endswith("_path") for k in options)
    [table] = [f for f in stage["artifact"]["files"] if f.endswith(".calibration.flatbuffers")]
    monkeypatch.setenv("UHOP_CACHE_DIR", str(tmp_path / "board-cache"))
    loaded = OrtTensorRT.format.board_options(bundle, stage["artifact"])
    assert loaded["trt_engine_cache_path"] == str(tmp_path / "board-cache" / "tensorrt")
    placed = tmp_path / "board-cache" / "tensorrt" / options["trt_int8_calibration_table_name"]
    assert placed.read_bytes() == (bundle / table).read_bytes() and placed.stat().st_size > 0


@pytest.mark.slow
def test_tune_competes_the_bundles_precision_again(tmp_path):
    """On the board, `tune` measures again at the bundle's precision and tolerance."""
    bundle = uhop_onnx.export_bundle(cnn(), "x86-64-v4", tmp_path / "b", providers=["openvino"], precision="bf16",
                                     tolerance=2e-2, calibration=samples(4, seed=1))
    tuned = uhop_onnx.tune_bundle(bundle, tmp_path / "tuned", budget=300)
    manifest = manifest_of(tuned)
    assert manifest["placement"] == "measured on this host for target x86-64-v4"
    assert (manifest["precision"]["choice"], manifest["precision"]["tolerance"]) == ("bf16", 2e-2)
    labels = {c["stages"] for c in manifest["profile"]["candidates"].values()}
    assert any("[bf16]" in stages for stages in labels) == HOST_BF16, labels  # measured only where it runs
    assert uhop_onnx.verify_bundle(tuned)["ok"]
