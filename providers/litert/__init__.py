"""LiteRT (TFLite): ONNX stages converted to `.tflite` and run by the LiteRT interpreter with XNNPACK or an
external delegate. Every converted stage is checked against ONNX Runtime when it is compiled; a conversion
checked on this machine is kept in the cache, so the same stage compiles again without converting."""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable, Iterable, Mapping
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from uhop_onnx.foundation.cache import JsonTable, cache_dir, prune, touch
from uhop_onnx.foundation.errors import CheckError, ProviderError, first_line, logger, missing_module
from uhop_onnx.foundation.files import atomic_file
from uhop_onnx.foundation.inputs import free_inputs
from uhop_onnx.precision import FP32_TOLERANCE, compare

from .. import indices
from ..base import FP32, Absent, Artifact, ArtifactFormat, Lowering, Provider, installed
from ..runner import Runner
from ..capability import Support
from . import delegates
from .runner import LiteRtRunner, empty_runner, interpreter_module
from .table import LITERT_TABLE

if TYPE_CHECKING:
    import onnx

log = logger(__name__)

FP16_TOLERANCE = {"rtol": 1e-2, "atol": 1e-3}
# int8 is checked for gross faults only: the error's norm within a tenth of the output's (on random inputs a few
# values past their calibrated ranges saturate; MobileNetV2's blocks stay within 0.05). The optimizer's accuracy
# gate holds the plan to the user's tolerance on the calibration samples.
INT8_TOLERANCE = {"l2": 0.1, "atol": 1e-3}
# fp32 sums whose terms are as large as the largest output differ by about this fraction of it between
# kernels that add in different orders: the check's atol grows by it. A ResNet-18 at 224x224 (logits up to 129)
# differs from MLAS by up to 1.4e-4 on XNNPACK, and by 1.3e-4 on OpenVINO, which has no build check; at fp32's
# tolerance alone, 2 of 3 seeds of its check would fail (an atol of 2.2e-5 and 3.4e-5 needed; OpenVINO 4.4e-5).
ROUNDING = 1e-6


class Tflite(ArtifactFormat):
    """A `.tflite` file with its delegate settings (for the board)."""

    name = "tflite"

    def blocker(self, provider: Provider) -> str | None:
        return missing_module("tflite", "pip install tflite")  # the converter writes with its schema

    def export(self, provider: Provider, model: onnx.ModelProto, folder: Path, stem: str) -> Artifact:
        """The stage converted, checked against ONNX Runtime on XNNPACK first where LiteRT runs on this host. At
        int8, the full-integer file the converter writes from the calibration ranges the stage carries (`lower`
        put them there)."""
        from .converter import convert, prepared

        calibrated = provider._calibrated(model)
        if provider.precision == "int8" and calibrated is None:
            raise ProviderError("litert[int8]: the stage carries no calibration ranges to quantize from; export "
                                "with calibration=...")
        fp16 = provider.precision == "fp16"
        model = prepared(model)
        blob = convert(model, fp16=fp16, ranges=calibrated and calibrated.ranges, prepare=False)
        try:
            interpreter_module()
        except Exception as error:  # noqa: BLE001 - missing or broken, the runtime cannot check it here
            log.info("litert: %s written unchecked: no LiteRT interpreter on this host (%s)", stem, error)
        else:
            verify(model, lambda: LiteRtRunner(blob, provider.threads), provider.tolerance,
                   inputs=_check_inputs(calibrated))[0].close()
        (folder / f"{stem}.tflite").write_bytes(blob)
        options = {k: v for k, v in provider.delegate_options().items() if v}
        return Artifact("tflite", [f"{stem}.tflite"], options, FP16_TOLERANCE if fp16 else None)

    def load(self, folder: Path, artifact: Mapping[str, Any], threads: int | None, exclusive: bool, trusted: bool,
             allowed_delegates: Iterable[str | os.PathLike]) -> Runner:
        """A bundle's `.tflite` stage, with the delegate it was exported with: any when `trusted`, else only a
        known one or one in `allowed_delegates` or the environment (see `delegates`)."""
        options = artifact.get("options", {})
        delegate = options.get("delegate")
        why = delegates.refusal(delegate, allowed_delegates) if delegate and not trusted else ""
        if why:
            raise ProviderError(f"the unsigned bundle's LiteRT delegate {why}")
        return LiteRtRunner((folder / artifact["files"][0]).read_bytes(), threads, delegate,
                            options.get("delegate_options"), bool(options.get("allow_fallback")))


