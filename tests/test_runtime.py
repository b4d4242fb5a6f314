"""The runtime floor: one `Stage` type (plan.json's and a bundle manifest's), its declared outputs recorded
when the plan is built, and `compile_plan` running a plan without the session."""

from __future__ import annotations

import json

import numpy as np

import uhop_onnx
from uhop_onnx.models import mlp
from uhop_onnx.plan import Stage
from uhop_onnx.runtime import compile_plan

from .conftest import assert_matches, random_feeds, reference


def test_declared_outputs_are_recorded_and_an_older_plan_without_them_still_runs(tmp_path):
    model = mlp()
    plan = uhop_onnx.optimize(model, providers=["ort-cpu"], profile=False)
    assert plan.stages[0].declared == [("output", (4, 10))]
    plan.save(tmp_path / "plan")
    path = tmp_path / "plan" / "plan.json"
    data = json.loads(path.read_text())
    assert data["stages"][0]["declared"] == [["output", [4, 10]]]
    assert uhop_onnx.Plan.load(tmp_path / "plan").stages[0].declared == [["output", [4, 10]]]
    for stage in data["stages"]:
        del stage["declared"]
    path.write_text(json.dumps(data))
    older = uhop_onnx.Plan.load(tmp_path / "plan")
    assert older.stages[0].declared is None
    feeds = random_feeds(model)
    with compile_plan(older) as executor:
        assert_matches(executor.run(None, feeds), reference(model, feeds))
    assert older.stages[0].declared == [("output", (4, 10))]  # read from the stage's model when compiled


def test_a_bundle_manifest_stage_is_a_stage_with_its_own_keys(tmp_path):
    bundle = uhop_onnx.export_bundle(mlp(), "x86-64", tmp_path / "b", providers=["ort-cpu"])
    entry = json.loads((bundle / "manifest.json").read_text())["stages"][0]
    stage = Stage.from_json(entry)
    assert {**stage.to_json(), **entry} == entry  # the manifest's stage is to_json() plus its own keys
    assert {"artifact", "runtime", "reference", "tolerance"} <= set(entry) - set(stage.to_json())
    assert stage.file == entry["reference"] and stage.declared == [["output", [4, 10]]]
    older = {k: v for k, v in entry.items() if k not in ("file", "precision", "sha256", "cost_ms")}
    assert Stage.from_json(older).file == entry["reference"]
    x = np.random.default_rng(0).standard_normal((4, 64)).astype(np.float32)
    assert uhop_onnx.load_bundle(bundle).run(None, {"input": x})[0].shape == (4, 10)
