"""ONNX Runtime providers: one class over ONNX Runtime's execution providers, configured by EP name.

`ort-cpu` runs on the CPU EP. The device providers, the GPUs' (`ort-cuda`, `ort-tensorrt`, `ort-rocm`) and
Qualcomm's NPU (`ort-qnn`), are present only when their EP is in this build *and* a tiny session runs on the
device; CUDA and TensorRT stages keep outputs on the device (IO binding), so consecutive stages on the same GPU
hand tensors over without a host copy. A device provider is configuration: its EPs, wheel, device kind,
precisions and EP options.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Iterable, Mapping
from dataclasses import replace
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import numpy as np

from uhop_onnx.foundation import ortlib
from uhop_onnx.foundation.cache import JsonTable, cache_dir
from uhop_onnx.foundation.errors import ProviderError, first_line, logger
from uhop_onnx.foundation.files import atomic_file

from .base import FP32, Absent, Artifact, ArtifactFormat, Lowering, Provider, probe_model, quantized
from .runner import Runner
from .capability import CapabilityTable, Support
from .quantize import offers, to_fp16

if TYPE_CHECKING:
    import onnx

log = logger(__name__)

ORT_TABLE = CapabilityTable(
    provider="onnxruntime",
    rules=(),
    dtypes=frozenset(
        "float float16 bfloat16 double int8 int16 int32 int64 uint8 uint16 uint32 uint64 bool string".split()
        + "float8e4m3fn float8e4m3fnuz float8e5m2 float8e5m2fnuz int4 uint4".split()
    ),
    domains={"": (1, 28), "ai.onnx.ml": (1, 5), "com.microsoft": (1, 1), "ai.onnx.preview.training": (1, 1)},
    any_op=True,
)


def session_options(threads: int | None, exclusive: bool, optimize: bool = True, arena: bool = True):
    """ONNX Runtime session options for a stage that may share the process with other stages (`arena`: its
    CPU memory arena, which a program may turn off for inputs of many shapes); one that shares it neither spins
    between calls nor plans a memory pattern."""
    ort = ortlib.load()

    so = ort.SessionOptions()
    so.enable_cpu_mem_arena = arena
    so.log_severity_level = ortlib.log_severity()
    so.intra_op_num_threads = threads or 0
    so.inter_op_num_threads = 1
    if not exclusive:
        # Spinning workers of several sessions in one process steal each other's cores.
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
        # ONNX Runtime allocates the memory pattern its first run planned, as one block, on its second, beside
        # what the first run left in its arena: each session of a plan of several stages held its activations
        # twice (a PP-OCR detector's plan of 5 stages on ONNX Runtime and LiteRT: 299 against 247 MiB, the
        # same time a call).
        so.enable_mem_pattern = False
    if not optimize:
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return so


def new_session(model_bytes: bytes | str, so, providers: list):
    """An ONNX Runtime session (on a model's bytes or path) on exactly `providers`: an EP that fails raises
    instead of retrying on CPU."""
    ort = ortlib.load()

    return ort.InferenceSession(model_bytes, so, providers=providers, enable_fallback=0)


class OrtRunner(Runner):
    """An ONNX Runtime session over one stage."""

    def __init__(self, model_bytes: bytes | str, providers: list, threads: int | None, exclusive: bool,
                 arena: bool = True):
        self.session = new_session(model_bytes, session_options(threads, exclusive, arena=arena), providers)
        self.outputs = [o.name for o in self.session.get_outputs()]

    def run(self, feeds: Mapping[str, Any]) -> dict[str, Any]:
        return dict(zip(self.outputs, self.outputs_of(self.outputs, feeds), strict=True))

    def outputs_of(self, names: list[str], feeds: Mapping[str, Any]) -> list[Any]:
        """The outputs `names`, in order, as host arrays of their own: the session's native run, without the
        Python wrapper's checks of the feed names (the runtime checks them itself, and the executor names the
        mistake when a call fails). What a one-stage plan on ONNX Runtime returns as it is (a model's 0.2 ms run
        pays 10-30 us for each layer of Python around it)."""
        return self.session._sess.run(names, feeds if type(feeds) is dict else dict(feeds), None)

    def close(self) -> None:
        """Release the session now, not when the garbage collector finds the executor holding it."""
        self.session = None


class OnnxFile(ArtifactFormat):
    """The stage as an `.onnx` file, with the EP and the options it compiles with (host paths left out)."""

    name = "onnx"

    def export(self, provider: Provider, model: onnx.ModelProto, folder: Path, stem: str) -> Artifact:
        (folder / f"{stem}.onnx").write_bytes(model.SerializeToString())
        entry = provider.stage_entry(model)
        ep, options = entry if isinstance(entry, tuple) else (entry, {})
        portable = {k: v for k, v in options.items() if not k.endswith("_path")}
        return Artifact("onnx", [f"{stem}.onnx"], {"ep": ep, "ep_options": portable})

    def load(self, folder: Path, artifact: Mapping[str, Any], threads: int | None, exclusive: bool, trusted: bool,
             allowed_delegates: Iterable[str | os.PathLike]) -> Runner:
        """A bundle's `.onnx` stage on the EP it was placed on. EP options that name files or libraries (a
        TensorRT plugin library, say: native code) are taken only when `trusted`, from a signed bundle."""
        ort = ortlib.load()

        options = artifact["options"]
        native = sorted(k for k in options.get("ep_options") or {} if "path" in k or "lib" in k)
        if native and not trusted:
            raise ProviderError(f"the unsigned bundle's {options['ep']} options {', '.join(native)} name files on "
                                "this host; such options are taken only from a signed bundle "
                                "(load_bundle(path, key=...))")
        if options["ep"] not in ort.get_available_providers():
            raise ImportError(f"this onnxruntime ({ort.__version__}) has no {options['ep']}")
        ep_options = self.board_options(folder, artifact)
        entry = (options["ep"], ep_options) if ep_options else options["ep"]
        return OrtRunner((folder / artifact["files"][0]).read_bytes(), [entry], threads, exclusive)

    def board_options(self, folder: Path, artifact: Mapping[str, Any]) -> dict[str, Any]:
        """The EP options a bundle's stage is loaded with on this host: those it was exported with."""
        return dict(artifact["options"].get("ep_options") or {})