class LiteRt(Provider):
    """LiteRT on the CPU (XNNPACK), or through an external delegate.

    Options: `delegate` (path of a delegate library, loaded with `load_delegate`), `delegate_options`
    (a dict of strings it takes), `allow_fallback` (run on XNNPACK, with a warning, when the delegate does
    not load).

    At fp16 (`at_precision("fp16")`) a stage's weights are stored as float16, verified within `FP16_TOLERANCE`.
    At int8 (`at_precision("int8", calibration)`) a stage is full-integer: `lower` gives the stage the ranges
    its values take over the calibration samples, and the converter quantizes from them (see `int8`).
    """

    id = "litert"
    install = "pip install 'uhop-onnx[litert]'  (ai-edge-litert and tflite)"
    table = LITERT_TABLE
    # fp16: float16 weights, written by the converter at that precision; int8 where LiteRT runs here: full
    # integer, quantized by the converter from the calibration ranges `calibrated` gives the stage
    lowerings = {"fp32": FP32, "fp16": FP32,
                 "int8": Lowering(lambda p, model: p.calibrated(model), offered=lambda p: p.present)}
    format = Tflite()
    option_types = {"delegate": str, "delegate_options": dict[str, str | int | float | bool], "allow_fallback": bool}
    precision_options = frozenset({"fp16"})
    static_shapes = True  # converted once per shape and integer input value a stage runs at
    keeps_conversions = True  # each checked conversion kept in the cache (`build_at`, `_compile_fixed`)

    @classmethod
    def device_kind(cls, options: Mapping[str, Any]) -> str:
        """With an external delegate, "delegate" (the device is the delegate's own); else "cpu"."""
        return "delegate" if options.get("delegate") else "cpu"

    @property
    def tolerance(self) -> dict[str, float]:
        if self.precision == "int8":
            return INT8_TOLERANCE
        return FP16_TOLERANCE if self.precision == "fp16" else FP32_TOLERANCE

    def calibrated(self, model: onnx.ModelProto) -> onnx.ModelProto:
        """An int8 stage: the stage carrying the range of each of its values over the calibration samples (and
        each input's mean and standard deviation there)."""
        from ..quantize import stage_values
        from .int8 import Calibrated, with_calibration

        if self.calibration is None:
            raise ProviderError("litert[int8]: a stage is quantized from calibration samples; give calibration=...")
        inputs = [i.name for i in model.graph.input]
        ranges = self.calibration.ranges(stage_values(model), keep=inputs)  # one pass: the inputs' values too
        samples = self.calibration.of(model)
        moments = {}
        for name in samples[0]:
            stacked = np.stack([np.asarray(s[name]) for s in samples])
            if stacked.dtype.kind == "f" and stacked.size:
                moments[name] = (float(stacked.mean()), float(stacked.std()))
        return with_calibration(model, Calibrated(ranges, moments))

    def locate(self) -> tuple[str, str] | None:
        """Where ai-edge-litert is installed with its interpreter's library, and the tflite schema beside it."""
        version = installed("ai_edge_litert", "ai-edge-litert", "*interpreter_wrapper*")
        return (version, self._device()) if version and installed("tflite", "tflite", "*.py") else None

    def probe(self) -> tuple[str, str]:
        try:
            interpreter_module()
        except ImportError as error:
            raise Absent(f"neither ai-edge-litert nor tflite-runtime can be imported ({error})") from None
        try:
            import tflite  # noqa: F401  - the flatbuffer schema the converter writes with
        except ImportError as error:
            raise Absent(f"the tflite package (the converter's schema) is not installed ({error})") from None
        return _version(), self._device()

    def _device(self) -> str:
        delegate = self.options.get("delegate")
        return f"delegate:{delegate}" if delegate else "CPU"

    def query(self, model: onnx.ModelProto) -> dict[str, Support]:
        """The converter's own answer: nodes it cannot express exactly, and why."""
        from .converter import unconvertible

        refused = {**unconvertible(model), **indices.unchecked(model)}
        return {name: Support(False, reason, "runtime") for name, reason in refused.items()}

    def check(self, model: onnx.ModelProto) -> None:
        """The check `compile` makes (convert, load, compare with ONNX Runtime), on a stage at fixed shapes, its
        integer inputs taken as variables; a stage with free dimensions is checked at each shape it runs at.
        At int8 the stage is lowered (calibrated) first."""
        self.require()
        if not free_inputs(model):
            self._compile_fixed(self.lower(model)).close()

    def build(self, model: onnx.ModelProto, *, exclusive: bool = True) -> Runner:
        """Convert, load and check the stage, at fixed shapes, against ONNX Runtime on random inputs
        (`CheckError` when they differ); not at all at a zero-sized input shape (`empty_runner`)."""
        return empty_runner(model) or indices.checked(model, self._compile_fixed(model))

    def build_at(self, model: onnx.ModelProto, shapes: Mapping[str, tuple], values: Mapping[str, np.ndarray], *,
                 exclusive: bool = True) -> Runner:
        """`Provider.build_at`; a conversion of the stage checked at these shapes and values earlier on this machine
        is loaded as kept, without fixing and simplifying the stage again (a program's process that serves it then
        imports no simplifier)."""
        start = time.perf_counter()
        key = _at_shapes_key(self._conversion_key(model), shapes, values)
        entry = _at_shapes().get(key)
        runner = entry and self._kept(entry["conversion"])
        if runner:
            log.info("litert: %s at %s as converted and verified earlier on this machine (%.2f s); max abs error "
                     "%.3g", model.graph.name, dict(shapes), time.perf_counter() - start, runner.error)
            return indices.guarded(runner, [indices.Bound(*bound) for bound in entry["bounds"]])
        runner = super().build_at(model, shapes, values, exclusive=exclusive)
        conversion = getattr(runner, "conversion", None)  # none for an empty input's runner: nothing converted
        if conversion:
            bounds = runner.bounds if isinstance(runner, indices.CheckedIndices) else []
            _at_shapes().update({key: {"conversion": conversion, "bounds": [list(b) for b in bounds]}})
        return runner

    def _kept(self, key: str) -> LiteRtRunner | None:
        """The conversion kept under `key`, loaded; None when there is none."""
        kept = _kept(key)
        if kept is None:
            return None
        runner = LiteRtRunner(kept[0], self.threads, **self.delegate_options())
        runner.error, runner.conversion = kept[1], key
        return runner

    def _compile_fixed(self, model: onnx.ModelProto) -> LiteRtRunner:
        from .converter import convert, prepared

        start = time.perf_counter()
        key = self._conversion_key(model)
        runner = self._kept(key)
        if runner is not None:
            log.info("litert: %s as converted and verified earlier on this machine (%.2f s); max abs error %.3g",
                     model.graph.name, time.perf_counter() - start, runner.error)
            return runner
        calibrated = self._calibrated(model)
        model = prepared(model)  # shape-only inputs pinned: random values for them would not be shapes
        uncalibrated = self.precision == "int8" and not calibrated  # built at fp32

        def converted() -> LiteRtRunner:  # after ONNX Runtime's reference run, which never holds the blob
            blob = convert(model, fp16=self.precision == "fp16", ranges=calibrated and calibrated.ranges,
                           prepare=False)
            return LiteRtRunner(blob, self.threads, **self.delegate_options())

        runner, error = verify(model, converted, FP32_TOLERANCE if uncalibrated else self.tolerance,
                               inputs=_check_inputs(calibrated))
        runner.error = error
        log.info("litert: %s converted and verified in %.2f s (%d bytes); max abs error %.3g",
                 model.graph.name, time.perf_counter() - start, len(runner.model), runner.error)
        _keep(key, runner.model, runner.error)
        runner.conversion = key
        return runner

    def _calibrated(self, model: onnx.ModelProto):
        """At int8, the calibration the stage carries (`lower` put it there); None at other precisions, and
        for a stage that carries none (the search's probe of a stage's entry cost), which is built as given."""
        from .int8 import calibration_of

        if self.precision != "int8":
            return None
        calibrated = calibration_of(model)
        if calibrated is None:
            log.debug("litert[int8]: %s carries no calibration ranges; built at fp32", model.graph.name)
        return calibrated

    def _conversion_key(self, model: onnx.ModelProto) -> str:
        """What a checked conversion depends on: the stage (with the calibration ranges an int8 one carries),
        the precision, options and tolerance, LiteRT's version and the converter's own source."""
        digest = _stage_digest(model)
        digest.update(json.dumps([self.precision, self.options, self.tolerance, _version(), _converter_digest()],
                                 sort_keys=True, default=repr).encode())
        return digest.hexdigest()[:32]

    def delegate_options(self) -> dict:
        return {"delegate": self.options.get("delegate"), "delegate_options": self.options.get("delegate_options"),
                "allow_fallback": bool(self.options.get("allow_fallback"))}

