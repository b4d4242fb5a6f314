"""Dynamic batching: requests that agree in every dimension but the first run as one call, split back after.

`run_together` is the one place requests are joined and split, for both engines; `Batcher` is the local
engine's queue (on Ray, Ray Serve's `@serve.batch` gathers the requests instead).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..foundation.dtypes import TensorSig

log = logging.getLogger(__name__)

# Runs the model: (wanted output names, feeds) -> outputs in `wanted` order.
Run = Callable[[list[str], dict[str, np.ndarray]], list[np.ndarray]]


@dataclass
class Job:
    """One request: its feeds, the outputs it wants, and when it arrived (`time.perf_counter`)."""

    feeds: dict[str, np.ndarray]
    wanted: list[str]
    arrived: float = field(default_factory=time.perf_counter)

    def key(self) -> tuple | None:
        """What a batch partner must share: outputs wanted, and each feed's dtype and all but its first
        dimension; None when the feeds have no common first dimension to batch along."""
        firsts = {np.shape(v)[:1] for v in self.feeds.values()}
        if len(firsts) != 1 or firsts == {()}:
            return None
        return tuple(self.wanted), tuple((n, v.dtype.str, v.shape[1:]) for n, v in sorted(self.feeds.items()))

    def size(self) -> int:
        return next(iter(self.feeds.values())).shape[0]


def batchable(inputs: Sequence[TensorSig], outputs: Sequence[TensorSig]) -> bool:
    """Whether every input and output of the model has a free first dimension to batch along."""
    return all(sig.shape and not isinstance(sig.shape[0], int) for sig in (*inputs, *outputs))


def run_together(run: Run, jobs: Sequence[Job], batch: bool,
                 started: Callable[[Sequence[Job]], None] = lambda _: None) -> list[dict[str, np.ndarray] | Exception]:
    """Each job's outputs (or the exception it raised), with jobs of the same `key` joined into one call when
    `batch`; `started` hears of the jobs of each call. A joined call that fails, or whose outputs do not follow
    the batch, runs its jobs one by one."""
    groups: dict[Any, list[int]] = {}
    for i, job in enumerate(jobs):
        key = job.key() if batch else None
        groups.setdefault(i if key is None else key, []).append(i)
    results: list[Any] = [None] * len(jobs)
    for members in groups.values():
        joined = _joined(run, [jobs[i] for i in members], started) if len(members) > 1 else None
        for i, answer in zip(members, joined or (_alone(run, jobs[i], started) for i in members)):
            results[i] = answer
    return results


def _alone(run: Run, job: Job, started: Callable[[Sequence[Job]], None]) -> dict[str, np.ndarray] | Exception:
    started([job])
    try:
        return dict(zip(job.wanted, run(job.wanted, job.feeds)))
    except Exception as error:  # noqa: BLE001 - handed back to this request alone
        return error


def _joined(run: Run, jobs: list[Job], started: Callable[[Sequence[Job]], None]) -> list[dict[str, np.ndarray]] | None:
    wanted, sizes = jobs[0].wanted, [job.size() for job in jobs]
    feeds = {name: np.concatenate([job.feeds[name] for job in jobs]) for name in jobs[0].feeds}
    started(jobs)
    try:
        values = run(wanted, feeds)
    except Exception as error:  # noqa: BLE001 - one request may be at fault; each is retried alone
        log.info("a batch of %d failed (%s); running its requests one by one", len(jobs), error)
        return None
    if any(np.ndim(v) == 0 or len(v) != sum(sizes) for v in values):
        return None
    cuts = np.cumsum(sizes)[:-1]
    parts = [np.split(np.asarray(v), cuts) for v in values]
    return [dict(zip(wanted, columns)) for columns in zip(*parts)]


class Batcher:
    """Gathers jobs until `max_batch` or `max_delay_s` after the first, whenever one of `lanes` runners is
    free, and hands each gathering to `run_jobs`; each job's future gets its own answer."""

    def __init__(self, run_jobs: Callable[[list[Job]], Awaitable[list]], max_batch: int, max_delay_s: float,
                 lanes: int):
        self.run_jobs, self.max_batch, self.max_delay_s = run_jobs, max_batch, max_delay_s
        self._lanes = asyncio.Semaphore(lanes)
        self._queue: asyncio.Queue[tuple[Job, asyncio.Future]] = asyncio.Queue()
        self._collector: asyncio.Task | None = None

    async def submit(self, job: Job) -> dict[str, np.ndarray] | Exception:
        future = asyncio.get_running_loop().create_future()
        self._queue.put_nowait((job, future))
        if self._collector is None or self._collector.done():
            self._collector = asyncio.create_task(self._collect())
        return await future

    async def _collect(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            first = await self._queue.get()
            await self._lanes.acquire()
            gathered, deadline = [first], loop.time() + self.max_delay_s
            while len(gathered) < self.max_batch:
                if not self._queue.empty():
                    gathered.append(self._queue.get_nowait())
                    continue
                left = deadline - loop.time()
                if left <= 0:
                    break
                try:
                    gathered.append(await asyncio.wait_for(self._queue.get(), left))
                except TimeoutError:
                    break
            live = [(job, future) for job, future in gathered if not future.done()]  # timed-out callers left
            if live:
                asyncio.create_task(self._dispatch(live))
            else:
                self._lanes.release()

    async def _dispatch(self, gathered: list[tuple[Job, asyncio.Future]]) -> None:
        try:
            answers = await self.run_jobs([job for job, _ in gathered])
        except Exception as error:  # noqa: BLE001 - every caller in the batch hears of it
            answers = [error] * len(gathered)
        finally:
            self._lanes.release()
        for (_, future), answer in zip(gathered, answers):
            if not future.done():
                future.set_result(answer)
