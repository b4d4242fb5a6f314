"""What the LiteRT converter can express, as a declarative capability table.

The converter (`ops`) refines these answers per node through `LiteRt.query`: static shapes, padding that
LiteRT can match, resize modes it computes the same way, integer arithmetic LiteRT has kernels for.
"""

from __future__ import annotations

from uhop_onnx.providers.capability import CapabilityTable, OpRule

FLOAT = frozenset({"float"})
INDEX = frozenset({"float", "int64", "int32"})  # float data with integer shapes, axes or indices
ANY = INDEX | {"bool"}  # every type the converter holds: data movement, masks and the tests that make them
BOOL = frozenset({"bool"})
FOUR_D = (4,)  # 2-D windows on NCHW tensors: LiteRT's convolutions and pools are 2-D, NHWC


def _rules() -> tuple[OpRule, ...]:
    # Integer tensors pass the table where shape arithmetic uses them: the converter folds nodes whose
    # inputs are all constants (Shape is one, shapes being static) and computes the rest with LiteRT's
    # integer kernels where there are some (no int64 DIV).
    arithmetic = [OpRule(op, dtypes=INDEX) for op in ["Add", "Sub", "Mul", "Div", "Max", "Min", "Range"]]
    # Boolean masks: comparisons of numbers, logic of booleans, selection, and the data movement of any type.
    logic = [OpRule(op, dtypes=ANY) for op in ["Equal", "Greater", "GreaterOrEqual", "Less", "LessOrEqual"]]
    logic += [OpRule(op, dtypes=BOOL) for op in ["And", "Or", "Xor", "Not"]]
    logic += [OpRule("Where", dtypes=ANY), OpRule("IsNaN", dtypes=FLOAT | BOOL), OpRule("Cast", dtypes=ANY)]
    movement = [OpRule(op, dtypes=ANY) for op in ["Identity", "Shape", "Concat", "Transpose", "Flatten", "Expand",
                                                   "Tile", "Gather", "GatherElements", "GatherND", "Reshape",
                                                   "Squeeze", "Unsqueeze", "Slice", "ConstantOfShape"]]
    movement.append(OpRule("Split", dtypes=INDEX))  # LiteRT's SPLIT_V has no boolean kernel
    unary = "Reciprocal Pow Relu Sigmoid Tanh HardSwish HardSigmoid LeakyRelu Elu PRelu Erf Sqrt Exp Abs Neg Log Floor Ceil Sin Cos"
    plain = [OpRule(op, dtypes=FLOAT) for op in unary.split()]
    plain += [OpRule(op, dtypes=FLOAT) for op in ["GlobalAveragePool", "GlobalMaxPool"]]
    return (
        *arithmetic,
        *logic,
        # Shapes, axes, bounds and indices exporters compute from Shape: the converter needs them constant once
        # folded, and inputs that only restate a static output shape are taken from it (`converter.prepared`).
        *movement,
        *plain,
        OpRule("Gelu", opsets=(20, 10_000), dtypes=FLOAT, attributes={"approximate": (b"none", b"tanh")},
               defaults={"approximate": b"none"}),
        OpRule("Dropout", dtypes=frozenset({"float", "bool"})),
        OpRule("Clip", dtypes=FLOAT, constant_inputs=(1, 2)),
        OpRule("Conv", dtypes=FLOAT, ranks=(3, 4), constant_inputs=(1, 2)),  # 1-D as 2-D of height 1
        OpRule("ConvTranspose", dtypes=FLOAT, ranks=FOUR_D, constant_inputs=(1, 2), attributes={"group": (1,)},
               defaults={"group": 1}),
        OpRule("MaxPool", dtypes=frozenset({"float", "int64"}), ranks=FOUR_D, attributes={"storage_order": (0,)},
               defaults={"storage_order": 0}),
        OpRule("AveragePool", dtypes=FLOAT, ranks=FOUR_D),
        OpRule("BatchNormalization", dtypes=FLOAT, constant_inputs=(1, 2, 3, 4), attributes={"training_mode": (0,)},
               defaults={"training_mode": 0}),
        OpRule("Gemm", dtypes=FLOAT, ranks=(2,)),
        OpRule("MatMul", dtypes=FLOAT, ranks=(2, 3, 4, 5)),
        OpRule("Softmax", dtypes=FLOAT),
        OpRule("LogSoftmax", dtypes=FLOAT),
        OpRule("LayerNormalization", dtypes=FLOAT, constant_inputs=(1, 2)),
        OpRule("InstanceNormalization", dtypes=FLOAT, constant_inputs=(1, 2)),
        *(OpRule(op, dtypes=INDEX, constant_inputs=(1,)) for op in ["ReduceMean", "ReduceSum", "ReduceMax", "ReduceMin"]),
        OpRule("CumSum", dtypes=INDEX, constant_inputs=(1,)),
        # Resize's roi, scales and sizes only fix the output shape, which the converter needs static.
        OpRule("Resize", opsets=(11, 10_000), dtypes=INDEX, ranks=FOUR_D,
               attributes={"mode": (b"nearest", b"linear"), "antialias": (0,)},
               defaults={"mode": b"nearest", "antialias": 0}),
        OpRule("Pad", dtypes=INDEX, constant_inputs=(1, 2, 3), attributes={"mode": (b"constant", b"reflect")},
               defaults={"mode": b"constant"}),
    )


LITERT_TABLE = CapabilityTable(provider="litert", rules=_rules(), dtypes=FLOAT, domains={"": (7, 28)})