class OrtProvider(Provider):
    """ONNX Runtime with one execution provider (and no silent CPU fallback)."""

    ep: ClassVar[str]
    table = ORT_TABLE
    format = OnnxFile()

    def probe(self) -> tuple[str, str]:
        try:
            ort = ortlib.load()
        except ImportError as error:
            raise Absent(f"onnxruntime is not installed ({error})") from None
        if self.ep not in ort.get_available_providers():
            raise Absent(f"{self.ep} is not in this onnxruntime build ({ort.__version__})")
        return ort.__version__, self.ep.removesuffix("ExecutionProvider")

    def ep_entry(self) -> Any:
        return self.ep

    def stage_entry(self, model: onnx.ModelProto) -> Any:
        """The EP entry a stage compiles with (its precision's options too, where it has any)."""
        return self.ep_entry()

    def query(self, model: onnx.ModelProto) -> dict[str, Support]:
        """Which nodes ONNX Runtime assigns to this EP, read from the session's assignment record."""
        so = session_options(self.threads, exclusive=False, optimize=False)
        so.add_session_config_entry("session.record_ep_graph_assignment_info", "1")
        providers = [self.ep_entry()] + (["CPUExecutionProvider"] if self.ep != "CPUExecutionProvider" else [])
        from uhop_onnx.model.loader import serialized  # protobuf's own serializer holds four times the model

        session = new_session(serialized(model), so, providers)
        taken = {
            node.name: info.ep_name for info in session.get_provider_graph_assignment_info() for node in info.get_nodes()
        }
        return {
            n.name: Support(False, f"ONNX Runtime assigned it to {taken[n.name]}", "runtime")
            for n in model.graph.node
            if n.name in taken and taken[n.name] != self.ep
        }

    def build(self, model: onnx.ModelProto | bytes | str, *, exclusive: bool = True) -> Runner:
        """A session on the stage's model (or its bytes or path, as a whole model read from its file is given)."""
        if not isinstance(model, (bytes, str)):
            from uhop_onnx.model.loader import serialized  # protobuf's own serializer holds four times the model

            model = serialized(model)
        return OrtRunner(model, [self.ep_entry()], self.threads, exclusive,
                         arena=self.options.get("enable_cpu_mem_arena", True))



