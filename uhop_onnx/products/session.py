"""`InferenceSession`: a thin facade with onnxruntime's interface: a model is optimized into a plan (or a plan
is loaded), and `compile_plan` runs it as one model."""

from __future__ import annotations

import functools
import hashlib
import json
import os
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np

from ..foundation.dtypes import TensorSig
from ..foundation.errors import FreeDimensionError, InputError, StageError, UhopError, first_line, logger
from ..runtime.executor import Executor, Timing, mapping
from ..foundation.files import atomic_file
from ..foundation.metadata import ModelMetadata, model_name
from ..runtime.plan import PLAN_FILE, Plan, Stage
from ..adaptation.serving import Decisions, Explore, Serving
from ..foundation.cache import cache_dir, device_fingerprint, model_digest
from ..precision import Tolerance
from ..providers import LAST_RESORT, Provider, Runner, create, resolve
from ..runtime.compile import compile_plan

log = logger(__name__)


class InferenceSession:
    """A model (a path, its bytes, an `onnx.ModelProto`), a `Plan` or a plan folder, compiled stage by stage
    on its providers; called as `onnxruntime.InferenceSession` is.

    `run(output_names, feeds)` returns what ONNX Runtime returns for the same model. A model given as such adapts
    (`adapt`, the default unless `profile=False`, `shapes`, `inputs`, `precision` or a plan is given, which measure
    or place once): construction compiles the model as ONNX Runtime would run it for the providers named, and
    returns; a shape bucket whose calls make it pay is then decided by a plan an earlier process kept, or by the
    explorer, a process beside the program (see `adaptation.serving.Serving`; `session.adaptation` says what it
    found, `adapt_budget` bounds the explorer's CPU seconds). `session.plan` is the plan that served the latest
    call. `policy="literal"` (or the session config entry `uhop.policy`) makes ONNX Runtime's EP names plain aliases
    of its runtimes; `uhop.adapt` = `0` turns adapting off. The second and third positional places are ONNX
    Runtime's: `sess_options` (an `onnxruntime.SessionOptions`: its `intra_op_num_threads`, `enable_cpu_mem_arena`,
    `enable_profiling`, `profile_file_prefix` and `log_severity_level` are read; a list there is taken as
    `providers`), `providers` (ids, ONNX Runtime's EP names, or `(name, options)` pairs) and `provider_options` (one
    dict per provider). A listed provider absent here is skipped with one warning (`strict=True`: an error). uhop's
    own parameters are keyword-only; any other keyword goes to `optimize`. With `fallback=True`, a stage that fails
    during a call is re-run on `ort-cpu` for that call only, with one warning per stage, and counted in
    `plan.fallbacks` (in memory; `plan.save` writes it); otherwise the failure is raised as `StageError` naming the
    stage and provider. `run` may be called from many threads at once. `shapes` (`{input: (1, 3, 640, 640)}`) or
    `inputs` (arrays by name, or an `.npz`) are what measuring the placement runs at (see `optimize`); the session
    runs at every shape the model allows. `precision`, `tolerance` and `calibration` let reduced-precision stages
    compete within the tolerance (see `optimize`).
    """

    def __init__(self, path_or_bytes: Any, sess_options: Any = None, providers: Sequence | None = None,
                 provider_options: Sequence[Mapping[str, Any]] | None = None, *, assign: Mapping[str, str] | None = None,
                 profile: bool = True, threads: int | None = None, fallback: bool = False, strict: bool = False,
                 shapes: Mapping[str, Sequence[int]] | None = None, inputs: Any = None, precision: str = "fp32",
                 tolerance: float | None = None, calibration: Any = None, adapt: bool | None = None,
                 policy: str | None = None, adapt_budget: float = 60.0, **optimize_options: Any):
        if isinstance(sess_options, (list, tuple)):
            if providers is not None:
                raise InputError("providers given twice: as the second argument and as providers=")
            sess_options, providers = None, sess_options
        options = _read_session_options(sess_options)
        if threads is None:
            threads = options["threads"]
        policy = policy or options["policy"]
        if adapt is None:
            adapt = options["adapt"]
        source = path_or_bytes
        given_plan = isinstance(source, Plan) or (
            isinstance(source, (str, os.PathLike)) and (Path(source) / PLAN_FILE).is_file())
        by_default = profile and shapes is None and inputs is None and precision == "fp32"
        if adapt and given_plan:
            raise InputError("adapt=True needs the model itself, not a plan: give the .onnx file, or drop adapt")
        specs = _with_options(providers, provider_options)
        compile = functools.partial(compile_plan, threads=threads)
        if given_plan:
            plan = source if isinstance(source, Plan) else Plan.load(source)
            self._serving = Serving(plan, compile, "plan")
        elif adapt if adapt is not None else by_default:
            self._serving = adaptive(source, specs, threads, policy, compile, budget_s=adapt_budget,
                                     assign=assign, strict=strict, arena=options["arena"], **optimize_options)
        else:
            plan = _optimize(source, providers=specs, assign=assign, profile=profile, threads=threads,
                             strict=strict, shapes=shapes, inputs=inputs, precision=precision, tolerance=tolerance,
                             calibration=calibration, policy=policy, **optimize_options)
            self._serving = Serving(plan, compile, "plan")
        self._source = source
        self.threads = threads if threads is not None else self._serving.plan.threads
        self._sess_options = sess_options
        self._serving.fallback = fallback
        self._close = weakref.finalize(self, self._serving.close)
        self._trace: list[dict[str, Any]] | None = [] if options["profiling"] else None
        self._profile_prefix = options["profile_prefix"]
        self._started = time.perf_counter()
        self._lock = threading.Lock()

    @property
    def plan(self) -> Plan:
        """The plan that served the latest call (before any, the one the session started on)."""
        plan = self._serving.plan
        stage = plan.stages[0] if len(plan.stages) == 1 else None
        if stage is not None and not stage.nodes and stage.data is not None:  # made from ONNX Runtime's view
            from ..model.loader import load_as_read

            stage.nodes = [node.name for node in load_as_read(self._source)[0].graph.node]
        return plan

    @property
    def _executor(self) -> Executor:
        """The executor of the plan serving now."""
        return self._serving.executor

    @property
    def adaptation(self) -> dict[str, dict[str, Any]]:
        """Per shape bucket: its calls, the plan serving it, the candidates tried with their figures (`ms`,
        and `interval`: their time over the serving plan's) and states, and the decision."""
        return self._serving.adaptation

    @property
    def fallback(self) -> bool:
        return self._serving.fallback

    @fallback.setter
    def fallback(self, on: bool) -> None:
        self._serving.fallback = on

    # onnxruntime's getters

    def get_inputs(self) -> list[TensorSig]:
        return list(self._serving.plan.inputs)

    def get_outputs(self) -> list[TensorSig]:
        return list(self._serving.plan.outputs)

    def get_overridable_initializers(self) -> list[TensorSig]:
        """Initializers that are also graph inputs: a feed of that name replaces the stored value."""
        from ..foundation.graph import TensorInfo

        found: dict[str, TensorSig] = {}
        for stage in self.plan.stages:
            for value in self.plan.stage_model(stage).graph.input:
                if value.name in self._executor.overridable and value.name not in found:
                    info = TensorInfo.from_type_proto(value.type)
                    found[value.name] = TensorSig(value.name, info.type, None if info.shape is None else list(info.shape))
        return list(found.values())

    def get_providers(self) -> list[str]:
        return self._serving.plan.get_providers()

    def get_provider_options(self) -> dict[str, dict[str, Any]]:
        """Each provider the plan uses -> its options, in `get_providers()` order."""
        options: dict[str, dict[str, Any]] = {}
        for stage in self._serving.plan.stages:
            options.setdefault(stage.provider, dict(stage.options))
        return options

    def get_session_options(self) -> Any:
        """The `onnxruntime.SessionOptions` this session reads: the one given, else one describing it."""
        if self._sess_options is None:
            import onnxruntime as ort

            self._sess_options = ort.SessionOptions()
            self._sess_options.intra_op_num_threads = self.threads or 0
            self._sess_options.enable_profiling = self._trace is not None
        return self._sess_options

    def get_modelmeta(self) -> ModelMetadata:
        return self._serving.plan.metadata

    # fallback switches

    def enable_fallback(self) -> None:
        """From the next call, a stage that fails is re-run on `ort-cpu` (with one warning)."""
        self.fallback = True

    def disable_fallback(self) -> None:
        """From the next call, a stage that fails raises `StageError`."""
        self.fallback = False

    def close(self) -> None:
        """Release every stage's runtime now (it happens anyway when the session is garbage-collected); a run
        started after it, or one it overtakes on another thread, raises `UhopError`."""
        self._close()

    # running

    def run(self, output_names: Sequence[str] | None, input_feed: Mapping[str, Any],
            run_options: Any = None) -> list[np.ndarray]:
        """Run the model; outputs in `output_names` order (all of `get_outputs()` when None or empty).
        `run_options` (an `onnxruntime.RunOptions`) is accepted; nothing in it changes how uhop-onnx runs."""
        return self._run(output_names, input_feed)

    def run_with_timings(self, output_names: Sequence[str] | None,
                         input_feed: Mapping[str, Any]) -> tuple[list[np.ndarray], list[Timing]]:
        """`run`, and for each stage that ran: (index, start, end) in `time.perf_counter()` seconds."""
        timings: list[Timing] = []
        return self._run(output_names, input_feed, timings=timings), timings

    def run_with_ort_values(self, output_names: Sequence[str] | None, input_dict_ort_values: Mapping[str, Any],
                            run_options: Any = None) -> list[Any]:
        """`run` with `onnxruntime.OrtValue`s in and out; an output a GPU stage leaves on its device stays there."""
        return [_ort_value(value) for value in self._run(output_names, input_dict_ort_values, host=False)]

    def run_async(self, output_names: Sequence[str] | None, input_feed: Mapping[str, Any],
                  callback: Callable[[list[np.ndarray] | None, Any, str], None], user_data: Any,
                  run_options: Any = None) -> None:
        """Run on another thread, then call `callback(outputs, user_data, error)`, as onnxruntime does:
        `error` is "" on success, else the message, with `outputs` None."""
        def work() -> None:
            try:
                outputs = self._run(output_names, input_feed)
            except Exception as error:  # noqa: BLE001 - handed to the callback, as onnxruntime does
                callback(None, user_data, str(error))
            else:
                callback(outputs, user_data, "")

        threading.Thread(target=work, name="uhop-run-async", daemon=True).start()

    def io_binding(self) -> IOBinding:
        return IOBinding(self)

    def run_with_iobinding(self, iobinding: IOBinding, run_options: Any = None) -> None:
        """Run on the binding's inputs; its bound outputs are then in `iobinding.get_outputs()`."""
        iobinding.outputs = self.run_with_ort_values(iobinding.output_names or None, iobinding.inputs, run_options)

    def end_profiling(self) -> str:
        """Write the profile gathered since the session started (one Chrome trace event per stage run, with
        its provider) to `<prefix>_<date>.json` in the working folder and return that file's name; profiling
        stops. "" when profiling was not on, as onnxruntime returns."""
        if self._trace is None:
            return ""
        with self._lock:
            events, self._trace = self._trace, None
        name = f"{self._profile_prefix}_{datetime.now():%Y-%m-%d_%H-%M-%S}.json"
        with atomic_file(Path(name)) as handle:
            json.dump(events, handle, indent=1)
        return name

    def _run(self, output_names, feeds, host: bool = True, timings: list[Timing] | None = None) -> list[Any]:
        try:
            if self._trace is None and timings is None:
                return self._serving.run(output_names, feeds, host=host)[0]
            timings = [] if timings is None else timings
            start = time.perf_counter()
            results, plan = self._serving.run(output_names, feeds, host=host, timings=timings)
        except Exception as error:  # a call that `close` overtook fails in whatever way its runtime does
            mapping(feeds)  # feeds of another kind fail at their first use: said as such
            if self._close.alive or type(error) is UhopError:  # open, or closed before the call began
                raise
            raise UhopError("the session was closed while this call ran: its runtimes were released; make a new "
                            "session to run again") from error
        if self._trace is not None:
            self._record(plan, start, time.perf_counter(), timings)
        return results

    def _record(self, plan: Plan, start: float, end: float, timings: list[Timing]) -> None:
        def event(name: str, cat: str, begin: float, finish: float, args: dict[str, Any]) -> dict[str, Any]:
            return {"cat": cat, "pid": os.getpid(), "tid": threading.get_ident(), "ph": "X", "name": name,
                    "ts": round((begin - self._started) * 1e6), "dur": round((finish - begin) * 1e6), "args": args}

        events = [event("model_run", "Session", start, end, {})]
        for k, begin, finish in timings:
            stage = plan.stages[k]
            events.append(event(f"stage_{k}", "Node", begin, finish, {
                "provider": stage.label, "nodes": len(stage.nodes), "first_node": (stage.nodes or [""])[0]}))
        with self._lock:
            if self._trace is not None:
                self._trace.extend(events)


