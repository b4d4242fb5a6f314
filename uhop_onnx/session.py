"""`InferenceSession`: run a plan's stages in order, as one model, with onnxruntime's interface."""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .dtypes import onnx_type
from .errors import InputError, ProviderError, StageError, first_line
from .plan import PLAN_FILE, Plan, Stage, TensorSig
from .providers import LAST_RESORT, Runner, create

log = logging.getLogger(__name__)


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
        exclusive = len(self.plan.stages) == 1
        self._runners: list[Runner] = [self._compile(stage, stage.fallback or stage.provider, exclusive)
                                       for stage in self.plan.stages]
        self._last_use = {name: k for k, stage in enumerate(self.plan.stages) for name in stage.inputs}
        produced = {name for stage in self.plan.stages for name in stage.outputs}
        self._signatures = {s.name: s for s in self.plan.inputs}
        # Initializers declared as graph inputs: a feed overrides them, as in ONNX Runtime.
        self._overridable = set(self._last_use) - produced - set(self._signatures)
        self._expected = [_declared_outputs(self.plan.stage_model(stage)) for stage in self.plan.stages]
        self._all_outputs = [o.name for o in self.plan.outputs]
        self._all_stages = self._stages_for(self._all_outputs)
        self._warned = False

    def get_inputs(self) -> list[TensorSig]:
        return list(self.plan.inputs)

    def get_outputs(self) -> list[TensorSig]:
        return list(self.plan.outputs)

    def get_providers(self) -> list[str]:
        return self.plan.get_providers()

    def run(self, output_names: Sequence[str] | None, input_feed: Mapping[str, Any]) -> list[np.ndarray]:
        """Run the model; outputs in `output_names` order (all of `get_outputs()` when None)."""
        wanted = self._check_outputs(output_names)
        values: dict[str, Any] = dict(self._check_feeds(input_feed))
        values.update(self.plan.constants)
        origin: dict[str, Runner] = {}
        for k in self._all_stages if output_names is None else self._stages_for(wanted):
            stage, runner = self.plan.stages[k], self._runners[k]
            feeds = {name: _handoff(values[name], origin.get(name), runner) for name in stage.inputs if name in values}
            results = self._run_stage(k, feeds)
            values.update(results)
            origin.update(dict.fromkeys(results, self._runners[k]))
            for name in stage.inputs:
                if self._last_use.get(name) == k and name not in wanted:
                    values.pop(name, None)
        return [_handoff(values[name], origin.get(name), None) for name in wanted]

    def _compile(self, stage: Stage, provider_id: str, exclusive: bool) -> Runner:
        options = stage.options if provider_id == stage.provider else {}
        provider = create((provider_id, options), self.threads)
        provider.require()
        return provider.compile(self.plan.stage_model(stage), exclusive=exclusive)

    def _run_stage(self, k: int, feeds: dict[str, Any]) -> dict[str, Any]:
        stage = self.plan.stages[k]
        try:
            return self._checked(k, self._runners[k].run(feeds))
        except Exception as error:  # noqa: BLE001 - a provider may fail in any way; say which stage
            where = f"stage {k} ({stage.label}, {len(stage.nodes)} nodes from {stage.nodes[0]!r})"
            if not self.fallback or (stage.fallback or stage.provider) == LAST_RESORT:
                raise StageError(f"{where} failed: {first_line(error)}", k, stage.provider) from error
            if not self._warned:
                warnings.warn(f"{where} failed ({first_line(error)}); re-running it on {LAST_RESORT}",
                              RuntimeWarning, stacklevel=3)
                self._warned = True
            self._runners[k] = self._compile(stage, LAST_RESORT, exclusive=len(self.plan.stages) == 1)
            self.plan.record_fallback(k, LAST_RESORT)
            feeds = {name: np.asarray(value) for name, value in feeds.items()}
            return self._checked(k, self._runners[k].run(feeds))

    def _checked(self, k: int, results: dict[str, Any]) -> dict[str, Any]:
        """The runner's results, refused when an output is missing or its shape contradicts the declared one."""
        for name, dims in self._expected[k]:
            if name not in results:
                raise ProviderError(f"output {name!r} is missing from the provider's results")
            shape = getattr(results[name], "shape", None)
            if dims is not None and shape is not None and (
                    len(shape) != len(dims) or any(d is not None and d != got for d, got in zip(dims, shape))):
                expected = ["?" if d is None else d for d in dims]
                raise ProviderError(f"output {name!r} has shape {list(shape)}, expected {expected}")
        return results

    def _stages_for(self, wanted: list[str]) -> list[int]:
        """The stages needed to compute `wanted`, in run order."""
        needed, chosen = set(wanted), []
        for k in range(len(self.plan.stages) - 1, -1, -1):
            stage = self.plan.stages[k]
            if needed.intersection(stage.outputs):
                chosen.append(k)
                needed.update(stage.inputs)
        return chosen[::-1]

    def _check_outputs(self, output_names: Sequence[str] | None) -> list[str]:
        valid = self._all_outputs
        if output_names is None:
            return valid
        if isinstance(output_names, str):
            raise InputError(f"output_names must be a list of names, not the string {output_names!r}")
        unknown = [n for n in output_names if n not in valid]
        if unknown:
            raise InputError(f"unknown output(s) {', '.join(map(repr, unknown))}; the model's outputs: {', '.join(valid)}")
        return list(output_names)

    def _check_feeds(self, feeds: Mapping[str, Any]) -> dict[str, np.ndarray]:
        if not isinstance(feeds, Mapping):
            raise InputError(f"feeds must be a dict of input name -> numpy array, got {type(feeds).__name__}")
        signatures = self._signatures
        unknown = [n for n in feeds if n not in signatures and n not in self._overridable]
        if unknown:
            raise InputError(f"unknown input(s) {', '.join(map(repr, unknown))}; {_describe(self.plan.inputs)}")
        missing = [n for n in signatures if n not in feeds]
        if missing:
            raise InputError(f"missing input(s) {', '.join(map(repr, missing))}; {_describe(self.plan.inputs)}")
        checked = {}
        for name, value in feeds.items():
            if not isinstance(value, (np.ndarray, np.generic)):
                raise InputError(f"input {name!r} is a {type(value).__name__}; pass a numpy array")
            value = np.asarray(value)
            if name in signatures:
                _check_value(signatures[name], value)
            checked[name] = value
        return checked


