"""`--engine ray`: each plan stage a Ray Serve deployment, composed through deployment handles.

The ingress deployment serves the protocol (the same Starlette app as the local engine) behind Ray
Serve's HTTP proxy and routes tensors between stage deployments in plan order, so successive requests
overlap in different stages. Each stage asks for the resources its provider needs: GPUs for CUDA,
TensorRT, MIGraphX and OpenVINO GPU stages, a custom resource for NPU stages, and a share of a CPU.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Mapping
from typing import Any

from ray import serve

from ..errors import UhopError
from ..plan import Plan, Stage
from .app import create_app
from .metrics import configure_tracing
from .pipeline import Pipeline, StageWorker, compile_stage
from .protocol import DEFAULT_MAX_REQUEST_BYTES

log = logging.getLogger(__name__)

GPU_PROVIDERS = frozenset({"ort-cuda", "ort-tensorrt", "ort-rocm"})
# Custom Ray resources a node must advertise (`ray start --resources '{"rknn": 3}'`) to host NPU stages.
NPU_RESOURCE = {"rknn": "rknn", "openvino": "npu"}


@serve.deployment(max_ongoing_requests=8)
class StageReplica:
    """One plan stage, compiled on its provider in this replica."""

    def __init__(self, model_bytes: bytes, provider: str, options: dict[str, Any], threads: int | None):
        import onnx

        self.worker = StageWorker([compile_stage(provider, options, onnx.load_from_string(model_bytes), threads)])

    async def __call__(self, feeds):
        return await self.worker(feeds)


@serve.deployment(max_ongoing_requests=64)
@serve.ingress()
class Ingress:
    """The protocol endpoint; calls the stage deployments through their handles."""

    def __init__(self, pipeline: Pipeline, name: str, stages: list, max_request_bytes: int):
        configure_tracing()
        self.pipeline, self.name, self.stages, self.max_request_bytes = pipeline, name, stages, max_request_bytes

    def __serve_build_asgi_app__(self):
        async def call(k: int, feeds):
            return await self.stages[k].remote(feeds)

        return create_app(self.pipeline, call, self.name, max_request_bytes=self.max_request_bytes)


def stage_resources(stage: Stage, num_cpus: float, accelerators: float = 1.0) -> dict[str, Any]:
    """Ray actor options for one replica of `stage`."""
    device = str(stage.options.get("device", "CPU")).upper()
    options: dict[str, Any] = {"num_cpus": num_cpus}
    if stage.provider in GPU_PROVIDERS or (stage.provider == "openvino" and device.startswith("GPU")):
        options["num_gpus"] = accelerators
    elif stage.provider == "rknn" or (stage.provider == "openvino" and device.startswith("NPU")):
        options["resources"] = {NPU_RESOURCE[stage.provider]: accelerators}
    return options


def ray_app(plan: Plan, name: str, replicas: int = 1, autoscaling: Mapping[str, Any] | None = None,
            num_cpus: float | None = None, accelerators: float = 1.0, threads: int | None = None,
            max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES):
    """The Ray Serve application serving `plan`: one deployment per stage plus the ingress.

    `replicas` per stage, or `autoscaling` (Ray Serve's `autoscaling_config`) instead. `num_cpus` per
    replica defaults to an equal share of the cluster's CPUs (at most 1), so every replica fits. Ray must
    be initialised.
    """
    if replicas < 1:
        raise UhopError(f"replicas must be at least 1, got {replicas}")
    most = int(autoscaling.get("max_replicas", replicas)) if autoscaling else replicas
    if num_cpus is None:
        num_cpus = cpu_share(len(plan.stages) * most + 1)
    scale = {"autoscaling_config": dict(autoscaling)} if autoscaling else {"num_replicas": replicas}
    threads = threads or plan.threads or max(1, math.floor(num_cpus))
    stages = [
        StageReplica.options(name=f"stage_{k}_{stage.label.replace(':', '_')}",
                             ray_actor_options=stage_resources(stage, num_cpus, accelerators), **scale)
        .bind(plan.stage_model(stage).SerializeToString(), stage.provider, dict(stage.options), threads)
        for k, stage in enumerate(plan.stages)
    ]
    env = {key: value for key, value in os.environ.items() if key.startswith("OTEL_")}
    ingress_options: dict[str, Any] = {"num_cpus": num_cpus}
    if env:
        ingress_options["runtime_env"] = {"env_vars": env}
    return Ingress.options(name="ingress", ray_actor_options=ingress_options).bind(
        Pipeline(plan), name, stages, max_request_bytes)


def cpu_share(replicas: int) -> float:
    """An equal share of the cluster's CPUs for each of `replicas`, at most 1, rounded down to 1/100."""
    import ray

    total = ray.cluster_resources().get("CPU", 1.0)
    return max(0.01, min(1.0, math.floor(100 * total / replicas) / 100))


def start_ray(host: str, port: int) -> bool:
    """Join the cluster at RAY_ADDRESS, or start a local Ray instance (True then); start Serve's HTTP proxy."""
    import ray

    started = False
    if not ray.is_initialized():
        address = os.environ.get("RAY_ADDRESS")
        if address:
            ray.init(address=address, log_to_driver=False)
        else:
            ray.init(address="local", _node_ip_address="127.0.0.1", include_dashboard=False, log_to_driver=False)
            started = True
    serve.start(http_options={"host": host, "port": port})
    return started


def deploy(app, name: str) -> None:
    """Deploy (or update) the application `name` at the root path and wait until it is running."""
    serve.run(app, name=name, route_prefix="/", logging_config={"enable_access_log": False})


def stop(name: str, started: bool) -> None:
    """Remove the application; shut Serve and Ray down too when this process started Ray."""
    import ray

    if started:
        serve.shutdown()
        ray.shutdown()
    else:
        serve.delete(name)
