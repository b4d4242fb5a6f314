"""An optional runtime whose import raises something other than `ImportError` (a protobuf version clash raises
`TypeError`) is absent, with that exception as the reason; `devices`, `optimize` and `InferenceSession` keep
working for models that never use it. Run in a subprocess whose `sys.path` starts with broken packages, bare or
with the native files that make the runtime look whole to `Provider.locate` (listed present, then refused where
it is first used); and in this process, with OpenVINO's probe made to fail after a plan on it was cached."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

import uhop_onnx
from uhop_onnx.models import mlp

BROKEN = ("openvino", "ai_edge_litert")
CLASH = "Descriptors cannot be created directly (protobuf clash)"

SCRIPT = textwrap.dedent("""
    import json
    import numpy as np
    import onnxruntime as ort
    import uhop_onnx
    from uhop_onnx.models import mlp
    from uhop_onnx.providers import devices, resolve

    model = mlp()
    x = np.random.default_rng(0).standard_normal((4, 64)).astype(np.float32)
    expected = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"input": x})
    session = uhop_onnx.InferenceSession(model, profile=False)
    got = session.run(None, {"input": x})
    plan = uhop_onnx.optimize(model, profile=True)
    try:
        uhop_onnx.InferenceSession(model, providers=["openvino"], profile=False, strict=True)
        asked = None
    except uhop_onnx.UhopError as error:
        asked = str(error)
    cpu = uhop_onnx.InferenceSession(model, providers=["CPUExecutionProvider"], profile=False, strict=True)
    print(json.dumps({
        "listed": [p.id for p in resolve(None)],
        "available": uhop_onnx.get_available_providers(),
        "cpu_strict": all(np.allclose(a, e, rtol=1e-4, atol=1e-5) for a, e in zip(cpu.run(None, {"input": x}), expected)),
        "devices": [d.to_json() for d in devices()],
        "providers": session.get_providers(),
        "matches": all(np.allclose(a, e, rtol=1e-4, atol=1e-5) for a, e in zip(got, expected)),
        "measured": [s.provider for s in plan.stages],
        "asked": asked,
    }))
