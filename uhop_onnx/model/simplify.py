"""Provider-neutral graph simplification, as onnx-ir passes (`passes`).

Node names and graph input and output names are kept, so plans and assignments can refer to them.
"""

from __future__ import annotations

import gc
from collections.abc import Mapping

import numpy as np
import onnx

from ..foundation.inference import inferred
from ..foundation.inputs import Shapes, at_shapes


COLLECTED = 4 << 20  # bytes of weights from which `simplify` collects the copies it left in reference cycles


def simplify(model: onnx.ModelProto, fixed: bool = False) -> onnx.ModelProto:
    """Lift constants to initializers, read constant Identities through, fold integer shape arithmetic (with
    `fixed`, everything computed from shapes: the inputs' shapes are fixed), remove dead nodes; shapes are
    inferred again. The onnx-ir graphs it made (the folder's copy of the weights among them) are reference
    cycles: for a model of `COLLECTED` bytes of weights or more they are collected before it returns, not
    whenever Python's collector next runs (a LiteRT block of 10 MB converted 25 MiB higher with them left; a
    collection takes 40-120 ms, which a small model's simplification is not worth)."""
    import onnx_ir as ir

    from .passes import FOLDING, PASSES, FoldShapeArithmeticPass

    folding = (FoldShapeArithmeticPass(fixed=True),) if fixed else FOLDING
    pipeline = ir.passes.Sequential(*folding, ir.passes.PassManager(PASSES, steps=2))
    result = pipeline(ir.serde.deserialize_model(model))
    simplified = ir.serde.serialize_model(result.model) if result.modified else model
    del result
    if sum(len(t.raw_data) for t in model.graph.initializer) >= COLLECTED:
        gc.collect()
    return inferred(simplified) if simplified is not model else model


def at_fixed_shapes(model: onnx.ModelProto, shapes: Shapes,
                    values: Mapping[str, np.ndarray] | None = None) -> onnx.ModelProto:
    """`model` specialised for a runtime that builds for fixed shapes: its inputs at `shapes` (and those named
    in `values` made those constants, `inputs.at_shapes`), simplified there, so that everything computed from
    shapes is folded. What such a runtime is asked about (`optimize`), built from (a session's stage) and
    exported as."""
    return simplify(at_shapes(model, shapes, values), fixed=True)


def opset(model: onnx.ModelProto) -> int | None:
    """The model's ai.onnx opset version (None when it imports none)."""
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), None)


def within_opsets(model: onnx.ModelProto, low: int, high: int,
                  feeds: Mapping[str, np.ndarray] | None = None) -> tuple[onnx.ModelProto, dict[str, str]]:
    """`model` with its ai.onnx opset moved into `low..high` by onnx's version converter, and the nodes that
    could not be moved (name -> the converter's reason). The whole model is converted at once where the
    converter can; else node by node: a node that converts is kept at the new opset, one that does not is left
    out, its outputs inputs of the model returned. With `feeds`, the result is checked against ONNX Runtime
    running `model`; a difference raises `ModelError`."""
    version = opset(model)
    if version is None or low <= version <= high:
        return model, {}
    target = min(max(version, low), high)
    try:
        converted, failed = onnx.version_converter.convert_version(model, target), {}
    except Exception:  # noqa: BLE001 - some node has no adapter: found one by one
        converted, failed = _converted_node_by_node(model, target)
    _named(converted)
    if feeds is not None:
        _check_conversion(model, converted, feeds, f"opset {version} -> {target}")
    return converted, failed


def _converted_node_by_node(model: onnx.ModelProto, target: int) -> tuple[onnx.ModelProto, dict[str, str]]:
    from onnx import helper

    inferred = onnx.shape_inference.infer_shapes(model)
    graph = inferred.graph
    types = {v.name: v for v in (*graph.input, *graph.value_info, *graph.output)}
    initializers = {t.name: t for t in graph.initializer}

    def typed(name: str) -> onnx.ValueInfoProto:
        return types.get(name) or helper.make_empty_tensor_value_info(name)

    nodes, failed, cut = [], {}, []
    for node in graph.node:
        used = [name for name in node.input if name]
        inputs = [typed(n) for n in used if n not in initializers]
        weights = [initializers[n] for n in used if n in initializers]
        single = helper.make_model(
            helper.make_graph([node], node.name, inputs, [typed(n) for n in node.output if n], weights),
            ir_version=model.ir_version, opset_imports=model.opset_import)
        try:
            nodes.extend(onnx.version_converter.convert_version(single, target).graph.node)
        except Exception as error:  # noqa: BLE001 - the converter's reason is the node's
            failed[node.name] = f"onnx's version converter cannot take it to opset {target}: {_reason(error)}"
            cut.extend(typed(n) for n in node.output if n)
    opsets = [helper.make_opsetid(o.domain, target if o.domain in ("", "ai.onnx") else o.version)
              for o in model.opset_import]
    converted = helper.make_model(
        helper.make_graph(nodes, graph.name, [*graph.input, *cut], list(graph.output), list(graph.initializer)),
        ir_version=model.ir_version, opset_imports=opsets)
    return onnx.shape_inference.infer_shapes(converted), failed


def _reason(error: Exception) -> str:
    """The converter's message without its source location (`...h:23: adapt: Assertion `false` failed: `)."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return text.rsplit("failed: ", 1)[-1]


def _named(model: onnx.ModelProto) -> None:
    """Names for the nodes the converter added (it leaves them unnamed)."""
    taken = {n.name for n in model.graph.node}
    for k, node in enumerate(model.graph.node):
        if not node.name:
            node.name = f"{node.op_type}_{k}.converted"
            while node.name in taken:
                node.name += "_"
            taken.add(node.name)


def _check_conversion(model: onnx.ModelProto, converted: onnx.ModelProto, feeds: Mapping[str, np.ndarray],
                      what: str) -> None:
    """ONNX Runtime's results of `converted` against those of `model` on `feeds` (the outputs of the nodes left
    out of `converted` fed to it from `model`'s run)."""
    from ..foundation.errors import ModelError
    from ..precision.accuracy import FP32_TOLERANCE, compare
    from ..foundation.samples import reference_outputs

    cut = [v for v in converted.graph.input if v.name not in {i.name for i in model.graph.input}]
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    probe.graph.output.extend(v for v in cut if v.type.HasField("tensor_type"))
    want = reference_outputs(probe.SerializeToString(), dict(feeds))
    got = reference_outputs(converted.SerializeToString(), {**feeds, **{v.name: want[v.name] for v in cut}})
    for name in (o.name for o in model.graph.output):
        verdict = compare(got[name], want[name], FP32_TOLERANCE) if name in got else {"ok": True}
        if not verdict["ok"]:
            raise ModelError(f"{what}: output {name!r} differs from ONNX Runtime's on the original "
                             f"({verdict.get('error') or 'max abs error %g' % verdict['max_abs_error']})")
