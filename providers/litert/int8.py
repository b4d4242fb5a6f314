"""Full-integer int8: the float32 LiteRT subgraph the lowering wrote, rewritten to LiteRT's 8-bit
quantization scheme from the ranges its values took over calibration samples.

As LiteRT's quantization specification has it: activations int8, asymmetric, one scale and zero point per
tensor, from the range each ONNX value took; Conv and FullyConnected weights int8 in -127..127, symmetric
(zero point 0), one scale per output channel; their biases int32 at input scale x weight scale. Ops that only
move or select values (RESHAPE, MAX_POOL_2D, PAD, ...) keep their input's scale; SOFTMAX, LOGISTIC and TANH
write the fixed output scales their int8 kernels take; CONCATENATION, MAXIMUM and MINIMUM read every input
at the output's scale (a requantizing QUANTIZE where one differs). The stage's inputs and outputs stay
float32: a QUANTIZE follows each input and a DEQUANTIZE writes each output. An op without an int8 kernel
here raises `Unsupported`, naming it, so the stage stays at fp32 elsewhere.

The ranges travel in the stage model's metadata (`with_calibration`, `calibration_of`): a saved plan
rebuilds its int8 stages without the calibration samples.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import onnx

from .lowering import Unsupported
from .writer import ModelWriter, Operator, Quantization

CALIBRATION = "uhop-onnx.int8"  # metadata key: the ranges of the stage's values, the moments of its inputs
LEAST, MOST = -128, 127
WEIGHT_AXIS = {"CONV_2D": 0, "FULLY_CONNECTED": 0, "DEPTHWISE_CONV_2D": 3}  # the weights' output-channel axis
CALIBRATED = frozenset({*WEIGHT_AXIS, "ADD", "SUB", "MUL", "MEAN", "SUM", "RELU", "RELU6", "RELU_N1_TO_1",
                        "RELU_0_TO_1", "LEAKY_RELU", "HARD_SWISH", "PRELU", "BATCH_MATMUL", "CONCATENATION"})
KEEPS_SCALE = frozenset({"RESHAPE", "TRANSPOSE", "SQUEEZE", "MAX_POOL_2D", "AVERAGE_POOL_2D", "PAD", "PADV2",
                         "STRIDED_SLICE", "SLICE", "GATHER", "SPLIT_V", "RESIZE_NEAREST_NEIGHBOR",
                         "RESIZE_BILINEAR", "MAXIMUM", "MINIMUM", "BROADCAST_TO", "TILE"})
FIXED = {"SOFTMAX": Quantization((1 / 256,), (-128,)), "LOGISTIC": Quantization((1 / 256,), (-128,)),
         "TANH": Quantization((1 / 128,), (0,))}
AT_OUTPUT_SCALE = frozenset({"CONCATENATION", "MAXIMUM", "MINIMUM"})
ACTIVATIONS = {1: (0.0, math.inf), 2: (-1.0, 1.0), 3: (0.0, 6.0)}  # fused RELU, RELU_N1_TO_1, RELU6: bounds


@dataclass(frozen=True)
class Calibrated:
    """What an int8 stage is built from: per value, the least and greatest it took over the calibration
    samples; per float input, its mean and standard deviation there (the stage is checked on such inputs)."""

    ranges: dict[str, tuple[float, float]]
    moments: dict[str, tuple[float, float]]


def with_calibration(model: onnx.ModelProto, calibrated: Calibrated) -> onnx.ModelProto:
    """A copy of `model` carrying `calibrated` in its metadata."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    entry = next((p for p in out.metadata_props if p.key == CALIBRATION), None) or out.metadata_props.add(
        key=CALIBRATION)
    entry.value = json.dumps({part: {name: [float(a), float(b)] for name, (a, b) in sorted(pairs.items())}
                              for part, pairs in (("ranges", calibrated.ranges), ("moments", calibrated.moments))})
    return out


def calibration_of(model: onnx.ModelProto) -> Calibrated | None:
    """What `with_calibration` put in `model`, or None when it carries nothing."""
    text = next((p.value for p in model.metadata_props if p.key == CALIBRATION), None)
    if text is None:
        return None
    data = json.loads(text)
    return Calibrated(*({name: tuple(pair) for name, pair in data[part].items()} for part in ("ranges", "moments")))


