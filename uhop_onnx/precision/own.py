"""What a model is held to against ONNX Runtime's run of the same model: fp32 models to the fp32 rule, a model
that is itself quantized (QDQ) or fp16 to a tolerance derived from its own precision, so that runtimes that
agree to that precision can compete."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import onnx
from onnx import numpy_helper

from .accuracy import Tolerance, compare

FP32_CHECK: Tolerance = {"rtol": 2e-4, "atol": 2e-5}  # a plan against ONNX Runtime on the same fp32 model
QDQ_STEPS = 2.0  # a QDQ model's output may differ by this many quantization steps of that output
FP16_ULPS = 8.0  # an fp16 model's output by this many fp16 epsilons times the output's scale (1 + max|ref|)
FP16_EPS = float(np.finfo(np.float16).eps)
QDQ_FALLBACK = 1e-2  # scaled, for a QDQ model's output whose step cannot be traced to a DequantizeLinear
QUANTIZED_OPS = {"DequantizeLinear", "QLinearConv", "QLinearMatMul", "ConvInteger", "MatMulInteger",
                 "DynamicQuantizeLinear"}
# ops that pass a dequantized value on without changing its step (the walk back from an output goes through them)
KEEPS_STEP = {"Identity", "Reshape", "Transpose", "Flatten", "Squeeze", "Unsqueeze", "Concat", "Slice", "Split",
              "Gather", "MaxPool", "Relu", "Clip", "Resize", "Pad", "Expand", "Tile", "Cast"}


def kind(model: onnx.ModelProto) -> str:
    """'qdq' for a model that quantizes itself, 'fp16' for one that computes in float16, else 'fp32'."""
    ops = {node.op_type for node in model.graph.node}
    if ops & QUANTIZED_OPS:
        return "qdq"
    halves = [t.type.tensor_type.elem_type for t in [*model.graph.input, *model.graph.output]]
    halves += [t.data_type for t in model.graph.initializer]
    halves += [a.i for node in model.graph.node if node.op_type == "Cast" for a in node.attribute if a.name == "to"]
    return "fp16" if onnx.TensorProto.FLOAT16 in halves else "fp32"


def tolerances(structure: onnx.ModelProto, full: Callable[[], onnx.ModelProto]) -> dict[str, Tolerance]:
    """Per graph output of the model whose `structure` is given (`full` reads it with its values, asked only
    for a QDQ model, whose scales it needs): the tolerance a plan's output is held to against ONNX Runtime's
    run of this model. See the module; `describe` says it in words."""
    outputs = [o.name for o in structure.graph.output]
    found = kind(structure)
    if found == "fp16":
        return dict.fromkeys(outputs, {"scaled": FP16_ULPS * FP16_EPS})
    if found == "fp32":
        return dict.fromkeys(outputs, dict(FP32_CHECK))
    model = full()
    steps = _steps(model)
    return {name: ({"rtol": FP32_CHECK["rtol"], "atol": max(FP32_CHECK["atol"], QDQ_STEPS * steps[name])}
                   if steps.get(name) else {"scaled": QDQ_FALLBACK}) for name in outputs}


def judged(names: Sequence[str], got: Sequence[Any], want: Sequence[Any],
           rules: Mapping[str, Tolerance]) -> tuple[str, str, float]:
    """Outputs `got` against ONNX Runtime's `want`, each held to its rule (`tolerances`; `FP32_CHECK` where
    none): (what differs, or "" where all agree; the rule of the output said, in words; the largest absolute
    error over the outputs)."""
    worst, said = 0.0, ""
    for name, a, b in zip(names, got, want):
        rule = rules.get(name, FP32_CHECK)
        verdict = compare(a, b, rule)
        worst = max(worst, verdict.get("max_abs_error") or 0.0)
        if not verdict["ok"]:
            error = verdict.get("error") or (f"max abs error {verdict['max_abs_error']:.4g}, "
                                             f"{verdict['nonfinite']} non-finite mismatches")
            return f"output {name!r} differs from ONNX Runtime's ({error})", describe(rule), worst
        said = said or describe(rule)
    return "", said, worst


def describe(tolerance: Tolerance) -> str:
    """A tolerance in words, for a decision's record."""
    if "scaled" in tolerance:
        return f"max|y - ref| <= {tolerance['scaled']:.3g} x (1 + max|ref|)"
    return f"|y - ref| <= {tolerance['atol']:.3g} + {tolerance['rtol']:.3g} x |ref|"


def _steps(model: onnx.ModelProto) -> dict[str, float]:
    """Per graph output, the largest quantization step (a DequantizeLinear's scale) that reaches it through
    ops that keep the step (`KEEPS_STEP`); outputs none reaches are left out."""
    values = {t.name: t for t in model.graph.initializer}
    values |= {node.output[0]: a.t for node in model.graph.node if node.op_type == "Constant"
               for a in node.attribute if a.name == "value"}
    producer = {out: node for node in model.graph.node for out in node.output if out}

    def step(name: str, depth: int = 0) -> float:
        node = producer.get(name)
        if node is None or depth > 64:
            return 0.0
        if node.op_type == "DequantizeLinear":
            scale = values.get(node.input[1])
            return float(np.abs(numpy_helper.to_array(scale)).max()) if scale is not None else 0.0
        if node.op_type in KEEPS_STEP:
            return max((step(i, depth + 1) for i in node.input[:1 if node.op_type != "Concat" else None] if i),
                       default=0.0)
        return 0.0

    return {o.name: s for o in model.graph.output if (s := step(o.name))}

