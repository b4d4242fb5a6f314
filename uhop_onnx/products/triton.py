"""A plan as a Triton Inference Server model repository: one model per stage and an ensemble wiring them.

ONNX Runtime stages become `onnxruntime_onnx` models on the instance kind and execution accelerator of
their provider; OpenVINO stages become `openvino` backend models holding OpenVINO IR. The ensemble,
named after the model, takes the plan's inputs and gives its outputs. With `max_batch`, every stage gets
Triton's `dynamic_batching` (the model's first dimension must be free everywhere). Every `config.pbtxt` is
built from Triton's own model-config protobuf and parsed back before the repository is renamed into place;
datatypes follow `tritonclient.utils`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ..foundation.errors import PlanError
from ..foundation.files import new_folder
from ..runtime.plan import Plan, Stage
from ..providers import device_kind

CONFIG = "config.pbtxt"
# Provider id -> (platform or backend, GPU execution accelerator): the providers Triton has a backend for. The
# instance kind follows the device kind the provider declares.
TARGETS: dict[str, tuple[str, str | None]] = {
    "ort-cpu": ("onnxruntime_onnx", None),
    "ort-cuda": ("onnxruntime_onnx", None),
    "ort-tensorrt": ("onnxruntime_onnx", "tensorrt"),
    "openvino": ("openvino", None),
}
INSTANCE_KINDS = {"cpu": "KIND_CPU", "gpu": "KIND_GPU"}  # device kind -> Triton's instance kind


def export_triton(model_or_plan: Any, repo_dir: str | os.PathLike, model_name: str | None = None,
                  providers=None, threads: int | None = None, instances: int = 1, max_batch: int = 0,
                  max_delay_ms: float | None = None) -> Path:
    """Write a Triton model repository for a model, a plan or a plan folder into `repo_dir`.

    `repo_dir` must be absent or empty; it is written to a temporary folder beside it and renamed into
    place. The ensemble is called `model_name` (default: the model's name), stage `k` `{model_name}_stage_{k}`.
    `max_batch` above 0 lets Triton batch up to that many requests, waiting at most `max_delay_ms` (Triton's
    default, no wait, when None); the batch axis is then left out of every tensor's `dims`.
    """
    from google.protobuf import text_format

    from ..serve.source import load_plan

    plan, default_name = load_plan(model_or_plan, providers, threads)
    name = model_name or default_name
    target = Path(repo_dir)
    if plan.constants:
        raise PlanError(f"outputs {', '.join(sorted(plan.constants))} are constants no stage computes; a Triton "
                        "ensemble cannot give them")
    if max_batch < 0:
        raise PlanError(f"max_batch must be 0 (no batching) or more, got {max_batch}")
    for k, stage in enumerate(plan.stages):
        _target(k, stage)
        if max_batch:
            _check_batch_axis(k, plan.stage_model(stage))
    batching = (max_batch, max_delay_ms)
    with new_folder(target, PlanError) as staging:
        configs = [_write_stage(plan, k, stage, f"{name}_stage_{k}", staging, instances, batching)
                   for k, stage in enumerate(plan.stages)]
        configs.append(_ensemble(plan, name, configs, max_batch))
        (staging / name / "1").mkdir(parents=True)
        for config in configs:
            (staging / config.name / CONFIG).write_text(text_format.MessageToString(config))
        validate_repository(staging)
    return target


def validate_repository(repo_dir: str | os.PathLike) -> dict[str, Any]:
    """Parse every `config.pbtxt` against Triton's model-config schema and check the ensembles' wiring.

    Returns the parsed `ModelConfig`s by model name; raises `PlanError` naming the first bad one.
    """
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2 as pb

    configs = {}
    for path in sorted(Path(repo_dir).glob(f"*/{CONFIG}")):
        try:
            config = text_format.Parse(path.read_text(), pb.ModelConfig())
        except text_format.ParseError as error:
            raise PlanError(f"{path}: not a valid Triton model config ({error})") from None
        if config.name != path.parent.name:
            raise PlanError(f"{path}: name {config.name!r} differs from its folder {path.parent.name!r}")
        configs[config.name] = config
    for config in configs.values():
        if config.platform == "ensemble":
            _check_ensemble(config, configs)
    return configs


def _target(k: int, stage: Stage) -> tuple[str, str, str | None]:
    if stage.provider not in TARGETS:
        raise PlanError(f"stage {k} runs on {stage.provider}, which Triton has no backend for; providers Triton "
                        f"can run: {', '.join(TARGETS)} (optimize with --providers among them)")
    if stage.precision in ("bf16", "fp16"):  # an int8 stage is its QDQ model, which the backends run as it is
        raise PlanError(f"stage {k} runs at {stage.precision}, which a Triton model config does not carry; "
                        "export a plan optimized with precision='fp32' or 'int8'")
    engine, accelerator = TARGETS[stage.provider]
    kind = device_kind(stage.provider, stage.options)
    if engine == "openvino" and kind != "cpu":
        device = str(stage.options.get("device", "CPU")).upper()
        raise PlanError(f"stage {k} runs on openvino:{device}; Triton's openvino backend runs on CPU only")
    return engine, INSTANCE_KINDS[kind], accelerator


def _check_batch_axis(k: int, model) -> None:
    for value in (*model.graph.input, *model.graph.output):
        dims = value.type.tensor_type.shape.dim
        if not dims or dims[0].HasField("dim_value"):
            shape = [d.dim_value if d.HasField("dim_value") else d.dim_param or "?" for d in dims]
            raise PlanError(f"stage {k}: tensor {value.name!r} has shape {shape}, without a free first dimension "
                            "to batch along; export without --max-batch, or export the model with a dynamic "
                            "batch axis")


def _write_stage(plan: Plan, k: int, stage: Stage, name: str, repo: Path, instances: int,
                 batching: tuple[int, float | None]):
    from tritonclient.grpc import model_config_pb2 as pb

    engine, kind, accelerator = _target(k, stage)
    model = plan.stage_model(stage)
    version = repo / name / "1"
    version.mkdir(parents=True)
    max_batch, max_delay_ms = batching
    config = pb.ModelConfig(name=name, max_batch_size=max_batch)
    if max_batch:
        config.dynamic_batching.SetInParent()
        if max_delay_ms is not None:
            config.dynamic_batching.max_queue_delay_microseconds = round(max_delay_ms * 1000)
    if engine == "openvino":
        import openvino as ov

        # Core.read_model, not convert_model: the converter also reports telemetry.
        ir = ov.Core().read_model(model.SerializeToString())
        ov.save_model(ir, version / "model.xml", compress_to_fp16=False)
        config.backend = "openvino"
    else:
        (version / "model.onnx").write_bytes(model.SerializeToString())
        config.platform = engine
    if accelerator:
        config.optimization.execution_accelerators.gpu_execution_accelerator.add(name=accelerator)
    group = config.instance_group.add(kind=pb.ModelInstanceGroup.Kind.Value(kind), count=instances)
    if kind == "KIND_GPU" and "device_id" in stage.options:
        group.gpus.append(int(stage.options["device_id"]))
    for value in model.graph.input:
        config.input.add(name=value.name, **_tensor(value, name, bool(max_batch)))
    for value in model.graph.output:
        config.output.add(name=value.name, **_tensor(value, name, bool(max_batch)))
    return config


def _ensemble(plan: Plan, name: str, stages: list, max_batch: int):
    from tritonclient.grpc import model_config_pb2 as pb

    config = pb.ModelConfig(name=name, platform="ensemble", max_batch_size=max_batch)
    declared = {t.name: t for stage in stages for t in (*stage.input, *stage.output)}
    for sig in plan.inputs:
        config.input.add(name=sig.name, data_type=declared[sig.name].data_type, dims=declared[sig.name].dims)
    for sig in plan.outputs:
        config.output.add(name=sig.name, data_type=declared[sig.name].data_type, dims=declared[sig.name].dims)
    for stage in stages:
        step = config.ensemble_scheduling.step.add(model_name=stage.name, model_version=-1)
        step.input_map.update({t.name: t.name for t in stage.input})
        step.output_map.update({t.name: t.name for t in stage.output})
    return config


def _tensor(value, model: str, batched: bool) -> dict[str, Any]:
    """Data type and dims of a tensor in a model config (without the batch axis when `batched`)."""
    import numpy as np
    from onnx import helper
    from tritonclient.grpc import model_config_pb2 as pb
    from tritonclient.utils import np_to_triton_dtype

    tensor = value.type.tensor_type
    try:
        kind = np_to_triton_dtype(np.dtype(helper.tensor_dtype_to_np_dtype(tensor.elem_type)))
    except (KeyError, TypeError):
        kind = None
    if kind is None:
        element = helper.tensor_dtype_to_string(tensor.elem_type).removeprefix("TensorProto.").lower()
        raise PlanError(f"{model}: tensor {value.name!r} has type {element}, which Triton cannot carry; types: "
                        "bool, (u)int8-64, float16, bfloat16, float, double, string")
    if not tensor.HasField("shape"):
        raise PlanError(f"{model}: tensor {value.name!r} has no known rank; Triton needs one")
    dims = [d.dim_value if d.HasField("dim_value") else -1 for d in tensor.shape.dim]
    return {"data_type": pb.DataType.Value("TYPE_" + ("STRING" if kind == "BYTES" else kind)),
            "dims": dims[1:] if batched else dims}


def _check_ensemble(config, configs: dict[str, Any]) -> None:
    """Every step's model exists and has the mapped tensors; every tensor is made before it is used."""
    available = {t.name for t in config.input}
    for step in config.ensemble_scheduling.step:
        where = f"ensemble {config.name!r} step {step.model_name!r}"
        model = configs.get(step.model_name)
        if model is None:
            raise PlanError(f"{where}: no such model in the repository; models: {', '.join(configs)}")
        unknown = set(step.input_map) - {t.name for t in model.input}
        unknown |= set(step.output_map) - {t.name for t in model.output}
        if unknown:
            raise PlanError(f"{where}: the model has no tensor(s) {', '.join(sorted(unknown))}")
        if model.max_batch_size < config.max_batch_size:
            raise PlanError(f"{where}: the model batches at most {model.max_batch_size}, the ensemble "
                            f"{config.max_batch_size}")
        missing = set(step.input_map.values()) - available
        if missing:
            raise PlanError(f"{where}: uses {', '.join(sorted(missing))} before any step makes it")
        available |= set(step.output_map.values())
    unmade = {t.name for t in config.output} - available
    if unmade:
        raise PlanError(f"ensemble {config.name!r}: no step makes output(s) {', '.join(sorted(unmade))}")
