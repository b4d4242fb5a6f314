"""What a server promises under load, apart from the web framework, so the CLI reads its defaults without the
`serve` extra."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_MAX_REQUEST_BYTES = 64 * 1024 * 1024
# The batching delay: how long the first request of a batch waits for others (benchmarks/serve.py).
DEFAULT_MAX_DELAY_MS = 2.0
DEFAULT_BODY_TIMEOUT_S = 10.0
DEFAULT_MAX_RECEIVING = 256


@dataclass(frozen=True)
class Limits:
    """What a server promises under load: request size (413), waiting requests (503), time to answer (504),
    and dynamic batching (off unless `max_batch` is above 1).

    A request's body is read before it takes a place among the waiting ones: it must arrive within
    `body_timeout_s` (else 408), and at most `max_receiving` bodies arrive at once (one more cuts the
    longest-arriving one off with 503), so clients that send slowly hold no place an honest request needs.
    A stage on a fixed-shape runtime (LiteRT, RKNN) is built for at most `max_shapes` input shapes (None: the
    runtime's own limit, `$UHOP_MAX_SHAPES` or 32); a request at one more gets 400."""

    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    max_queue: int = 64
    timeout_s: float = 30.0
    max_batch: int = 0
    max_delay_ms: float = DEFAULT_MAX_DELAY_MS
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S
    max_receiving: int = DEFAULT_MAX_RECEIVING
    max_shapes: int | None = None
