"""Running compiled stages in order as one model: feeds checked, tensors handed over, intermediates freed.

The one routing loop: `compile_plan` (and so `InferenceSession`), bundles, the server, `verify` and the
search's sample runs all use it; imports only numpy, so a board needs nothing else.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from operator import itemgetter
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from ..foundation.dtypes import TensorSig, onnx_type
from ..foundation.errors import CheckError, InputError, ProviderError, StageError, first_line, logger
from ..providers.runner import Runner

if TYPE_CHECKING:
    from .plan import Stage

log = logger(__name__)

Timing = tuple[int, float, float]  # stage index, start and end (`time.perf_counter()` seconds)
Check = Callable[[int, dict[str, Any]], dict[str, Any]]  # (stage index, its results) -> them, once checked


class OnFailure(Protocol):
    """What re-runs a stage that failed: called with (stage index, error, feeds, `Executor.checked`), it
    returns the stage's checked results or raises; `close` releases what it compiled."""

    def __call__(self, k: int, error: Exception, feeds: dict[str, Any], check: Check) -> dict[str, Any]: ...

    def close(self) -> None: ...


class Executor:
    """Runs `runners[k]` for each of the plan's `stages` needed, in order (a stage's `declared` outputs, when
    recorded, are what its results are checked against); while `fallback` is on, `on_failure` re-runs a
    failed stage elsewhere. Nothing in it changes during `run`, so calls from many threads at once are safe
    when the runners are. A context manager: closing it closes its runners and `on_failure`'s."""

    def __init__(self, stages: Sequence[Stage], runners: list[Runner], inputs: Sequence[TensorSig],
                 outputs: Sequence[str], constants: Mapping[str, np.ndarray], on_failure: OnFailure | None = None,
                 fallback: bool = False):
        self.stages, self.runners = list(stages), runners
        self.inputs, self.outputs, self.constants = list(inputs), list(outputs), dict(constants)
        self.on_failure, self.fallback = on_failure, fallback
        self._signatures = {s.name: s for s in self.inputs}
        # Per plain tensor input: (dtype, rank, fixed dimensions' getter and sizes), what `_as_declared` takes an
        # array as it is by (any other value goes through `_checked_feed`).
        self._tensor_inputs = {s.name: (s.dtype, len(s.shape), *_fixed(s.shape)) for s in self.inputs
                               if s.type.startswith("tensor(") and s.shape is not None
                               and s.dtype is not None and s.dtype.kind != "O"}
        self._last_use = {name: k for k, stage in enumerate(self.stages) for name in stage.inputs}
        # Per stage, the values no later stage reads and no caller can ask for: dropped once it has run.
        self._freed = [[name for name in dict.fromkeys(stage.inputs) if self._last_use[name] == k
                        and name not in self.outputs] for k, stage in enumerate(self.stages)]
        produced = {name for stage in self.stages for name in stage.outputs}
        # Initializers declared as graph inputs: a feed overrides them, as in ONNX Runtime.
        self.overridable = set(self._last_use) - produced - set(self._signatures)
        self._all_stages = stages_for(self.stages, self.outputs)
        # Per stage, each declared output's name, dimensions, rank and fixed dimensions' getter and sizes: what
        # `checked` holds its results to (nothing where the stage recorded none).
        self._declared = [[(name, dims, len(dims or ()), *_fixed(dims or ())) for name, dims in stage.declared or ()]
                          for stage in self.stages]
        # One stage that takes every input and computes every output: fed arrays, the runtime checks them
        # itself, so they are checked here only when a call fails, to say what was wrong (and to fall back).
        self._whole = (len(self.stages) == 1 and list(self.stages[0].outputs) == self.outputs and not self.constants
                       and set(self._signatures) <= set(self.stages[0].inputs))
        # A whole stage on ONNX Runtime: its native run's host arrays are the results as they are (the model it
        # runs declares what it returns; ONNX Runtime is the reference every provider is checked against).
        self._native = getattr(runners[0], "outputs_of", None) if self._whole else None

    def run(self, output_names: Sequence[str] | None, input_feed: Mapping[str, Any], *, host: bool = True,
            timings: list[Timing] | None = None) -> list[Any]:
        """The model's outputs in `output_names` order (all outputs when None or empty): host arrays, or with
        `host=False` left where their stage put them. `timings` receives each stage's run time."""
        wanted = self._check_outputs(output_names) if output_names else self.outputs  # [] too, as in ONNX Runtime
        if self._whole and timings is None and _native_arrays(input_feed.values()):
            runner = self.runners[0]
            try:
                if self._native is not None and host:
                    return self._native(wanted, input_feed)
                results = self.checked(0, runner.run(input_feed))
            except Exception as error:  # noqa: BLE001 - a runtime may fail in any way; said below
                checked = self._check_feeds(input_feed)  # a wrong feed is the caller's mistake, said as such
                results = self._failed(0, error, checked)
            return [hand_over(results[name], runner, None) if host else results[name] for name in wanted]
        values: dict[str, Any] = {**self._check_feeds(input_feed), **self.constants}
        origin: dict[str, Runner] = {}
        # A host array goes to any stage as it is (`hand_over` would give it back): only other values are handed.
        for k in self._all_stages if not output_names else stages_for(self.stages, wanted):
            stage, runner = self.stages[k], self.runners[k]
            feeds = {name: value if type(value := values[name]) is np.ndarray
                     else hand_over(value, origin.get(name), runner) for name in stage.inputs if name in values}
            start = time.perf_counter() if timings is not None else 0.0
            try:
                results = self.checked(k, runner.run(feeds))
            except Exception as error:  # noqa: BLE001 - a runtime may fail in any way; say which stage
                results = self._failed(k, error, feeds)
            if timings is not None:
                timings.append((k, start, time.perf_counter()))
            values.update(results)
            origin.update(dict.fromkeys(results, runner))
            for name in self._freed[k]:
                values.pop(name, None)
        return [hand_over(values[name], origin.get(name), None) if host else values[name] for name in wanted]

    def _failed(self, k: int, error: Exception, feeds: dict[str, Any]) -> dict[str, Any]:
        """Stage `k` failed on `feeds`: re-run elsewhere while `fallback` is on, or whatever it is when the
        provider's own check refused to build it at these shapes (`CheckError`: its nodes belong elsewhere),
        else `StageError`."""
        if self.on_failure is None or not (self.fallback or isinstance(error, CheckError)):
            raise StageError(f"stage {k} ({self.stages[k].described}) failed: {first_line(error)}", k,
                             self.stages[k].provider) from error
        return self.on_failure(k, error, feeds, self.checked)

    def close(self) -> None:
        """Close every runner (the fallback's too); one that fails to close is logged, the others still close."""
        for closing in [*self.runners, *([self.on_failure] if self.on_failure is not None else [])]:
            try:
                closing.close()
            except Exception as error:  # noqa: BLE001 - a runtime may fail in any way while releasing
                log.warning("closing %s failed: %s", type(closing).__name__, first_line(error))

    def __enter__(self) -> Executor:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def checked(self, k: int, results: dict[str, Any]) -> dict[str, Any]:
        """A runner's results, refused when an output is missing or its shape contradicts the declared one."""
        for name, dims, rank, fixed, sizes in self._declared[k]:
            if name not in results:
                raise ProviderError(f"output {name!r} is missing from the provider's results")
            shape = getattr(results[name], "shape", None)
            if dims is not None and shape is not None and not _fits(shape, rank, fixed, sizes):
                expected = ["?" if d is None else d for d in dims]
                raise ProviderError(f"output {name!r} has shape {list(shape)}, expected {expected}")
        return results

    def _check_outputs(self, output_names: Sequence[str]) -> list[str]:
        if isinstance(output_names, str):
            raise InputError(f"output_names must be a list of names, not the string {output_names!r}")
        unknown = [n for n in output_names if n not in self.outputs]
        if unknown:
            raise InputError(f"unknown output(s) {', '.join(map(repr, unknown))}; "
                             f"the model's outputs: {', '.join(self.outputs)}")
        return list(output_names)

    def _check_feeds(self, feeds: Mapping[str, Any]) -> dict[str, np.ndarray]:
        mapping(feeds)
        unknown = [n for n in feeds if n not in self._signatures and n not in self.overridable]
        if unknown:
            raise InputError(f"unknown input(s) {', '.join(map(repr, unknown))}; {_describe(self.inputs)}")
        missing = [n for n in self._signatures if n not in feeds]
        if missing:
            raise InputError(f"missing input(s) {', '.join(map(repr, missing))}; {_describe(self.inputs)}")
        return {name: value if self._as_declared(name, value)
                else _checked_feed(self._signatures.get(name), name, value) for name, value in feeds.items()}

    def _as_declared(self, name: str, value: Any) -> bool:
        """Whether `value` is an array of the plain tensor input `name`'s dtype and shape: taken as it is."""
        known = self._tensor_inputs.get(name)
        return (known is not None and type(value) is np.ndarray and value.dtype == known[0]
                and _fits(value.shape, *known[1:]))


