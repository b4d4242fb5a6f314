"""Conformance: the ONNX backend node cases through `uhop_onnx.backend.Backend`, and again in a stress mode.

Every node case must pass through us when plain ONNX Runtime (CPU, numpy feeds) passes it. A case that
plain ONNX Runtime fails too is an expected failure, with ONNX Runtime's own error as the reason; a case
we fail for a known gap of ours is listed in `GAPS` with the reason. The "real" models need a download
and are left out, as are the other non-node kinds.

The stress mode spreads the nodes of multi-node cases over every present provider (each node to the next
provider, in turn, that can run it), so that stage boundaries and provider-specific bugs surface.

A plain test run takes a fixed sample of the cases (picked by a hash of the name), to keep the suite fast;
`UHOP_NODE_CASES=all` runs every one. `python tests/test_backend.py` prints how many node cases plain ONNX
Runtime passes on this machine.
"""

from __future__ import annotations

import functools
import os
import re
import unittest
import warnings
import zlib
from typing import Any

import numpy as np
import onnx
import onnx.backend.test
import pytest
from onnx.backend.test.loader import load_model_tests
from onnx.backend.test.runner import Runner

from uhop_onnx.backend import Backend, BackendRep
from uhop_onnx.products.session import InferenceSession

GAPS: dict[str, str] = {}  # case name pattern -> why we fail it while ONNX Runtime passes (none today)

STRESS_GAPS: dict[str, str] = {}  # case name pattern -> why the spread placement fails it (provider bugs it surfaced)

EVERY_CASE = os.environ.get("UHOP_NODE_CASES") == "all"
SAMPLE = 1 / 10  # share of the node cases a plain run takes
STRESS_SAMPLE = 1 / 16  # share of the multi-node cases the stress mode takes


@functools.cache
def node_cases() -> dict[str, Any]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # overflows and divisions the case builders mean
        return {case.name: case for case in load_model_tests(kind="node")}


def _arrays(values) -> list[Any]:
    return [onnx.numpy_helper.to_array(v) if isinstance(v, onnx.TensorProto) else v for v in values]


@functools.cache
def onnxruntime_error(name: str) -> str | None:
    """Why plain ONNX Runtime fails node case `name`, or None when it passes."""
    import onnxruntime as ort

    case = node_cases()[name]
    try:
        options = ort.SessionOptions()
        options.log_severity_level = 4
        session = ort.InferenceSession(case.model.SerializeToString(), options, providers=["CPUExecutionProvider"])
        names = [i.name for i in session.get_inputs()]
        for inputs, expected in case.data_sets:
            outputs = session.run(None, dict(zip(names, _arrays(inputs))))
            Runner.assert_similar_outputs(_arrays(expected), outputs, rtol=case.rtol, atol=case.atol)
    except Exception as error:  # noqa: BLE001 - any failure of ONNX Runtime is the reason
        lines = str(error).strip().splitlines() or [""]
        return f"plain ONNX Runtime fails it too: {type(error).__name__}: {lines[0][:200]}"
    return None


def gap(name: str, gaps: dict[str, str]) -> str | None:
    return next((reason for pattern, reason in gaps.items() if re.fullmatch(pattern, name)), None)


def judged(test: Any, name: str, gaps: dict[str, str]) -> Any:
    """`test` where a failure is expected when ONNX Runtime fails the case too, or it is a known gap."""

    @functools.wraps(test)
    def wrapper(*args, **kwargs):
        try:
            test(*args, **kwargs)
        except Exception:
            reason = onnxruntime_error(name) or gap(name, gaps)
            if reason is None:
                raise
            pytest.xfail(reason)
        if gap(name, gaps) and not onnxruntime_error(name):
            pytest.fail(f"{name} passes now: remove it from the gaps")

    return wrapper


