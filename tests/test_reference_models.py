"""Every reference model, on each provider alone and under forced splits, equals ONNX Runtime."""

from __future__ import annotations

import random

import pytest

import uhop_onnx
from uhop_onnx.providers import REGISTRY, create

from .conftest import assert_matches, random_feeds, reference

PRESENT = [ident for ident, cls in REGISTRY.items() if cls().present]
SPLITTABLE = [p for p in ("openvino", "ort-cpu") if p in PRESENT]


def _check(model, **options) -> uhop_onnx.InferenceSession:
    feeds = random_feeds(model)
    session = uhop_onnx.InferenceSession(model, profile=False, **options)
    assert_matches(session.run(None, feeds), reference(model, feeds))
    return session


@pytest.mark.parametrize("provider", ["openvino", "ort-cpu"])
def test_each_provider_alone(reference_model, provider):
    if not create(provider).present:
        pytest.skip(create(provider).availability.reason)
    _, model = reference_model
    session = _check(model, providers=[provider])
    assert session.get_providers() == [provider]
    assert sum(len(s.nodes) for s in session.plan.stages) == len(model.graph.node)


@pytest.mark.slow
@pytest.mark.parametrize("every", [1, 3])
def test_alternating_providers(reference_model, every):
    if len(SPLITTABLE) < 2:
        pytest.skip("needs openvino and ort-cpu")
    _, model = reference_model
    names = [n.name for n in model.graph.node]
    assign = {name: SPLITTABLE[(i // every) % 2] for i, name in enumerate(names)}
    session = _check(model, providers=SPLITTABLE, assign=assign)
    placed = {node: stage.provider for stage in session.plan.stages for node in stage.nodes}
    assert placed == assign
    assert len(session.plan.stages) > 1


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(4))
def test_random_assignment(reference_model, seed):
    if len(SPLITTABLE) < 2:
        pytest.skip("needs openvino and ort-cpu")
    _, model = reference_model
    rng = random.Random(seed)
    assign = {n.name: rng.choice(SPLITTABLE) for n in model.graph.node}
    session = _check(model, providers=SPLITTABLE, assign=assign)
    assert {node: stage.provider for stage in session.plan.stages for node in stage.nodes} == assign


def test_plan_folder_runs_like_the_model(reference_model, tmp_path):
    _, model = reference_model
    feeds = random_feeds(model, seed=1)
    plan = uhop_onnx.optimize(model, providers=SPLITTABLE or None, profile=False,
                              assign={model.graph.node[0].name: "ort-cpu"})
    plan.save(tmp_path / "plan")
    session = uhop_onnx.InferenceSession(str(tmp_path / "plan"))
    assert [s.nodes for s in session.plan.stages] == [s.nodes for s in plan.stages]
    assert_matches(session.run(None, feeds), reference(model, feeds))