def _check_inputs(calibrated) -> dict[str, tuple[float, float, float, float]] | None:
    """What `verify` draws an int8 stage's inputs from: each one's (mean, standard deviation, least, greatest)
    over the calibration samples; None (standard normal) for a stage that carries no calibration."""
    return calibrated and {name: (*moments, *calibrated.ranges[name]) for name, moments in calibrated.moments.items()}


def verify(model: onnx.ModelProto, build: Callable[[], Runner], tolerance: dict[str, float], seed: int = 0,
           inputs: dict[str, tuple[float, float, float, float]] | None = None) -> tuple[Runner, float]:
    """ONNX Runtime's outputs on random inputs (`check_feeds`), its session released before `build()` makes the
    runner (the two runtimes never hold their memory at once), then the runner's on the same inputs, each output
    judged (`judge`). The runner and the largest absolute difference; or a `CheckError` naming the first output
    outside `tolerance` (the runner closed), or ONNX Runtime's failure on the inputs."""
    from uhop_onnx.model.loader import reference_session

    feeds = check_feeds(model, seed, inputs)
    try:
        session = reference_session(model)
        expected = dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds), strict=True))
    except Exception as error:  # noqa: BLE001 - without a reference there is no check, and no stage
        raise CheckError(f"litert: cannot check stage {model.graph.name!r}: ONNX Runtime failed on random "
                         f"inputs ({first_line(error)})") from None
    del session
    runner = build()
    try:
        return runner, judge(model.graph.name, runner.run(feeds), expected, tolerance)
    except BaseException:
        runner.close()
        raise


