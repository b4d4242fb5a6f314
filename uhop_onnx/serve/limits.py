"""What a server promises under load, apart from the web framework, so the CLI reads its defaults without the
`serve` extra."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_MAX_REQUEST_BYTES = 64 * 1024 * 1024
# The batching delay: how long the first request of a batch waits for others (benchmarks/serve.py).
DEFAULT_MAX_DELAY_MS = 2.0


@dataclass(frozen=True)
class Limits:
    """What a server promises under load: request size (413), waiting requests (503), time to answer (504),
    and dynamic batching (off unless `max_batch` is above 1)."""

    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    max_queue: int = 64
    timeout_s: float = 30.0
    max_batch: int = 0
    max_delay_ms: float = DEFAULT_MAX_DELAY_MS