class IOBinding:
    """onnxruntime's `IOBinding` over a session: inputs bound by name (arrays or `OrtValue`s), outputs by
    name; `run_with_iobinding` fills `get_outputs()`. Only host memory can be bound by pointer."""

    def __init__(self, session: InferenceSession):
        self._session = session
        self.inputs: dict[str, Any] = {}
        self.output_names: list[str] = []
        self.outputs: list[Any] = []

    def bind_cpu_input(self, name: str, arr_on_cpu: np.ndarray) -> None:
        self.inputs[name] = arr_on_cpu

    def bind_ortvalue_input(self, name: str, ortvalue: Any) -> None:
        self.inputs[name] = ortvalue

    def bind_input(self, name: str, device_type: str, device_id: int, element_type: Any, shape: Sequence[int],
                   buffer_ptr: int) -> None:
        """Bind `shape` elements of `element_type` at host address `buffer_ptr` (read when the session runs)."""
        self.inputs[name] = _host_buffer(name, device_type, element_type, shape, buffer_ptr)

    def bind_output(self, name: str, device_type: str = "cpu", device_id: int = 0, element_type: Any = None,
                    shape: Sequence[int] | None = None, buffer_ptr: int | None = None) -> None:
        if buffer_ptr is not None:
            raise InputError(f"output {name!r}: binding a preallocated buffer is not supported; "
                             "bind the output by name and read it from get_outputs()")
        self.output_names.append(name)

    def get_outputs(self) -> list[Any]:
        """The outputs of the last `run_with_iobinding`, as `OrtValue`s."""
        return list(self.outputs)

    def copy_outputs_to_cpu(self) -> list[np.ndarray]:
        """Copies of the outputs, owning their memory (an `OrtValue`'s `numpy()` is only a view of it)."""
        return [np.array(value.numpy(), copy=True) for value in self.outputs]

    def clear_binding_inputs(self) -> None:
        self.inputs.clear()

    def clear_binding_outputs(self) -> None:
        self.output_names.clear()
        self.outputs = []

    def synchronize_inputs(self) -> None:
        """Nothing to wait for: inputs are read when the session runs."""

    def synchronize_outputs(self) -> None:
        """Nothing to wait for: outputs are complete when `run_with_iobinding` returns."""


