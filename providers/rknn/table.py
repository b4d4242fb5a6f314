"""What the RKNN NPU runs: Rockchip's ONNX operator list for RKNN-Toolkit2 (RKNNToolKit2_OP_Support, ONNX
opset 12..19; the 2.x lists agree on these rows), as data.

Ops the list marks "Not Supported" are simply absent. Its remarks become rule constraints where the
table can say them (modes, constant inputs) and `remarks` below where they need shapes (batch size 1).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..capability import CapabilityTable, OpRule, Support

if TYPE_CHECKING:
    from uhop_onnx.foundation.graph import Graph

OPS = """
Add And ArgMax ArgMin AveragePool BatchNormalization Cast Clip Concat Constant ConstantOfShape Conv ConvTranspose
Cos DepthToSpace DequantizeLinear Div Dropout Elu Equal Erf Exp Expand Flatten Floor Gather GatherElements Gemm
GlobalAveragePool GlobalMaxPool Greater GreaterOrEqual GRU HardSigmoid HardSwish Identity InstanceNormalization
LayerNormalization LeakyRelu Less LessOrEqual Log LogSoftmax LpNormalization LRN LSTM MatMul Max MaxPool
MaxRoiPool MaxUnpool MeanVarianceNormalization Min Mish Mod Mul Pad Pow PRelu QuantizeLinear ReduceMax ReduceMean
ReduceMin ReduceSum Relu Reshape ReverseSequence ScatterND Shape Sigmoid Sin Size Slice Softmax Softplus
SpaceToDepth Split Sqrt Squeeze Sub Tanh Tile Transpose Unsqueeze Where
""".split()

CONSTRAINED = (
    OpRule("Resize", attributes={"mode": (b"nearest", b"linear")}, defaults={"mode": b"nearest"}),  # nearest/bilinear
    OpRule("RoiAlign", attributes={"mode": (b"avg",)}, defaults={"mode": b"avg"}),  # pool type average
    OpRule("EyeLike", constant_inputs=(0,)),  # only constant input
    OpRule("If", constant_inputs=(0,)),  # only constant input
    # Not on the list, but rewritten by the toolkit into ops that are (its rule `convert_reciprocal_to_div`);
    # the simulator matches ONNX Runtime on it.
    OpRule("Reciprocal"),
)

# Ops the list restricts to batch size 1 (the first dimension of the first input).
BATCH_ONE = frozenset({"GRU", "LogSoftmax", "RoiAlign", "Slice", "Softmax", "Tile"})

RKNN_TABLE = CapabilityTable(
    provider="rknn",
    rules=tuple(OpRule(op) for op in OPS) + CONSTRAINED,
    dtypes=frozenset("float float16 int8 uint8 int16 int32 int64 bool".split()),
    domains={"": (12, 19)},
)

TARGETS = ("rk3588", "rk3576", "rk3568", "rk3566", "rk3562")  # target platforms, default first
DTYPES = ("fp16", "int8")
# fp16 NPU results against ONNX Runtime CPU fp32: the precision gate's rule, max|y - ref| <= 1e-2 (1 + max|ref|)
FP16_TOLERANCE = {"scaled": 1e-2}


def remarks(graph: Graph) -> dict[str, Support]:
    """The list's batch-size-1 remarks, for the nodes they reject."""
    verdicts = {}
    for node in graph.nodes:
        if node.op_type not in BATCH_ONE or not node.inputs:
            continue
        info = graph.tensors.get(node.inputs[0])
        batch = info.shape[0] if info is not None and info.shape else None
        if batch != 1:
            verdicts[node.name] = Support(False, f"{node.op_type} runs at batch size 1 only on the NPU; "
                                                 f"input {node.inputs[0]!r} has batch {batch!r}")
    return verdicts
