"""Request bodies, read before a request takes a place among those waiting to run: whole within a deadline,
and at most so many arriving at once, the one arriving longest cut off for a newcomer. So a client that sends
slowly holds no place in the queue, and no place among the arriving for long, and honest requests get in."""

from __future__ import annotations

import asyncio

from starlette.requests import Request

from .limits import Limits
from .protocol import ProtocolError, too_large


class Arrivals:
    """The bodies arriving now, oldest first, within `limits` (size, deadline, how many at once)."""

    def __init__(self, limits: Limits):
        self.limit, self.timeout_s, self.most = limits.max_request_bytes, limits.body_timeout_s, limits.max_receiving
        self._arriving: dict[asyncio.Future, None] = {}  # insertion order: the oldest first

    async def read(self, request: Request) -> bytes:
        """The body as sent (its Content-Encoding not undone). `ProtocolError` 413 past the size limit, 408
        past the deadline, 503 when cut off for a newer request; `ClientDisconnect` when the client left."""
        if len(self._arriving) >= self.most:
            oldest = next(iter(self._arriving))
            del self._arriving[oldest]
            oldest.cancel()
        reading = asyncio.ensure_future(_read(request, self.limit))
        self._arriving[reading] = None
        try:
            done, _ = await asyncio.wait([reading], timeout=self.timeout_s)
        finally:
            self._arriving.pop(reading, None)
            reading.cancel()  # nothing when it is done
        if not done:
            raise ProtocolError(f"the request body did not arrive within the server's body timeout of "
                                f"{self.timeout_s:g} s", 408)
        if reading.cancelled():
            raise ProtocolError(f"{self.most} other requests are sending their bodies; this one, the longest "
                                "arriving, was cut off", 503)
        return reading.result()


async def _read(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large(limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)