def mapping(feeds: Any) -> None:
    """Refuses feeds that are not a mapping of input name -> value."""
    if not isinstance(feeds, Mapping):
        raise InputError(f"feeds must be a dict of input name -> numpy array, got {type(feeds).__name__}")


def _native_arrays(values: Iterable[Any]) -> bool:
    """Whether every value is an array in this machine's byte order: what a whole stage's runtime reads as it is
    (ONNX Runtime reads a big-endian array's bytes as native ones); any other goes through `_checked_feed`."""
    for value in values:
        if type(value) is not np.ndarray or not value.dtype.isnative:
            return False
    return True


def _fits(shape: Sequence[int], rank: int, fixed: Callable[[Sequence[int]], Any] | None, sizes: Any) -> bool:
    """Whether `shape` has `rank` dimensions, and the `sizes` where `fixed` (of `_fixed`) gets any."""
    return len(shape) == rank and (fixed is None or fixed(shape) == sizes)


def _fixed(dims: Sequence[Any]) -> tuple[Callable[[Sequence[int]], Any] | None, Any]:
    """A getter of a shape's fixed (integer) dimensions, and their sizes in `dims`; (None, None) when none is."""
    axes = [axis for axis, d in enumerate(dims) if isinstance(d, int)]
    if not axes:
        return None, None
    getter = itemgetter(*axes)
    return getter, getter(dims)


