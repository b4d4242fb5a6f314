"""`--engine local`: every stage compiled in this process, the protocol served by uvicorn."""

from __future__ import annotations

from starlette.applications import Starlette

from ..plan import Plan
from .app import create_app
from .pipeline import Pipeline, StageWorker, compile_stage
from .protocol import DEFAULT_MAX_REQUEST_BYTES


def local_app(plan: Plan, name: str, replicas: int = 1, threads: int | None = None,
              max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES) -> Starlette:
    """The ASGI app serving `plan`, each stage with `replicas` runners so requests overlap within a stage."""
    threads = threads if threads is not None else plan.threads
    workers = [StageWorker([compile_stage(stage.provider, stage.options, plan.stage_model(stage), threads)
                            for _ in range(replicas)]) for stage in plan.stages]

    async def call(k: int, feeds):
        return await workers[k](feeds)

    return create_app(Pipeline(plan), call, name, max_request_bytes=max_request_bytes)


def run_local(app: Starlette, host: str, port: int) -> None:
    """Serve until interrupted."""
    import uvicorn

    uvicorn.run(app, host=host, port=port, log_level="warning")
