"""A read-only view of an ONNX graph as a DAG of named nodes, with the type of every tensor."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import onnx
from onnx import helper

from .dtypes import TensorSig


@dataclass(frozen=True)
class TensorInfo:
    """Element type (`"float"`, `"int64"`, ... as ONNX spells them) and shape (ints, symbols or None); for a
    sequence or optional value, its full ONNX type in `wrapped` (`"seq(tensor(float))"`)."""

    dtype: str | None
    shape: tuple[int | str | None, ...] | None
    wrapped: str | None = None

    @property
    def type(self) -> str:
        if self.wrapped:
            return self.wrapped
        return f"tensor({self.dtype})" if self.dtype else "tensor(unknown)"

    @classmethod
    def from_type_proto(cls, type_proto: onnx.TypeProto) -> TensorInfo:
        kind = type_proto.WhichOneof("value")
        if kind in ("sequence_type", "optional_type"):
            return cls(None, None, type_string(type_proto))
        if kind != "tensor_type":
            return cls(None, None)
        tensor = type_proto.tensor_type
        dtype = onnx.TensorProto.DataType.Name(tensor.elem_type).lower() if tensor.elem_type else None
        if not tensor.HasField("shape"):
            return cls(dtype, None)
        return cls(dtype, tuple(dimension(d) for d in tensor.shape.dim))


def dimension(dim: onnx.TensorShapeProto.Dimension) -> int | str | None:
    """One axis as ONNX Runtime shows it: its size, the name of a symbolic axis, or None for a free axis
    without a name (none given, a negative `dim_value` as Paddle writes, or a name ONNX's shape inference
    made up: `unk__0`)."""
    if dim.HasField("dim_value"):
        return dim.dim_value if dim.dim_value >= 0 else None
    return None if dim.dim_param.startswith("unk__") else dim.dim_param or None


def type_string(type_proto: onnx.TypeProto) -> str:
    """ONNX's spelling of a type: `tensor(float)`, `seq(tensor(int64))`, `optional(seq(tensor(float)))`."""
    kind = type_proto.WhichOneof("value")
    if kind == "sequence_type":
        return f"seq({type_string(type_proto.sequence_type.elem_type)})"
    if kind == "optional_type":
        return f"optional({type_string(type_proto.optional_type.elem_type)})"
    if kind == "tensor_type" and type_proto.tensor_type.elem_type:
        return f"tensor({onnx.TensorProto.DataType.Name(type_proto.tensor_type.elem_type).lower()})"
    return "tensor(unknown)"


@dataclass(frozen=True)
class Node:
    """One node: its position in the graph, names, and attribute values (subgraphs left as protos)."""

    index: int
    name: str
    op_type: str
    domain: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    attributes: dict[str, Any] = field(repr=False)
    outer_inputs: frozenset[str] = field(repr=False)  # outer-scope tensors its subgraphs read