def activation(least: float, greatest: float) -> Quantization:
    """Asymmetric int8 over [least, greatest], widened to hold 0 exactly (the zero point)."""
    least, greatest = min(float(least), 0.0), max(float(greatest), 0.0)
    scale = float(np.float32(max((greatest - least) / (MOST - LEAST), 1e-8)))
    return Quantization((scale,), (int(np.clip(round(LEAST - least / scale), LEAST, MOST)),))


def full_integer(writer: ModelWriter, ranges: Mapping[str, Sequence[float]]) -> None:
    """Rewrite `writer`'s subgraph, in place, to int8 (see the module); `Unsupported` for an op without an
    int8 kernel here, or a computed value with no range."""
    _Rewrite(writer, ranges).run()


class _Rewrite:
    """One pass over the operators in run order, each input read at the quantization its producer wrote."""

    def __init__(self, writer: ModelWriter, ranges: Mapping[str, Sequence[float]]):
        self.w, self.ranges = writer, ranges
        self.floats = {i for i, t in enumerate(writer.tensors) if t.dtype == np.float32}
        self.held: dict[int, int] = {}  # float variable -> its int8 tensor (itself, once its op is rewritten)
        self.constants: dict[tuple[int, Quantization | str], int] = {}
        self.operators: list[Operator] = []

    def run(self) -> None:
        w = self.w
        for i in w.inputs:
            if i in self.floats:
                t = w.tensors[i]
                self.held[i] = w.tensor(f"{t.name}/int8", t.shape, np.int8)
                w.tensors[self.held[i]].quantization = activation(*self.range(t.name, f"input {t.name!r}"))
                self.operators.append(Operator("QUANTIZE", [i], [self.held[i]]))
        for op in w.operators:
            if any(i in self.floats for i in (*op.inputs, *op.outputs)):
                self.rewrite(op)
            else:
                self.operators.append(op)
        outputs = []
        for i in w.outputs:
            if i not in self.floats:
                outputs.append(i)
                continue
            held, t = self.held[i], w.tensors[i]
            out = w.tensor(t.name, t.shape)
            w.tensors[held].name = f"{t.name}/int8"
            self.operators.append(Operator("DEQUANTIZE", [held], [out]))
            outputs.append(out)
        w.operators, w.outputs = self.operators, outputs

    def range(self, name: str, where: str) -> Sequence[float]:
        if name not in self.ranges:
            raise Unsupported(f"{where} has no calibration range (int8 scales come from the ranges of the values "
                              "the ONNX stage computes; an op that keeps its input's scale needs none)")
        return self.ranges[name]

    def rewrite(self, op: Operator) -> None:
        w, code = self.w, op.name
        if code not in CALIBRATED | KEEPS_SCALE | FIXED.keys():
            raise Unsupported(f"node {op.node!r} is lowered to {code}, which has no int8 kernel here (int8 "
                              f"builtins: {', '.join(sorted(CALIBRATED | KEEPS_SCALE | FIXED.keys()))})")
        floats = [k for k, i in enumerate(op.inputs) if i in self.floats]
        if code in FIXED:
            out = FIXED[code]
        elif code in KEEPS_SCALE:
            first = op.inputs[floats[0]]
            out = self.of(self.held[first]) if first in self.held else activation(
                *_extent(w.buffers[w.tensors[first].buffer]))
        else:
            name = w.tensors[op.outputs[0]].name
            least, greatest = self.ranges.get(name) or self.bounds(op) or self.range(
                name, f"node {op.node!r}: {code} writes {name!r}, which")
            lo, hi = ACTIVATIONS.get(op.fields.get("FusedActivationFunction", 0), (-math.inf, math.inf))
            least, greatest = min(max(least, lo), hi), min(max(greatest, lo), hi)
            variables = [op.inputs[k] for k in floats if op.inputs[k] in self.held]
            if least == greatest == 0 and variables:  # always zero (a Conv of zero weights): any scale holds it;
                out = self.of(self.held[variables[0]])  # its input's keeps the kernels' rescaling factors sane
            else:
                out = activation(least, greatest)
        inputs = list(op.inputs)
        for k in floats:
            i = inputs[k]
            if w.tensors[i].buffer:
                inputs[k] = self.constant(op, k, inputs, out)
            elif i not in self.held:
                raise Unsupported(f"node {op.node!r}: {code} reads {w.tensors[i].name!r}, which no int8 op computes")
            else:
                inputs[k] = self.held[i]
                if code in AT_OUTPUT_SCALE and self.of(inputs[k]) != out:
                    inputs[k] = self.requantized(inputs[k], out)
        for i in op.outputs:
            if i not in self.floats:
                raise Unsupported(f"node {op.node!r}: {code} writes a {w.tensors[i].dtype} tensor from float ones; "
                                  "int8 stages compute float values only")
            w.tensors[i].dtype, w.tensors[i].quantization = np.dtype(np.int8), out
            self.held[i] = i
        op.inputs = inputs
        self.operators.append(op)

    def bounds(self, op: Operator) -> tuple[float, float] | None:
        """For a value the ONNX stage does not name (HardSigmoid's and BatchNormalization's steps): the
        bounds of MUL, ADD or SUB of a quantized variable and a float constant, from the variable's range;
        None for any other op."""
        variables = [i for i in op.inputs if i in self.held]
        constants = [i for i in op.inputs if i in self.floats and self.w.tensors[i].buffer]
        if op.name not in ("MUL", "ADD", "SUB") or len(variables) != 1 or len(constants) != 1:
            return None
        q = self.of(self.held[variables[0]])
        x = ((LEAST - q.zero_points[0]) * q.scales[0], (MOST - q.zero_points[0]) * q.scales[0])
        c = _extent(self.w.buffers[self.w.tensors[constants[0]].buffer])
        if op.name == "MUL":
            products = [a * b for a in x for b in c]
            return min(products), max(products)
        if op.name == "ADD":
            return x[0] + c[0], x[1] + c[1]
        return (x[0] - c[1], x[1] - c[0]) if op.inputs[1] == constants[0] else (c[0] - x[1], c[1] - x[0])

    def of(self, index: int) -> Quantization:
        return self.w.tensors[index].quantization

    def constant(self, op: Operator, k: int, inputs: list[int], out: Quantization) -> int:
        """The int8 (or int32 bias) form of the float constant input `k` of `op`."""
        w = self.w
        source = w.tensors[inputs[k]]
        array = np.frombuffer(w.buffers[source.buffer], np.float32).reshape(source.shape)
        if op.name in WEIGHT_AXIS and k == 1:
            key: Quantization | str = "weight"
            values, quantization = _per_channel(array, WEIGHT_AXIS[op.name])
        elif op.name in WEIGHT_AXIS and k == 2:
            scales = np.float64(self.of(inputs[0]).scales[0]) * np.asarray(self.of(inputs[1]).scales, np.float64)
            key = Quantization(tuple(scales.tolist()), ())
            values = np.clip(np.round(array / scales), -2**31, 2**31 - 1).astype(np.int32)
            quantization = Quantization(tuple(np.float32(scales).tolist()), (0,) * len(scales))
        else:
            quantization = out if op.name in KEEPS_SCALE | AT_OUTPUT_SCALE else activation(*_extent(array))
            key = quantization
            (scale,), (zero,) = quantization.scales, quantization.zero_points
            values = np.clip(np.round(array / np.float32(scale)) + zero, LEAST, MOST).astype(np.int8)
        if (inputs[k], key) not in self.constants:
            index = w.constant(f"{source.name}/int8", values)
            w.tensors[index].quantization = quantization
            self.constants[inputs[k], key] = index
        return self.constants[inputs[k], key]

    def requantized(self, index: int, out: Quantization) -> int:
        """`index` at the scale and zero point `out` (QUANTIZE from int8 to int8)."""
        t = self.w.tensors[index]
        moved = self.w.tensor(f"{t.name}/requantized", t.shape, np.int8)
        self.w.tensors[moved].quantization = out
        self.operators.append(Operator("QUANTIZE", [index], [moved]))
        return moved


def _per_channel(array: np.ndarray, axis: int) -> tuple[np.ndarray, Quantization]:
    """Symmetric int8 weights in -127..127, one scale per slice along `axis` (zero point 0); an all-zero
    slice takes the largest slice's scale (XNNPACK refuses a kernel whose rescaling factor is out of bounds)."""
    peak = np.abs(np.moveaxis(array, axis, 0).reshape(array.shape[axis], -1)).max(axis=1)
    scales = np.where(peak > 0, peak, peak.max(initial=0.0) or 1.0).astype(np.float32) / np.float32(MOST)
    shape = [1] * array.ndim
    shape[axis] = -1
    values = np.clip(np.round(array / scales.reshape(shape)), -MOST, MOST).astype(np.int8)
    return values, Quantization(tuple(scales.tolist()), (0,) * len(scales), axis)


def _extent(data: bytes | np.ndarray) -> tuple[float, float]:
    array = np.frombuffer(data, np.float32) if isinstance(data, bytes) else data
    return (float(array.min()), float(array.max())) if array.size else (0.0, 0.0)
