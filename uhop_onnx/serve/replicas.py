"""A plan's replicas in one server process: each the runtime's `Executor` over the plan's stage runners, used
by one call at a time in a worker thread, every stage run timed into `/metrics`.

A runner is a stage compiled here, or (on Ray) a handle to a stage deployment on other hardware; the
`Executor` routes tensors between them the same way `InferenceSession` does.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from ..foundation.dtypes import TensorSig
from ..runtime.executor import Executor
from ..runtime.plan import Plan
from ..providers.runner import PerShapeRunner, Runner
from .batching import Job, batchable, run_together
from .metrics import Metrics, span

log = logging.getLogger(__name__)


class Timed(Runner):
    """A stage's runner whose runs are recorded (time or failure) in `metrics`, each within a span."""

    def __init__(self, runner: Runner, index: int, label: str, metrics: Metrics):
        self.runner, self.index, self.label, self.metrics = runner, index, label, metrics
        self.device = runner.device

    def run(self, feeds: Mapping[str, Any]) -> dict[str, Any]:
        with span(f"stage {self.index}", stage=self.index, provider=self.label, model=self.metrics.model):
            start = time.perf_counter()
            try:
                results = self.runner.run(feeds)
            except Exception:
                self.metrics.stage(self.index, self.label, None)
                raise
        self.metrics.stage(self.index, self.label, time.perf_counter() - start)
        return results

    def to_host(self, value: Any) -> np.ndarray:
        return self.runner.to_host(value)

    def close(self) -> None:
        self.runner.close()


def bounded(runner: Runner, max_shapes: int | None) -> Runner:
    """`runner`, built for at most `max_shapes` input shapes when it is built per shape and that is given."""
    if max_shapes is not None and isinstance(runner, PerShapeRunner):
        runner.limit = max_shapes
    return runner


def plan_executor(plan: Plan, runners: Sequence[Runner], metrics: Metrics) -> Executor:
    """The runtime's `Executor` over one runner per stage of `plan`, each timed into `metrics`."""
    timed = [Timed(runner, k, s.label, metrics) for k, (s, runner) in enumerate(zip(plan.stages, runners))]
    return Executor(plan.stages, timed, plan.inputs, [o.name for o in plan.outputs], plan.constants)


class Replicas:
    """Executors of one plan, each running one call at a time in its own worker thread.

    With `max_batch` above 1 and a model whose inputs and outputs all have a free first dimension, the jobs
    handed to `run_jobs` together are joined into batches; `submit` (a `Batcher`'s, or a Ray Serve
    `@serve.batch` method) gathers them. `capacity` is how many requests can be running at once.
    """

    def __init__(self, executors: Sequence[Executor], inputs: Sequence[TensorSig], outputs: Sequence[TensorSig],
                 metrics: Metrics, max_batch: int = 0):
        self.inputs, self.outputs, self.metrics = list(inputs), list(outputs), metrics
        self.batch = max_batch > 1 and batchable(inputs, outputs)
        if max_batch > 1 and not self.batch:
            log.warning("%s: an input or output has a fixed first dimension; requests run one at a time, "
                        "unbatched", metrics.model)
        self.capacity = len(executors) * (max_batch if self.batch else 1)
        self.submit: Callable[[Job], Awaitable[dict[str, np.ndarray] | Exception]] | None = None
        self._executors = list(executors)
        self._free: asyncio.Queue[Executor] = asyncio.Queue()
        for executor in executors:
            self._free.put_nowait(executor)
        self._threads = ThreadPoolExecutor(len(executors), thread_name_prefix="uhop-serve")

    def close(self) -> None:
        """Wait for the runs under way, then close every executor (and so every stage's runner)."""
        self._threads.shutdown(wait=True)
        for executor in self._executors:
            executor.close()

    async def infer(self, feeds: dict[str, np.ndarray], wanted: list[str]) -> dict[str, np.ndarray]:
        """The outputs `wanted` for one request; what the run raised, for this request alone."""
        job = Job(feeds, wanted)
        answer = await self.submit(job) if self.submit else (await self.run_jobs([job]))[0]
        if isinstance(answer, Exception):
            raise answer
        return answer

    async def run_jobs(self, jobs: list[Job]) -> list[dict[str, np.ndarray] | Exception]:
        """Run `jobs` on the next free executor; it is handed back only when its thread is done, even when the
        callers stopped waiting."""
        executor = await self._free.get()
        call = functools.partial(contextvars.copy_context().run, run_together, executor.run, jobs, self.batch,
                                 self._started)
        future = asyncio.get_running_loop().run_in_executor(self._threads, call)
        future.add_done_callback(lambda _: self._free.put_nowait(executor))
        return await asyncio.shield(future)

    def _started(self, jobs: Sequence[Job]) -> None:
        now = time.perf_counter()
        self.metrics.run([now - job.arrived for job in jobs])