def _refusals(entry: Any) -> None:
    """A capability cache entry is {node name: reason}."""
    if not isinstance(entry, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in entry.items()):
        raise TypeError(f"{entry!r:.80} is not a map of node name -> reason")


class OrtCpu(OrtProvider):
    """ONNX Runtime on the CPU. Option `quantization`: how an int8 stage is made, "static" (the default: a
    QDQ model from `quantize_static`) or "dynamic" (`quantize_dynamic`: int8 MatMul weights, activations
    quantized at run time, for MatMul-heavy stages where static ranges lose accuracy). Option
    `enable_cpu_mem_arena` (default True): ONNX Runtime's session option of that name (a session given
    `sess_options` that turns it off starts on ONNX Runtime so)."""

    id = "ort-cpu"
    ep = "CPUExecutionProvider"
    lowerings = {"fp32": FP32, "int8": Lowering(quantized, methods=("static", "dynamic"))}  # int8: the QDQ model
    install = "pip install onnxruntime"
    option_types = {"quantization": Literal["static", "dynamic"], "enable_cpu_mem_arena": bool}


class DeviceTensor:
    """A tensor left on a GPU between stages: an `onnxruntime.OrtValue`, with numpy's `shape`."""

    def __init__(self, value: Any):
        self.value = value

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.value.shape())

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        array = self.value.numpy()
        return array if dtype is None else array.astype(dtype)


class OrtGpuRunner(OrtRunner):
    """A stage on a GPU EP. With `device_type`, inputs and outputs are bound on the device (IO binding):
    a `DeviceTensor` from a stage on the same device goes in without a host copy."""

    def __init__(self, model_bytes: bytes, providers: list, threads: int | None, exclusive: bool,
                 device_type: str | None, device_id: int, label: str):
        start = time.perf_counter()
        super().__init__(model_bytes, providers, threads, exclusive)
        self.build_seconds = time.perf_counter() - start  # session creation; TensorRT adds its warm-up
        self.device_type = device_type
        self.device_id = device_id
        self.device = f"{device_type or label}:{device_id}"

    def run(self, feeds: Mapping[str, Any]) -> dict[str, Any]:
        if self.device_type is None:
            return super().run({name: np.asarray(value) for name, value in feeds.items()})
        binding = self.session.io_binding()
        for name, value in feeds.items():
            if isinstance(value, DeviceTensor):
                binding.bind_ortvalue_input(name, value.value)
            else:
                binding.bind_cpu_input(name, np.ascontiguousarray(value))
        for name in self.outputs:
            binding.bind_output(name, self.device_type, self.device_id)
        self.session.run_with_iobinding(binding)
        return {name: DeviceTensor(v) for name, v in zip(self.outputs, binding.get_outputs(), strict=True)}

    def warm_up(self) -> None:
        """One run on zeros when every input shape is fixed, so an engine build is not part of any latency."""
        from uhop_onnx.foundation.dtypes import numpy_dtype

        feeds = {}
        for arg in self.session.get_inputs():
            dtype = numpy_dtype(arg.type)
            if dtype is None or dtype == np.object_ or not all(isinstance(d, int) for d in arg.shape):
                return
            feeds[arg.name] = np.zeros(arg.shape, dtype)
        start = time.perf_counter()
        self.run(feeds)
        self.build_seconds += time.perf_counter() - start


