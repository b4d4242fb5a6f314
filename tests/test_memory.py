"""A measured `optimize` holds, above what its imports alone take, at most twice the memory ONNX Runtime takes
to run the same model, each measured in a fresh process (`benchmarks/memory.py`), on a model whose weights
(a ResNet-50's, 100 MB) make every copy of them show: before the copies were cut, it held 771 MiB where the
bound is 757 (ONNX Runtime 306, the imports 145); now about 505."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import onnx
import pytest

from benchmarks.memory import FLOOR, ORT, optimize_peak, peak
from uhop_onnx.models import resnet50

BUDGET = 6.0  # seconds of measured search (its peak comes early: loading, asking the providers, the first plans)


@pytest.mark.slow
def test_optimize_holds_at_most_twice_onnx_runtimes_peak_above_its_imports(tmp_path):
    path = tmp_path / "resnet50.onnx"
    onnx.save(resnet50(), path)
    floor, _ = peak(FLOOR, [])
    ort, _ = peak(ORT, [str(path), "{}"])
    own, _ = optimize_peak(path, {}, BUDGET, tmp_path, ["--providers", "openvino,litert,ort-cpu"])  # no kernels build
    assert own - floor <= 2 * ort, f"optimize peaked at {own} MiB, {own - floor} above its imports ({floor} MiB); " \
                                   f"ONNX Runtime at {ort} MiB"


def test_finding_the_providers_present_imports_no_runtime():
    """`optimize` finds every provider present from the installed files (OpenVINO's CPU plugin, LiteRT's
    interpreter library) and imports a runtime only where it runs it: imported to be listed, OpenVINO and LiteRT
    took 42 MiB and a few tenths of a second of every command's start."""
    code = ("import json, sys; from uhop_onnx.providers import resolve; found = [p.id for p in resolve(None)]; "
            "print(json.dumps([found, sorted({'openvino', 'ai_edge_litert'} & set(sys.modules))]))")
    found, imported = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                                check=True, timeout=120).stdout)
    if not {"openvino", "litert"} & set(found):
        pytest.skip("neither OpenVINO nor LiteRT is installed here")
    assert imported == [], f"listing {found} imported {imported}"


def test_a_session_on_onnx_runtime_imports_only_what_serves():
    """A one-shot script pays for ONNX Runtime and uhop-onnx's own modules: the model's structure (`onnx`) is
    read, and another runtime's module imported, only when a bucket is explored or `session.plan` is asked for."""
    model = Path(__file__).parent.parent / "models" / "example_mobilenet.onnx"
    code = ("import json, sys, numpy as np, uhop_onnx; "
            f"s = uhop_onnx.InferenceSession({str(model)!r}, providers=['CPUExecutionProvider']); "
            "i = s.get_inputs()[0]; s.run(None, {i.name: np.zeros(i.shape, np.float32)}); "
            "heavy = lambda: sorted({m.split('.')[0] for m in sys.modules} & {'onnx', 'onnx_ir', 'openvino', "
            "'ai_edge_litert', 'pydantic'} | {m for m in sys.modules if m.split('.')[2:3] in "
            "(['openvino'], ['litert'], ['rknn'], ['kernels'])}); "
            "served = heavy(); nodes = len(s.plan.stages[0].nodes); print(json.dumps([served, heavy(), nodes]))")
    served, asked, nodes = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                                     check=True, timeout=120).stdout)
    assert served == [], f"a session serving ONNX Runtime imported {served}"
    assert "onnx" in asked and nodes == 14  # the plan asked for: the model read, its nodes named


def test_optimize_simplifies_in_a_worker_and_its_own_process_imports_no_simplifier(tmp_path):
    """onnx-ir, onnxscript and the sympy they import (about 60 MiB) are imported only by the search worker that
    simplifies the model: a measured `optimize`'s own process held them for its whole run. The plan is the
    simplified model's (its shape arithmetic folded)."""
    from uhop_onnx.model.loader import load
    from uhop_onnx.model.simplify import simplify

    from .test_litert import exported_flatten

    model = exported_flatten()
    onnx.save(model, tmp_path / "flatten.onnx")
    code = ("import json, sys, uhop_onnx; "
            f"plan = uhop_onnx.optimize({str(tmp_path / 'flatten.onnx')!r}, providers=['ort-cpu'], budget=5); "
            "print(json.dumps([sorted({m.split('.')[0] for m in sys.modules} & {'onnx_ir', 'onnxscript', 'sympy'}), "
            "sorted(n for s in plan.stages for n in s.nodes)]))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "UHOP_CACHE_DIR": str(tmp_path / "cache")})
    assert done.returncode == 0, done.stderr
    imported, nodes = json.loads(done.stdout.splitlines()[-1])
    assert imported == [], f"optimize's own process imported {imported}"
    simplified = sorted(n.name for n in simplify(load(model)).graph.node)
    assert nodes == simplified and len(simplified) < len(model.graph.node)
