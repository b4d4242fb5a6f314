"""The runtime floor: one `Stage` type (plan.json's and a bundle manifest's), its declared outputs recorded
when the plan is built, and `compile_plan` running a plan without the session."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest

import uhop_onnx
from uhop_onnx.models import mlp
from uhop_onnx.runtime.plan import Stage
from uhop_onnx.runtime.compile import compile_plan

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


def test_verify_puts_the_reference_in_place_of_a_stage_that_does_not_match(tmp_path):
    """A stage whose artifact computes something else fails its check; its reference stands in, so the
    stages after it (here, the model's outputs) are checked on the right values."""
    from onnx import numpy_helper

    from uhop_onnx.bundle.manifest import hash_files

    model = mlp()
    assign = _first_on_ort(model)
    bundle = uhop_onnx.export_bundle(model, "x86-64", tmp_path / "b", providers=["openvino", "ort-cpu"],
                                     assign=assign)
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert len(manifest["stages"]) > 1 and manifest["stages"][0]["provider"] == "ort-cpu"
    [artifact] = manifest["stages"][0]["artifact"]["files"]
    stage = onnx.load(bundle / artifact)
    weight = stage.graph.initializer[0]
    weight.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(weight) + 1, weight.name))
    onnx.save(stage, bundle / artifact)
    manifest["files"] = hash_files(bundle)
    (bundle / "manifest.json").write_text(json.dumps(manifest))
    report = uhop_onnx.verify_bundle(bundle)
    assert not report["ok"] and report["stages"][0]["ok"] is False
    assert not any(c["ok"] for c in report["stages"][0]["outputs"].values())
    assert all(s["ok"] for s in report["stages"][1:]) and all(o["ok"] for o in report["outputs"].values())


def test_a_stage_whose_runtime_returns_another_shape_or_drops_an_output_fails_naming_it():
    """Each stage's results are held to the shapes its model declares (a free batch free, the rest fixed):
    a runtime that answers otherwise fails its stage (a `StageError` saying what was wrong), whatever the
    feeds that passed the executor's own checks."""
    model = mlp()
    assign = _first_on_ort(model)
    plan = uhop_onnx.optimize(model, ["ort-cpu", "openvino"], assign=assign, profile=False)
    assert len(plan.stages) > 1
    x = np.random.default_rng(0).standard_normal((4, 64)).astype(np.float32)
    with compile_plan(plan) as executor:
        assert_matches(executor.run(None, {"input": x}), reference(model, {"input": x}))
        first, name = executor.runners[0], plan.stages[0].outputs[0]
        answers = {"shape": lambda feeds: {name: first.run(feeds)[name][:, :-1]},
                   "missing": lambda feeds: {}}
        for what, answer in answers.items():
            executor.runners[0] = type("Misbehaving", (), {"run": staticmethod(answer), "device": "cpu"})()
            with pytest.raises(uhop_onnx.StageError, match="has shape" if what == "shape" else "missing"):
                executor.run(None, {"input": x})
        executor.runners[0] = first
        with pytest.raises(uhop_onnx.InputError, match="dimension 1 must be 64"):
            executor.run(None, {"input": x[:, :32].copy()})
        with pytest.raises(uhop_onnx.InputError, match="float64"):
            executor.run(None, {"input": x.astype(np.float64)})


@pytest.mark.slow
def test_a_big_endian_feed_gives_what_its_values_give_on_one_stage_and_on_many():
    """ONNX Runtime reads a big-endian array's bytes as native ones; the session hands the runtimes the values."""
    model = mlp()
    x = np.random.default_rng(1).standard_normal((4, 64)).astype(np.float32)
    want = reference(model, {"input": x})
    assign = _first_on_ort(model)
    many = uhop_onnx.optimize(model, ["ort-cpu", "openvino"], assign=assign, profile=False)
    one = uhop_onnx.InferenceSession(model, providers=["ort-cpu"], adapt=False)
    assert_matches(one.run(None, {"input": x.astype(">f4")}), want)
    one.close()
    with compile_plan(many) as split:
        assert_matches(split.run(None, {"input": x.astype(">f4")}), want)


def _first_on_ort(model: onnx.ModelProto) -> dict[str, str]:
    """The first node on ONNX Runtime, the rest on OpenVINO: a plan of two stages."""
    return {node.name: "openvino" if k else "ort-cpu" for k, node in enumerate(model.graph.node)}
