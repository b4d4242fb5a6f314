"""Real architectures nobody here wrote: the default plan and the measured plan of each corpus model, at two
input shapes, match ONNX Runtime CPU on the same file.

The models (`benchmarks/corpus_models.py`) come from timm, torchvision and transformers with random weights,
each exported by the TorchScript and the dynamo exporter, plus files other tools write (int8 QDQ, fp16,
external data, If/Loop, Paddle's -1 dimensions). A fixed subset runs by default; `UHOP_CORPUS=all` runs
every model. Exports are cached under the user's cache folder (the first run builds them). An export that
fails is the exporter's limit: an xfail carrying its error.
"""

from __future__ import annotations

import inspect
import os

import numpy as np
import onnx
import pytest

import uhop_onnx
from benchmarks import corpus_models as corpus
from benchmarks.corpus_models import EXPORTERS, FILES, TORCH_MODELS, ExportFailed

RTOL, ATOL = 1e-4, 1e-5
BUDGET = 2.0  # seconds of measured search per model: the plan is measured, not exhaustively searched

# Failures of the product met on this corpus (its own bugs, filed; strict=False so a fix shows as XPASS).
KNOWN: dict[tuple[str, ...], str] = {}  # (model, exporter[, "default" | "measured"]) -> the error

_ALL = os.environ.get("UHOP_CORPUS") == "all"


def _cases():
    for s in TORCH_MODELS:
        for exporter in EXPORTERS:
            if _ALL or s.default:
                yield s.name, exporter
    for f in FILES:
        yield f.name, "file"


def _params(kind: str):
    for name, exporter in _cases():
        known = KNOWN.get((name, exporter, kind)) or KNOWN.get((name, exporter))
        marks = [pytest.mark.xfail(strict=False, reason=known)] if known else []
        yield pytest.param(name, exporter, id=f"{name}-{exporter}", marks=marks)


def _model(name: str, exporter: str):
    """(path, spec, (rtol, atol)) of a corpus case, skipping where a package is missing and marking the
    exporter's failure as its limit."""
    pytest.importorskip("torch", reason="PyTorch is not installed (pip install torch==2.13.0)")
    if exporter == "file":
        f = corpus.file_spec(name)
        s, tolerance = f.inputs_spec, f.tolerance
    else:
        s, tolerance = corpus.spec(name), (RTOL, ATOL)
    why = corpus.missing(s) if s.library != "onnx" else None
    if why:
        pytest.skip(why)
    try:
        path = corpus.written(f) if exporter == "file" else corpus.exported(s, exporter)
    except ExportFailed as e:
        pytest.xfail(f"{exporter} exporter's limit: {e}")
    return path, s, tolerance


def _reference(path, feeds):
    import onnxruntime as ort

    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, feeds)


def _check(session, path, s, tolerance):
    for k in (0, 1):
        feeds = s.feeds(k, seed=k)
        expected = _reference(path, feeds)
        got = session.run(None, feeds)
        assert len(got) == len(expected)
        for name, g, e in zip(s.outputs, got, expected):
            assert g.shape == e.shape, f"{name} at {s.sizes[k]}: shape {g.shape} != {e.shape}"
            np.testing.assert_allclose(g, e, rtol=tolerance[0], atol=tolerance[1],
                                       err_msg=f"{name} at {s.sizes[k]}")


def _shapes_option(s) -> dict:
    """The measured shapes, passed where `optimize` takes them."""
    return {"shapes": s.shapes(0)} if "shapes" in inspect.signature(uhop_onnx.optimize).parameters else {}


@pytest.mark.slow
@pytest.mark.parametrize("name,exporter", list(_params("default")))
def test_the_default_plan_matches_onnxruntime_at_two_shapes(name, exporter):
    path, s, tolerance = _model(name, exporter)
    _check(uhop_onnx.InferenceSession(str(path), profile=False), path, s, tolerance)


@pytest.mark.slow
@pytest.mark.parametrize("name,exporter", list(_params("measured")))
def test_the_measured_plan_matches_onnxruntime_at_two_shapes(name, exporter):
    path, s, tolerance = _model(name, exporter)
    plan = uhop_onnx.optimize(str(path), profile=True, budget=BUDGET, **_shapes_option(s))
    assert plan.placement == "measured"
    _check(uhop_onnx.InferenceSession(plan), path, s, tolerance)


def test_the_corpus_is_the_size_the_issue_asks_for():
    assert len(TORCH_MODELS) >= 30 and {"timm", "torchvision", "transformers"} <= {s.library for s in TORCH_MODELS}
    assert {f.name for f in FILES} == set(corpus.FORMATS)


def test_each_file_of_another_tool_is_what_it_claims():
    """int8 QDQ pairs, fp16 weights, external data, If and Loop, -1 dimensions."""
    paths = {f.name: _model(f.name, "file")[0] for f in FILES}
    ops = {name: {n.op_type for n in onnx.load(p).graph.node} for name, p in paths.items()}
    assert {"QuantizeLinear", "DequantizeLinear"} <= ops["int8-qdq"]
    assert {i.data_type for i in onnx.load(paths["fp16"]).graph.initializer} >= {onnx.TensorProto.FLOAT16}
    assert (paths["external-data"].parent / "model.onnx.data").stat().st_size > 100_000
    assert all(i.data_location == onnx.TensorProto.EXTERNAL
               for i in onnx.load(paths["external-data"], load_external_data=False).graph.initializer)
    assert {"If", "Loop"} <= ops["if-loop"]
    assert onnx.load(paths["paddle-dims"]).graph.input[0].type.tensor_type.shape.dim[0].dim_value == -1
