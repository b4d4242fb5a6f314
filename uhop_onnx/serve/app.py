"""The Open Inference Protocol (KServe v2 REST) as a Starlette ASGI app over a plan's `Replicas`.

The same app runs in one process under uvicorn (`--engine local`) and inside each Ray Serve replica of the
plan (`--engine ray`). Under load it keeps its promises: beyond `max_queue` waiting requests it answers 503
with `Retry-After`, past `timeout_s` 504, and a client that goes away is one log line.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import zlib

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route

from .. import __version__
from ..errors import StageError
from .metrics import span
from .limits import Limits
from .protocol import (
    HEADER_LENGTH,
    ProtocolError,
    decode_request,
    encode_response,
    error_body,
    tensor_metadata,
)
from .replicas import Replicas

log = logging.getLogger(__name__)

VERSION = "1"  # the one version of the model served
EXTENSIONS = ["binary_tensor_data"]
_WBITS = {"gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}
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

    async def infer(request: Request) -> Response:
        nonlocal inside
        start = time.perf_counter()
        if inside >= most:
            metrics.request(503)
            return _error(f"the server is busy ({limits.max_queue} requests waiting); retry after "
                          f"{RETRY_AFTER_S} s", 503, {"Retry-After": str(RETRY_AFTER_S)})
        inside += 1
        try:
            check_model(request)
            body = await _read_body(request, limits.max_request_bytes)
            decoded = decode_request(body, request.headers.get(HEADER_LENGTH), replicas.inputs, replicas.outputs)
            with span("infer", request.headers, model=name):
                values = await asyncio.wait_for(replicas.infer(decoded.feeds, [n for n, _ in decoded.outputs]),
                                                limits.timeout_s)
            content, headers = encode_response(name, decoded, values, replicas.outputs)
        except ProtocolError as error:
            metrics.request(error.status)
            return _error(str(error), error.status)
        except StageError as error:
            log.warning("%s", error)
            metrics.request(500)
            return _error(str(error), 500)
        except TimeoutError:
            metrics.request(504)
            return _error(f"no answer within the server's timeout of {limits.timeout_s:g} s", 504)
        except ClientDisconnect:
            log.info("a client disconnected before sending its whole request")
            metrics.request(499)
            return Response(status_code=499)
        finally:
            inside -= 1
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
    return Starlette(routes=routes, exception_handlers={
        ProtocolError: protocol_error, HTTPException: http_error, Exception: server_error})


async def _read_body(request: Request, limit: int) -> bytes:
    """The request body, decompressed per Content-Encoding; `ProtocolError` 413 past `limit` bytes."""
    too_big = f"the request is larger than the server's limit of {limit} bytes"
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise ProtocolError(too_big, 413)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ProtocolError(too_big, 413)
        chunks.append(chunk)
    body = b"".join(chunks)
    encoding = request.headers.get("content-encoding", "identity").lower()
    if encoding == "identity":
        return body
    if encoding not in _WBITS:
        raise ProtocolError(f"Content-Encoding {encoding!r} is not supported; use gzip, deflate or none", 415)
    inflater = zlib.decompressobj(_WBITS[encoding])
    try:
        plain = inflater.decompress(body, limit + 1)
    except zlib.error as error:
        raise ProtocolError(f"the {encoding} request body does not decompress: {error}") from None
    if len(plain) > limit:
        raise ProtocolError(too_big, 413)
    return plain


def _json(data: object) -> Response:
    return Response(json.dumps(data).encode(), headers={"content-type": "application/json"})


def _error(message: str, status: int, headers: dict[str, str] | None = None) -> Response:
    return Response(error_body(message), status_code=status,
                    headers={"content-type": "application/json", **(headers or {})})
