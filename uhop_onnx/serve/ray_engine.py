"""`--engine ray`: the whole plan as one replicated Ray Serve deployment; a stage gets a deployment of its own
only where it needs other hardware than the CPU replicas have.

Each replica of the plan serves the protocol itself (the same Starlette app as the local engine) behind Ray
Serve's HTTP proxy and runs the plan's `Executor` in-process, so a request crosses the network only to reach
a GPU or NPU stage and come back (the tensors travel as numpy arrays, through Ray's object store when large).
A replica takes in every request its app can hold (bodies arriving, requests waiting and running), since Ray
Serve hands a request to a replica before its body has arrived: a slow body must hold no place of Ray's. The
app then keeps its limits as on the local engine (408, 503 with `Retry-After`); Ray Serve queues only what
is beyond them, up to `max_queue`. With `max_batch` its `@serve.batch` gathers the requests each replica runs
together.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
from collections.abc import Mapping
from typing import Any

import numpy as np
from ray import serve

from ..foundation.errors import UhopError
from ..runtime.plan import Plan, Stage
from ..providers import REGISTRY, device_kind
from ..providers.runner import Runner
from ..runtime.compile import compile_stage
from .app import RETRY_AFTER_S, create_app
from .limits import Limits
from .batching import Job
from .metrics import Metrics, configure_tracing
from .replicas import Replicas, bounded, plan_executor

log = logging.getLogger(__name__)


@serve.deployment(max_ongoing_requests=4)
class StageReplica:
    """One plan stage on the hardware it needs, compiled in this replica; runs one call at a time."""

    def __init__(self, plan: Plan, index: int, threads: int | None, max_shapes: int | None):
        self.runner = bounded(compile_stage(plan, plan.stages[index], threads), max_shapes)
        self.lock = asyncio.Lock()

    async def __call__(self, feeds: dict) -> dict:
        # Large arrays arrive as read-only views of Ray's object store; some runtimes (OpenVINO's shared
        # input tensors) need memory they could write, so those are copied once here.
        feeds = {name: np.require(value, requirements="W") for name, value in feeds.items()}
        async with self.lock:
            results = await asyncio.to_thread(self.runner.run, feeds)
        return {name: self.runner.to_host(value) for name, value in results.items()}


class Remote(Runner):
    """A stage deployment, called through its handle from an executor's worker thread."""

    def __init__(self, handle):
        self.handle = handle

    def run(self, feeds):
        return self.handle.remote(dict(feeds)).result()


@serve.deployment
@serve.ingress()
class PlanReplica:
    """The protocol endpoint and the plan's `Executor`: stages compiled here, or handles to stage deployments."""

    def __init__(self, plan: Plan, name: str, remote: list, threads: int | None, limits: Limits):
        configure_tracing()
        metrics = Metrics(name)
        runners = [bounded(compile_stage(plan, stage, threads), limits.max_shapes) if handle is None else Remote(handle)
                   for stage, handle in zip(plan.stages, remote)]
        self.replicas = Replicas([plan_executor(plan, runners, metrics)], plan.inputs, plan.outputs, metrics,
                                 limits.max_batch)
        if self.replicas.batch:
            self.batched.set_max_batch_size(limits.max_batch)
            self.batched.set_batch_wait_timeout_s(limits.max_delay_ms / 1e3)
            self.replicas.submit = self.batched
        self.asgi = create_app(self.replicas, name, limits)

    def __serve_build_asgi_app__(self):
        return self.asgi

    @serve.batch
    async def batched(self, jobs: list[Job]) -> list:
        return await self.replicas.run_jobs(jobs)


def stage_resources(stage: Stage, num_cpus: float, accelerators: float = 1.0) -> dict[str, Any]:
    """Ray actor options for one replica of `stage`, by the device kind its provider declares: a GPU stage
    asks for `accelerators` GPUs, an NPU stage as much of the custom resource its provider names (a node
    advertises it: `ray start --resources '{"rknn": 3}'`)."""
    kind = device_kind(stage.provider, stage.options)
    options: dict[str, Any] = {"num_cpus": num_cpus}
    if kind == "gpu":
        options["num_gpus"] = accelerators
    elif kind == "npu":
        options["resources"] = {REGISTRY[stage.provider].npu_resource: accelerators}
    return options


def ray_app(plan: Plan, name: str, replicas: int = 1, autoscaling: Mapping[str, Any] | None = None,
            num_cpus: float | None = None, accelerators: float = 1.0, threads: int | None = None,
            limits: Limits = Limits(), per_stage: bool = False,
            stage_options: Mapping[int, Mapping[str, Any]] | None = None):
    """The Ray Serve application serving `plan`: replicas of the whole plan, plus a deployment for each stage
    that needs a GPU or NPU (or for every stage, `per_stage`).

    `replicas` per deployment, or `autoscaling` (Ray Serve's `autoscaling_config`) instead. `num_cpus` per
    replica defaults to an equal share of the cluster's CPUs (at most 1), so every replica fits.
    `stage_options` adds Ray actor options for stage k (`{"resources": {"npu": 1}}` pins it to the nodes
    that advertise that resource, and gives it a deployment of its own). Ray must be initialised.
    """
    if replicas < 1:
        raise UhopError(f"replicas must be at least 1, got {replicas}")
    most = int(autoscaling.get("max_replicas", replicas)) if autoscaling else replicas
    extra = stage_options or {}
    asks = [{**stage_resources(stage, 0), **extra.get(k, {})} for k, stage in enumerate(plan.stages)]
    apart = [k for k, ask in enumerate(asks) if per_stage or set(ask) - {"num_cpus"}]
    if num_cpus is None:
        num_cpus = cpu_share(most * (1 + len(apart)))
    scale = {"autoscaling_config": dict(autoscaling)} if autoscaling else {"num_replicas": replicas}
    threads = threads or plan.threads or max(1, math.floor(num_cpus))
    for stage in plan.stages:
        plan.stage_model(stage)  # in memory, so replicas on other nodes need no plan folder
    remote: list[Any] = [None] * len(plan.stages)
    for k in apart:
        options = {**stage_resources(plan.stages[k], num_cpus, accelerators), **extra.get(k, {})}
        remote[k] = StageReplica.options(name=f"stage_{k}_{plan.stages[k].label.replace(':', '_')}",
                                         ray_actor_options=options, **scale).bind(plan, k, threads,
                                                                                  limits.max_shapes)
    env = {key: value for key, value in os.environ.items() if key.startswith("OTEL_")}
    options: dict[str, Any] = {"num_cpus": num_cpus}
    if env:
        options["runtime_env"] = {"env_vars": env}
    return PlanReplica.options(
        name="plan", ray_actor_options=options,
        max_ongoing_requests=limits.max_receiving + limits.max_queue + 2 * max(1, limits.max_batch),
        max_queued_requests=limits.max_queue, graceful_shutdown_timeout_s=limits.timeout_s,
        backpressure_config={"status_code": 503, "retry_after_s": RETRY_AFTER_S}, **scale,
    ).bind(plan, name, remote, threads, limits)


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
    """Remove the application, its replicas answering what they accepted first; shut Serve and Ray down too
    when this process started Ray."""
    import ray

    if started:
        serve.shutdown()
        ray.shutdown()
    else:
        serve.delete(name)