def _check_value(sig: TensorSig, value: np.ndarray) -> None:
    expected = sig.dtype
    if expected is not None:
        text_ok = expected == np.object_ and value.dtype.kind in "OUS"
        if value.dtype != expected and not text_ok:
            raise InputError(
                f"input {sig.name!r} has dtype {value.dtype} ({onnx_type(value.dtype)}); the model expects "
                f"{expected} ({sig.type}): use .astype(np.{expected})"
            )
    if sig.shape is None:
        return
    if value.ndim != len(sig.shape):
        raise InputError(f"input {sig.name!r} has shape {list(value.shape)} (rank {value.ndim}); "
                         f"the model expects rank {len(sig.shape)}: {sig.shape}")
    for axis, (got, want) in enumerate(zip(value.shape, sig.shape)):
        if isinstance(want, int) and want != got:
            raise InputError(f"input {sig.name!r} has shape {list(value.shape)}; the model expects "
                             f"{sig.shape} (dimension {axis} must be {want})")


def _declared_outputs(model) -> list[tuple[str, tuple[int | None, ...] | None]]:
    """(name, fixed dimensions or None per axis) of each graph output; None where the shape is unknown."""
    declared = []
    for output in model.graph.output:
        tensor = output.type.tensor_type
        dims = tuple(d.dim_value if d.HasField("dim_value") else None for d in tensor.shape.dim)
        declared.append((output.name, dims if tensor.HasField("shape") else None))
    return declared


def _handoff(value: Any, source: Runner | None, target: Runner | None) -> Any:
    """A value as `target` takes it: left on its device when both runners share one, else on the host."""
    if source is None or (target is not None and source.device == target.device):
        return value
    return source.to_host(value)


def _describe(signatures: Sequence[TensorSig]) -> str:
    listed = ", ".join(f"{s.name} ({s.type} {s.shape})" for s in signatures)
    return f"the model's inputs: {listed or 'none'}"

