"""How a `kernels` stage becomes plain data: which nodes it may hold, and the steps (fused epilogues) it runs as.

A stage holds Conv, Gemm and MatMul nodes, and Relu, Clip, bias Adds (a constant vector along the last or
the channel axis) and residual Adds (two computed tensors of one shape). `lower` turns it into steps, where
each Relu, Clip or bias Add that alone reads a product is fused into that product's epilogue, a residual Add
into a convolution's (the sum then takes a Relu or Clip too), and the rest run as a bias+residual+clamp kernel.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from uhop_onnx.foundation.errors import ProviderError

from ..capability import CapabilityTable, OpRule

if TYPE_CHECKING:
    import onnx

PADS = (b"NOTSET", b"VALID")
KERNELS_TABLE = CapabilityTable(
    provider="kernels",
    rules=(
        OpRule("Conv", ranks=(4,), attributes={"auto_pad": PADS}, defaults={"auto_pad": b"NOTSET"}),
        OpRule("Gemm"),
        OpRule("MatMul"),
        OpRule("Relu"),
        OpRule("Clip", opsets=(11, 10_000)),
        OpRule("Add"),
    ),
    dtypes=frozenset({"float"}),
    domains={"": (7, 28)},
)
PRODUCTS = ("Conv", "Gemm", "MatMul")


def bias_axis(bias_shape: tuple[int, ...], rank: int) -> int | None:
    """The axis a constant Add operand of `bias_shape` runs along on a rank-`rank` tensor: -1 for a vector
    along the last axis (or a scalar), 1 for a channel vector of a 4-D tensor; None when it is no bias."""
    dims = list(bias_shape)
    if len(dims) > rank:
        return None
    while dims and dims[0] == 1:
        dims.pop(0)
    if len(dims) <= 1:
        return -1
    if rank == 4 and len(dims) == 3 and dims[1:] == [1, 1]:
        return 1
    return None


def _constants(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    from onnx import numpy_helper

    return {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}


def refusals(model: onnx.ModelProto) -> dict[str, str]:
    """Why each node of `model` that the table accepts cannot be lowered, by node name: Adds that are not a bias
    or a residual sum, Clips without constant bounds, MatMuls of vectors."""
    from uhop_onnx.foundation.graph import Graph

    graph = Graph.from_model(model)
    constants = _constants(model)
    return {node.name: reason for node in graph.nodes if (reason := _refusal(node, graph, constants))}


def _rank(graph, name: str) -> int | None:
    info = graph.tensors.get(name)
    return None if info is None or info.shape is None else len(info.shape)


def _shape(graph, name: str) -> tuple | None:
    """The tensor's shape when every dimension is known (a number or a symbol), else None."""
    info = graph.tensors.get(name)
    return None if info is None or info.shape is None or None in info.shape else tuple(info.shape)


def _refusal(node, graph, constants: Mapping[str, np.ndarray]) -> str:
    """Why this provider cannot run `node`, or "" when it can."""
    if node.op_type == "Add":
        const = [name for name in node.inputs if name in constants]
        other = [name for name in node.inputs if name not in constants]
        if not const:
            shapes = [_shape(graph, name) for name in other]
            if shapes[0] is None or shapes[0] != shapes[1]:
                return (f"Add of computed tensors of shapes {shapes} runs on kernels only as a residual sum: "
                        "both shapes known and equal")
            return ""
        if len(const) != 1 or len(other) != 1:
            return "Add runs on kernels as a bias (a constant and a computed operand) or a residual sum"
        rank, shape = _rank(graph, other[0]), constants[const[0]].shape
        if rank is None or bias_axis(shape, rank) is None:
            return (f"Add of a constant of shape {list(shape)} to a rank-{rank} tensor is no bias; kernels take "
                    "a vector along the last axis or a channel vector [C,1,1]")
    if node.op_type == "Clip":
        for name in node.inputs[1:]:
            if name and (name not in constants or constants[name].size != 1):
                return f"Clip bound {name!r} must be a constant scalar"
    if node.op_type == "MatMul":
        ranks = [_rank(graph, name) for name in node.inputs]
        if any(r is None or r < 2 for r in ranks):
            return f"MatMul operands of ranks {ranks}; kernels need known ranks of at least 2"
    return ""