""")


# Files that make an installed runtime look whole without importing it (`Provider.locate`): with them, the
# broken runtime is listed as present and refused where it is first used.
NATIVE = {"openvino": "libs/libopenvino_intel_cpu_plugin.so", "ai_edge_litert": "_pywrap_litert_interpreter_wrapper.so"}


def broken_path(tmp_path, looks_whole: bool = False) -> dict[str, str]:
    for name in BROKEN:
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(f"raise TypeError({CLASH!r})\n")
        if looks_whole:
            (tmp_path / name / NATIVE[name]).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / name / NATIVE[name]).touch()
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}


@pytest.mark.slow
@pytest.mark.parametrize("looks_whole", [False, True], ids=["bare", "native-files-present"])
def test_a_runtime_that_raises_on_import_is_absent_and_the_rest_works(tmp_path, looks_whole):
    env = broken_path(tmp_path, looks_whole)
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300, env=env,
                          check=False)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    absent = {d["id"]: d for d in report["devices"] if d["id"] in ("openvino", "litert")}
    assert absent and all(not d["present"] and "TypeError" in d["reason"] and CLASH in d["reason"]
                          for d in absent.values())
    assert report["matches"] and report["providers"] and not set(report["providers"]) & {"openvino", "litert"}
    assert report["measured"] and not set(report["measured"]) & {"openvino", "litert"}
    assert report["asked"] and "openvino" in report["asked"] and "TypeError" in report["asked"]
    # the host's CPU, named strictly, is every CPU provider that runs here: the broken ones left out
    assert report["cpu_strict"] and not set(report["available"]) & {"openvino", "litert"}
    if looks_whole:  # listed from their files (the real packages' metadata), then refused where used
        assert {"openvino", "litert"} <= set(report["listed"]), report["listed"]


def _broken_openvino(monkeypatch) -> None:
    """OpenVINO whose files are all there (`locate` lists it present) but whose import fails."""
    from uhop_onnx.providers.openvino import OpenVino

    def probe(self):
        raise TypeError(CLASH)

    monkeypatch.setattr(OpenVino, "probe", probe)


@pytest.mark.slow
def test_a_cached_plan_on_a_runtime_that_no_longer_imports_is_measured_again_without_it(monkeypatch, tmp_path,
                                                                                       caplog):
    monkeypatch.setenv("UHOP_CACHE_DIR", str(tmp_path))
    model = mlp()
    uhop_onnx.optimize(model, budget=5)
    [cached] = (tmp_path / "plans").iterdir()
    shutil.rmtree(cached)
    uhop_onnx.optimize(model, providers=["openvino"], profile=False).save(cached)  # as if OpenVINO had won
    assert uhop_onnx.optimize(model, budget=5).get_providers() == ["openvino"]  # the cached plan, reused
    _broken_openvino(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="uhop_onnx.products.optimizer"):
        plan = uhop_onnx.optimize(model, budget=5)
    assert "openvino" not in plan.get_providers()
    assert "runs on openvino, not available here now" in caplog.text and CLASH in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="uhop_onnx.products.optimizer"):  # measured once: then reused
        assert uhop_onnx.optimize(model, budget=5).get_providers() == plan.get_providers()
    assert "reusing the plan measured earlier" in caplog.text, caplog.text


@pytest.mark.parametrize("looks_whole", [False, True], ids=["bare", "native-files-present"])
def test_devices_command_lists_the_broken_runtime_as_absent(tmp_path, looks_whole):
    env = broken_path(tmp_path, looks_whole)
    done = subprocess.run([sys.executable, "-m", "uhop_onnx.cli", "devices", "--json"], capture_output=True,
                          text=True, timeout=300, env=env, check=False)
    assert done.returncode == 0, done.stderr
    listed = {d["id"]: d for d in json.loads(done.stdout)}
    assert not listed["litert"]["present"] and "TypeError" in listed["litert"]["reason"]
    assert listed["ort-cpu"]["present"]


def test_a_bundle_for_a_target_whose_runtime_cannot_write_here_says_why(monkeypatch, tmp_path):
    """OpenVINO importable but unable to read a model here (a corrupt plugin): the IR cannot be written, so an
    Intel NPU bundle is refused naming OpenVINO's own error, not a raw traceback midway through writing."""
    def read_model(model_bytes):
        raise RuntimeError("libopenvino_intel_cpu_plugin.so: invalid ELF header")

    monkeypatch.setattr("uhop_onnx.providers.openvino.read_model", read_model)
    with pytest.raises(uhop_onnx.ProviderError, match="openvino: OpenVINO cannot read an ONNX model here.*invalid ELF"):
        uhop_onnx.export_bundle(mlp(), "intel-npu", tmp_path / "b")
    assert not (tmp_path / "b").exists()


def test_a_runtimes_version_is_read_beside_the_package_found_not_from_a_stale_copy_earlier_on_the_path(
        tmp_path, monkeypatch):
    """Metadata left earlier on the path by an old install (no package beside it) names another version than
    the package that is found and run."""
    from uhop_onnx.providers.base import installed

    stale, real = tmp_path / "stale", tmp_path / "real"
    for folder, version, package in ((stale, "1.0", False), (real, "2.0", True)):
        meta = folder / f"uhoprt-{version}.dist-info"
        meta.mkdir(parents=True)
        (meta / "METADATA").write_text(f"Metadata-Version: 2.1\nName: uhoprt\nVersion: {version}\n")
        if package:
            (folder / "uhoprt").mkdir()
            (folder / "uhoprt" / "__init__.py").write_text("")
            (folder / "uhoprt" / "libuhoprt_plugin.so").touch()
    monkeypatch.syspath_prepend(str(real))
    monkeypatch.syspath_prepend(str(stale))  # searched first
    assert installed("uhoprt", "uhoprt", "*plugin*") == "2.0"
    assert installed("uhoprt", "uhoprt", "*missing*") is None
