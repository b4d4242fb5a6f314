"""An optional runtime whose import raises something other than `ImportError` (a protobuf version clash raises
`TypeError`) is absent, with that exception as the reason; `devices`, `optimize` and `InferenceSession` keep
working for models that never use it. Run in a subprocess whose `sys.path` starts with broken packages."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

BROKEN = ("openvino", "ai_edge_litert")
CLASH = "Descriptors cannot be created directly (protobuf clash)"

SCRIPT = textwrap.dedent("""
    import json
    import numpy as np
    import onnxruntime as ort
    import uhop_onnx
    from uhop_onnx.models import mlp
    from uhop_onnx.providers import devices

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
    print(json.dumps({
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


def test_devices_command_lists_the_broken_runtime_as_absent(tmp_path):
    env = broken_path(tmp_path)
    done = subprocess.run([sys.executable, "-m", "uhop_onnx.cli", "devices", "--json"], capture_output=True,
                          text=True, timeout=300, env=env, check=False)
    assert done.returncode == 0, done.stderr
    listed = {d["id"]: d for d in json.loads(done.stdout)}
    assert not listed["litert"]["present"] and "TypeError" in listed["litert"]["reason"]
    assert listed["ort-cpu"]["present"]
