"""`--engine local`: replicas of the whole plan in this process, the protocol served by uvicorn."""

from __future__ import annotations

from starlette.applications import Starlette

from ..runtime.plan import Plan
from ..runtime.compile import compile_stages
from .app import create_app
from .limits import Limits
from .batching import Batcher
from .metrics import Metrics
from .replicas import Replicas, bounded, plan_executor


def local_app(plan: Plan, name: str, replicas: int = 1, threads: int | None = None,
              limits: Limits = Limits()) -> Starlette:
    """The ASGI app serving `plan` with `replicas` copies of its compiled stages, so requests overlap."""
    threads = threads if threads is not None else plan.threads
    metrics = Metrics(name)
    executors = [plan_executor(plan, [bounded(r, limits.max_shapes) for r in compile_stages(plan, threads)], metrics)
                 for _ in range(replicas)]
    served = Replicas(executors, plan.inputs, plan.outputs, metrics, limits.max_batch)
    if served.batch:
        served.submit = Batcher(served.run_jobs, limits.max_batch, limits.max_delay_ms / 1e3, replicas).submit
    app = create_app(served, name, limits)
    app.state.replicas = served  # closed by `run_local` once the server stopped
    return app


def run_local(app: Starlette, host: str, port: int, limits: Limits = Limits()) -> None:
    """Serve until SIGINT or SIGTERM; then stop accepting, answer what was accepted (for at most
    `limits.timeout_s`), close the stages' runners, and return."""
    import uvicorn

    try:
        uvicorn.run(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=limits.timeout_s)
    finally:
        app.state.replicas.close()