def _optimize(source: Any, **options: Any) -> Plan:
    """`optimize`; a model with free dimensions that nobody sized is placed without measuring (as onnxruntime
    scripts give no sizes), with one warning naming them and how to have the model measured."""
    from .optimizer import optimize

    try:
        return optimize(source, progress=log.info, **options)
    except FreeDimensionError as error:
        if not options["profile"]:
            raise
        warnings.warn(f"placed without measuring: {error}", UserWarning, stacklevel=3)
        with warnings.catch_warnings():  # the providers skipped were named once already
            warnings.filterwarnings("ignore", message="provider .* is not available here")
            return optimize(source, progress=log.info, **{**options, "profile": False})


def adaptive(source: Any, specs: list | None, threads: int | None, policy: str, compile: Callable[..., Executor],
             *, budget_s: float, assign: Mapping[str, str] | None, strict: bool, arena: bool = True,
             **optimize_options: Any) -> Serving:
    """An adapting session's `Serving`. It starts on the model placed on the runtimes `specs` name, as ONNX
    Runtime would run it (`ort-cpu`, the model as given, unsimplified and unread, when none are named); what it
    decides later is found by the explorer, a process of its own (`adaptation.explorer`), and checked against
    ONNX Runtime running the model as given before it serves; `arena` False (the program's `sess_options` turned
    ONNX Runtime's memory arena off) is kept for the ONNX Runtime it starts on. `compile` is `compile_plan`, or
    one that takes its keywords."""
    first = resolve(["ort-cpu"] if specs is None else specs, threads, strict, policy="literal")[0]
    plain = first.id == LAST_RESORT and not assign  # ONNX Runtime runs every node: nothing to place
    if plain and not arena:
        first = create((LAST_RESORT, {**first.options, "enable_cpu_mem_arena": False}), threads)
    data = _as_given(source)
    umpire = first if plain else resolve([LAST_RESORT], threads, False, policy="literal")[0]

    def referee() -> tuple[Plan, Executor]:
        """ONNX Runtime running the model as given, unsimplified: what every other plan is compared with."""
        plan, runner = on_ort(source, data, umpire)
        return plan, compile(plan, runners=[runner])

    def tolerances() -> dict[str, Tolerance]:
        """Per output, what a plan is held to against the referee: the model's own precision's rule."""
        from ..model.loader import load, load_as_read
        from ..precision import own

        return own.tolerances(load_as_read(source)[0], lambda: load(source, check=False))

    compiled = None
    if plain:
        (starter, compiled), label = referee(), first.label
    else:
        from .optimizer import optimize

        starter = optimize(source, providers=specs, assign=assign, profile=False, threads=threads, strict=strict,
                           policy="literal")
        nodes = {p: sum(len(s.nodes) for s in starter.stages if s.provider == p) for p in starter.get_providers()}
        label = max(nodes, key=nodes.get)
    job = {"source": data if isinstance(data, str) else None, "providers": specs, "threads": threads,
           "policy": policy, "assign": dict(assign or {}), "options": optimize_options}
    explore = Explore(job, functools.partial(decisions_for, source, specs, threads, policy, assign),
                      lambda: data if isinstance(data, bytes) else None, budget_s)
    return Serving(starter, compile, label, explore, tolerances=tolerances, referee=referee, plain=plain,
                   compiled=compiled)


