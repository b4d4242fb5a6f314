"""A measured `optimize` holds, above what its imports alone take, at most twice the memory ONNX Runtime takes
to run the same model, each measured in a fresh process (`benchmarks/memory.py`), on a model whose weights
(a ResNet-50's, 100 MB) make every copy of them show: before the copies were cut, it held 771 MiB where the
bound is 757 (ONNX Runtime 306, the imports 145); now about 505."""

from __future__ import annotations

import onnx

from benchmarks.memory import FLOOR, ORT, optimize_peak, peak
from uhop_onnx.models import resnet50

BUDGET = 6.0  # seconds of measured search (its peak comes early: loading, asking the providers, the first plans)


def test_optimize_holds_at_most_twice_onnx_runtimes_peak_above_its_imports(tmp_path):
    path = tmp_path / "resnet50.onnx"
    onnx.save(resnet50(), path)
    floor, _ = peak(FLOOR, [])
    ort, _ = peak(ORT, [str(path), "{}"])
    own, _ = optimize_peak(path, {}, BUDGET, tmp_path, ["--providers", "openvino,litert,ort-cpu"])  # no kernels build
    assert own - floor <= 2 * ort, f"optimize peaked at {own} MiB, {own - floor} above its imports ({floor} MiB); " \
                                   f"ONNX Runtime at {ort} MiB"