def collect(backend: type[Backend], names: set[str], gaps: dict[str, str]) -> dict[str, type[unittest.TestCase]]:
    """The node cases `names` as unittest classes for pytest, run through `backend` on CPU; `gaps` are its
    known failures."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        suite = onnx.backend.test.BackendTest(backend, __name__)
    cls = suite.test_cases["OnnxBackendNodeModelTest"]
    for attr in [a for a in vars(cls) if a.startswith("test_")]:
        name = attr.removesuffix("_cpu")
        if not attr.endswith("_cpu") or name not in names:
            delattr(cls, attr)
        else:
            setattr(cls, attr, judged(getattr(cls, attr), name, gaps))
    return {backend.__name__ + cls.__name__: cls}


class SpreadBackend(Backend):
    """Every node on the next present provider, in turn, that can run it: as many boundaries as possible."""

    @classmethod
    def prepare(cls, model: onnx.ModelProto, device: str = "CPU", **kwargs: Any) -> BackendRep:
        from uhop_onnx.products.optimizer import analyze, build_plan

        a = analyze(model)
        placement = []
        for node in a.graph.nodes:
            able = [label for label, support in a.support.items() if support[node.name].ok]
            placement.append(able[node.index % len(able)] if able else a.providers[0].label)
        return BackendRep(InferenceSession(build_plan(a, placement, None), profile=False))


def sample(share: float, min_nodes: int = 1) -> set[str]:
    """The node cases of at least `min_nodes` nodes: all with UHOP_NODE_CASES=all, else a fixed share of them
    picked by a hash of the name."""
    cut = (1.0 if EVERY_CASE else share) * 2**32
    return {name for name, case in node_cases().items()
            if len(case.model.graph.node) >= min_nodes and zlib.crc32(name.encode()) < cut}


def stress_sample() -> set[str]:
    return sample(STRESS_SAMPLE, min_nodes=3)


globals().update(collect(Backend, sample(SAMPLE), GAPS))
globals().update(collect(SpreadBackend, stress_sample(), {**GAPS, **STRESS_GAPS}))


def test_backend_refuses_other_devices():
    assert Backend.supports_device("CPU") and not Backend.supports_device("CUDA")


def test_backend_takes_inputs_by_position_or_name():
    from uhop_onnx.models import BUILDERS

    model = BUILDERS["cnn"]() if "cnn" in BUILDERS else next(iter(BUILDERS.values()))()
    rep = Backend.prepare(model)
    inputs = {i.name: np.random.default_rng(0).standard_normal([d or 1 for d in i.shape]).astype(np.float32)
              for i in rep.session.get_inputs()}
    by_name = rep.run(inputs)
    by_position = Backend.run_model(model, list(inputs.values()))
    assert len(by_name) == len(rep.session.get_outputs())
    for a, b in zip(by_name, by_position):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("providers", [None, ["litert"]])
def test_a_node_that_fails_the_litert_check_runs_on_the_next_provider(providers):
    """LiteRT converts a training-mode Dropout as an identity, which its build check refuses on random ratios:
    the node goes to the next provider that runs it, the case passes, and the plan says why. (Measured
    placement cannot time this case: its sample ratio is outside [0, 1), which ONNX Runtime refuses.)"""
    import uhop_onnx

    if not uhop_onnx.providers.REGISTRY["litert"]().present:
        pytest.skip("litert is not present here")
    case = node_cases()["test_training_dropout_zero_ratio"]
    plan = uhop_onnx.optimize(case.model, providers=providers, profile=False)
    assert [(s.provider, s.nodes) for s in plan.stages] == [("ort-cpu", ["Dropout_0"])]
    assert [(r["node"], r["provider"]) for r in plan.replaced] == [("Dropout_0", "litert")]
    assert "fails the build check: litert: the converted stage 'Dropout_0' differs" in plan.replaced[0]["reason"]
    session = InferenceSession(plan)
    names = [i.name for i in session.get_inputs()]
    for inputs, expected in case.data_sets:
        got = session.run(None, dict(zip(names, _arrays(inputs))))
        Runner.assert_similar_outputs(_arrays(expected), got, rtol=case.rtol, atol=case.atol)


def test_stress_mode_spreads_nodes_over_every_present_provider():
    """At least one sampled case gets stages on every provider present, so the stress mode stresses."""
    from uhop_onnx.providers import resolve

    present = {p.id for p in resolve(None)}
    seen: set[str] = set()
    for name in sorted(stress_sample()):
        try:
            seen |= set(SpreadBackend.prepare(node_cases()[name].model).session.get_providers())
        except Exception:  # noqa: BLE001, S112 - a case that does not plan is judged by its own test
            continue
        if seen >= present:
            break
    assert seen == present, f"the stress sample never used {sorted(present - seen)}"


if __name__ == "__main__":
    passed = sum(onnxruntime_error(name) is None for name in node_cases())
    print(f"plain ONNX Runtime passes {passed} of {len(node_cases())} node cases")