def _as_given(source: Any) -> bytes | str:
    """What ONNX Runtime is given, the model unread: a file's resolved path, or the model's bytes."""
    if isinstance(source, (str, os.PathLike)) and os.path.isfile(source):
        return str(Path(source).resolve())
    if isinstance(source, bytes):
        return source
    from ..model.loader import load_as_read

    return load_as_read(source)[1]  # a model object serialized; anything else refused as `load` refuses it


def on_ort(source: Any, data: bytes | str, provider: Provider) -> tuple[Plan, Runner]:
    """The model (`data`, as `_as_given` gives it) whole on `provider`, an ONNX Runtime one: compiled, and a plan
    of it made from the runtime's own view (inputs, outputs, overridable initializers, metadata), the model's
    structure unread: its stage names no nodes until `InferenceSession.plan` is asked for. A model ONNX Runtime refuses is
    then read as `load` reads it, so that the error says what is wrong with it (its external data outside its
    folder, an IR version out of range)."""
    try:
        runner = provider.compile(data, exclusive=True)
    except Exception as error:
        from ..model.loader import load_as_read

        load_as_read(source)
        raise StageError(f"the model could not be compiled on {provider.id}: {first_line(error)}", 0,
                         provider.id) from error
    session = runner.session
    # ONNX Runtime shows `[]` for a scalar and for a rank it does not know alike: such an input's rank is left
    # unknown here, and ONNX Runtime checks it
    inputs = [TensorSig(a.name, a.type, a.shape or None) for a in session.get_inputs()]
    outputs = [TensorSig(a.name, a.type, a.shape) for a in session.get_outputs()]
    stored = [a.name for a in session.get_overridable_initializers()]
    meta = session.get_modelmeta()
    stage = Stage(provider=provider.id, options=dict(provider.options), nodes=[],
                  inputs=[*(i.name for i in inputs), *stored], outputs=[o.name for o in outputs],
                  file=f"stage_00_{provider.id}.onnx", declared=[(o.name, None) for o in outputs], data=data)
    plan = Plan(model_name=model_name(source, meta.graph_name), model_hash="", inputs=inputs, outputs=outputs,
                providers=[{"id": provider.id, "options": dict(provider.options),
                            "version": provider.availability.version}],
                stages=[stage], placement="whole",
                metadata=ModelMetadata(meta.producer_name, meta.graph_name, meta.domain, meta.description,
                                       meta.graph_description, meta.version, dict(meta.custom_metadata_map)))
    return plan, runner