class OrtGpuProvider(OrtProvider):
    """ONNX Runtime on an accelerator's execution provider: a GPU's (option `device_id`, default 0), or an NPU's.

    Present when the EP is in this onnxruntime build and a tiny session runs on the device (ONNX
    Runtime's assignment record shows the EP took its node, and the result is right). Capability comes
    from the same record for the stage's nodes, cached on disk per model hash, EP, onnxruntime version
    and options.
    """

    eps: ClassVar[tuple[str, ...]]  # the EPs that implement this provider, preferred first
    package: ClassVar[str]  # the wheel that brings the EP
    device_type: ClassVar[str | None] = "cuda"  # OrtValue device for IO binding; None: hand over on the host
    kind = "gpu"
    option_types = {"device_id": int | str}

    @cached_property
    def ep(self) -> str:
        ort = ortlib.load()

        available = ort.get_available_providers()
        return next((ep for ep in self.eps if ep in available), self.eps[0])

    @property
    def short(self) -> str:
        return self.ep.removesuffix("ExecutionProvider")

    def __init__(self, options: Mapping[str, Any] | None = None, threads: int | None = None):
        super().__init__(options, threads)
        value = self.options.get("device_id", 0)
        if isinstance(value, bool) or not str(value).isdigit():
            raise ProviderError(f"{self.id}: device_id must be a non-negative integer, got {value!r}")
        self.device_id = int(value)

    def ep_options(self) -> dict[str, Any]:
        return {"device_id": self.device_id}

    def ep_entry(self) -> Any:
        return (self.ep, self.ep_options())

    def probe(self) -> tuple[str, str]:
        try:
            ort = ortlib.load()
        except ImportError:
            raise Absent(f"{self.package} not installed (onnxruntime cannot be imported)") from None
        available = ort.get_available_providers()
        if not any(ep in available for ep in self.eps):
            raise Absent(f"{self.package} not installed: onnxruntime {ort.__version__} here offers only "
                         f"{', '.join(available)}, not {' or '.join(self.eps)}")
        if hasattr(ort, "preload_dlls") and self.device_type == "cuda":
            ort.preload_dlls()  # CUDA and cuDNN libraries from their pip wheels, where installed
        so = session_options(1, exclusive=False)
        so.add_session_config_entry("session.record_ep_graph_assignment_info", "1")
        try:
            session = new_session(probe_model(), so, [self.ep_entry()])
            y = session.run(None, {"x": np.array([-1, 0, 1, 2], np.float32)})[0]
        except Exception as error:  # noqa: BLE001 - any EP failure means no usable device
            raise Absent(f"{self.short} EP present but no device: {first_line(error)}") from None
        ran_on = {info.ep_name for info in session.get_provider_graph_assignment_info()}
        if ran_on != {self.ep} or not np.array_equal(y, [0, 0, 1, 2]):
            raise Absent(f"{self.short} EP present but no device: the probe ran on {', '.join(sorted(ran_on))}")
        return ort.__version__, f"{self.short}:{self.device_id}"

    def query(self, model: onnx.ModelProto) -> dict[str, Support]:
        ort = ortlib.load()

        table = JsonTable(cache_dir() / "capability" / f"{self.id}-{ort.__version__}.json", check=_refusals)
        key = self.cache_key(model)
        refused = table.get(key)
        if refused is None:
            refused = {name: verdict.reason for name, verdict in super().query(model).items()}
            table.update({key: refused})
        return {name: Support(False, reason, "runtime") for name, reason in refused.items()}

    def cache_key(self, model: onnx.ModelProto) -> str:
        """A hash of the model, the EP and its options (the table is per provider and onnxruntime version)."""
        digest = hashlib.sha256(model.SerializeToString(deterministic=True))
        digest.update(json.dumps([self.ep, self.ep_options()], sort_keys=True, default=str).encode())
        return digest.hexdigest()

    def stage_options(self, model: onnx.ModelProto) -> dict[str, Any]:
        """The EP options a stage compiles with: `ep_options`, and what its precision adds."""
        return self.ep_options()

    def stage_entry(self, model: onnx.ModelProto) -> Any:
        return (self.ep, self.stage_options(model))

    def build(self, model: onnx.ModelProto, *, exclusive: bool = True) -> Runner:
        return OrtGpuRunner(model.SerializeToString(), [self.stage_entry(model)], self.threads,
                            exclusive, self.device_type, self.device_id, self.short.lower())


