"""The Open Inference Protocol (KServe v2 REST) as a Starlette ASGI app over a `Pipeline`.

The same app runs in one process under uvicorn (`--engine local`) and inside a Ray Serve ingress
replica (`--engine ray`); only the way a stage is called differs.
"""

from __future__ import annotations

import json
import logging
import time
import zlib

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from .. import __version__
from ..errors import StageError
from .metrics import Metrics, span
from .pipeline import Pipeline, StageCall
from .protocol import (
    DEFAULT_MAX_REQUEST_BYTES,
    HEADER_LENGTH,
    ProtocolError,
    decode_request,
    encode_response,
    error_body,
    tensor_metadata,
)

log = logging.getLogger(__name__)

VERSION = "1"  # the one version of the model served
EXTENSIONS = ["binary_tensor_data"]
_WBITS = {"gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}


def create_app(pipeline: Pipeline, call: StageCall, name: str, *,
               max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES, metrics: Metrics | None = None) -> Starlette:
    """Serve `pipeline` as model `name`; requests larger than `max_request_bytes` (after decompression)
    are refused with 413."""
    metrics = metrics or Metrics(name)
    model_metadata = {
        "name": name, "versions": [VERSION], "platform": "uhop-onnx",
        "inputs": [tensor_metadata(s) for s in pipeline.inputs],
        "outputs": [tensor_metadata(s) for s in pipeline.outputs],
    }

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
        start = time.perf_counter()
        try:
            check_model(request)
            body = await _read_body(request, max_request_bytes)
            decoded = decode_request(body, request.headers.get(HEADER_LENGTH), pipeline.inputs, pipeline.outputs)
            with span("infer", request.headers, model=name):
                values = await pipeline.run(decoded.feeds, [n for n, _ in decoded.outputs], call, metrics)
            content, headers = encode_response(name, decoded, values, pipeline.outputs)
        except ProtocolError as error:
            metrics.request(error.status)
            return _error(str(error), error.status)
        except StageError as error:
            log.warning("%s", error)
            metrics.request(500)
            return _error(str(error), 500)
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


def _error(message: str, status: int) -> Response:
    return Response(error_body(message), status_code=status, headers={"content-type": "application/json"})