def check_feeds(model: onnx.ModelProto, seed: int = 0,
                inputs: dict[str, tuple[float, float, float, float]] | None = None) -> dict[str, np.ndarray]:
    """Random inputs of a stage at fixed shapes: floats standard normal, or where `inputs` gives an input's (mean,
    standard deviation, least, greatest), normal with those moments, clipped to that range; integers 0 and 1."""
    from onnx import helper

    rng = np.random.default_rng(seed)
    feeds = {}
    for value in model.graph.input:
        if value.name in {t.name for t in model.graph.initializer}:
            continue
        dims = [d.dim_value for d in value.type.tensor_type.shape.dim]
        dtype = helper.tensor_dtype_to_np_dtype(value.type.tensor_type.elem_type)
        # integers are indices: 0 and 1 are valid wherever an axis has two entries (and are both booleans)
        mean, spread, least, greatest = (inputs or {}).get(value.name, (0.0, 1.0, -np.inf, np.inf))
        if np.dtype(dtype).kind in "biu":
            drawn = rng.integers(0, 2, dims)
        else:  # in place: one float64 draw held, not one per step
            drawn = rng.standard_normal(dims)
            drawn *= spread
            drawn += mean
            np.clip(drawn, least, greatest, out=drawn)
        feeds[value.name] = np.asarray(drawn, dtype)  # an array, 0-d ones included (a scalar is not a feed)
    return feeds


def judge(stage: str, got: Mapping[str, Any], expected: Mapping[str, np.ndarray], tolerance: dict[str, float]) -> float:
    """Each output of `got` against ONNX Runtime's (`expected`) by the accuracy rule (`precision.compare`), at
    `tolerance` with its atol widened by `ROUNDING` times the output's largest magnitude; with `l2` (int8: a form
    `compare` has no equivalent of), the error's norm within `l2 |ref| + atol sqrt(size)`. The largest absolute
    difference, or a `CheckError` naming the first output outside."""
    worst = 0.0
    for name, reference in expected.items():
        value = np.asarray(got[name])
        where = f"litert: the converted stage {stage!r} differs from ONNX Runtime on output {name!r}"
        figures = compare(value, reference)
        if "error" in figures:
            raise CheckError(f"{where}: {figures['error']}")
        if "l2" in tolerance:
            error = np.abs(value.astype(np.float64) - reference)
            norm = float(np.linalg.norm(error))
            allowed = tolerance["l2"] * float(np.linalg.norm(reference)) + tolerance["atol"] * np.sqrt(error.size)
            if not norm <= allowed:
                raise CheckError(f"{where}: the error's norm is {norm:.3g}, allowed {allowed:.3g} ({tolerance['l2']} "
                                 f"of the output's + {tolerance['atol']} per element)")
        else:
            rule = {"rtol": tolerance["rtol"], "atol": tolerance["atol"] + ROUNDING * (figures.get("scale", 1.0) - 1)}
            if not compare(value, reference, rule)["ok"]:
                nonfinite = f", {figures['nonfinite']} non-finite values" if figures["nonfinite"] else ""
                raise CheckError(f"{where}: max abs error {figures['max_abs_error']:.3g}{nonfinite} (tolerance "
                                 f"rtol={tolerance['rtol']}, atol={tolerance['atol']} + {ROUNDING} x max |output|)")
        worst = max(worst, figures["max_abs_error"] or 0.0)
    return worst


