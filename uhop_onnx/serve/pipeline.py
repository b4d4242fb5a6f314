"""A plan's stages as asynchronous calls: the routing of tensors between stages, and one stage's runners.

`Pipeline` knows only tensor names and stage order, so it travels to wherever requests come in (the local
server, or a Ray Serve ingress replica); how a stage is called is passed to `Pipeline.run`. `StageWorker`
runs a compiled stage off the event loop, one request per runner at a time.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import StageError, first_line
from ..dtypes import TensorSig
from ..executor import stages_for
from ..plan import Plan
from .metrics import Metrics, span

# Calls stage `k` with its feeds; returns its outputs and the seconds it spent running.
StageCall = Callable[[int, dict[str, np.ndarray]], Awaitable[tuple[dict[str, np.ndarray], float]]]


@dataclass(frozen=True)
class Route:
    """What one stage takes and gives, by tensor name."""

    label: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]


class Pipeline:
    """The routing of a plan: which stages compute the wanted outputs, and from which tensors."""

    def __init__(self, plan: Plan):
        self.model_name = plan.model_name
        self.inputs: list[TensorSig] = list(plan.inputs)
        self.outputs: list[TensorSig] = list(plan.outputs)
        self.routes = [Route(s.label, tuple(s.inputs), tuple(s.outputs)) for s in plan.stages]
        self.constants = dict(plan.constants)

    def stages_for(self, wanted: Sequence[str]) -> list[int]:
        """Indices of the stages needed for `wanted`, in run order."""
        return stages_for(self.routes, wanted)

    async def run(self, feeds: Mapping[str, np.ndarray], wanted: Sequence[str], call: StageCall,
                  metrics: Metrics | None = None) -> dict[str, np.ndarray]:
        """Run the stages `wanted` needs, each through `call`; a failure raises `StageError`."""
        values: dict[str, Any] = {**feeds, **self.constants}
        for k in self.stages_for(wanted):
            route = self.routes[k]
            stage_feeds = {name: values[name] for name in route.inputs if name in values}
            with span(f"stage {k}", stage=k, provider=route.label, model=self.model_name):
                try:
                    results, seconds = await call(k, stage_feeds)
                except Exception as error:  # noqa: BLE001 - a provider (or the cluster) may fail in any way
                    if metrics is not None:
                        metrics.stage(k, route.label, None)
                    raise StageError(f"stage {k} ({route.label}) failed: {first_line(error)}", k,
                                     route.label) from error
            if metrics is not None:
                metrics.stage(k, route.label, seconds)
            values.update(results)
        return {name: values[name] for name in wanted}


def compile_stage(provider_id: str, options: Mapping[str, Any], model, threads: int | None):
    """A stage model's runner, compiled on its provider to share the process with other stages."""
    from ..providers import create

    provider = create((provider_id, dict(options)), threads)
    provider.require()
    return provider.compile(model, exclusive=False)


class StageWorker:
    """Runs a stage on a pool of runners, each used by one request at a time, in worker threads."""

    def __init__(self, runners: Sequence[Any]):
        self._free: asyncio.Queue = asyncio.Queue()
        for runner in runners:
            self._free.put_nowait(runner)

    async def __call__(self, feeds: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], float]:
        runner = await self._free.get()
        try:
            return await asyncio.to_thread(_timed_run, runner, feeds)
        finally:
            self._free.put_nowait(runner)


def _timed_run(runner, feeds: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], float]:
    start = time.perf_counter()
    results = runner.run(feeds)
    host = {name: runner.to_host(value) for name, value in results.items()}
    return host, time.perf_counter() - start
