"""OpenVINO: ONNX stages read by OpenVINO's ONNX frontend and compiled with `Core` on one device."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable, Mapping
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from uhop_onnx.foundation.errors import InputError, first_line, missing_module

from . import indices
from uhop_onnx.foundation.host import cpu_features, host_arch

from .base import (FP32, Absent, Artifact, ArtifactFormat, Lowering, Provider, installed, output_dtypes, probe_model,
                   quantized)
from .runner import Pool, Runner
from .capability import CapabilityTable, OpRule, Support

if TYPE_CHECKING:
    import onnx

# ONNX ops OpenVINO's frontend converts and the CPU plugin computes as ONNX Runtime does (checked against the
# onnx backend node cases). Left out, as OpenVINO 2026.4 answers wrongly: Dropout (the folded graph loses its
# input), DynamicQuantizeLinear (rounds differently), If (branches of different rank do not compile),
# NonMaxSuppression (an IoU equal to the threshold suppresses), Softplus (0 below x = -17,
# 1e-2 relative error below -6), TopK (ties not in index order).
OPS = """
Abs Acos Acosh Add AffineGrid And ArgMax ArgMin Asin Asinh Atan Atanh AveragePool BatchNormalization
BitwiseAnd BitwiseNot BitwiseOr BitwiseXor BlackmanWindow Cast CastLike Ceil Celu CenterCropPad Clip
Compress Concat Constant Conv ConvInteger ConvTranspose Cos Cosh CumSum DFT DepthToSpace
DequantizeLinear Div Einsum Elu Equal Erf Exp EyeLike Flatten Floor GRU
Gather GatherElements GatherND Gelu Gemm GlobalAveragePool GlobalMaxPool Greater GreaterOrEqual GridSample
GroupNormalization HammingWindow HannWindow HardSigmoid HardSwish Hardmax Identity InstanceNormalization
IsInf IsNaN LRN LayerNormalization LeakyRelu Less LessOrEqual Log LogSoftmax Loop LpNormalization LpPool
MatMul MatMulInteger Max Mean MeanVarianceNormalization Min Mish Mod Mul Neg NegativeLogLikelihoodLoss
NonZero Not OneHot Or PRelu Pad Pow QLinearConv QLinearMatMul RMSNormalization
RNN Range Reciprocal ReduceProd
Relu ReverseSequence RoiAlign RotaryEmbedding Round Scan Scatter
ScatterElements ScatterND Selu Shape Shrink Sigmoid Sign Sin Sinh Size Slice Softmax SoftmaxCrossEntropyLoss
Softsign Split Sqrt Squeeze Sub Sum Swish Tan Tanh ThresholdedRelu Transpose
Trilu Unique Unsqueeze Upsample Where Xor
""".split()

# Reductions whose axes come as an input (opset 18, ReduceSum 13): OpenVINO drops an empty axes input from the
# compiled model and then has no port to feed it, so the axes must be constant.
# ReduceMax and ReduceMin are left out: over -inf (+inf) they give the finite float limit.
REDUCTIONS = "ReduceL1 ReduceL2 ReduceLogSum ReduceLogSumExp ReduceMean ReduceSum ReduceSumSquare"

# Ops OpenVINO runs only under constraints: outside them it computes something else.
RULES = (
    OpRule("Attention", attributes={"left_window_size": (-1,), "right_window_size": (-1,)},
           defaults={"left_window_size": -1, "right_window_size": -1}),
    OpRule("BitShift", dtypes=frozenset("uint8 uint16 uint32 uint64".split())),  # signed shifts differ
    # ConstantOfShape, Expand, Reshape: the CPU plugin cannot compile an output of unknown rank.
    OpRule("ConstantOfShape", sized_inputs=(0,)),
    OpRule("Expand", sized_inputs=(1,)),
    OpRule("LSTM", absent_inputs=(7,)),  # peepholes are ignored
    OpRule("MaxPool", attributes={"ceil_mode": (0,)}, defaults={"ceil_mode": 0}),  # ceil sizes differ at edges
    OpRule("QuantizeLinear", constant_inputs=(1, 2)),  # a computed scale or zero point gives wrong values
    OpRule("Reshape", sized_inputs=(1,)),
    OpRule("Resize", attributes={"antialias": (0,), "exclude_outside": (0,), "keep_aspect_ratio_policy": (b"stretch",)},
           defaults={"antialias": 0, "exclude_outside": 0, "keep_aspect_ratio_policy": b"stretch"}),
    OpRule("SpaceToDepth", attributes={"mode": (b"DCR",)}, defaults={"mode": b"DCR"}),  # CRD is ignored
    OpRule("Tile", constant_inputs=(1,)),  # runtime repeats give garbage
    *(OpRule(op, constant_inputs=(1,)) for op in REDUCTIONS.split()),
)

OPENVINO_TABLE = CapabilityTable(
    provider="openvino",
    rules=tuple(OpRule(op) for op in OPS) + RULES,
    # No double: the CPU plugin computes f64 in f32. Float16 only where checked: it computes f16 graphs in f32
    # without rounding between ops, one f16 ulp away from ONNX Runtime's per-op results on some inputs.
    dtypes=frozenset("float bfloat16 int8 int16 int32 int64 uint8 uint16 uint32 uint64 bool".split()),
    domains={"": (7, 28)},
    checked_dtypes=frozenset({"float16"}),
)


DEVICE_SETUP = {
    "GPU": "install Intel's GPU compute runtime (Debian/Ubuntu: apt install intel-opencl-icd) and check with clinfo",
    "NPU": "install Intel's NPU driver (linux-npu-driver) on a Core Ultra host",
}


def read_model(model_bytes: bytes):
    import openvino as ov

    return ov.Core().read_model(model_bytes)  # convert_model would also send usage telemetry


class OpenVinoRunner(Runner):
    """An OpenVINO `CompiledModel` over one stage, compiled for `device` with `config`, with outputs in their
    declared ONNX dtypes. An infer request serves one call at a time, so concurrent calls each borrow one from
    a pool.

    A failed call can break the compiled model itself, not only its request: after an empty batch through
    MaxPool, OpenVINO 2026.4's CPU plugin fails every later call at the shape it last ran, on any request. So
    the call that failed replaces it (exported and imported again, which keeps no second copy of the weights
    meanwhile) before it raises; calls under way finish on the old one."""

    def __init__(self, compiled, dtypes: Mapping[str, np.dtype], device: str, config: Mapping[str, Any]):
        import openvino as ov

        self.device, self.config = device, dict(config)
        self.current = self._serving(compiled)
        # OpenVINO's binding fills a table on the process's first `Type.to_dtype()` (which `infer` calls); two
        # threads making that first call at once deadlock (one holds the GIL, the other the table's guard).
        compiled.outputs[0].get_element_type().to_dtype()
        # Per input name: its index, and the type code of the arrays it takes as they are (None: every value goes
        # through OpenVINO's own conversion).
        self._tensor = ov.Tensor
        self.inputs = {name: (i, None if port.get_element_type() in (ov.Type.string, ov.Type.bf16, ov.Type.dynamic)
                              else port.get_element_type().to_dtype().char)
                       for i, port in enumerate(compiled.inputs) for name in port.get_names()}
        # By position among the model's outputs (a renewed copy keeps their order); `port.get_index()` is the
        # port's index on its own node, 0 for every Result.
        self.outputs = [(i, _onnx_name(port, dtypes)) for i, port in enumerate(compiled.outputs)]
        self.dtypes = dict(dtypes)
        self._renewing = threading.Lock()

    @staticmethod
    def _serving(compiled) -> tuple[Any, Pool]:
        return compiled, Pool(compiled.create_infer_request, compiled.create_infer_request())

    def close(self) -> None:
        """Release the compiled model and its requests now, not when the garbage collector finds them."""
        self.current = None

    def run(self, feeds: Mapping[str, Any]) -> dict[str, Any]:
        # Inputs are read in place (inference is synchronous); outputs come as copies the caller may keep.
        current = self.current
        requests = current[1]
        try:
            request = requests.take()  # given back only when the call succeeds
            shared = self._shared(feeds)
            if shared is None:
                results = request.infer({name: _plain(value) for name, value in feeds.items()}, share_inputs=True)
            else:
                for index, tensor in shared:
                    request.set_input_tensor(index, tensor)
                results = request.infer()
        except Exception:
            self._renew(current)
            raise
        requests.give(request)
        values = results.to_tuple()
        out = {}
        for port, name in self.outputs:
            dtype = self.dtypes.get(name)
            out[name] = values[port].astype(dtype, copy=False) if dtype is not None else values[port]
        return out

    def _shared(self, feeds: Mapping[str, Any]) -> list[tuple[int, Any]] | None:
        """(input index, a `Tensor` over the array's memory) per feed; None when one needs OpenVINO's own
        conversion (another type or byte order, a scalar, a view that is not contiguous or not writeable). The call's
        dearest part on a small model is `infer`'s conversion of what it is given: arrays of the right type
        skip it."""
        shared = []
        for name, value in feeds.items():
            index, char = self.inputs.get(name, (0, None))
            if (type(value) is not np.ndarray or value.dtype.char != char or not value.dtype.isnative
                    or not value.ndim or not (value.flags.c_contiguous and value.flags.writeable)):
                return None
            shared.append((index, self._tensor(value, shared_memory=True)))
        return shared

    def _renew(self, failed: tuple[Any, Pool]) -> None:
        """Serve from a fresh copy of the compiled model that `failed` holds; the first call to fail on it
        renews it, later ones find it renewed."""
        import openvino as ov

        with self._renewing:
            if self.current is failed:
                self.current = self._serving(ov.Core().import_model(failed[0].export_model(), self.device,
                                                                    self.config))


def _plain(value: Any) -> np.ndarray:
    """`value` as an array whose type code OpenVINO's binding knows: it refuses ONNX Runtime's int64 outputs,
    typed `longlong` ('q'), until they are relabelled as the same-width 'l'."""
    array = np.asarray(value)
    return array.view(array.dtype.str)


def _onnx_name(port, dtypes: Mapping[str, np.dtype]) -> str:
    names = port.get_names()
    return next((n for n in names if n in dtypes), next(iter(names)))


class OpenVinoIr(ArtifactFormat):
    """OpenVINO IR (`.xml` + `.bin`), compiled on the board's device at the stage's precision."""

    name = "openvino-ir"

    def blocker(self, provider: Provider) -> str | None:
        """The IR is written by OpenVINO itself: it must be installed and read an ONNX model here (any device)."""
        missing = missing_module("openvino", provider.install)
        if missing is not None:
            return missing
        try:
            read_model(probe_model())
        except Exception as error:  # noqa: BLE001 - a broken install fails in any way
            return f"OpenVINO cannot read an ONNX model here ({type(error).__name__}: {first_line(error)})"
        return None

    def export(self, provider: Provider, model: onnx.ModelProto, folder: Path, stem: str) -> Artifact:
        """The stage as OpenVINO IR, weights kept in fp32 (in f16 at fp16; an int8 stage's IR is its QDQ
        model's), with the precision it compiles at (`compile_config`'s inference precision hint)."""
        import openvino as ov

        ov.save_model(read_model(model.SerializeToString()), folder / f"{stem}.xml",
                      compress_to_fp16=provider.precision == "fp16")
        dtypes = {name: dtype.name for name, dtype in output_dtypes(model).items()}
        return Artifact("openvino-ir", [f"{stem}.xml", f"{stem}.bin"],
                        {"device": provider.device, "outputs": dtypes, "precision": provider.precision})

    def load(self, folder: Path, artifact: Mapping[str, Any], threads: int | None, exclusive: bool, trusted: bool,
             allowed_delegates: Iterable[str | os.PathLike]) -> Runner:
        """A bundle's OpenVINO IR stage on the device it was placed on."""
        import openvino as ov

        options = artifact["options"]
        core = ov.Core()
        provider = OpenVino({"device": options["device"]}, threads).at_precision(options.get("precision", "fp32"))
        config = provider.compile_config()
        compiled = core.compile_model(core.read_model(folder / artifact["files"][0]), options["device"], config)
        return OpenVinoRunner(compiled, {name: np.dtype(dtype) for name, dtype in options["outputs"].items()},
                              options["device"], config)


class OpenVino(Provider):
    """OpenVINO on one device (`{"device": "CPU"}` by default; `openvino:GPU`, `openvino:NPU`). Option
    `quantization`: how an int8 stage was made, "nncf" (the default where NNCF is installed) or "static"."""

    id = "openvino"
    install = "pip install openvino"
    table = OPENVINO_TABLE
    # bf16 and fp16: the inference precision hint; int8: NNCF's QDQ model or ONNX Runtime's (`openvino[int8-static]`):
    # NNCF's is the closer to fp32, and neither was the faster on every model here, so both compete.
    lowerings = {"fp32": FP32, "bf16": Lowering(offered=lambda p: p.offers("bf16")),
                 "fp16": Lowering(offered=lambda p: p.offers("fp16")),
                 "int8": Lowering(quantized, methods=("nncf", "static"), offered=lambda p: p.offers("int8"))}
    format = OpenVinoIr()
    option_types = {"device": str, "quantization": Literal["nncf", "static"]}

    @classmethod
    def device_kind(cls, options: Mapping[str, Any]) -> str:
        """The kind of OpenVINO's device: cpu, gpu or npu for its CPU, GPU and NPU devices (`GPU.1` too); a
        device that chooses among others at run time (`AUTO`, `HETERO:...`, `MULTI:...`) is an `InputError`."""
        device = str(options.get("device", "CPU")).upper()
        family = device.split(".")[0]
        if family not in ("CPU", "GPU", "NPU"):
            raise InputError(f"openvino device {device!r} is not one device (CPU, GPU or NPU, as GPU.1): its kind, "
                             "which placement, Ray and Triton need, depends on what OpenVINO chooses at run time; "
                             "name the device")
        return family.lower()

    @property
    def device(self) -> str:
        return str(self.options.get("device", "CPU")).upper()

    @classmethod
    def known_options(cls) -> list[dict[str, Any]]:
        return [{"device": d} for d in ("CPU", "GPU", "NPU")]

    def locate(self) -> tuple[str, str] | None:
        """The CPU device, where openvino is installed with its CPU plugin (a GPU or NPU needs its driver: the
        probe asks)."""
        version = installed("openvino", "openvino", "libs/*openvino_*cpu_plugin*") if self.device == "CPU" else None
        return (version, self.device) if version else None

    def probe(self) -> tuple[str, str]:
        try:
            import openvino as ov
        except ImportError as error:
            raise Absent(f"openvino is not installed ({error})") from None
        devices = ov.Core().available_devices
        family = {d.split(".")[0] for d in devices}
        if self.device not in devices and self.device not in family:
            raise Absent(f"OpenVINO device {self.device!r} not found; devices here: {', '.join(devices) or 'none'}",
                         install=DEVICE_SETUP.get(self.device, "see OpenVINO's device configuration guide"))
        return ov.get_version().split("-")[0], self.device

    def offers(self, precision: str) -> bool:
        """Whether this device computes `precision`: where it is present and reports its capability
        (`CAPABILITIES`) in `OPTIMIZATION_CAPABILITIES` (GPU and NPU devices fp16 always, their native
        precision), bf16 on the CPU only where the CPU has AVX-512 BF16 and oneDNN is not held below it
        (`ONEDNN_MAX_CPU_ISA`): held there, the CPU plugin still reports BF16 and fails to compile bf16."""
        if not self.present:
            return False
        if precision == "bf16" and self.device.split(".")[0] == "CPU" and not cpu_computes_bf16():
            return False
        return CAPABILITIES[precision] in self.reported

    @cached_property
    def reported(self) -> frozenset[str]:
        """The device's `OPTIMIZATION_CAPABILITIES`, with FP16 on GPU and NPU devices."""
        import openvino as ov

        reported = set(ov.Core().get_property(self.device, "OPTIMIZATION_CAPABILITIES"))
        return frozenset(reported | ({"FP16"} if self.device.split(".")[0] in ("GPU", "NPU") else set()))

    def query(self, model: onnx.ModelProto) -> dict[str, Support]:
        """Nodes OpenVINO's `query_model` does not place on the device, mapped back by output tensor names."""
        import openvino as ov

        converted = read_model(model.SerializeToString())
        placed = ov.Core().query_model(converted, self.device)
        unplaced = {name for op in converted.get_ops() if op.get_friendly_name() not in placed
                    for i in range(op.get_output_size()) for name in op.output(i).get_names()}
        verdicts = {
            n.name: Support(False, f"OpenVINO query_model does not place it on {self.device}", "runtime")
            for n in model.graph.node
            if unplaced.intersection(n.output)
        }
        # The CPU plugin compiles no Parameter of unknown rank (query_model accepts it); a tensor whose rank
        # inference could not find may become one at a stage boundary. Inside one stage OpenVINO's own shape
        # inference may find it: the search times the whole model on OpenVINO where only this refuses nodes.
        g = model.graph
        ranked = {v.name for v in (*g.input, *g.value_info, *g.output) if v.type.tensor_type.HasField("shape")}
        ranked |= {t.name for t in g.initializer}
        for n in g.node:
            for name in set(filter(None, n.input)) - ranked:
                verdicts[n.name] = Support(False, f"input {name!r} has unknown rank; OpenVINO needs a known rank",
                                           "unknown")
        verdicts.update((name, Support(False, reason, "runtime")) for name, reason in indices.unchecked(model).items())
        return verdicts

    def build(self, model: onnx.ModelProto, *, exclusive: bool = True) -> Runner:
        import openvino as ov

        config = self.compile_config()
        compiled = ov.Core().compile_model(read_model(model.SerializeToString()), self.device, config)
        return indices.checked(model, OpenVinoRunner(compiled, output_dtypes(model), self.device, config))

    def compile_config(self) -> dict[str, Any]:
        """The properties this instance compiles a stage with (`Core.compile_model`'s config)."""
        config: dict[str, Any] = {"PERFORMANCE_HINT": "LATENCY"}
        if self.device == "CPU" or self.precision != "fp32":
            config["INFERENCE_PRECISION_HINT"] = HINTS[self.precision]  # fp32: exact, as ONNX Runtime computes
        if self.device == "CPU":
            if self.threads:
                config["INFERENCE_NUM_THREADS"] = self.threads
        return config


# A stage's precision -> the device capability that offers it, and the inference precision it compiles at (an
# int8 stage is a QDQ model: its quantized ops run in int8, the rest in f32).
CAPABILITIES = {"bf16": "BF16", "fp16": "FP16", "int8": "INT8"}
HINTS = {"fp32": "f32", "bf16": "bf16", "fp16": "f16", "int8": "f32"}
# oneDNN's ISA levels below AVX512_CORE_BF16, as `ONEDNN_MAX_CPU_ISA` names them
BELOW_BF16 = ("SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI")


def cpu_computes_bf16() -> bool:
    """Whether OpenVINO's CPU plugin may compute bf16 here: on x86-64, where the CPU has AVX-512 BF16 (CPUID)
    and `ONEDNN_MAX_CPU_ISA` does not hold oneDNN below it; elsewhere as the plugin reports."""
    if host_arch() != "x86_64":
        return True
    held = os.environ.get("ONEDNN_MAX_CPU_ISA", "").strip().upper() in BELOW_BF16
    return "avx512bf16" in cpu_features() and not held