class OrtCuda(OrtGpuProvider):
    id = "ort-cuda"
    # fp16: the stage converted to float16 by onnxconverter-common (the `quantize` extra)
    lowerings = {"fp32": FP32, "fp16": Lowering(lambda _, model: to_fp16(model),
                                                 offered=lambda p: offers("onnxconverter_common", f"{p.id} fp16"))}
    eps = ("CUDAExecutionProvider",)
    package = "onnxruntime-gpu"
    install = "pip install onnxruntime-gpu"

    def ep_options(self) -> dict[str, Any]:
        return {"device_id": self.device_id, "use_tf32": 0}  # exact fp32, as ONNX Runtime CPU computes


class TensorRtOnnxFile(OnnxFile):
    """The stage as for any ONNX Runtime EP; an int8 one carries its calibration table too
    (`stem.calibration.flatbuffers`), which TensorRT reads from the engine cache on the board."""

    def export(self, provider: Provider, model: onnx.ModelProto, folder: Path, stem: str) -> Artifact:
        artifact = super().export(provider, model, folder, stem)
        if provider.precision != "int8":
            return artifact
        import shutil

        table = f"{stem}.calibration.flatbuffers"
        shutil.copyfile(provider.engine_cache / artifact.options["ep_options"]["trt_int8_calibration_table_name"],
                        folder / table)
        return replace(artifact, files=[*artifact.files, table])

    def board_options(self, folder: Path, artifact: Mapping[str, Any]) -> dict[str, Any]:
        """The exported options with this host's engine cache (`trt_engine_cache_path` and the timing cache are
        left out of a bundle); an int8 stage's calibration table, carried by the bundle, is copied there under
        the name the options give it."""
        options = super().board_options(folder, artifact)
        cache = OrtTensorRT().engine_cache
        cache.mkdir(parents=True, exist_ok=True)
        for key in ("trt_engine_cache", "trt_timing_cache"):
            if options.get(f"{key}_enable"):
                options[f"{key}_path"] = str(cache)
        table = options.get("trt_int8_calibration_table_name")
        if table:
            carried = next(f for f in artifact["files"] if f.endswith(".calibration.flatbuffers"))
            with atomic_file(cache / table, "wb") as handle:
                handle.write((folder / carried).read_bytes())
        return options


