"""Shared fixtures: reference models, random feeds, and ONNX Runtime's answer to compare with (what this
host's CPU computes is in `host.py`)."""

from __future__ import annotations

import importlib.util
import os
import tempfile

import numpy as np
import onnx
import pytest

from uhop_onnx.foundation.cache import cache_dir
from uhop_onnx.models import BUILDERS
from uhop_onnx.partitioner.placer import Placement
from uhop_onnx.precision import FP32_TOLERANCE, compare

from .support import plans_below_the_chosen

RTOL, ATOL = FP32_TOLERANCE["rtol"], FP32_TOLERANCE["atol"]

# Profiles and built kernels go to a cache of this run, not the user's; the corpus's exports stay in the
# user's cache, where they last between runs.
os.environ.setdefault("UHOP_CORPUS_CACHE", str(cache_dir() / "corpus"))
os.environ.setdefault("UHOP_CACHE_DIR", tempfile.mkdtemp(prefix="uhop-test-cache-"))

# A torchvision wheel built for another torch (PyPI's CUDA build beside torch's CPU build) fails at import, and
# so do timm and transformers' models, which import it: the corpus makes it importable for every test.
if importlib.util.find_spec("torchvision") is not None:
    from benchmarks.corpus_models import import_torchvision

    import_torchvision()


def random_feeds(model: onnx.ModelProto, seed: int = 0) -> dict[str, np.ndarray]:
    """One standard-normal float32 array per graph input (dynamic dimensions set to 1)."""
    rng = np.random.default_rng(seed)
    initializers = {i.name for i in model.graph.initializer}
    feeds = {}
    for value in model.graph.input:
        if value.name in initializers:
            continue
        dims = [d.dim_value or 1 for d in value.type.tensor_type.shape.dim]
        dtype = onnx.helper.tensor_dtype_to_np_dtype(value.type.tensor_type.elem_type)
        feeds[value.name] = rng.standard_normal(dims).astype(dtype)
    return feeds


def reference(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    """ONNX Runtime CPU's outputs, in graph output order."""
    import onnxruntime as ort

    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def assert_matches(actual: list[np.ndarray], expected: list[np.ndarray]) -> None:
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        assert a.dtype == e.dtype and a.shape == e.shape
        result = compare(a, e, FP32_TOLERANCE)  # the one accuracy rule, at fp32's tolerance
        assert result["ok"], result


@pytest.fixture(params=sorted(BUILDERS), scope="session")
def reference_model(request) -> tuple[str, onnx.ModelProto]:
    return request.param, BUILDERS[request.param]()


@pytest.fixture
def tests_in_workers(monkeypatch, pytestconfig):
    """For tests that send their own functions or providers to measuring workers, which run `python -P` (the
    working directory is not on their path): the `tests` package is found on PYTHONPATH, as a program's own
    module would be."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(pytestconfig.rootpath),
                                                                    os.environ.get("PYTHONPATH")])))


@pytest.fixture(autouse=True, scope="session")
def every_report_checked():
    """Every measured placement's report that any test makes is checked as it is made: no timed plan the gate
    accepted lies wholly below the chosen one (and again at the end, for one made where a failure is caught: a
    background thread's)."""
    original, seen = Placement.to_json, []

    def checked(self):
        report = original(self)
        wrong = plans_below_the_chosen(report) if report else []
        seen.extend(wrong)
        assert not wrong, "; ".join(wrong)
        return report

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Placement, "to_json", checked)
        yield
    assert not seen, "; ".join(seen)