def model_size(source: Any) -> int | None:
    """The bytes of a model file, of serialized bytes or of a model object; None for anything else, or a path
    not readable (loading names the problem)."""
    if isinstance(source, bytes):
        return len(source)
    if isinstance(source, (str, os.PathLike)):
        try:
            return os.stat(source).st_size
        except OSError:
            return None
    return source.ByteSize() if hasattr(source, "ByteSize") else None


def decisions_for(source: Any, specs: list | None, threads: int | None, policy: str,
                  assign: Mapping[str, str] | None, digest: str | None = None) -> Decisions:
    """Where sessions keep their decisions for this model (by content: `digest`, its `model_digest` when
    known), host, uhop-onnx's version, providers, policy and pins."""
    from .. import __version__

    # uhop-onnx's version, not its source's hash: a kept plan is checked again on live calls, never trusted
    digest = digest or model_digest(source)
    key = json.dumps([digest, device_fingerprint(threads), __version__, repr(specs), policy, dict(assign or {})],
                     sort_keys=True)
    name = f"{model_size(source)}-{hashlib.sha256(key.encode()).hexdigest()[:32]}"
    return Decisions(cache_dir() / "sessions" / name, digest)


def _read_session_options(so: Any) -> dict[str, Any]:
    """What uhop-onnx takes from an `onnxruntime.SessionOptions` (or None)."""
    if so is None:
        return {"threads": None, "profiling": False, "profile_prefix": "onnxruntime_profile_", "adapt": None,
                "policy": "device", "arena": True}
    if not hasattr(so, "intra_op_num_threads"):
        raise InputError(f"sess_options must be an onnxruntime.SessionOptions (or a list of providers), "
                         f"got {type(so).__name__}")
    if getattr(so, "log_severity_level", -1) in range(5):  # -1: not set
        from ..foundation.ortlib import set_log_severity

        set_log_severity(so.log_severity_level)
    adapt = _config_entry(so, "uhop.adapt")
    if adapt not in (None, "0", "1"):
        raise InputError(f"session config entry uhop.adapt is {adapt!r}; use '0' (keep one plan) or '1' (adapt)")
    return {"threads": so.intra_op_num_threads or None, "profiling": bool(so.enable_profiling),
            "profile_prefix": so.profile_file_prefix or "onnxruntime_profile_",
            "adapt": None if adapt is None else adapt == "1", "policy": _config_entry(so, "uhop.policy") or "device",
            "arena": bool(getattr(so, "enable_cpu_mem_arena", True))}