def stages_for(stages: Sequence[Any], wanted: Sequence[str]) -> list[int]:
    """Indices of the stages (objects with `inputs` and `outputs`) needed to compute `wanted`, in run order."""
    needed, chosen = set(wanted), []
    for k in range(len(stages) - 1, -1, -1):
        if needed.intersection(stages[k].outputs):
            chosen.append(k)
            needed.update(stages[k].inputs)
    return chosen[::-1]


def _checked_feed(sig: TensorSig | None, name: str, value: Any) -> Any:
    """A feed as the runners take it: an array; a list of arrays for a `seq(...)` input; None allowed for an
    `optional(...)` one. As in ONNX Runtime, an `OrtValue` is read on the host and a Python list (or scalar)
    becomes an array of the input's type."""
    kind = sig.type if sig else "tensor"
    if kind.startswith("optional("):
        if value is None:
            return None
        kind = kind.removeprefix("optional(")
    if kind.startswith("seq("):
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, np.ndarray) for v in value):
            raise InputError(f"input {name!r} is a sequence ({sig.type}); pass a list of numpy arrays")
        return list(value)
    value = as_array(sig, name, value)
    if sig is not None:
        _check_value(sig, value)
    return value


def as_array(sig: TensorSig | None, name: str, value: Any) -> np.ndarray:
    """A tensor feed as an array, as ONNX Runtime reads it: an `OrtValue` on the host, a list (or scalar) as an
    array of the input's type; `InputError` for anything else."""
    if isinstance(value, (np.ndarray, np.generic)):
        value = np.asarray(value)
        return value if value.dtype.isnative else value.astype(value.dtype.newbyteorder("="))
    if type(value).__name__ == "OrtValue" and callable(getattr(value, "numpy", None)):
        return value.numpy()
    if isinstance(value, (list, int, float, bool)):
        dtype = sig.dtype if sig is not None else None
        try:
            return np.array(value, dtype=dtype)
        except (TypeError, ValueError) as error:
            raise InputError(f"input {name!r}: cannot make a {dtype or 'numpy'} array of this list ({error})") from None
    raise InputError(f"input {name!r} is a {type(value).__name__}; pass a numpy array, a list or an OrtValue")


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


def hand_over(value: Any, source: Runner | None, target: Runner | None) -> Any:
    """A value as `target` takes it: left on an accelerator both runners share, else a host array (a runtime's
    numpy scalar becomes a 0-d array)."""
    if source is None or value is None or isinstance(value, list) or (
            target is not None and source.device == target.device != "cpu"):
        return value  # sequences and absent optionals go as they are
    return source.to_host(value)


def _describe(signatures: Sequence[TensorSig]) -> str:
    listed = ", ".join(f"{s.name} ({s.type} {s.shape})" for s in signatures)
    return f"the model's inputs: {listed or 'none'}"
