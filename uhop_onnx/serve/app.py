"""The Open Inference Protocol (KServe v2 REST) as a Starlette ASGI app over a plan's `Replicas`.

The same app runs in one process under uvicorn (`--engine local`) and inside each Ray Serve replica of the
plan (`--engine ray`). Under load it keeps its promises: a body is read whole (`Arrivals`: within
`body_timeout_s`, else 408) before the request takes a place among the `max_queue` waiting ones (beyond them
503 with `Retry-After`); past `timeout_s` it answers 504; the codec runs off the event loop (`Offload`), which
so stays free to answer health checks; and a client that goes away is one log line.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from contextlib import asynccontextmanager

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route

from .. import __version__
from ..foundation.errors import InputError, StageError
from .bodies import Arrivals
from .metrics import span
from .limits import Limits
from .offload import Offload
from .protocol import ProtocolError, error_body, tensor_metadata
from .replicas import Replicas

log = logging.getLogger(__name__)

VERSION = "1"  # the one version of the model served
EXTENSIONS = ["binary_tensor_data"]
RETRY_AFTER_S = 1  # what a 503 tells the client to wait


def create_app(replicas: Replicas, name: str, limits: Limits = Limits()) -> Starlette:
    """Serve `replicas` as model `name` within `limits`."""
    metrics = replicas.metrics
    model_metadata = {
        "name": name, "versions": [VERSION], "platform": "uhop-onnx",
        "inputs": [tensor_metadata(s) for s in replicas.inputs],
        "outputs": [tensor_metadata(s) for s in replicas.outputs],
    }
    most = limits.max_queue + replicas.capacity  # requests inside at once: waiting, and running
    inside = 0
    arrivals, offload = Arrivals(limits), Offload(limits.max_request_bytes)

    def check_model(request: Request) -> None:
        asked, version = request.path_params["name"], request.path_params.get("version", VERSION)
        if asked != name:
            raise ProtocolError(f"unknown model {asked!r}; this server serves: {name}", 404)
        if version != VERSION:
            raise ProtocolError(f"model {name!r} has no version {version!r}; versions: {VERSION}", 404)

    async def live(_: Request) -> Response:
        return _json({"live": True})

    async def ready(_: Request) -> Response:
        return _json({"ready": True})

    async def server_metadata(_: Request) -> Response:
        return _json({"name": "uhop-onnx", "version": __version__, "extensions": EXTENSIONS})

    async def metadata(request: Request) -> Response:
        check_model(request)
        return _json(model_metadata)

    async def model_ready(request: Request) -> Response:
        check_model(request)
        return _json({"name": name, "ready": True})

    @asynccontextmanager
    async def place():
        """A place among the requests inside; `ProtocolError` 503 when there is none."""
        nonlocal inside
        if inside >= most:
            raise ProtocolError(f"the server is busy ({limits.max_queue} requests waiting); retry after "
                                f"{RETRY_AFTER_S} s", 503)
        inside += 1
        try:
            yield
        finally:
            inside -= 1

    def refused(message: str, status: int, unread: bool = False) -> Response:
        """An error answer; one that cuts a body off (`unread`) closes the connection, so that a client still
        sending holds nothing of the server's."""
        metrics.request(status)
        response = _error(message, status)
        if unread:
            response.headers["connection"] = "close"
        return response

    async def infer(request: Request) -> Response:
        start = time.perf_counter()
        body = None
        try:
            check_model(request)
            body = await arrivals.read(request)
            async with place():
                decoded = await offload.decode(body, request.headers, replicas.inputs, replicas.outputs)
                with span("infer", request.headers, model=name):
                    values = await asyncio.wait_for(replicas.infer(decoded.feeds, [n for n, _ in decoded.outputs]),
                                                    limits.timeout_s)
                content, headers = await offload.encode(name, decoded, values, replicas.outputs)
        except InputError as error:  # a ProtocolError has a status of its own
            status = getattr(error, "status", 400)
            return refused(str(error), status, unread=body is None and status in (408, 503))
        except StageError as error:
            if isinstance(error.__cause__, InputError):  # a stage that refuses these inputs
                return refused(str(error), 400)
            log.warning("%s", error)
            return refused(str(error), 500)
        except TimeoutError:
            return refused(f"no answer within the server's timeout of {limits.timeout_s:g} s", 504)
        except ClientDisconnect:
            log.info("a client disconnected before sending its whole request")
            metrics.request(499)
            return Response(status_code=499)
        metrics.request(200, time.perf_counter() - start)
        return Response(content, headers=headers)

    async def prometheus(_: Request) -> Response:
        content, content_type = metrics.render()
        return Response(content, headers={"content-type": content_type})

    async def protocol_error(_: Request, error: Exception) -> Response:
        return _error(str(error), getattr(error, "status", 400))

    async def http_error(_: Request, error: Exception) -> Response:
        assert isinstance(error, HTTPException)
        return _error(error.detail, error.status_code)

    async def server_error(_: Request, error: Exception) -> Response:
        return _error(f"internal error: {type(error).__name__}: {error}", 500)

    model = "/v2/models/{name}"
    versioned = model + "/versions/{version}"
    routes = [
        Route("/v2/health/live", live),
        Route("/v2/health/ready", ready),
        Route("/v2", server_metadata),
        Route("/metrics", prometheus),
    ]
    for prefix in (model, versioned):
        routes += [Route(prefix, metadata), Route(prefix + "/ready", model_ready),
                   Route(prefix + "/infer", infer, methods=["POST"])]

    @asynccontextmanager
    async def lifespan(_: Starlette):
        try:
            yield
        finally:
            offload.close()

    return Starlette(routes=routes, lifespan=lifespan, exception_handlers={
        ProtocolError: protocol_error, HTTPException: http_error, Exception: server_error})


def _json(data: object) -> Response:
    return Response(json.dumps(data).encode(), headers={"content-type": "application/json"})


def _error(message: str, status: int) -> Response:
    """A JSON error; a 503 says when to retry."""
    retry = {"Retry-After": str(RETRY_AFTER_S)} if status == 503 else {}
    return Response(error_body(message), status_code=status, headers={"content-type": "application/json", **retry})