def lower(model: onnx.ModelProto) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """The stage as plain data, and its constants. Data: `outputs`, and `steps` of `op`, `inputs`, `output`,
    `attrs`, the clamp `lo`/`hi` (None when unbounded), `bias` (a fused bias Add's constant, or None) and
    `residual` (the other operand of a fused residual Add, added before the clamp, or None)."""
    from onnx import helper

    unknown = sorted({n.op_type for n in model.graph.node} - {r.op for r in KERNELS_TABLE.rules})
    if unknown:
        raise ProviderError(f"kernels cannot run {', '.join(unknown)}; "
                            f"it runs {', '.join(r.op for r in KERNELS_TABLE.rules)}")
    constants = _constants(model)
    outputs = [o.name for o in model.graph.output]
    readers: dict[str, int] = {}
    for n in model.graph.node:
        for name in n.input:
            readers[name] = readers.get(name, 0) + 1
    steps: list[dict[str, Any]] = []
    by_output: dict[str, dict[str, Any]] = {}

    def fusable(name: str) -> dict[str, Any] | None:
        """The step producing `name` when this node alone reads it, so its epilogue can take the node."""
        step = by_output.get(name)
        return step if step and readers.get(name) == 1 and name not in outputs else None

    for n in model.graph.node:
        computed = [name for name in n.input if name not in constants]
        if n.op_type in PRODUCTS:
            attrs = {a.name: helper.get_attribute_value(a) for a in n.attribute}
            steps.append({"op": n.op_type, "inputs": list(n.input), "output": n.output[0],
                          "attrs": _attributes(n.op_type, attrs), "lo": None, "hi": None, "bias": None,
                          "residual": None})
        elif n.op_type == "Add" and len(computed) == 2:  # a residual sum
            candidates = [(steps.index(step), step, other) for name, other in (computed, computed[::-1])
                          if (step := fusable(name)) and step["op"] == "Conv" and _fuse_residual(step)]
            if candidates:  # into the later producer, so the other operand exists when it runs
                _, step, other = max(candidates, key=lambda c: c[0])
                step["residual"] = other
                _rename(by_output, step, n.output[0])
                continue
            steps.append({"op": "Add", "inputs": [computed[0]], "output": n.output[0], "attrs": {}, "lo": None,
                          "hi": None, "bias": None, "residual": computed[1]})
        else:
            producer = fusable(computed[0] if computed else n.input[0])
            if producer and _fuse(producer, n, constants):
                _rename(by_output, producer, n.output[0])
                continue
            lo, hi = (None, None) if n.op_type == "Add" else _bounds(n, constants)
            bias = _bias_name(n, constants) if n.op_type == "Add" else None
            steps.append({"op": n.op_type, "inputs": [computed[0] if computed else n.input[0]],
                          "output": n.output[0], "attrs": {}, "lo": lo, "hi": hi, "bias": bias, "residual": None})
        by_output[steps[-1]["output"]] = steps[-1]
    return {"steps": steps, "outputs": outputs}, constants


def _rename(by_output: dict[str, dict[str, Any]], step: dict[str, Any], output: str) -> None:
    """The step now produces `output` (its old output was read only by the node fused into it)."""
    del by_output[step["output"]]
    step["output"] = output
    by_output[output] = step


def _fuse_residual(step: dict[str, Any]) -> bool:
    """Whether a residual can join the step's epilogue: before any clamp, and only one."""
    return step["lo"] is None and step["hi"] is None and step["residual"] is None


def _attributes(op: str, attrs: Mapping[str, Any]) -> dict[str, Any]:
    """A product's attributes with defaults applied, as JSON values."""
    if op == "Conv":
        explicit = attrs.get("auto_pad", b"NOTSET") == b"NOTSET"
        return {"strides": list(attrs.get("strides", (1, 1))), "dilations": list(attrs.get("dilations", (1, 1))),
                "pads": list(attrs.get("pads", (0, 0, 0, 0))) if explicit else [0] * 4,
                "group": int(attrs.get("group", 1))}
    if op == "Gemm":
        return {"transA": int(attrs.get("transA", 0)), "transB": int(attrs.get("transB", 0)),
                "alpha": float(attrs.get("alpha", 1.0)), "beta": float(attrs.get("beta", 1.0))}
    return {}


def _fuse(step: dict[str, Any], node, constants: Mapping[str, np.ndarray]) -> bool:
    """Fold a Relu, Clip or bias Add into a product's epilogue (a bias only before any clamp), or a Relu or Clip
    into a residual sum's."""
    if step["lo"] is not None or step["hi"] is not None:
        return False
    if node.op_type in ("Relu", "Clip") and (step["op"] in PRODUCTS or step["residual"] is not None):
        step["lo"], step["hi"] = _bounds(node, constants)
        return True
    if step["op"] not in PRODUCTS or node.op_type != "Add":
        return False
    name = _bias_name(node, constants)
    bias = constants[name]
    axis = bias_axis(bias.shape, 4 if step["op"] == "Conv" else bias.ndim)
    if step["bias"] is not None or bias.size != 1 and axis != (1 if step["op"] == "Conv" else -1):
        return False
    step["bias"] = name
    return True


def _bounds(node, constants: Mapping[str, np.ndarray]) -> tuple[float | None, float | None]:
    """Relu's lower bound; Clip's two, an absent one being the float limit, as ONNX Runtime takes it (so Clip
    maps an infinity to the largest finite float, where Relu keeps it)."""
    if node.op_type == "Relu":
        return 0.0, None
    limit = float(np.finfo(np.float32).max)
    names = [*node.input[1:], "", ""]
    return tuple(float(constants[name]) if name else default for name, default in zip(names[:2], (-limit, limit)))


def _bias_name(node, constants: Mapping[str, np.ndarray]) -> str:
    return next(name for name in node.input if name in constants)
