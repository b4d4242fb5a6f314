"""The codec off the event loop, so that the server keeps answering (`/v2/health/live` within milliseconds)
while large requests are decoded and their answers encoded.

Compressed bodies are inflated, binary tensors and small JSON documents decoded, in a thread: zlib and numpy's
copies release the GIL. A large JSON document goes to a worker process (`Workers`), since Python's JSON
decoder and encoder hold the GIL for the whole document (0.8 s for a 23 MiB tensor here), which no thread
would hide.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import zlib
from collections.abc import Mapping, Sequence

import numpy as np

from ..foundation.dtypes import TensorSig
from .protocol import HEADER_LENGTH, InferRequest, ProtocolError, decode_request, encode_response, too_large
from .workers import Workers

INLINE_JSON_BYTES = 64 * 1024  # a request's JSON beyond this is decoded in a worker process
INLINE_JSON_VALUES = 4096  # outputs asked for as JSON with more values than this are encoded in one
_WBITS = {"gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}


class Offload:
    """Decodes requests and encodes answers in a thread, or in one of `workers` processes (started when first
    needed) for large JSON; `limit` bounds a body once inflated."""

    def __init__(self, limit: int, workers: int | None = None):
        self.limit = limit
        self.workers = Workers(workers or min(4, max(1, (os.cpu_count() or 1) // 2)))

    async def decode(self, body: bytes, headers: Mapping[str, str], inputs: Sequence[TensorSig],
                     outputs: Sequence[TensorSig]) -> InferRequest:
        """The request in `body`, as `decode_request` reads it once its Content-Encoding is undone."""
        encoding = headers.get("content-encoding", "identity").lower()
        plain = body if encoding == "identity" else await asyncio.to_thread(inflate, body, encoding, self.limit)
        header_length = headers.get(HEADER_LENGTH)
        json_bytes = int(header_length) if header_length and header_length.isdigit() else len(plain)
        return await self._run(json_bytes > INLINE_JSON_BYTES, decode_request, plain, header_length, inputs,
                               outputs)

    async def encode(self, name: str, request: InferRequest, values: Mapping[str, np.ndarray],
                     signatures: Sequence[TensorSig]) -> tuple[bytes, dict[str, str]]:
        """The response body and headers, as `encode_response` writes them."""
        request = dataclasses.replace(request, feeds={})  # what the answer needs of it, and no more to copy
        json_values = sum(np.size(values[output]) for output, binary in request.outputs if not binary)
        return await self._run(json_values > INLINE_JSON_VALUES, encode_response, name, request, values,
                               signatures)

    def close(self) -> None:
        self.workers.close()

    async def _run(self, heavy: bool, function, *args):
        """`function(*args)` in a thread, or when `heavy` in a worker process (a thread waiting for it)."""
        if heavy:
            return await asyncio.to_thread(self.workers.call, function, *args)
        return await asyncio.to_thread(function, *args)


def inflate(body: bytes, encoding: str, limit: int) -> bytes:
    """`body` decompressed per its Content-Encoding; `ProtocolError` 413 past `limit` bytes, 415 for an
    encoding other than gzip or deflate, 400 for data that does not decompress."""
    if encoding not in _WBITS:
        raise ProtocolError(f"Content-Encoding {encoding!r} is not supported; use gzip, deflate or none", 415)
    inflater = zlib.decompressobj(_WBITS[encoding])
    try:
        plain = inflater.decompress(body, limit + 1)
    except zlib.error as error:
        raise ProtocolError(f"the {encoding} request body does not decompress: {error}") from None
    if len(plain) > limit:
        raise too_large(limit)
    return plain