class OrtTensorRT(OrtGpuProvider):
    """TensorRT through ONNX Runtime. Options: `device_id`, `engine_cache` (folder; default under the cache
    root). Engines are built when a stage is compiled and the time is reported as `runner.build_seconds`, never
    inside a measured latency.

    Precisions: fp16 is TensorRT's own (`trt_fp16_enable` on the fp32 stage, set by precision fp16 only, never
    by an option). An int8 stage is the fp32 model with a calibration table in the engine cache, named in the
    model's metadata (`TABLE_KEY`), which TensorRT reads with `trt_int8_enable` and
    `trt_int8_calibration_table_name`."""

    TABLE_KEY = "uhop.trt_int8_calibration_table"

    id = "ort-tensorrt"
    # fp16: the EP's own option on the fp32 stage (`ep_options`); int8: the model with its calibration table
    lowerings = {"fp32": FP32, "fp16": FP32, "int8": Lowering(lambda p, model: p.with_calibration_table(model))}
    eps = ("TensorrtExecutionProvider",)
    package = "onnxruntime-gpu"
    install = "pip install onnxruntime-gpu tensorrt"
    format = TensorRtOnnxFile()
    option_types = {"device_id": int | str, "engine_cache": str}
    precision_options = frozenset({"fp16"})  # trt_fp16_enable follows the precision (`ep_options`)

    @property
    def engine_cache(self) -> Path:
        return Path(self.options.get("engine_cache") or cache_dir() / "tensorrt").expanduser()

    def ep_options(self) -> dict[str, Any]:
        return {
            "device_id": self.device_id,
            "trt_fp16_enable": self.precision == "fp16",
            "trt_engine_cache_enable": True,
            "trt_engine_cache_path": str(self.engine_cache),
            "trt_timing_cache_enable": True,
            "trt_timing_cache_path": str(self.engine_cache),
        }

    def with_calibration_table(self, model: onnx.ModelProto) -> onnx.ModelProto:
        """An int8 stage: the model, its calibration table written into the engine cache and named in its
        metadata."""
        import onnx

        from .quantize import trt_calibration_table

        self.engine_cache.mkdir(parents=True, exist_ok=True)
        tagged = onnx.ModelProto()
        tagged.CopyFrom(model)
        onnx.helper.set_model_props(tagged, {**{p.key: p.value for p in model.metadata_props},
                                             self.TABLE_KEY: trt_calibration_table(model, self.calibration,
                                                                                   self.engine_cache)})
        return tagged

    def stage_options(self, model: onnx.ModelProto) -> dict[str, Any]:
        options = self.ep_options()
        if self.precision == "int8":
            table = next((p.value for p in model.metadata_props if p.key == self.TABLE_KEY), None)
            if table is None or not (self.engine_cache / table).is_file():
                raise ProviderError(f"{self.id}: the int8 stage's calibration table {table or '(none named)'} is "
                                    f"not in the engine cache {self.engine_cache}; optimize again with calibration=...")
            options |= {"trt_int8_enable": True, "trt_int8_calibration_table_name": table,
                        "trt_int8_use_native_calibration_table": False}
        return options

    def build(self, model: onnx.ModelProto, *, exclusive: bool = True) -> Runner:
        self.engine_cache.mkdir(parents=True, exist_ok=True)
        runner = super().build(model, exclusive=exclusive)
        runner.warm_up()
        log.info("%s: engine ready in %.2f s (cache %s)", self.id, runner.build_seconds, self.engine_cache)
        return runner


class OrtRocm(OrtGpuProvider):
    """AMD GPUs: ONNX Runtime's MIGraphX EP, or its ROCm EP in builds older than 1.23 that still have it.
    Stages hand tensors over through host memory: ONNX Runtime's Python IO binding names no AMD device."""

    id = "ort-rocm"
    eps = ("MIGraphXExecutionProvider", "ROCMExecutionProvider")
    package = "onnxruntime-migraphx"
    install = "pip install onnxruntime-migraphx"
    device_type = None


class OrtQnn(OrtGpuProvider):
    """Qualcomm NPUs (Hexagon HTP) through ONNX Runtime's QNN EP. Option `backend_type`: htp (the default), gpu
    or cpu (QNN's backends). fp32 is computed in fp32 (`enable_htp_fp16_precision` off), fp16 with it on; an
    int8 stage is the QDQ model ONNX Runtime's QNN configuration makes (uint8), which the HTP runs in 8 bits.
    Stages hand tensors over through host memory."""

    id = "ort-qnn"
    kind = "npu"
    # fp16: the EP's own option on the fp32 stage (`ep_options`); int8: the QDQ model
    lowerings = {"fp32": FP32, "fp16": FP32, "int8": Lowering(quantized, methods=("qnn",))}
    eps = ("QNNExecutionProvider",)
    package = "onnxruntime-qnn"
    install = "pip install onnxruntime-qnn"
    device_type = None
    option_types = {"backend_type": Literal["htp", "gpu", "cpu"]}
    precision_options = frozenset({"fp16"})  # enable_htp_fp16_precision follows the precision (`ep_options`)

    def ep_options(self) -> dict[str, Any]:
        return {"backend_type": self.options.get("backend_type", "htp"),
                "enable_htp_fp16_precision": "1" if self.precision == "fp16" else "0"}
