"""uhop-onnx under onnxruntime's name: the plain swap, `patch_onnxruntime` and `python -m uhop_onnx.exec`.
uhop-onnx's own use of ONNX Runtime keeps ONNX Runtime's real classes whatever a program assigns."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

import uhop_onnx
from uhop_onnx import InputError, ortlib
from uhop_onnx.models import cnn
from uhop_onnx.products.patch import Patch

ROOT = Path(__file__).resolve().parents[1]
REAL = ortlib.load().InferenceSession


def _run(args: list[str], tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    environment = {**os.environ, "UHOP_CACHE_DIR": str(tmp_path / "cache"), "PYTHONPATH": str(ROOT), **env}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env=environment)


@pytest.mark.slow
def test_after_the_plain_swap_every_provider_precision_bundle_and_bench_still_work(tmp_path):
    run = _run([str(ROOT / "tests" / "ort_swap_script.py"), str(tmp_path)], tmp_path)
    assert run.returncode == 0, run.stderr[-4000:]
    done = json.loads(run.stdout.splitlines()[-1])
    assert done["swapped"] is True
    assert {"ort-cpu", "openvino", "litert"} <= set(done["providers"]), done["providers"]
    assert all(ran[0] == ident for ident, ran in done["providers"].items()), done["providers"]  # none fell back
    quantized = {label for label, v in done["variants"].items() if v["qdq"]}  # by ONNX Runtime's quantizer, NNCF
    assert {"ort-cpu[int8]", "openvino[int8]", "openvino[int8-static]"} <= quantized, done["variants"]
    assert all(v["cosine"] > 0.99 for v in done["variants"].values()), done["variants"]
    assert "litert[fp16]" in done["variants"]
    assert done["int8_plan"] and done["verify"] is True, done
    assert done["bench"], done


def test_ort_lib_binds_the_defining_modules_classes_which_a_swap_does_not_touch(monkeypatch):
    import onnxruntime
    from onnxruntime.capi import onnxruntime_inference_collection as collection

    assert REAL is collection.InferenceSession and ortlib.load().SessionOptions is onnxruntime.SessionOptions
    monkeypatch.setattr(onnxruntime, "InferenceSession", uhop_onnx.InferenceSession)
    assert collection.InferenceSession is REAL and ortlib.load().InferenceSession is REAL
    import onnxruntime.quantization.quant_utils as quant_utils

    monkeypatch.setattr(quant_utils, "InferenceSession", uhop_onnx.InferenceSession)  # imported after a swap
    with ortlib.own_session():
        assert onnxruntime.InferenceSession is REAL and quant_utils.InferenceSession is REAL
    assert onnxruntime.InferenceSession is uhop_onnx.InferenceSession is quant_utils.InferenceSession


def test_patch_is_idempotent_a_context_and_undone(monkeypatch):
    import onnxruntime

    monkeypatch.setattr(onnxruntime, "InferenceSession", REAL)
    first = uhop_onnx.patch_onnxruntime()
    assert issubclass(onnxruntime.InferenceSession, uhop_onnx.InferenceSession)
    patched = onnxruntime.InferenceSession
    with uhop_onnx.patch_onnxruntime() as again:
        assert isinstance(again, Patch) and onnxruntime.InferenceSession is patched
    assert onnxruntime.InferenceSession is patched  # the patch before the block is in force again
    uhop_onnx.unpatch_onnxruntime()
    assert onnxruntime.InferenceSession is REAL
    uhop_onnx.unpatch_onnxruntime()
    assert onnxruntime.InferenceSession is REAL
    with first:
        pass
    mine = type("Wrapper", (), {})
    monkeypatch.setattr(onnxruntime, "InferenceSession", mine)
    uhop_onnx.unpatch_onnxruntime()  # a program's own replacement is not uhop-onnx's to undo
    assert onnxruntime.InferenceSession is mine


def test_patched_sessions_take_the_defaults_under_the_callers_keywords_and_log_once(monkeypatch, caplog):
    import onnxruntime

    monkeypatch.setattr(onnxruntime, "InferenceSession", REAL)
    model = cnn().SerializeToString()
    x = np.random.default_rng(0).standard_normal((1, 3, 32, 32)).astype(np.float32)
    with uhop_onnx.patch_onnxruntime(profile=False, policy="literal"), caplog.at_level(logging.INFO, "uhop_onnx.products.patch"):
        session = onnxruntime.InferenceSession(model, providers=["CPUExecutionProvider"])
        assert session.get_providers() == ["ort-cpu"]
        np.testing.assert_allclose(session.run(None, {"input": x})[0],
                                   REAL(model, providers=["CPUExecutionProvider"]).run(None, {"input": x})[0],
                                   rtol=1e-4, atol=1e-5)
        device = onnxruntime.InferenceSession(model, providers=["CPUExecutionProvider"], policy="device")
    assert onnxruntime.InferenceSession is REAL
    lines = [r.getMessage() for r in caplog.records if r.name == "uhop_onnx.products.patch"]
    assert lines == [f"onnxruntime.InferenceSession(a model of {len(model)} bytes) runs on uhop-onnx: "
                     f"{', '.join(s.get_providers())} in {len(s.plan.stages)} stage(s)" for s in (session, device)]
    with pytest.raises(InputError, match="providers cannot be a default"):
        uhop_onnx.patch_onnxruntime(providers=["ort-cpu"])
    with pytest.raises(InputError, match="precison cannot be a default.*precision"):
        uhop_onnx.patch_onnxruntime(precison="fp16")


APP = """
import sys
import onnxruntime
print(onnxruntime.InferenceSession.__module__, dict(getattr(onnxruntime.InferenceSession, "patch_defaults", {})))
print(sys.argv[1:], __name__)
session = onnxruntime.InferenceSession(sys.argv[1], providers=["CPUExecutionProvider"])
print(type(session).__module__, session.get_providers())
sys.exit(3)
"""


@pytest.mark.slow
def test_exec_runs_a_script_or_a_module_under_the_patch(tmp_path):
    onnx.save(cnn(), tmp_path / "cnn.onnx")
    (tmp_path / "app.py").write_text(APP)
    run = _run(["-m", "uhop_onnx.exec", "python", "app.py", "cnn.onnx", "--flag"], tmp_path,
               UHOP_PRECISION="fp32", UHOP_TOLERANCE="0.05")
    assert run.returncode == 3, run.stderr[-3000:]
    out = run.stdout.splitlines()
    assert out[0] == "uhop_onnx.products.patch {'precision': 'fp32', 'tolerance': 0.05}"
    assert out[1] == "['cnn.onnx', '--flag'] __main__"
    assert out[2].startswith("uhop_onnx.products.patch [")
    run = _run(["-m", "uhop_onnx.exec", "-m", "app", "cnn.onnx"], tmp_path)
    assert run.returncode == 3 and run.stdout.splitlines()[1] == "['cnn.onnx'] __main__", run.stderr[-3000:]
    run = _run(["-m", "uhop_onnx.exec", "app.py"], tmp_path, UHOP_PRECISION="fp12")
    assert run.returncode == 2 and "UHOP_PRECISION/UHOP_TOLERANCE: precision: 'fp12' is not one of" in run.stderr
    run = _run(["-m", "uhop_onnx.exec", "missing.py"], tmp_path)
    assert run.returncode == 2 and "missing.py is not a file" in run.stderr
    # the command line's form: the program's own options (-v here) are its own
    run = _run(["-m", "uhop_onnx.cli", "exec", "--", "python", "app.py", "cnn.onnx", "-v"], tmp_path)
    assert run.returncode == 3 and run.stdout.splitlines()[1] == "['cnn.onnx', '-v'] __main__", run.stderr[-3000:]
    assert run.stdout.splitlines()[2].startswith("uhop_onnx.products.patch [")
