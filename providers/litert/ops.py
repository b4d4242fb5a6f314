"""ONNX ops lowered to LiteRT builtins: one function per op family, registered in `LOWERINGS`.

A lowering reads its inputs through the `Lowering` (asking for the layout it needs), writes LiteRT
operators, and registers its outputs with the layout they have. It raises `Unsupported` with the reason
for any case it cannot express exactly.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import onnx

from .lowering import FLOAT, NHWC, Lowering, Node, Unsupported, Value, identity, inverse

LOWERINGS: dict[str, Callable[[Lowering, Node], None]] = {}

SAME, VALID = 0, 1  # tflite.Padding
RELU, RELU_N1_TO_1, RELU6 = 1, 2, 3  # tflite.ActivationFunctionType
FLOAT_MIN = float(np.finfo(np.float32).min)


def lowers(*ops: str):
    def register(fn):
        LOWERINGS.update(dict.fromkeys(ops, fn))
        return fn
    return register


def emit(cx: Lowering, code: str, inputs, shape, options: str | None = None, *, dtype=np.float32, **fields) -> int:
    """One operator writing a new intermediate tensor of `shape`; returns that tensor."""
    out = cx.temp(shape, dtype)
    cx.op(code, inputs, [out], options, **fields)
    return out


def physical(cx: Lowering, name: str) -> list[int]:
    shape, perm = cx.shape(name), cx.perm(name)
    return [shape[a] for a in perm]


def scalar(cx: Lowering, value: float) -> int:
    return cx.constant(np.float32(value))


# ---- elementwise
UNARY = {"Relu": "RELU", "Sigmoid": "LOGISTIC", "Tanh": "TANH", "HardSwish": "HARD_SWISH", "Sqrt": "SQRT",
         "Exp": "EXP", "Abs": "ABS", "Neg": "NEG", "Log": "LOG", "Floor": "FLOOR", "Ceil": "CEIL", "Sin": "SIN",
         "Cos": "COS", "Elu": "ELU"}


NONNEGATIVE = frozenset({"Relu", "Sigmoid", "Exp", "Abs", "Sqrt"})


@lowers(*UNARY)
def unary(cx: Lowering, node: Node) -> None:
    x, y = node.inputs[0], node.outputs[0]
    if node.op in NONNEGATIVE:
        cx.nonnegative.add(y)
    if node.op == "Relu" and cx.fuse(x, RELU):
        cx.alias(y, x)
        return
    if node.op == "Elu" and node.attrs.get("alpha", 1.0) != 1.0:
        raise Unsupported(f"alpha={node.attrs['alpha']}; LiteRT's ELU has alpha 1")
    cx.op(UNARY[node.op], [cx.read(x)], [cx.write(y, cx.perm(x))])


@lowers("Reciprocal")
def reciprocal(cx: Lowering, node: Node) -> None:
    x, y = node.inputs[0], node.outputs[0]
    cx.op("DIV", [scalar(cx, 1.0), cx.read(x)], [cx.write(y, cx.perm(x))], "DivOptions")


@lowers("HardSigmoid")
def hard_sigmoid(cx: Lowering, node: Node) -> None:
    """clamp(alpha x + beta, 0, 1)."""
    x, y = node.inputs[0], node.outputs[0]
    shape = physical(cx, x)
    scaled = emit(cx, "MUL", [cx.read(x), scalar(cx, node.attrs.get("alpha", 0.2))], shape)
    shifted = emit(cx, "ADD", [scaled, scalar(cx, node.attrs.get("beta", 0.5))], shape)
    cx.op("RELU_0_TO_1", [shifted], [cx.write(y, cx.perm(x))])


@lowers("PRelu")
def prelu(cx: Lowering, node: Node) -> None:
    x, slope, y = node.inputs[0], node.inputs[1], node.outputs[0]
    rank, perm = cx.rank(y), cx.perm(x)
    cx.op("PRELU", [cx.read(x), cx.broadcast(slope, rank, perm)], [cx.write(y, perm)])


@lowers("Identity", "Dropout")
def identity_op(cx: Lowering, node: Node) -> None:
    if any(cx.readers[o] for o in node.outputs[1:] if o):
        raise Unsupported("the Dropout mask output is read")
    cx.alias(node.outputs[0], node.inputs[0])


@lowers("LeakyRelu")
def leaky_relu(cx: Lowering, node: Node) -> None:
    x, y = node.inputs[0], node.outputs[0]
    cx.op("LEAKY_RELU", [cx.read(x)], [cx.write(y, cx.perm(x))], "LeakyReluOptions",
          Alpha=float(node.attrs.get("alpha", 0.01)))


@lowers("Gelu")
def gelu(cx: Lowering, node: Node) -> None:
    x, y = node.inputs[0], node.outputs[0]
    approximate = node.attrs.get("approximate", "none")
    if approximate not in ("none", "tanh"):
        raise Unsupported(f"approximate={approximate!r}; supported: 'none', 'tanh'")
    cx.op("GELU", [cx.read(x)], [cx.write(y, cx.perm(x))], "GeluOptions", Approximate=approximate == "tanh")


# Abramowitz & Stegun 7.1.26: |error| <= 1.5e-7
ERF_P = 0.3275911
ERF_A = (0.254829592, -0.284496736, 1.421413741, -1.453152027, 1.061405429)


@lowers("Erf")
def erf(cx: Lowering, node: Node) -> None:
    """erf(x) = sign(x) (1 - t P(t) exp(-x^2)), t = 1 / (1 + p |x|): LiteRT has no ERF builtin."""
    x, y = node.inputs[0], node.outputs[0]
    shape, xi = physical(cx, x), cx.read(x)
    ax = emit(cx, "ABS", [xi], shape)
    t = emit(cx, "DIV", [scalar(cx, 1.0), emit(cx, "ADD", [emit(cx, "MUL", [ax, scalar(cx, ERF_P)], shape),
                                                            scalar(cx, 1.0)], shape)], shape)
    poly = emit(cx, "MUL", [t, scalar(cx, ERF_A[-1])], shape)
    for a in reversed(ERF_A[:-1]):
        poly = emit(cx, "MUL", [emit(cx, "ADD", [poly, scalar(cx, a)], shape), t], shape)
    gauss = emit(cx, "EXP", [emit(cx, "MUL", [emit(cx, "MUL", [xi, xi], shape), scalar(cx, -1.0)], shape)], shape)
    one_minus = emit(cx, "SUB", [scalar(cx, 1.0), emit(cx, "MUL", [poly, gauss], shape)], shape)
    cx.op("MUL", [emit(cx, "SIGN", [xi], shape), one_minus], [cx.write(y, cx.perm(x))])


@lowers("Clip")
def clip(cx: Lowering, node: Node) -> None:
    x, y = node.inputs[0], node.outputs[0]
    limit = float(np.finfo(np.float32).max)  # an absent bound, as ONNX Runtime takes it: an infinity is clipped
    if node.opset < 11:
        lo, hi = node.attrs.get("min", -limit), node.attrs.get("max", limit)
    else:
        lo = float(cx.const(node.input(1), "Clip min").reshape(())) if node.input(1) else -limit
        hi = float(cx.const(node.input(2), "Clip max").reshape(())) if node.input(2) else limit
    named = {(0.0, 6.0): ("RELU6", RELU6), (-1.0, 1.0): ("RELU_N1_TO_1", RELU_N1_TO_1)}
    if lo >= 0.0:
        cx.nonnegative.add(y)
    if (lo, hi) in named:
        code, activation = named[(lo, hi)]
        if cx.fuse(x, activation):
            cx.alias(y, x)
        else:
            cx.op(code, [cx.read(x)], [cx.write(y, cx.perm(x))])
        return
    if lo == -math.inf and hi == math.inf:
        cx.alias(y, x)
        return
    index = cx.read(x)
    if lo > -math.inf and hi < math.inf:
        index = emit(cx, "MAXIMUM", [index, scalar(cx, lo)], physical(cx, x))
    code, bound = ("MINIMUM", hi) if hi < math.inf else ("MAXIMUM", lo)
    cx.op(code, [index, scalar(cx, bound)], [cx.write(y, cx.perm(x))])


BINARY = {"Add": "ADD", "Sub": "SUB", "Mul": "MUL", "Div": "DIV", "Pow": "POW", "Max": "MAXIMUM", "Min": "MINIMUM"}
FUSABLE = {"ADD": "AddOptions", "SUB": "SubOptions", "MUL": "MulOptions", "DIV": "DivOptions"}


def broadcasting(cx: Lowering, node: Node, code: str, options: str | None = None, nonfloat: bool = False):
    """`code` over the node's inputs broadcast to its output; the result takes the layout of a full-rank
    variable operand."""
    inputs, y = node.inputs, node.outputs[0]
    rank = cx.rank(y)
    perm = next((cx.perm(n) for n in inputs if n not in cx.consts and cx.rank(n) == rank), identity(rank))
    return cx.op(code, [cx.broadcast(n, rank, perm, nonfloat) for n in inputs], [cx.write(y, perm, nonfloat)],
                 options)


@lowers(*BINARY)
def binary(cx: Lowering, node: Node) -> None:
    """Broadcasting arithmetic (x ** 1, 2 and 0.5 as themselves, products, square roots)."""
    if len(node.inputs) != 2:
        raise Unsupported(f"{node.op} of {len(node.inputs)} inputs; LiteRT's takes 2")
    a, b = node.inputs
    y = node.outputs[0]
    power = node.op == "Pow" and b in cx.consts and cx.consts[b].size == 1 and cx.shape(a) == cx.shape(y)
    exponent = float(cx.consts[b].reshape(())) if power else None
    if exponent in (1.0, 2.0, 0.5):
        if exponent == 1.0:
            cx.alias(y, a)
        else:
            inputs = [cx.read(a)] * (2 if exponent == 2.0 else 1)
            cx.op("MUL" if exponent == 2.0 else "SQRT", inputs, [cx.write(y, cx.perm(a))])
        return
    if node.op == "Add" and (fold_bias(cx, a, b, y) or fold_bias(cx, b, a, y)):
        return
    integer = cx.integer(y)
    if integer and node.op in ("Div", "Pow"):
        raise Unsupported(f"{node.op} of integer tensors; LiteRT raises only float32 to powers, has no int64 DIV, "
                          "and its int32 division by zero is undefined (ONNX Runtime raises)")
    code = BINARY[node.op]
    op = broadcasting(cx, node, code, FUSABLE.get(code), integer)
    if code in FUSABLE and not integer:
        cx.fusable[y] = op


# ---- comparisons, logic and selection (boolean tensors)
COMPARISONS = {"Equal": "EQUAL", "Greater": "GREATER", "GreaterOrEqual": "GREATER_EQUAL", "Less": "LESS",
               "LessOrEqual": "LESS_EQUAL", "And": "LOGICAL_AND", "Or": "LOGICAL_OR", "Xor": "NOT_EQUAL"}


@lowers(*COMPARISONS)
def compare(cx: Lowering, node: Node) -> None:
    """Broadcasting comparisons of numbers (Equal of booleans too) and logic of booleans (Xor: not equal)."""
    broadcasting(cx, node, COMPARISONS[node.op], nonfloat=True)


@lowers("Where")
def where(cx: Lowering, node: Node) -> None:
    broadcasting(cx, node, "SELECT_V2", nonfloat=True)


@lowers("Not")
def logical_not(cx: Lowering, node: Node) -> None:
    x, y = node.inputs[0], node.outputs[0]
    cx.op("LOGICAL_NOT", [cx.read(x, nonfloat=True)], [cx.write(y, cx.perm(x), nonfloat=True)])


@lowers("IsNaN")
def is_nan(cx: Lowering, node: Node) -> None:
    """x != x: true exactly for NaN."""
    x, y = node.inputs[0], node.outputs[0]
    index = cx.read(x)
    cx.op("NOT_EQUAL", [index, index], [cx.write(y, cx.perm(x), nonfloat=True)])


def fold_bias(cx: Lowering, x: str, c: str, y: str) -> bool:
    """y = x + c, with x from a bias-less FULLY_CONNECTED read by nothing else and c a constant along the
    last axis: c becomes that op's bias."""
    op, bias = cx.fusable.get(x), cx.consts.get(c)
    if op is None or op.name != "FULLY_CONNECTED" or op.inputs[2] != -1 or bias is None or cx.readers[x] != 1:
        return False
    if cx.shape(x) != cx.shape(y) or bias.shape[-1:] != (cx.shape(y)[-1],) or bias.size != cx.shape(y)[-1]:
        return False
    op.inputs[2] = cx.constant(bias.reshape(-1).astype(np.float32), c)
    cx.alias(y, x)
    cx.writer.tensors[op.outputs[0]].name = y  # it holds y now (int8 takes y's calibration range)
    cx.fusable[y] = op
    return True


