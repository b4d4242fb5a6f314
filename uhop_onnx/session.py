"""`InferenceSession`: a plan's stages compiled on their providers and run as one model, with
onnxruntime's interface."""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .dtypes import TensorSig
from .errors import StageError, UhopError, first_line
from .executor import Executor, StageIO
from .graph import declared_outputs
from .plan import PLAN_FILE, Plan, Stage
from .providers import LAST_RESORT, Runner, create


class InferenceSession:
    """A model (or a plan, or a plan folder) compiled stage by stage on its providers.

    `run(output_names, feeds)` returns what ONNX Runtime returns for the same model. With
    `fallback=True`, a stage that fails at run time is re-run on `ort-cpu`, with one warning, and the
    plan records it; otherwise the failure is raised as `StageError` naming the stage and provider.
    """

    def __init__(self, model_or_plan_or_dir: Any, providers=None, assign=None, profile: bool = True,
                 threads: int | None = None, fallback: bool = False):
        source = model_or_plan_or_dir
        if isinstance(source, Plan):
            self.plan = source
        elif isinstance(source, (str, os.PathLike)) and (Path(source) / PLAN_FILE).is_file():
            self.plan = Plan.load(source)
        else:
            from .optimizer import optimize

            self.plan = optimize(source, providers=providers, assign=assign, profile=profile, threads=threads)
        self.fallback = fallback
        self.threads = threads if threads is not None else self.plan.threads
        self._exclusive = len(self.plan.stages) == 1
        runners = [self._compile(stage, stage.fallback or stage.provider) for stage in self.plan.stages]
        stages = [StageIO(_describe(s), s.inputs, s.outputs, declared_outputs(self.plan.stage_model(s)), s.provider)
                  for s in self.plan.stages]
        self._executor = Executor(stages, runners, self.plan.inputs, [o.name for o in self.plan.outputs],
                                  self.plan.constants, self._fall_back if fallback else None)
        self._warned = False

    def get_inputs(self) -> list[TensorSig]:
        return list(self.plan.inputs)

    def get_outputs(self) -> list[TensorSig]:
        return list(self.plan.outputs)

    def get_providers(self) -> list[str]:
        return self.plan.get_providers()

    def run(self, output_names: Sequence[str] | None, input_feed: Mapping[str, Any]) -> list[np.ndarray]:
        """Run the model; outputs in `output_names` order (all of `get_outputs()` when None)."""
        return self._executor.run(output_names, input_feed)

    def _compile(self, stage: Stage, provider_id: str) -> Runner:
        options = stage.options if provider_id == stage.provider else {}
        provider = create((provider_id, options), self.threads)
        provider.require()
        try:
            return provider.compile(self.plan.stage_model(stage), exclusive=self._exclusive)
        except UhopError:
            raise
        except Exception as error:  # noqa: BLE001 - a runtime may refuse a stage in any way; say which
            k = self.plan.stages.index(stage)
            raise StageError(f"stage {k} ({_describe(stage)}) could not be compiled on {provider_id}: "
                             f"{first_line(error)}", k, provider_id) from error

    def _fall_back(self, k: int, error: Exception, feeds: dict[str, Any]) -> dict[str, Any]:
        """Re-run a failed stage on the last resort, warn once, and record it in the plan."""
        stage = self.plan.stages[k]
        where = f"stage {k} ({self._executor.stages[k].label})"
        if (stage.fallback or stage.provider) == LAST_RESORT:
            raise StageError(f"{where} failed: {first_line(error)}", k, stage.provider) from error
        if not self._warned:
            warnings.warn(f"{where} failed ({first_line(error)}); re-running it on {LAST_RESORT}",
                          RuntimeWarning, stacklevel=4)
            self._warned = True
        self._executor.runners[k] = self._compile(stage, LAST_RESORT)
        self.plan.record_fallback(k, LAST_RESORT)
        feeds = {name: np.asarray(value) for name, value in feeds.items()}
        return self._executor.checked(k, self._executor.runners[k].run(feeds))


def _describe(stage: Stage) -> str:
    return f"{stage.label}, {len(stage.nodes)} nodes from {stage.nodes[0]!r}"