def _config_entry(so: Any, key: str) -> str | None:
    """A session config entry of an `onnxruntime.SessionOptions`, None when it was not added."""
    try:
        return so.get_session_config_entry(key)
    except (AttributeError, RuntimeError):  # onnxruntime raises for a key never added
        return None


def _with_options(providers: Sequence | None, provider_options: Sequence[Mapping[str, Any]] | None) -> list | None:
    """`providers` paired with onnxruntime's parallel `provider_options` list."""
    if provider_options is None:
        return None if providers is None else list(providers)
    if providers is None or len(provider_options) != len(providers):
        raise InputError(f"provider_options has {len(provider_options)} entries; it needs one per provider "
                         f"({0 if providers is None else len(providers)} given)")
    return [(p if isinstance(p, str) else p[0], dict(o)) for p, o in zip(providers, provider_options, strict=True)]


def _ort_value(value: Any) -> Any:
    """A run's result as an `onnxruntime.OrtValue`: a device tensor's own, else one over the host array."""
    import onnxruntime as ort

    inner = getattr(value, "value", value)
    if isinstance(inner, ort.OrtValue):
        return inner
    return ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(value))


def _host_buffer(name: str, device_type: str, element_type: Any, shape: Sequence[int], pointer: int) -> np.ndarray:
    """A copy of the array at host address `pointer`."""
    import ctypes

    if str(device_type).lower() != "cpu":
        raise InputError(f"input {name!r}: only host (cpu) buffers can be bound by pointer, not {device_type!r}; "
                         "bind an OrtValue with bind_ortvalue_input")
    dtype = np.dtype(element_type)
    count = int(np.prod(shape, dtype=np.int64))
    raw = (ctypes.c_char * (count * dtype.itemsize)).from_address(pointer)
    return np.frombuffer(raw, dtype=dtype, count=count).reshape(tuple(shape)).copy()