@dataclass(frozen=True)
class Graph:
    """The main graph of a model: nodes in topological order and what connects them."""

    nodes: tuple[Node, ...]
    tensors: dict[str, TensorInfo]
    initializers: frozenset[str]
    inputs: tuple[str, ...]  # graph inputs that are not initializers
    outputs: tuple[str, ...]
    opsets: dict[str, int]

    @classmethod
    def from_model(cls, model: onnx.ModelProto) -> Graph:
        g = model.graph
        tensors = {}
        for value in (*g.input, *g.value_info, *g.output):
            tensors[value.name] = TensorInfo.from_type_proto(value.type)
        for init in g.initializer:
            tensors.setdefault(init.name, TensorInfo(_dtype_name(init.data_type), tuple(init.dims)))
        initializers = frozenset(i.name for i in g.initializer) | frozenset(
            i.values.name for i in g.sparse_initializer
        )
        nodes = tuple(
            Node(
                index=i,
                name=n.name,
                op_type=n.op_type,
                domain=_domain(n.domain),
                inputs=tuple(n.input),
                outputs=tuple(n.output),
                attributes={a.name: helper.get_attribute_value(a) for a in n.attribute},
                outer_inputs=frozenset(outer_inputs(n)),
            )
            for i, n in enumerate(g.node)
        )
        opsets = {_domain(o.domain): o.version for o in model.opset_import}
        return cls(
            nodes=nodes,
            tensors=tensors,
            initializers=initializers,
            inputs=tuple(i.name for i in g.input if i.name not in initializers),
            outputs=tuple(o.name for o in g.output),
            opsets=opsets,
        )

    def signature(self, name: str) -> TensorSig:
        """A graph input or output as onnxruntime's `NodeArg` shows it."""
        info = self.tensors.get(name)
        shape = None if info is None or info.shape is None else list(info.shape)
        return TensorSig(name=name, type=info.type if info else "tensor(unknown)", shape=shape)

    def node(self, name: str) -> Node:
        return self.nodes[self.index_of[name]]

    @cached_property
    def index_of(self) -> dict[str, int]:
        return {n.name: n.index for n in self.nodes}

    @cached_property
    def producer(self) -> dict[str, int]:
        """Tensor name -> index of the node that writes it."""
        return {out: n.index for n in self.nodes for out in n.outputs if out}

    @cached_property
    def readers(self) -> dict[str, frozenset[int]]:
        """Tensor name -> indices of the nodes that read it (directly or from a subgraph)."""
        readers: dict[str, set[int]] = {}
        for n in self.nodes:
            for name in reads(n):
                readers.setdefault(name, set()).add(n.index)
        return {name: frozenset(r) for name, r in readers.items()}

    @cached_property
    def successors(self) -> tuple[frozenset[int], ...]:
        """For each node, the nodes that read one of its outputs."""
        return tuple(frozenset(j for out in n.outputs if out for j in self.readers.get(out, ())) for n in self.nodes)

    @cached_property
    def predecessors(self) -> tuple[frozenset[int], ...]:
        preds: list[set[int]] = [set() for _ in self.nodes]
        for i, succ in enumerate(self.successors):
            for j in succ:
                preds[j].add(i)
        return tuple(frozenset(p) for p in preds)


def reads(node: Node) -> set[str]:
    """Every tensor a node reads: its inputs and the outer-scope names its subgraphs use."""
    return {name for name in node.inputs if name} | node.outer_inputs


def _domain(domain: str) -> str:
    return "" if domain == "ai.onnx" else domain


def _dtype_name(data_type: int) -> str:
    return onnx.TensorProto.DataType.Name(data_type).lower()


def outer_inputs(node: onnx.NodeProto) -> set[str]:
    """Names a node's subgraphs read from enclosing scopes."""
    used: set[str] = set()
    for attr in node.attribute:
        for sub in (*([attr.g] if attr.HasField("g") else []), *attr.graphs):
            used |= _free_names(sub)
    return used


def _free_names(graph: onnx.GraphProto) -> set[str]:
    defined = {i.name for i in graph.input} | {i.name for i in graph.initializer}
    defined |= {i.values.name for i in graph.sparse_initializer}
    free: set[str] = set()
    for n in graph.node:
        free |= {name for name in n.input if name and name not in defined}
        free |= outer_inputs(n) - defined
        defined |= set(n.output)
    free |= {o.name for o in graph.output if o.name not in defined}
    return free


def io_signatures(model: onnx.ModelProto) -> tuple[list[TensorSig], list[TensorSig]]:
    """The graph's inputs (initializers left out) and outputs as onnxruntime's `NodeArg`s show them, read
    without building a `Graph`."""
    g = model.graph
    stored = {i.name for i in g.initializer} | {i.values.name for i in g.sparse_initializer}

    def sig(value: onnx.ValueInfoProto) -> TensorSig:
        info = TensorInfo.from_type_proto(value.type)
        return TensorSig(value.name, info.type, None if info.shape is None else list(info.shape))

    return [sig(v) for v in g.input if v.name not in stored], [sig(v) for v in g.output]


def declared_outputs(model: onnx.ModelProto) -> list[tuple[str, tuple[int | None, ...] | None]]:
    """(name, fixed dimensions or None per axis) of each graph output; None where the shape is unknown."""
    declared = []
    for output in model.graph.output:
        tensor = output.type.tensor_type
        dims = tuple(d if isinstance(d, int) else None for d in map(dimension, tensor.shape.dim))
        declared.append((output.name, dims if tensor.HasField("shape") else None))
    return declared
