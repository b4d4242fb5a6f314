"""`compile_plan`: a plan's stages compiled on their providers, at their precisions, into one `Executor`;
with fallback, a stage that fails during a call is re-run on the last resort for that call. `convert_ahead`:
a plan's stages converted and kept before the plan is timed."""

from __future__ import annotations

import threading
import warnings
from collections.abc import Mapping
from contextlib import ExitStack
from typing import Any

import numpy as np

from ..foundation.errors import StageError, UhopError, first_line, logger, outside
from .executor import Check, Executor
from .plan import Plan, Stage
from ..providers import LAST_RESORT, REGISTRY, Runner, create

log = logger(__name__)


def compile_plan(plan: Plan, threads: int | None = None, fallback: bool = False,
                 exclusive: bool | None = None, runners: list[Runner] | None = None) -> Executor:
    """An `Executor` over each stage of `plan` compiled on its provider at its precision, with `threads`
    (default: the plan's), or over `runners`, its stages compiled already. `exclusive` (default: when the plan
    has one stage) tells a runtime it has the process to itself. The executor can re-run a failed stage on
    `ort-cpu` (`executor.fallback`, on with `fallback`), counting it in `plan.fallbacks`; closing it closes
    every runner it compiled."""
    threads = plan.threads if threads is None else threads
    exclusive = len(plan.stages) == 1 if exclusive is None else exclusive
    runners = compile_stages(plan, threads, exclusive) if runners is None else runners
    return Executor(plan.stages, runners, plan.inputs,
                    [o.name for o in plan.outputs], plan.constants, LastResort(plan, threads), fallback)


def compile_stages(plan: Plan, threads: int | None, exclusive: bool = False) -> list[Runner]:
    """Every stage's runner (`compile_stage`); the stages compiled so far are closed when a later one fails."""
    runners: list[Runner] = []
    with ExitStack() as compiled:
        for stage in plan.stages:
            runners.append(compile_stage(plan, stage, threads, exclusive))
            compiled.callback(runners[-1].close)
        compiled.pop_all()
    return runners


def compile_stage(plan: Plan, stage: Stage, threads: int | None, exclusive: bool = False, *,
                  on: str | None = None) -> Runner:
    """`stage`'s runner, compiled on its provider at its precision (or `on` another provider, with that
    provider's default options, at fp32); a runtime's refusal is a `StageError` naming the stage. A stage of
    a plan saved before stages recorded their `declared` outputs gets them from its model."""
    provider_id = on or stage.provider
    provider = create((stage.provider, dict(stage.options)) if on is None else provider_id, threads)
    if on is None:
        provider = provider.at_precision(stage.precision)
    provider.require()
    if stage.declared is None:
        from ..foundation.graph import declared_outputs

        stage.declared = declared_outputs(plan.stage_model(stage))
    try:
        return provider.compile(plan.stage_model(stage) if stage.data is None or on else stage.data,
                                exclusive=exclusive)
    except UhopError:
        raise
    except Exception as error:  # noqa: BLE001 - a runtime may refuse a stage in any way; say which
        k = plan.stages.index(stage)
        raise StageError(f"stage {k} ({stage.described}) could not be compiled on {provider_id}: "
                         f"{first_line(error)}", k, provider_id) from error


def keeps_conversions(stage: Stage) -> bool:
    """Whether `stage`'s provider keeps its checked conversions on this machine (`Provider.keeps_conversions`)."""
    return REGISTRY[stage.provider].keeps_conversions


def convert_ahead(folder: str, feeds: dict[str, np.ndarray], threads: int | None) -> None:
    """The plan saved in `folder` run once on `feeds`, as far as its last stage on a provider that keeps its
    conversions: each such stage built there (converted at the shapes and values it receives, checked and kept;
    one its check refuses is run on ONNX Runtime instead, as the plan's process runs it), every other one on
    ONNX Runtime's CPU; each stage compiled for its run and closed after it, so that one stage's runtime is held
    at a time."""
    plan = Plan.load(folder)
    last = max((k for k, stage in enumerate(plan.stages) if keeps_conversions(stage)), default=None)
    if last is None:
        return
    runners: list[Runner] = [_OneRun(plan, stage, threads) for stage in plan.stages]
    with Executor(plan.stages, runners, plan.inputs, plan.stages[last].outputs, plan.constants,
                  LastResort(plan, threads)) as executor:
        executor.run(None, feeds)


class _OneRun(Runner):
    """A stage compiled when it runs, on its provider where that keeps its conversions, else on ONNX Runtime's
    CPU, and closed after the run: its results as host arrays."""

    def __init__(self, plan: Plan, stage: Stage, threads: int | None):
        self.plan, self.stage, self.threads = plan, stage, threads

    def run(self, feeds: Mapping[str, Any]) -> dict[str, Any]:
        on = None if keeps_conversions(self.stage) else LAST_RESORT
        with compile_stage(self.plan, self.stage, self.threads, on=on) as runner:
            return {name: runner.to_host(value) for name, value in runner.run(feeds).items()}


class LastResort:
    """The executor's fallback: a stage that failed is re-run on `ort-cpu` (compiled on its first failure),
    for that call only; each failure is counted in `plan.fallbacks`, with one warning per stage."""

    def __init__(self, plan: Plan, threads: int | None):
        self.plan, self.threads = plan, threads
        self.runners: dict[int, Runner] = {}  # stage index -> its runner on the last resort
        self._warned: set[int] = set()
        self._lock = threading.Lock()

    def __call__(self, k: int, error: Exception, feeds: dict[str, Any], check: Check) -> dict[str, Any]:
        stage = self.plan.stages[k]
        where = f"stage {k} ({stage.described})"
        if stage.provider == LAST_RESORT:
            raise StageError(f"{where} failed: {first_line(error)}", k, stage.provider) from error
        with self._lock:
            entry = self.plan.fallbacks.setdefault(k, {"provider": LAST_RESORT, "count": 0, "last_error": ""})
            entry["count"] += 1
            entry["last_error"] = first_line(error)
            first = k not in self._warned
            if first:
                self._warned.add(k)
            if k not in self.runners:
                self.runners[k] = compile_stage(self.plan, stage, self.threads, on=LAST_RESORT)
            runner = self.runners[k]
        if first:
            warnings.warn(f"{where} failed ({first_line(error)}); re-running it on {LAST_RESORT} when it fails "
                          f"(counted in plan.fallbacks)", RuntimeWarning, stacklevel=outside())
        try:
            return check(k, runner.run({name: np.asarray(value) for name, value in feeds.items()}))
        except Exception as again:  # noqa: BLE001 - a runtime may fail in any way; say both failures
            raise StageError(f"{where} failed ({first_line(error)}), and so did its re-run on {LAST_RESORT}: "
                             f"{first_line(again)}", k, stage.provider) from again

    def close(self) -> None:
        with self._lock:
            closing, self.runners = list(self.runners.values()), {}
        for runner in closing:
            runner.close()
