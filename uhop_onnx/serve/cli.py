"""`uhop-onnx serve`: the Open Inference Protocol over a model or a plan folder, on one process or on Ray."""

from __future__ import annotations

import json
import logging
import signal
import time
from enum import StrEnum
from pathlib import Path
from typing import Annotated

import typer

from ..foundation.errors import UhopError
from .limits import (
    DEFAULT_BODY_TIMEOUT_S,
    DEFAULT_MAX_DELAY_MS,
    DEFAULT_MAX_RECEIVING,
    DEFAULT_MAX_REQUEST_BYTES,
    Limits,
)
from .source import load_plan

log = logging.getLogger(__name__)


class Engine(StrEnum):
    local = "local"
    ray = "ray"


def serve(
    model_or_dir: Annotated[Path, typer.Argument(help="An ONNX model, or a plan folder written by optimize.")],
    engine: Annotated[Engine, typer.Option(
        help="local: one process; ray: replicas of the whole plan on Ray Serve (a stage on a GPU or NPU gets a "
             "deployment of its own).")] = Engine.local,
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on.")] = 8000,
    model_name: Annotated[str | None, typer.Option(help="Name in the URL; default: the model's name.")] = None,
    replicas: Annotated[int, typer.Option(min=1, help="Replicas of the plan (and of each stage deployment).")]
    = 1,
    providers: Annotated[str | None, typer.Option(help="For a model file: provider ids, comma-separated.")]
    = None,
    threads: Annotated[int | None, typer.Option(min=1, help="Intra-op threads per stage runner.")] = None,
    autoscaling: Annotated[str | None, typer.Option(
        help='Ray only: Ray Serve autoscaling_config as JSON, e.g. {"min_replicas": 1, "max_replicas": 4}.')]
    = None,
    num_cpus: Annotated[float | None, typer.Option(help="Ray only: CPUs per replica; default: an equal share.")]
    = None,
    per_stage: Annotated[bool, typer.Option(help="Ray only: every stage a deployment of its own.")] = False,
    max_request_bytes: Annotated[int, typer.Option(min=1, help="Larger requests get HTTP 413.")]
    = DEFAULT_MAX_REQUEST_BYTES,
    max_batch: Annotated[int, typer.Option(
        min=0, help="Dynamic batching: run up to N requests as one call (needs a free first dimension); "
                    "off below 2.")] = 0,
    max_delay_ms: Annotated[float, typer.Option(
        min=0, help="Dynamic batching: how long a batch waits for more requests.")] = DEFAULT_MAX_DELAY_MS,
    max_queue: Annotated[int, typer.Option(min=1, help="Requests waiting beyond those running; more get 503.")]
    = 64,
    timeout_s: Annotated[float, typer.Option(min=0.001, help="Requests not answered in time get 504.")] = 30.0,
    body_timeout_s: Annotated[float, typer.Option(
        min=0.001, help="A request body must arrive within this, else 408; it takes no place among the waiting "
                        "requests until it has.")] = DEFAULT_BODY_TIMEOUT_S,
    max_receiving: Annotated[int, typer.Option(
        min=1, help="Request bodies arriving at once; one more cuts the longest arriving off with 503.")]
    = DEFAULT_MAX_RECEIVING,
    max_shapes: Annotated[int | None, typer.Option(
        min=1, help="Input shapes a stage on a fixed-shape runtime (LiteRT, RKNN) is built for; a request at "
                    "one more gets 400. Default: $UHOP_MAX_SHAPES, else 32.")] = None,
) -> None:
    """Serve the Open Inference Protocol (KServe v2 REST) until SIGINT or SIGTERM, then answer what was
    accepted and stop."""
    _require_serve_extra()
    from .metrics import configure_tracing

    engine = Engine(engine)
    scaling = _autoscaling(autoscaling)
    if engine is Engine.local and (scaling or num_cpus is not None or per_stage):
        raise UhopError("--autoscaling, --num-cpus and --per-stage apply to --engine ray only")
    limits = Limits(max_request_bytes=max_request_bytes, max_queue=max_queue, timeout_s=timeout_s,
                    max_batch=max_batch, max_delay_ms=max_delay_ms, body_timeout_s=body_timeout_s,
                    max_receiving=max_receiving, max_shapes=max_shapes)
    plan, default_name = load_plan(model_or_dir, providers, threads)
    name = model_name or default_name
    configure_tracing()
    if engine is Engine.local:
        from .local import local_app, run_local

        log.info("serving %s on http://%s:%d/v2/models/%s", name, host, port, name)
        run_local(local_app(plan, name, replicas, threads, limits), host, port, limits)
        return
    from .ray_engine import deploy, ray_app, start_ray, stop

    started = start_ray(host, port)
    try:
        deploy(ray_app(plan, name, replicas, scaling, num_cpus, threads=threads, limits=limits,
                       per_stage=per_stage), name)
        log.info("serving %s on http://%s:%d/v2/models/%s with Ray Serve", name, host, port, name)
        _wait_for_signal()
    finally:
        stop(name, started)


def _require_serve_extra() -> None:
    """Stop before any work when the `serve` extra is missing, naming what is."""
    try:
        import starlette  # noqa: F401
        import tritonclient.utils  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as error:
        raise UhopError(f"uhop-onnx serve needs the serve extra ({error.name} is not installed): "
                        "pip install 'uhop-onnx[serve]'") from None


def _wait_for_signal() -> None:
    """Block until SIGINT or SIGTERM, even where the parent left SIGINT ignored (a background job)."""
    received: list[int] = []
    for number in (signal.SIGINT, signal.SIGTERM):
        signal.signal(number, lambda n, _: received.append(n))
    while not received:
        time.sleep(0.5)


def _autoscaling(text: str | None) -> dict | None:
    if not text:
        return None
    try:
        config = json.loads(text)
    except ValueError as error:
        raise UhopError(f"--autoscaling is not JSON ({error}): {text!r}") from None
    if not isinstance(config, dict):
        raise UhopError(f"--autoscaling must be a JSON object such as {{\"max_replicas\": 4}}, got {text!r}")
    return config