def _conversions() -> Path:
    return cache_dir() / "litert"


def _verified() -> JsonTable:
    """Key -> {"sha256", "error"} of each conversion checked on this machine."""
    return JsonTable(_conversions() / "verified.json", lambda entry: (str(entry["sha256"]), float(entry["error"])))


def _at_shapes() -> JsonTable:
    """(stage, input shapes and values) key -> {"conversion": the key of its checked conversion, "bounds": the index
    inputs `indices.checked` checks there}, for each shape a stage was converted at on this machine."""
    def check(entry: Any) -> None:
        assert isinstance(entry["conversion"], str)
        for node, name, size in entry["bounds"]:
            assert isinstance(node, str) and isinstance(name, str) and isinstance(size, int)

    return JsonTable(_conversions() / "at_shapes.json", check)


def _stage_digest(model: onnx.ModelProto):
    """A sha256 of the stage, its graph's name and the value infos that restate its initializers' types apart
    (the nodes a capability check named "check" converted are the same conversion as a plan's stage of them,
    which declares its weights' types): each field, and each item of a repeated one, serialized alone, so a
    model of large weights is never serialized whole."""
    digest = hashlib.sha256()
    weights = {t.name for t in model.graph.initializer}
    for message, apart in ((model, "graph"), (model.graph, "name")):
        for field, value in message.ListFields():
            if field.name == apart:
                continue
            digest.update(field.name.encode())
            for item in value if field.label == field.LABEL_REPEATED else [value]:
                if field.name == "value_info" and item.name in weights:
                    continue
                data = item.SerializeToString(deterministic=True) if hasattr(item, "SerializeToString") else (
                    str(item).encode())
                digest.update(len(data).to_bytes(8, "little") + data)
    return digest


def _at_shapes_key(stage: str, shapes: Mapping[str, tuple], values: Mapping[str, np.ndarray]) -> str:
    """A stage's conversion key with the input shapes and integer input values it is fixed at."""
    digest = hashlib.sha256(stage.encode())
    digest.update(json.dumps(sorted((name, list(shape)) for name, shape in shapes.items())).encode())
    for name in sorted(values):
        value = np.asarray(values[name])
        digest.update(f"{name}:{value.dtype.str}:{value.shape}".encode() + value.tobytes())
    return digest.hexdigest()[:32]


def _kept(key: str) -> tuple[bytes, float] | None:
    """A checked conversion's `.tflite` bytes and error; None when there is none, or its file is missing or
    not the bytes that were checked."""
    entry = _verified().get(key)
    if entry is None:
        return None
    path = _conversions() / f"{key}.tflite"
    try:
        blob = path.read_bytes()
    except OSError:
        return None
    if hashlib.sha256(blob).hexdigest() != entry["sha256"]:
        log.warning("litert: %s is not the conversion that was checked; converting again", _conversions() / key)
        return None
    touch(path)  # used now: the cache cap drops the least recently used first
    return blob, float(entry["error"])


def _keep(key: str, blob: bytes, error: float) -> None:
    """Keep a checked conversion (nothing, with a logged warning, when the cache cannot be written), the cache
    then pruned to its cap: each new shape a stage is run at adds one."""
    try:
        with atomic_file(_conversions() / f"{key}.tflite", "wb") as handle:
            handle.write(blob)
    except OSError as problem:
        log.warning("litert: a checked conversion could not be kept in %s (%s)", _conversions(), problem)
        return
    _verified().update({key: {"sha256": hashlib.sha256(blob).hexdigest(), "error": float(error)}})
    prune()


@cache
def _converter_digest() -> str:
    """The converter's source, hashed: a changed converter converts again."""
    digest = hashlib.sha256()
    for path in sorted(Path(__file__).parent.glob("*.py")):
        digest.update(path.read_bytes())
    return digest.hexdigest()


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("ai-edge-litert", "tflite-runtime"):
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    return "unknown"


__all__ = ["LiteRt", "judge", "verify"]
