"""The Triton model repository export: schema-valid configs, an ensemble whose steps reproduce the model."""

from __future__ import annotations

import numpy as np
import pytest

from uhop_onnx.foundation.errors import PlanError
from uhop_onnx.models import mlp
from uhop_onnx.products.optimizer import optimize
from uhop_onnx.products.triton import export_triton, validate_repository

from .conftest import assert_matches, random_feeds, reference

pytest.importorskip("tritonclient.grpc.model_config_pb2")

# Three stages: OpenVINO, ONNX Runtime, OpenVINO.
SPLIT = {"/fc1/MatMul": "ort-cpu", "/fc1/Add": "ort-cpu"}


@pytest.fixture(scope="module")
def model():
    return mlp()


@pytest.fixture
def plan(model):
    return optimize(model, providers=["openvino", "ort-cpu"], assign=SPLIT, profile=False)


def run_ensemble(repo, name: str, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Run the ensemble's steps from the repository's own files, as Triton would wire them."""
    import onnxruntime as ort
    import openvino as ov

    configs = validate_repository(repo)
    tensors = dict(feeds)
    for step in configs[name].ensemble_scheduling.step:
        config, folder = configs[step.model_name], repo / step.model_name / "1"
        inputs = {key: tensors[value] for key, value in step.input_map.items()}
        if config.backend == "openvino":
            compiled = ov.Core().compile_model(folder / "model.xml", "CPU", {"INFERENCE_PRECISION_HINT": "f32"})
            results = compiled(inputs)
            outputs = {key: np.asarray(results[compiled.output(key)]) for key in step.output_map}
        else:
            session = ort.InferenceSession(str(folder / "model.onnx"), providers=["CPUExecutionProvider"])
            outputs = dict(zip(step.output_map, session.run(list(step.output_map), inputs)))
        tensors.update({step.output_map[key]: value for key, value in outputs.items()})
    return {t.name: tensors[t.name] for t in configs[name].output}


def test_repository_has_a_model_per_stage_and_an_ensemble_that_reproduces_the_model(tmp_path, model, plan):
    repo = export_triton(plan, tmp_path / "repo", model_name="classifier")
    configs = validate_repository(repo)
    assert sorted(configs) == ["classifier", "classifier_stage_0", "classifier_stage_1", "classifier_stage_2"]
    assert [configs[f"classifier_stage_{k}"].backend or configs[f"classifier_stage_{k}"].platform
            for k in range(3)] == ["openvino", "onnxruntime_onnx", "openvino"]
    ensemble = configs["classifier"]
    assert ensemble.platform == "ensemble"
    assert [t.name for t in ensemble.input] == ["input"] and list(ensemble.input[0].dims) == [4, 64]
    assert (repo / "classifier" / "1").is_dir()
    feeds = random_feeds(model)
    got = run_ensemble(repo, "classifier", feeds)
    assert_matches([got["output"]], reference(model, feeds))


def test_accelerators_follow_the_provider(tmp_path, plan):
    from tritonclient.grpc import model_config_pb2 as pb

    plan.stages[1].provider, plan.stages[1].options = "ort-tensorrt", {"device_id": 1}
    configs = validate_repository(export_triton(plan, tmp_path / "repo"))
    stage = configs["mlp_stage_1"]
    assert stage.platform == "onnxruntime_onnx"
    assert [a.name for a in stage.optimization.execution_accelerators.gpu_execution_accelerator] == ["tensorrt"]
    assert stage.instance_group[0].kind == pb.ModelInstanceGroup.KIND_GPU and list(stage.instance_group[0].gpus) == [1]


def test_a_provider_triton_cannot_run_is_refused_and_nothing_is_left(tmp_path, plan):
    plan.stages[1].provider = "rknn"
    with pytest.raises(PlanError, match=r"stage 1 runs on rknn.*ort-cpu, ort-cuda, ort-tensorrt, openvino"):
        export_triton(plan, tmp_path / "repo")
    assert list(tmp_path.iterdir()) == []


def test_a_non_empty_folder_is_refused(tmp_path, plan):
    (tmp_path / "repo").mkdir()
    (tmp_path / "repo" / "other").mkdir()
    with pytest.raises(PlanError, match="not an empty folder"):
        export_triton(plan, tmp_path / "repo")


def test_a_plan_folder_exports_under_its_model_name(tmp_path, plan):
    plan.save(tmp_path / "plan")
    configs = validate_repository(export_triton(tmp_path / "plan", tmp_path / "repo"))
    assert "mlp" in configs and configs["mlp"].platform == "ensemble"


def test_validation_catches_broken_wiring_and_bad_syntax(tmp_path, plan):
    repo = export_triton(plan, tmp_path / "repo")
    config = repo / "mlp" / "config.pbtxt"
    text = config.read_text()
    handed = plan.stages[0].outputs[0]
    config.write_text(text.replace(f'value: "{handed}"', 'value: "nowhere"', 1))
    with pytest.raises(PlanError, match=f"uses {handed} before any step makes it"):
        validate_repository(repo)
    config.write_text(text.replace("platform:", "platfrom:"))
    with pytest.raises(PlanError, match="not a valid Triton model config"):
        validate_repository(repo)


def test_max_batch_writes_dynamic_batching_and_dims_without_the_batch_axis(tmp_path):
    from onnx import TensorProto, helper, numpy_helper

    weight = numpy_helper.from_array(np.random.default_rng(0).standard_normal((8, 8)).astype(np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["h"], name="mm"), helper.make_node("Relu", ["h"], ["y"], name="relu")],
        "batched", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 8])], [weight])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    plan = optimize(model, providers=["openvino", "ort-cpu"], assign={"relu": "ort-cpu"}, profile=False)
    configs = validate_repository(export_triton(plan, tmp_path / "repo", max_batch=16, max_delay_ms=2.5))
    stages = [configs[f"batched_stage_{k}"] for k in range(2)]
    assert all(c.max_batch_size == 16 and c.dynamic_batching.max_queue_delay_microseconds == 2500 for c in stages)
    assert [list(t.dims) for c in stages for t in (*c.input, *c.output)] == [[8]] * 4
    ensemble = configs["batched"]
    assert ensemble.max_batch_size == 16 and list(ensemble.input[0].dims) == [8]
    assert not ensemble.HasField("dynamic_batching")


def test_max_batch_on_a_fixed_batch_model_is_refused(tmp_path, plan):
    with pytest.raises(PlanError, match=r"tensor 'input' has shape \[4, 64\], without a free first dimension"):
        export_triton(plan, tmp_path / "repo", max_batch=8)
    assert list(tmp_path.iterdir()) == []
