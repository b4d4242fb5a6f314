"""RKNN stages in bundles: `.rknn` files written by the toolkit, verified in Rockchip's simulator against
ONNX Runtime, a board runtime named when it is missing, and a clear refusal without the toolkit."""

from __future__ import annotations

import json

import numpy as np
import pytest
from uhop_onnx.models import cnn
from uhop_onnx.providers.rknn.table import FP16_TOLERANCE

import uhop_onnx
from uhop_onnx.bundle.manifest import BundleError
from uhop_onnx.foundation.errors import ProviderError

from .support import needs_toolkit

def rknn_stage(bundle) -> dict:
    manifest = json.loads((bundle / "manifest.json").read_text())
    (stage,) = [s for s in manifest["stages"] if s["provider"] == "rknn"]
    return stage


def simulated(report) -> dict:
    (entry,) = [s for s in report["stages"] if s["provider"] == "rknn"]
    assert entry["ran"] and entry["how"].startswith("the RKNN simulator"), entry
    return entry


@needs_toolkit
def test_fp16_stage_is_written_and_verified_in_the_simulator(tmp_path, caplog):
    # The static cost model leaves a CNN this small on the CPU; keep it to the NPU here.
    bundle = uhop_onnx.export_bundle(cnn(), "rk3588", tmp_path / "b", providers=["rknn"])
    said = [r.getMessage() for r in caplog.records if "fastest at int8" in r.getMessage()]
    assert len(said) == 1 and "--calibration" in said[0] and "\n" not in said[0]
    stage = rknn_stage(bundle)
    artifact = stage["artifact"]
    assert artifact["format"] == "rknn" and (bundle / artifact["files"][0]).read_bytes()[:4] == b"RKNN"
    assert artifact["options"]["inputs"] == ["input"] and artifact["options"]["outputs"] == ["output"]
    assert artifact["options"]["dtypes"] == {"output": "float32"} and artifact["options"]["target"] == "rk3588"
    assert stage["tolerance"] == FP16_TOLERANCE and (bundle / stage["reference"]).is_file()
    report = uhop_onnx.verify_bundle(bundle)
    entry = simulated(report)
    assert report["ok"] and entry["ok"], report
    assert 0 < entry["outputs"]["output"]["max_abs_error"] < FP16_TOLERANCE["scaled"]  # fp16, but close
    try:
        import rknnlite  # noqa: F401 - on a board the stage loads; elsewhere the runtime is named
    except ImportError:
        with pytest.raises(BundleError, match="rknn-toolkit-lite2"):
            uhop_onnx.load_bundle(bundle)


@needs_toolkit
def test_int8_stage_carries_its_calibration_and_the_gates_tolerance(tmp_path):
    rng = np.random.default_rng(7)
    np.savez(tmp_path / "calibration.npz", input=rng.standard_normal((6, 1, 3, 32, 32)).astype(np.float32))
    profile = {"name": "rk3588-int8", "arch": "aarch64", "isa": ["neon"], "memory_gb": 8, "providers": [
        {"id": "rknn", "options": {"target": "rk3588", "calibration": str(tmp_path / "calibration.npz")},
         "version": "rknn-toolkit-lite2 2.3", "required": True, "gflops": 1000, "gbps": 8, "stage_ms": 0.6,
         "precisions": {"int8": 2.0}}]}
    (tmp_path / "profile.json").write_text(json.dumps(profile))
    bundle = uhop_onnx.export_bundle(cnn(), str(tmp_path / "profile.json"), tmp_path / "b", precision="int8",
                                     calibration=tmp_path / "calibration.npz", tolerance=0.05)
    stage = rknn_stage(bundle)
    assert stage["precision"] == "int8" and "dtype" not in stage["options"]
    carried = bundle / stage["artifact"]["files"][1]
    assert carried.read_bytes() == (tmp_path / "calibration.npz").read_bytes()
    assert stage["tolerance"] == {"scaled": 0.05} and stage["gated"]
    report = uhop_onnx.verify_bundle(bundle)
    entry = simulated(report)
    assert report["ok"] and entry["ok"], report
    assert entry["outputs"]["output"]["max_abs_error"] > FP16_TOLERANCE["scaled"]  # quantized for real


def test_without_the_toolkit_export_names_the_setup_command(tmp_path, monkeypatch):
    (tmp_path / "empty").mkdir()
    monkeypatch.setenv("UHOP_RKNN_VENV", str(tmp_path / "empty"))
    with pytest.raises(ProviderError, match="rk3588 needs rknn.*uhop-onnx setup rknn"):
        uhop_onnx.export_bundle(cnn(), "rk3588", tmp_path / "b")
    assert not (tmp_path / "b").exists()


@needs_toolkit
def test_int8_precision_quantizes_with_the_toolkit_and_gates_in_the_simulator(tmp_path):
    rng = np.random.default_rng(3)
    calibration = {"input": rng.standard_normal((4, 1, 3, 32, 32)).astype(np.float32)}
    bundle = uhop_onnx.export_bundle(cnn(), "rk3588", tmp_path / "b", providers=["rknn"], precision="int8",
                                     calibration=calibration, tolerance=0.05)
    manifest = json.loads((bundle / "manifest.json").read_text())
    (stage,) = manifest["stages"]
    assert stage["precision"] == "int8" and stage["gated"]
    gate = manifest["precision"]
    assert gate["calibrated"] and gate["samples"] == 4 and gate["ungated"] == []
    accuracy = gate["accuracy"]["output"]  # per output, against ONNX Runtime fp32, in the simulator
    assert 0 < accuracy["max_abs_error"] and accuracy["cosine"] > 0.99
    assert uhop_onnx.verify_bundle(bundle)["ok"]