# ---- convolution and pooling (NHWC)
def onnx_pads(node: Node, sizes, kernel, strides, dilations, out_sizes) -> tuple[list[int], list[int]]:
    """(begin, end) padding of each spatial axis, trimmed or extended to exactly what the windows use."""
    auto = node.attrs.get("auto_pad", "NOTSET")
    spans = [(k - 1) * d + 1 for k, d in zip(kernel, dilations)]
    if auto in ("SAME_UPPER", "SAME_LOWER"):
        totals = [max((o - 1) * s + span - i, 0) for i, o, s, span in zip(sizes, out_sizes, strides, spans)]
        begin = [t // 2 if auto == "SAME_UPPER" else t - t // 2 for t in totals]
    elif auto == "VALID":
        begin = [0] * len(sizes)
    else:
        begin = list(node.attrs.get("pads", [0] * 2 * len(sizes)))[: len(sizes)]
    end = [max((o - 1) * s + span - i - b, 0) for i, o, s, span, b in zip(sizes, out_sizes, strides, spans, begin)]
    return begin, end


def padded_input(cx: Lowering, node: Node, x: str, y: str, kernel, strides, dilations,
                 pad_value: float | None, same_ok: bool = True) -> tuple[int, int]:
    """(tflite padding, input tensor in NHWC): SAME or VALID when they match ONNX's pads, else an explicit
    PAD with `pad_value` (None: this op cannot be padded explicitly) and VALID."""
    sizes, out_sizes = cx.shape(x)[2:], cx.shape(y)[2:]
    begin, end = onnx_pads(node, sizes, kernel, strides, dilations, out_sizes)
    index = cx.read(x, NHWC)
    if not any(begin) and not any(end):
        return VALID, index
    spans = [(k - 1) * d + 1 for k, d in zip(kernel, dilations)]
    same = [max((-(-i // s) - 1) * s + span - i, 0) for i, s, span in zip(sizes, strides, spans)]
    if same_ok and list(out_sizes) == [-(-i // s) for i, s in zip(sizes, strides)] and \
            begin == [t // 2 for t in same] and end == [t - t // 2 for t in same]:
        return SAME, index
    if pad_value is None:
        raise Unsupported(f"pads {begin + end} differ from SAME and cannot be padded explicitly here")
    n, c = cx.shape(x)[:2]
    shape = [n, *(i + b + e for i, b, e in zip(sizes, begin, end)), c]
    paddings = cx.int32([[0, 0], *zip(begin, end), [0, 0]])
    if pad_value == 0.0:
        return VALID, emit(cx, "PAD", [index, paddings], shape)
    return VALID, emit(cx, "PADV2", [index, paddings, scalar(cx, pad_value)], shape)


def spatial(node: Node, x_rank: int, kernel) -> tuple[list[int], list[int]]:
    if x_rank != 4 or len(kernel) != 2:
        raise Unsupported(f"{len(kernel)}-D window on a rank-{x_rank} input; LiteRT converts 2-D (rank 4)")
    return list(node.attrs.get("strides", [1, 1])), list(node.attrs.get("dilations", [1, 1]))


@lowers("Conv")
def conv(cx: Lowering, node: Node) -> None:
    x, w, y = node.inputs[0], node.inputs[1], node.outputs[0]
    if cx.rank(x) == 3:
        return conv_1d(cx, node)
    weight = cx.const(w, "Conv weight")
    strides, dilations = spatial(node, cx.rank(x), weight.shape[2:])
    channels, group, out_channels = cx.shape(x)[1], int(node.attrs.get("group", 1)), weight.shape[0]
    bias = cx.const(node.input(2), "Conv bias") if node.input(2) else np.zeros(out_channels, np.float32)
    padding, index = padded_input(cx, node, x, y, weight.shape[2:], strides, dilations, pad_value=0.0)
    fields = {"Padding": padding, "StrideH": strides[0], "StrideW": strides[1],
              "DilationHFactor": dilations[0], "DilationWFactor": dilations[1]}
    if group == 1 or group != channels:
        code, options, kernel = "CONV_2D", "Conv2DOptions", weight.transpose(0, 2, 3, 1)  # OHWI
    else:
        code, options, kernel = "DEPTHWISE_CONV_2D", "DepthwiseConv2DOptions", weight.transpose(1, 2, 3, 0)  # 1HWO
        fields["DepthMultiplier"] = out_channels // channels
    inputs = [index, cx.weight(kernel, w), cx.constant(bias.astype(np.float32), node.input(2) or "bias")]
    cx.fusable[y] = cx.op(code, inputs, [cx.write(y, NHWC)], options, **fields)


def conv_1d(cx: Lowering, node: Node) -> None:
    """A 1-D Conv as a 2-D one of height 1: the input (N, C, L) held as (N, L, C), which is NHWC of height 1
    (as a 1-D Conv's output is held, so that chained ones need no TRANSPOSE), the kernel and attributes with
    a unit first axis."""
    x, w, y = node.inputs[0], node.inputs[1], node.outputs[0]
    (n, c, length), (_, out_channels, out_length) = cx.shape(x), cx.shape(y)
    x2, w2, y2 = f"{x}/2d", f"{w}/2d", f"{y}/2d"
    cx.types[x2], cx.types[y2] = (FLOAT, (n, c, 1, length)), (FLOAT, (n, out_channels, 1, out_length))
    held = cx.read(x, (0, 2, 1))
    cx.values[x2] = Value(emit(cx, "RESHAPE", [held, cx.int32([n, 1, length, c])], [n, 1, length, c]), NHWC)
    cx.consts[w2] = cx.const(w, "Conv weight")[:, :, None, :]
    given = node.attrs
    begin, end = given.get("pads", [0, 0])
    attrs = {"strides": [1, *given.get("strides", [1])], "dilations": [1, *given.get("dilations", [1])],
             "pads": [0, begin, 0, end], "group": given.get("group", 1), "auto_pad": given.get("auto_pad", "NOTSET")}
    conv(cx, Node(node.name, "Conv", (x2, w2, *node.inputs[2:]), (y2,), attrs, node.opset))
    out = cx.write(y, (0, 2, 1))
    cx.op("RESHAPE", [cx.read(y2, NHWC), cx.int32(cx.writer.tensors[out].shape)], [out])


@lowers("ConvTranspose")
def conv_transpose(cx: Lowering, node: Node) -> None:
    """TRANSPOSE_CONV with VALID padding gives the full output; ONNX's pads are cut off by SLICE."""
    x, w, y = node.inputs[0], node.inputs[1], node.outputs[0]
    weight = cx.const(w, "ConvTranspose weight")  # (C_in, C_out, kH, kW)
    strides, dilations = spatial(node, cx.rank(x), weight.shape[2:])
    if dilations != [1, 1] or int(node.attrs.get("group", 1)) != 1:
        raise Unsupported(f"dilations={dilations}, group={node.attrs.get('group', 1)}; LiteRT needs 1 and 1")
    if node.attrs.get("auto_pad", "NOTSET") not in ("NOTSET", "VALID") or "output_shape" in node.attrs:
        raise Unsupported("auto_pad SAME or output_shape; give explicit pads")
    n, _, h, wd = cx.shape(x)
    out_channels, kh, kw = weight.shape[1:]
    full = [(h - 1) * strides[0] + kh, (wd - 1) * strides[1] + kw]
    begin = list(node.attrs.get("pads", [0, 0, 0, 0]))[:2]
    out = cx.shape(y)[2:]
    if any(b + o > f for b, o, f in zip(begin, out, full)):
        raise Unsupported(f"output_padding beyond the end pads (output {list(out)}, full {full}, pads {begin})")
    bias = cx.const(node.input(2), "ConvTranspose bias") if node.input(2) else np.zeros(out_channels, np.float32)
    inputs = [cx.int32([n, *full, out_channels]), cx.weight(weight.transpose(1, 2, 3, 0), w), cx.read(x, NHWC),
              cx.constant(bias.astype(np.float32), "bias")]
    if full == list(out):
        cx.op("TRANSPOSE_CONV", inputs, [cx.write(y, NHWC)], "TransposeConvOptions", Padding=VALID,
              StrideH=strides[0], StrideW=strides[1])
        return
    whole = emit(cx, "TRANSPOSE_CONV", inputs, [n, *full, out_channels], "TransposeConvOptions", Padding=VALID,
                 StrideH=strides[0], StrideW=strides[1])
    cx.op("SLICE", [whole, cx.int32([0, *begin, 0]), cx.int32([n, *out, out_channels])], [cx.write(y, NHWC)])


@lowers("MaxPool", "AveragePool")
def pool(cx: Lowering, node: Node) -> None:
    x, y = node.inputs[0], node.outputs[0]
    if any(cx.readers[o] for o in node.outputs[1:] if o):
        raise Unsupported("the MaxPool Indices output is read")
    kernel = list(node.attrs["kernel_shape"])
    strides, dilations = spatial(node, cx.rank(x), kernel)
    if dilations != [1, 1]:
        raise Unsupported(f"dilations={dilations}; LiteRT pools need 1")
    if node.op == "MaxPool":  # a window always holds an element, so zero pads are exact on values >= 0
        code, pad_value, same_ok = "MAX_POOL_2D", 0.0 if x in cx.nonnegative else FLOAT_MIN, True
        if x in cx.nonnegative:
            cx.nonnegative.add(y)
    else:
        include = bool(node.attrs.get("count_include_pad", 0))
        code, pad_value, same_ok = "AVERAGE_POOL_2D", 0.0 if include else None, not include
    padding, index = padded_input(cx, node, x, y, kernel, strides, dilations, pad_value, same_ok)
    cx.op(code, [index], [cx.write(y, NHWC)], "Pool2DOptions", Padding=padding, StrideH=strides[0],
          StrideW=strides[1], FilterHeight=kernel[0], FilterWidth=kernel[1])


REDUCERS = {"GlobalAveragePool": "MEAN", "GlobalMaxPool": "REDUCE_MAX", "ReduceMean": "MEAN", "ReduceSum": "SUM",
            "ReduceMax": "REDUCE_MAX", "ReduceMin": "REDUCE_MIN"}


@lowers(*REDUCERS)
def reduce(cx: Lowering, node: Node) -> None:
    """Reductions over any axes, in whatever layout the input has."""
    x, y = node.inputs[0], node.outputs[0]
    rank = cx.rank(x)
    keep = bool(node.attrs.get("keepdims", 1))
    if node.op.startswith("Global"):
        axes, keep = list(range(2, rank)), True
    elif "axes" in node.attrs:
        axes = list(node.attrs["axes"])
    else:
        axes = [int(a) for a in cx.const(node.input(1), "axes").reshape(-1)] if node.input(1) else []
    if not axes:
        if node.attrs.get("noop_with_empty_axes", 0):
            cx.alias(y, x)
            return
        axes = list(range(rank))
    axes = sorted({a % rank for a in axes})
    perm = cx.perm(x)
    kept = [a for a in perm if a not in axes]
    out_perm = perm if keep else tuple(sorted(kept).index(a) for a in kept)
    cx.op(REDUCERS[node.op], [cx.read(x), cx.int32(sorted(inverse(perm)[a] for a in axes))],
          [cx.write(y, out_perm)], "ReducerOptions", KeepDims=keep)


@lowers("CumSum")
def cumsum(cx: Lowering, node: Node) -> None:
    """CUMSUM along the constant axis, in whatever layout the input has (float32, int32, int64)."""
    x, y = node.inputs[0], node.outputs[0]
    rank, perm = cx.rank(x), cx.perm(x)
    axis = int(cx.const(node.inputs[1], "CumSum axis").reshape(())) % rank
    cx.op("CUMSUM", [cx.read(x, nonfloat=True), cx.constant(np.int32(inverse(perm)[axis]))],
          [cx.write(y, perm, nonfloat=True)], "CumsumOptions", Exclusive=bool(node.attrs.get("exclusive", 0)),
          Reverse=bool(node.attrs.get("reverse", 0)))


@lowers("BatchNormalization")
def batch_norm(cx: Lowering, node: Node) -> None:
    """Inference batch norm as one MUL and one ADD by per-channel constants."""
    if node.attrs.get("training_mode", 0) or any(cx.readers[o] for o in node.outputs[1:] if o):
        raise Unsupported("training mode (running statistics outputs)")
    x, y = node.inputs[0], node.outputs[0]
    scale, bias, mean, var = (cx.const(n, "BatchNormalization statistics").astype(np.float64) for n in node.inputs[1:5])
    factor = scale / np.sqrt(var + node.attrs.get("epsilon", 1e-5))
    rank, perm = cx.rank(x), cx.perm(x)
    channel = (1, -1) + (1,) * (rank - 2)
    def per_channel(v): return cx.constant(v.astype(np.float32).reshape(channel).transpose(perm))
    scaled = emit(cx, "MUL", [cx.read(x), per_channel(factor)], physical(cx, x), "MulOptions")
    cx.fusable[y] = cx.op("ADD", [scaled, per_channel(bias - mean * factor)], [cx.write(y, perm)], "AddOptions")


# ---- matrix products
@lowers("Gemm")
def gemm(cx: Lowering, node: Node) -> None:
    """FULLY_CONNECTED for a constant B (alpha, and beta * C when C is a row vector, folded in), else
    BATCH_MATMUL; any other C is added after."""
    a, b, y, c = node.inputs[0], node.inputs[1], node.outputs[0], node.input(2)
    alpha, beta = float(node.attrs.get("alpha", 1.0)), float(node.attrs.get("beta", 1.0))
    m, n = cx.shape(y)
    lhs = cx.read(a, (1, 0) if node.attrs.get("transA", 0) else (0, 1))
    trans_b = node.attrs.get("transB", 0)
    bias = cx.consts.get(c) if c else np.zeros(n, np.float32)
    row = bias is not None and bias.size in (1, n) and (bias.ndim < 2 or bias.shape[0] == 1)
    if b in cx.consts:
        weight = (cx.consts[b] if trans_b else cx.consts[b].T) * alpha  # (N, K)
        folded = np.broadcast_to(bias.reshape(-1) * beta, (n,)) if row else np.zeros(n)
        product = cx.write(y) if row else cx.temp([m, n])
        op = cx.op("FULLY_CONNECTED", [lhs, cx.weight(weight, b), cx.constant(folded.astype(np.float32))], [product],
                   "FullyConnectedOptions")
        if row:
            cx.fusable[y] = op
            return
    else:
        if alpha != 1.0:
            raise Unsupported(f"alpha={alpha} with a variable B")
        rhs = cx.read(b, (1, 0) if trans_b else (0, 1))
        product = cx.write(y) if not c else cx.temp([m, n])
        cx.op("BATCH_MATMUL", [lhs, rhs], [product], "BatchMatMulOptions")
        if not c:
            return
    if c not in cx.consts and beta != 1.0:
        raise Unsupported(f"beta={beta} with a variable C")
    addend = cx.constant((bias * beta).astype(np.float32)) if c in cx.consts else cx.broadcast(c, 2, (0, 1))
    cx.fusable[y] = cx.op("ADD", [product, addend], [cx.write(y)], "AddOptions")


@lowers("MatMul")
def matmul(cx: Lowering, node: Node) -> None:
    """FULLY_CONNECTED for a constant 2-D right operand, else BATCH_MATMUL (a transposed right operand
    is read as it is held, with adj_y)."""
    a, b, y = node.inputs[0], node.inputs[1], node.outputs[0]
    rank_a, rank_b = cx.rank(a), cx.rank(b)
    if rank_a < 2 or rank_b < 2:
        raise Unsupported(f"MatMul of ranks {rank_a} and {rank_b}; LiteRT needs rank >= 2 operands")
    lhs = cx.read(a, identity(rank_a))
    if b in cx.consts and rank_b == 2:
        cx.fusable[y] = cx.op("FULLY_CONNECTED", [lhs, cx.weight(cx.consts[b].T, b), -1], [cx.write(y)],
                              "FullyConnectedOptions", KeepNumDims=True)
        return
    swapped = identity(rank_b)[:-2] + (rank_b - 1, rank_b - 2)
    adjoint = b not in cx.consts and cx.perm(b) == swapped
    rhs = cx.read(b) if adjoint else cx.read(b, identity(rank_b))
    cx.op("BATCH_MATMUL", [lhs, rhs], [cx.write(y)], "BatchMatMulOptions", AdjY=adjoint)


# ---- shapes and data movement
@lowers("Shape")
def shape_op(cx: Lowering, node: Node) -> None:
    """A constant: every shape in a LiteRT stage is static."""
    shape = cx.shape(node.inputs[0])
    start, end = node.attrs.get("start", 0), node.attrs.get("end", len(shape))
    cx.consts[node.outputs[0]] = np.array(shape[start:end], np.int64)


@lowers("Cast")
def cast(cx: Lowering, node: Node) -> None:
    """Between float32, int32, int64 and bool by CAST (non-zero, NaN too, is true; true is 1); a cast to its
    own type is the value itself. Casts of constants are folded."""
    x, y, to = node.inputs[0], node.outputs[0], node.attrs["to"]
    source = cx.read(x, nonfloat=True)
    have, want = cx.writer.tensors[source].dtype, onnx.helper.tensor_dtype_to_np_dtype(to)
    if want not in (np.float32, np.int32, np.int64, np.bool_) or (have == np.float32 and want.kind == "i"):
        raise Unsupported(f"Cast of a variable {have} tensor to {want}; LiteRT stages cast between float32, int32, "
                          "int64 and bool, except float32 to integers (out of range, C++ leaves the result "
                          "undefined)")
    if have == want:
        cx.alias(y, x)
    else:
        cx.op("CAST", [source], [cx.write(y, cx.perm(x), nonfloat=True)])


@lowers("ConstantOfShape", "Range")
def shape_computation(cx: Lowering, node: Node) -> None:
    raise Unsupported(f"{node.op} of a variable input (it is folded when its inputs are constants)")


@lowers("Reshape", "Flatten", "Squeeze", "Unsqueeze")
def reshape(cx: Lowering, node: Node) -> None:
    x, y = node.inputs[0], node.outputs[0]
    if node.input(1):
        cx.const(node.inputs[1], f"{node.op} shape or axes")
    source = cx.read(x, identity(cx.rank(x)), nonfloat=True)
    cx.op("RESHAPE", [source, cx.int32(cx.shape(y))], [cx.write(y, nonfloat=True)])


@lowers("Transpose")
def transpose(cx: Lowering, node: Node) -> None:
    """Free: the output is the input's tensor, held in a different permutation of the ONNX value."""
    x, y = node.inputs[0], node.outputs[0]
    rank = cx.rank(x)
    order = tuple(node.attrs.get("perm", range(rank - 1, -1, -1)))
    if x in cx.consts:
        cx.consts[y] = cx.consts[x].transpose(order)
        return
    cx.shape(y)
    back = inverse(order)
    cx.values[y] = Value(cx.value(x).index, tuple(back[a] for a in cx.perm(x)))


@lowers("Expand")
def expand(cx: Lowering, node: Node) -> None:
    x, y = node.inputs[0], node.outputs[0]
    cx.const(node.inputs[1], "Expand shape")
    rank = cx.rank(y)
    perm = cx.perm(x) if cx.rank(x) == rank and x not in cx.consts else identity(rank)
    cx.op("BROADCAST_TO", [cx.broadcast(x, rank, perm, nonfloat=True), cx.int32([cx.shape(y)[a] for a in perm])],
          [cx.write(y, perm, nonfloat=True)])


@lowers("Tile")
def tile(cx: Lowering, node: Node) -> None:
    x, y = node.inputs[0], node.outputs[0]
    repeats, perm = cx.const(node.inputs[1], "Tile repeats").reshape(-1), cx.perm(x)
    cx.op("TILE", [cx.read(x, nonfloat=True), cx.int32([repeats[a] for a in perm])], [cx.write(y, perm, nonfloat=True)])


@lowers("Concat")
def concat(cx: Lowering, node: Node) -> None:
    y = node.outputs[0]
    rank = cx.rank(y)
    perm = next((cx.perm(n) for n in node.inputs if n not in cx.consts), identity(rank))
    axis = inverse(perm)[node.attrs["axis"] % rank]
    cx.op("CONCATENATION", [cx.read(n, perm, nonfloat=True) for n in node.inputs], [cx.write(y, perm, nonfloat=True)],
          "ConcatenationOptions", Axis=axis)


@lowers("Split")
def split(cx: Lowering, node: Node) -> None:
    x = node.inputs[0]
    rank, perm = cx.rank(x), cx.perm(x)
    axis = node.attrs.get("axis", 0) % rank
    sizes = [cx.shape(o)[axis] for o in node.outputs]
    if cx.types.get(x, (0, None))[0] == onnx.TensorProto.BOOL:
        raise Unsupported(f"tensor {x!r} is bool; LiteRT's SPLIT_V has no boolean kernel")
    cx.op("SPLIT_V", [cx.read(x, nonfloat=True), cx.int32(sizes), cx.constant(np.int32(inverse(perm)[axis]))],
          [cx.write(o, perm, nonfloat=True) for o in node.outputs], "SplitVOptions", NumSplits=len(sizes))


@lowers("Slice")
def slice_op(cx: Lowering, node: Node) -> None:
    x, y = node.inputs[0], node.outputs[0]
    shape, perm = cx.shape(x), cx.perm(x)
    if node.opset < 10:
        starts, ends = node.attrs["starts"], node.attrs["ends"]
        axes, steps = node.attrs.get("axes", range(len(starts))), [1] * len(starts)
    else:
        starts, ends = (cx.const(node.inputs[i], "Slice bound").reshape(-1).tolist() for i in (1, 2))
        axes = cx.const(node.input(3), "Slice axes").reshape(-1).tolist() if node.input(3) else range(len(starts))
        steps = cx.const(node.input(4), "Slice steps").reshape(-1).tolist() if node.input(4) else [1] * len(starts)
    begin, end, stride, open_end = [0] * len(shape), list(shape), [1] * len(shape), set()
    for start, stop, axis, step in zip(starts, ends, axes, steps):
        axis %= len(shape)
        taken = range(*slice(int(start), int(stop), int(step)).indices(shape[axis]))
        if not taken:
            raise Unsupported(f"empty slice on axis {axis}")
        begin[axis], stride[axis] = taken.start, int(step)
        end[axis] = taken[-1] + (1 if step > 0 else -1)
        if end[axis] < 0:
            open_end.add(axis)
    cx.op("STRIDED_SLICE", [cx.read(x, nonfloat=True), *(cx.int32([v[a] for a in perm]) for v in (begin, end, stride))],
          [cx.write(y, perm, nonfloat=True)], "StridedSliceOptions",
          EndMask=sum(1 << i for i, a in enumerate(perm) if a in open_end))


@lowers("Gather")
def gather(cx: Lowering, node: Node) -> None:
    """GATHER on data in ONNX layout; constant indices are checked and made non-negative here, variable
    ones by FLOOR_MOD."""
    data, indices, y = node.inputs[0], node.inputs[1], node.outputs[0]
    shape = cx.shape(data)
    axis = node.attrs.get("axis", 0) % len(shape)
    if indices in cx.consts:
        positions = cx.consts[indices].astype(np.int64)
        if ((positions < -shape[axis]) | (positions >= shape[axis])).any():
            raise Unsupported(f"Gather indices outside -{shape[axis]}..{shape[axis] - 1}")
        positions = np.where(positions < 0, positions + shape[axis], positions).astype(np.int32)
        index = cx.constant(positions.reshape(-1) if positions.ndim == 0 else positions, indices)
        scalar_index = positions.ndim == 0
    else:
        index = cx.read(indices, identity(cx.rank(indices)), nonfloat=True)
        dtype = cx.writer.tensors[index].dtype
        index = emit(cx, "FLOOR_MOD", [index, cx.constant(np.array(shape[axis], dtype))], cx.shape(indices),
                     dtype=dtype)
        scalar_index = not cx.shape(indices)
    gather_at(cx, cx.read(data, identity(len(shape)), nonfloat=True), shape, axis, index, scalar_index, y)


def gather_at(cx: Lowering, source: int, shape, axis: int, index: int, scalar_index: bool, y: str) -> None:
    """`y` = GATHER of the LiteRT tensor `source` (of `shape`, ONNX layout) at `index` along `axis`."""
    inputs = [source, index]
    if not scalar_index:
        cx.op("GATHER", inputs, [cx.write(y, nonfloat=True)], "GatherOptions", Axis=axis)
        return
    # LiteRT keeps a unit axis for a scalar index: gather one, then drop that axis
    picked = emit(cx, "GATHER", inputs, [*shape[:axis], 1, *shape[axis + 1:]], "GatherOptions", Axis=axis,
                  dtype=cx.writer.tensors[source].dtype)
    cx.op("RESHAPE", [picked, cx.int32(cx.shape(y))], [cx.write(y, nonfloat=True)])


@lowers("GatherElements", "GatherND")
def gather_positions(cx: Lowering, node: Node) -> None:
    """GatherElements, and GatherND (batch_dims 0) of constant indices: one GATHER from the data flattened
    over the indexed axes, at flat positions computed here (variable GatherElements indices are wrapped by
    FLOOR_MOD and scaled onto them)."""
    data, indices, y = node.inputs[0], node.inputs[1], node.outputs[0]
    shape = cx.shape(data)
    variable = node.op == "GatherElements" and indices not in cx.consts
    if node.op == "GatherElements":
        axis = node.attrs.get("axis", 0) % len(shape)
        coords = list(np.indices(cx.shape(indices)))
        coords[axis] = np.zeros_like(coords[axis]) if variable else cx.consts[indices].astype(np.int64)
    else:
        if node.attrs.get("batch_dims", 0):
            raise Unsupported(f"batch_dims={node.attrs['batch_dims']}; supported: 0")
        coords = list(np.moveaxis(cx.const(indices, "GatherND indices").astype(np.int64), -1, 0))
    depth = len(coords)
    if not 0 < depth <= len(shape) or any(((c < -d) | (c >= d)).any() for c, d in zip(coords, shape)):
        raise Unsupported(f"{node.op} indices of shape {list(cx.shape(indices))} outside the data's {list(shape)}")
    positions = np.ravel_multi_index(tuple(c % d for c, d in zip(coords, shape)), shape[:depth])
    source, flat = cx.read(data, identity(len(shape)), nonfloat=True), [math.prod(shape[:depth]), *shape[depth:]]
    if flat != list(shape):
        source = emit(cx, "RESHAPE", [source, cx.int32(flat)], flat, dtype=cx.writer.tensors[source].dtype)
    if variable:
        index = cx.read(indices, identity(depth), nonfloat=True)
        dtype, size = cx.writer.tensors[index].dtype, cx.shape(indices)
        index = emit(cx, "FLOOR_MOD", [index, cx.constant(np.array(shape[axis], dtype))], size, dtype=dtype)
        stride = math.prod(shape[axis + 1:])
        if stride != 1:
            index = emit(cx, "MUL", [index, cx.constant(np.array(stride, dtype))], size, dtype=dtype)
        index = emit(cx, "ADD", [index, cx.constant(positions.astype(dtype))], size, dtype=dtype)
    else:
        positions = positions.astype(np.int32)
        index = cx.constant(positions.reshape(-1) if positions.ndim == 0 else positions, indices)
    gather_at(cx, source, flat, 0, index, positions.ndim == 0, y)


RESIZE_NEAREST = {  # (coordinate transform, nearest mode) -> (align_corners, half_pixel_centers)
    ("asymmetric", "floor"): (False, False),
    ("tf_half_pixel_for_nn", "floor"): (False, True),
    ("half_pixel", "round_prefer_ceil"): (False, True),
    ("align_corners", "round_prefer_ceil"): (True, False),
}
RESIZE_LINEAR = {"asymmetric": (False, False), "half_pixel": (False, True), "pytorch_half_pixel": (False, True),
                 "align_corners": (True, False)}


def resize_scales(cx: Lowering, node: Node) -> list[float]:
    """The scales ONNX maps H and W coordinates by: given, or sizes over input sizes (one for all axes when
    the aspect ratio is kept)."""
    axes = [a % 4 for a in node.attrs.get("axes", range(4))]
    given = node.input(1) if node.opset < 11 else node.input(2)
    scales = cx.const(given, "Resize scales").reshape(-1).astype(float) if given else np.zeros(0)
    if not scales.size:
        sizes, shape = cx.const(node.input(3), "Resize sizes").reshape(-1), cx.shape(node.inputs[0])
        scales = np.array([s / shape[a] for a, s in zip(axes, sizes)])
        policy = node.attrs.get("keep_aspect_ratio_policy", "stretch")
        if policy != "stretch":
            scales[:] = scales.max() if policy == "not_smaller" else scales.min()
    by_axis = dict(zip(axes, scales.tolist()))
    return [by_axis.get(a, 1.0) for a in (2, 3)]


@lowers("Resize")
def resize(cx: Lowering, node: Node) -> None:
    x, y = node.inputs[0], node.outputs[0]
    if cx.rank(x) != 4:
        raise Unsupported(f"rank-{cx.rank(x)} Resize; LiteRT resizes rank-4 (NCHW) tensors")
    (n, c, h, w), (n2, c2, oh, ow) = cx.shape(x), cx.shape(y)
    if (n, c) != (n2, c2):
        raise Unsupported("Resize of the batch or channel axis")
    if node.attrs.get("antialias", 0):
        raise Unsupported("antialias=1")
    scales = resize_scales(cx, node)
    if any(not math.isclose(s, o / i, rel_tol=1e-6) for s, i, o in zip(scales, (h, w), (oh, ow))):
        raise Unsupported(f"scales {scales} for H and W, not the output/input ratios {[oh / h, ow / w]}; LiteRT "
                          "maps coordinates by those ratios")
    mode = node.attrs.get("mode", "nearest")
    coordinates = node.attrs.get("coordinate_transformation_mode", "half_pixel")
    if mode == "nearest":
        key = (coordinates, node.attrs.get("nearest_mode", "round_prefer_floor"))
        if key == ("half_pixel", "round_prefer_floor") and oh % h == 0 and ow % w == 0:
            key = ("half_pixel", "round_prefer_ceil")  # the two agree on whole-number upscales
        flags, code, options = RESIZE_NEAREST.get(key), "RESIZE_NEAREST_NEIGHBOR", "ResizeNearestNeighborOptions"
    elif mode == "linear":
        key = coordinates
        flags, code, options = RESIZE_LINEAR.get(key), "RESIZE_BILINEAR", "ResizeBilinearOptions"
        if key == "pytorch_half_pixel" and min(oh, ow) == 1:
            flags = None
    else:
        raise Unsupported(f"mode={mode!r}; supported: 'nearest', 'linear'")
    if flags is None:
        raise Unsupported(f"{mode} resize with {key}; LiteRT matches only {list(RESIZE_NEAREST if mode == 'nearest' else RESIZE_LINEAR)}")
    cx.op(code, [cx.read(x, NHWC), cx.int32([oh, ow])], [cx.write(y, NHWC)], options, AlignCorners=flags[0],
          HalfPixelCenters=flags[1])


@lowers("Pad")
def pad(cx: Lowering, node: Node) -> None:
    x, y = node.inputs[0], node.outputs[0]
    rank, perm = cx.rank(x), cx.perm(x)
    mode = node.attrs.get("mode", "constant")
    if node.opset < 11:
        pads, value = list(node.attrs["pads"]), float(node.attrs.get("value", 0.0))
    else:
        pads = cx.const(node.inputs[1], "pads").reshape(-1).tolist()
        value = float(cx.const(node.input(2), "Pad value").reshape(-1)[0]) if node.input(2) else 0.0
    axes = [a % rank for a in cx.const(node.input(3), "Pad axes").reshape(-1).tolist()] if node.input(3) else list(range(rank))
    widths = [[0, 0] for _ in range(rank)]
    for k, axis in enumerate(axes):
        widths[axis] = [int(pads[k]), int(pads[k + len(axes)])]
    if min(min(w) for w in widths) < 0:
        raise Unsupported(f"negative pads {pads}")
    paddings = cx.int32([widths[a] for a in perm])
    out = cx.write(y, perm)
    if mode == "constant":
        inputs = [cx.read(x), paddings] + ([scalar(cx, value)] if value != 0.0 else [])
        cx.op("PADV2" if value != 0.0 else "PAD", inputs, [out])
    elif mode == "reflect":
        cx.op("MIRROR_PAD", [cx.read(x), paddings], [out], "MirrorPadOptions", Mode=0)
    else:
        raise Unsupported(f"mode={mode!r}; supported: 'constant', 'reflect'")


# ---- normalization
@lowers("Softmax", "LogSoftmax")
def softmax(cx: Lowering, node: Node) -> None:
    """SOFTMAX and LOG_SOFTMAX work on the innermost axis: the input is held with the ONNX axis innermost."""
    x, y = node.inputs[0], node.outputs[0]
    rank = cx.rank(x)
    axis = node.attrs.get("axis", 1 if node.opset < 13 else -1) % rank
    if node.opset < 13 and axis != rank - 1:
        raise Unsupported(f"axis={axis} before opset 13 (softmax over the flattened trailing axes)")
    perm = cx.perm(x)
    if perm[-1] != axis:
        perm = tuple(a for a in perm if a != axis) + (axis,)
    if node.op == "Softmax":
        cx.op("SOFTMAX", [cx.read(x, perm)], [cx.write(y, perm)], "SoftmaxOptions", Beta=1.0)
    else:
        cx.op("LOG_SOFTMAX", [cx.read(x, perm)], [cx.write(y, perm)])


def standardized(cx: Lowering, x: str, axes: list[int], epsilon: float) -> int:
    """(x - mean) * rsqrt(var + epsilon) over the ONNX `axes`, in the layout `x` has."""
    perm, shape = cx.perm(x), physical(cx, x)
    reduced = [1 if a in axes else d for a, d in zip(perm, shape)]
    held = cx.int32(sorted(inverse(perm)[a] for a in axes))
    xi = cx.read(x)
    mean = emit(cx, "MEAN", [xi, held], reduced, "ReducerOptions", KeepDims=True)
    centred = emit(cx, "SUB", [xi, mean], shape)
    variance = emit(cx, "MEAN", [emit(cx, "MUL", [centred, centred], shape), held], reduced, "ReducerOptions",
                    KeepDims=True)
    inv_std = emit(cx, "RSQRT", [emit(cx, "ADD", [variance, scalar(cx, epsilon)], reduced)], reduced)
    return emit(cx, "MUL", [centred, inv_std], shape)


@lowers("LayerNormalization")
def layer_norm(cx: Lowering, node: Node) -> None:
    """(x - mean) * rsqrt(var + eps) * scale + bias: LiteRT has no layer-norm builtin."""
    if any(cx.readers[o] for o in node.outputs[1:] if o):
        raise Unsupported("the Mean or InvStdDev output is read")
    x, scale, y = node.inputs[0], node.inputs[1], node.outputs[0]
    rank, perm = cx.rank(x), cx.perm(x)
    axis = node.attrs.get("axis", -1) % rank
    normed = standardized(cx, x, list(range(axis, rank)), node.attrs.get("epsilon", 1e-5))
    bias = node.input(2)
    scaled = cx.write(y, perm) if not bias else cx.temp(physical(cx, x))
    cx.op("MUL", [normed, cx.broadcast(scale, rank, perm)], [scaled])
    if bias:
        cx.fusable[y] = cx.op("ADD", [scaled, cx.broadcast(bias, rank, perm)], [cx.write(y, perm)], "AddOptions")


@lowers("InstanceNormalization")
def instance_norm(cx: Lowering, node: Node) -> None:
    """Each sample's channels standardized over their spatial axes, then scaled and shifted per channel."""
    x, y = node.inputs[0], node.outputs[0]
    rank, perm = cx.rank(x), cx.perm(x)
    if rank < 3:
        raise Unsupported(f"rank-{rank} input; InstanceNormalization needs N, C and a spatial axis")
    normed = standardized(cx, x, list(range(2, rank)), node.attrs.get("epsilon", 1e-5))
    scale, bias = (cx.const(n, "InstanceNormalization scale and bias").astype(np.float32) for n in node.inputs[1:3])
    channel = (1, -1) + (1,) * (rank - 2)
    scaled = emit(cx, "MUL", [normed, cx.constant(scale.reshape(channel).transpose(perm))], physical(cx, x))
    cx.fusable[y] = cx.op("ADD", [scaled, cx.constant(bias.reshape(channel).transpose(perm))], [cx.write(y, perm)],
                          "AddOptions")
