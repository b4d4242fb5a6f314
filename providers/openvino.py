"""OpenVINO: ONNX stages read by OpenVINO's ONNX frontend and compiled with `Core` on one device."""

from __future__ import annotations

import io
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from .base import Absent, Provider, Runner, output_dtypes
from .capability import CapabilityTable, OpRule, Support

if TYPE_CHECKING:
    import onnx

# ONNX ops OpenVINO's frontend converts (checked against the onnx backend node cases).
OPS = """
Abs Acos Acosh Add AffineGrid And ArgMax ArgMin Asin Asinh Atan Atanh Attention AveragePool BatchNormalization
BitShift BitwiseAnd BitwiseNot BitwiseOr BitwiseXor BlackmanWindow Cast CastLike Ceil Celu CenterCropPad Clip
Compress Concat Constant ConstantOfShape Conv ConvInteger ConvTranspose Cos Cosh CumSum DFT DepthToSpace
DequantizeLinear Div Dropout DynamicQuantizeLinear Einsum Elu Equal Erf Exp Expand EyeLike Flatten Floor GRU
Gather GatherElements GatherND Gelu Gemm GlobalAveragePool GlobalMaxPool Greater GreaterOrEqual GridSample
GroupNormalization HammingWindow HannWindow HardSigmoid HardSwish Hardmax Identity If InstanceNormalization
IsInf IsNaN LRN LSTM LayerNormalization LeakyRelu Less LessOrEqual Log LogSoftmax Loop LpNormalization LpPool
MatMul MatMulInteger Max MaxPool Mean MeanVarianceNormalization Min Mish Mod Mul Neg NegativeLogLikelihoodLoss
NonMaxSuppression NonZero Not OneHot Or PRelu Pad Pow QLinearConv QLinearMatMul QuantizeLinear RMSNormalization
RNN Range Reciprocal ReduceL1 ReduceL2 ReduceLogSum ReduceLogSumExp ReduceMax ReduceMean ReduceMin ReduceProd
ReduceSum ReduceSumSquare Relu Reshape Resize ReverseSequence RoiAlign RotaryEmbedding Round Scan Scatter
ScatterElements ScatterND Selu Shape Shrink Sigmoid Sign Sin Sinh Size Slice Softmax SoftmaxCrossEntropyLoss
Softplus Softsign SpaceToDepth Split Sqrt Squeeze Sub Sum Swish Tan Tanh ThresholdedRelu Tile TopK Transpose
Trilu Unique Unsqueeze Upsample Where Xor
""".split()

OPENVINO_TABLE = CapabilityTable(
    provider="openvino",
    rules=tuple(OpRule(op) for op in OPS),
    dtypes=frozenset("float float16 bfloat16 double int8 int16 int32 int64 uint8 uint16 uint32 uint64 bool".split()),
    domains={"": (7, 28)},
)


DEVICE_SETUP = {
    "GPU": "install Intel's GPU compute runtime (Debian/Ubuntu: apt install intel-opencl-icd) and check with clinfo",
    "NPU": "install Intel's NPU driver (linux-npu-driver) on a Core Ultra host",
}


def read_model(model_bytes: bytes):
    import openvino as ov

    return ov.convert_model(io.BytesIO(model_bytes))


class OpenVinoRunner(Runner):
    """An OpenVINO `CompiledModel` over one stage, with outputs in their declared ONNX dtypes."""

    def __init__(self, compiled, dtypes: Mapping[str, np.dtype]):
        self.compiled = compiled
        self.request = compiled.create_infer_request()
        self.outputs = [(port, _onnx_name(port, dtypes)) for port in compiled.outputs]
        self.dtypes = dict(dtypes)

    def run(self, feeds: Mapping[str, Any]) -> dict[str, Any]:
        results = self.request.infer(dict(feeds))
        out = {}
        for port, name in self.outputs:
            value = np.asarray(results[port])
            dtype = self.dtypes.get(name)
            out[name] = value.astype(dtype, copy=True) if dtype is not None else value.copy()
        return out


def _onnx_name(port, dtypes: Mapping[str, np.dtype]) -> str:
    names = port.get_names()
    return next((n for n in names if n in dtypes), next(iter(names)))


class OpenVino(Provider):
    """OpenVINO on one device (`{"device": "CPU"}` by default; `openvino:GPU`, `openvino:NPU`)."""

    id = "openvino"
    install = "pip install openvino"
    table = OPENVINO_TABLE
    option_names = frozenset({"device"})

    @property
    def device(self) -> str:
        return str(self.options.get("device", "CPU")).upper()

    @classmethod
    def known_options(cls) -> list[dict[str, Any]]:
        return [{"device": d} for d in ("CPU", "GPU", "NPU")]

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

    def config(self) -> dict[str, Any]:
        config: dict[str, Any] = {"PERFORMANCE_HINT": "LATENCY"}
        if self.device == "CPU":
            config["INFERENCE_PRECISION_HINT"] = "f32"  # exact fp32, as ONNX Runtime computes
            if self.threads:
                config["INFERENCE_NUM_THREADS"] = self.threads
        return config

    def query(self, model: onnx.ModelProto) -> dict[str, Support]:
        """Nodes OpenVINO's `query_model` does not place on the device, mapped back by output tensor names."""
        import openvino as ov

        converted = read_model(model.SerializeToString())
        placed = ov.Core().query_model(converted, self.device)
        unplaced = {name for op in converted.get_ops() if op.get_friendly_name() not in placed
                    for i in range(op.get_output_size()) for name in op.output(i).get_names()}
        return {
            n.name: Support(False, f"OpenVINO query_model does not place it on {self.device}", "runtime")
            for n in model.graph.node
            if unplaced.intersection(n.output)
        }

    def compile(self, model: onnx.ModelProto, *, exclusive: bool = True) -> Runner:
        import openvino as ov

        self.require()
        compiled = ov.Core().compile_model(read_model(model.SerializeToString()), self.device, self.config())
        return OpenVinoRunner(compiled, output_dtypes(model))
