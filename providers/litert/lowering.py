"""The state of one ONNX -> LiteRT lowering: values, their layouts, constants and static shapes.

Every value carries a permutation `perm`: its LiteRT tensor holds the ONNX tensor transposed by `perm`
(NCHW data held with perm (0, 2, 3, 1) is NHWC). An op asks for the layout it needs; a TRANSPOSE is
written only where a value is read in a layout it does not have (a RESHAPE when only unit axes move).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

from .writer import ModelWriter, Operator

NHWC = (0, 2, 3, 1)
FLOAT = onnx.TensorProto.FLOAT
INTEGERS = {onnx.TensorProto.INT64: np.int64, onnx.TensorProto.INT32: np.int32}
NONFLOAT = {**INTEGERS, onnx.TensorProto.BOOL: np.bool_}  # what LiteRT holds besides float32
LARGEST = int(np.iinfo(np.int32).max)  # LiteRT's shapes are int32


class Unsupported(Exception):
    """A node the converter cannot express; the message says why."""


@dataclass(frozen=True)
class Value:
    index: int  # the LiteRT tensor
    perm: tuple[int, ...]  # the tensor holds the ONNX value transposed by perm


@dataclass(frozen=True)
class Node:
    name: str
    op: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    attrs: dict[str, Any]
    opset: int

    @classmethod
    def from_proto(cls, node: onnx.NodeProto, opset: int) -> Node:
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        attrs = {k: v.decode() if isinstance(v, bytes) else v for k, v in attrs.items()}
        return cls(node.name, node.op_type, tuple(node.input), tuple(node.output), attrs, opset)

    def input(self, position: int) -> str:
        """The name of an optional input, or "" when it is absent."""
        return self.inputs[position] if position < len(self.inputs) else ""


def identity(rank: int) -> tuple[int, ...]:
    return tuple(range(rank))


def inverse(perm) -> tuple[int, ...]:
    return tuple(int(i) for i in np.argsort(perm))


class Lowering:
    """Builds the LiteRT subgraph of one ONNX graph."""

    def __init__(self, model: onnx.ModelProto, fp16: bool = False):
        graph = model.graph
        self.writer = ModelWriter()
        self.fp16 = fp16
        self.consts: dict[str, np.ndarray] = {t.name: numpy_helper.to_array(t) for t in graph.initializer}
        self.types: dict[str, tuple[int, tuple | None]] = {}
        for v in (*graph.input, *graph.value_info, *graph.output):
            t = v.type.tensor_type
            dims = tuple(d.dim_value if d.HasField("dim_value") else None for d in t.shape.dim)
            self.types[v.name] = (t.elem_type, dims if t.HasField("shape") else None)
        self.outputs = [o.name for o in graph.output]
        self.readers = Counter(name for n in graph.node for name in n.input if name) + Counter(self.outputs)
        self.values: dict[str, Value] = {}
        self.unavailable: dict[str, str] = {}  # tensor -> why it has no LiteRT tensor
        self.fusable: dict[str, Operator] = {}  # value -> the op writing it, which can take a fused activation
        self.nonnegative: set[str] = set()  # values known to be >= 0 (after ReLU, say)
        self._layouts: dict[tuple[str, tuple[int, ...] | None], int] = {}
        self.node = ""  # the ONNX node being lowered

    # ---- what is known about ONNX tensors
    def shape(self, name: str) -> tuple[int, ...]:
        if name in self.consts:
            return tuple(self.consts[name].shape)
        _, dims = self.types.get(name, (0, None))
        if dims is None or any(d is None or d <= 0 for d in dims):
            raise Unsupported(f"tensor {name!r} has no static shape ({dims}); LiteRT stages need static shapes")
        if max(dims, default=0) > LARGEST or np.prod(dims, dtype=object) > LARGEST:
            raise Unsupported(f"tensor {name!r} of shape {list(dims)} has more than {LARGEST} elements along an "
                              "axis or in all; LiteRT's shapes and sizes are int32")
        return dims

    def integer(self, name: str) -> bool:
        """Whether the ONNX tensor `name` holds integers (int32 or int64)."""
        if name in self.consts:
            return self.consts[name].dtype.kind in "iu"
        return self.types.get(name, (FLOAT, None))[0] in INTEGERS

    def rank(self, name: str) -> int:
        return len(self.shape(name))

    def const(self, name: str, what: str = "") -> np.ndarray:
        if name not in self.consts:
            raise Unsupported(f"{what or 'input'} {name!r} must be constant (an initializer, or computed from them)")
        return self.consts[name]

    def perm(self, name: str) -> tuple[int, ...]:
        return identity(self.rank(name)) if name in self.consts else self.value(name).perm

    def value(self, name: str) -> Value:
        if name not in self.values:
            raise Unsupported(self.unavailable.get(name, f"tensor {name!r} is not available as a float32 LiteRT tensor"))
        return self.values[name]

    # ---- LiteRT tensors
    def read(self, name: str, perm=None, nonfloat: bool = False) -> int:
        """The LiteRT tensor of `name`, held in `perm` (default: the layout it has). Integer and boolean
        variables are read only by ops that say they take them (`nonfloat`)."""
        perm = None if perm is None else tuple(perm)
        if not nonfloat and name in self.values and self.writer.tensors[self.values[name].index].dtype != np.float32:
            raise Unsupported(f"tensor {name!r} is {self.writer.tensors[self.values[name].index].dtype}; this LiteRT "
                              "lowering takes float32 tensors only")
        key = (name, perm)
        if key in self._layouts:
            return self._layouts[key]
        if name in self.consts:
            array = self.consts[name]
            index = self.constant(array if perm is None else array.transpose(perm), name)
        else:
            value = self.value(name)
            if perm is None or perm == value.perm:
                return value.index
            index = self.relayout(value.index, self.shape(name), value.perm, perm)
        self._layouts[key] = index
        return index

    def relayout(self, index: int, shape, have, want) -> int:
        """`index` (the ONNX `shape` held in `have`) held in `want` instead."""
        steps = [inverse(have)[a] for a in want]
        out = self.temp([shape[a] for a in want], self.writer.tensors[index].dtype)
        moved = [s for s in steps if shape[have[s]] != 1]
        if moved == sorted(moved):
            self.op("RESHAPE", [index, self.int32([shape[a] for a in want])], [out])
        else:
            self.op("TRANSPOSE", [index, self.int32(steps)], [out])
        return out

    def broadcast(self, name: str, rank: int, perm, nonfloat: bool = False) -> int:
        """`name` read as an operand of a broadcasting op of `rank` whose result is held in `perm`."""
        shape = self.shape(name)
        if name in self.consts:
            array = self.consts[name]
            if array.size == 1:
                return self.read_array(array.reshape(()), name)
            return self.read_array(array.reshape((1,) * (rank - array.ndim) + array.shape).transpose(perm), name)
        if len(shape) == rank:
            return self.read(name, perm, nonfloat)
        full = (1,) * (rank - len(shape)) + shape
        source = self.read(name, identity(len(shape)), nonfloat)
        index = self.temp(full, self.writer.tensors[source].dtype)
        self.op("RESHAPE", [source, self.int32(full)], [index])
        return self.relayout(index, full, identity(rank), tuple(perm))

    def read_array(self, array: np.ndarray, name: str) -> int:
        return self.constant(array.astype(np.float32) if array.dtype.kind == "f" else array, name)

    def write(self, name: str, perm=None, nonfloat: bool = False) -> int:
        """A new tensor for the ONNX value `name`, held in `perm` (default: ONNX layout); float32, or
        int32/int64/bool where the writer takes them (`nonfloat`)."""
        elem_type, _ = self.types.get(name, (FLOAT, None))
        if elem_type not in (FLOAT, 0) and not (nonfloat and elem_type in NONFLOAT):
            raise Unsupported(f"tensor {name!r} is {helper.tensor_dtype_to_np_dtype(elem_type)}; the LiteRT "
                              "converter computes float32, int32, int64 and bool tensors")
        shape = self.shape(name)
        perm = tuple(perm) if perm is not None else identity(len(shape))
        index = self.writer.tensor(name, [shape[a] for a in perm], NONFLOAT.get(elem_type, np.float32))
        self.values[name] = Value(index, perm)
        return index

    def alias(self, name: str, source: str) -> None:
        """`name` is the same value as `source`."""
        if source in self.consts:
            self.consts[name] = self.consts[source]
        else:
            self.values[name] = self.value(source)

    def temp(self, shape, dtype=np.float32) -> int:
        return self.writer.tensor(f"t{len(self.writer.tensors)}", shape, dtype)

    def constant(self, array: np.ndarray, name: str = "c") -> int:
        return self.writer.constant(f"{name}/{len(self.writer.tensors)}", array)

    def int32(self, values) -> int:
        return self.constant(np.asarray(values, np.int32))

    def weight(self, array: np.ndarray, name: str) -> int:
        """A float weight; with fp16, stored as float16 and widened by DEQUANTIZE when the model loads."""
        array = np.require(array, np.float32, "C")
        if not self.fp16:
            return self.constant(array, name)
        out = self.temp(array.shape)
        self.op("DEQUANTIZE", [self.constant(array.astype(np.float16), name)], [out])
        return out

    def op(self, name: str, inputs, outputs, options: str | None = None, **fields) -> Operator:
        operator = self.writer.op(name, inputs, outputs, options, **fields)
        operator.node = self.node
        return operator

    def fuse(self, name: str, activation: int) -> bool:
        """Fold an activation into the op writing `name`, when nothing else reads `name`."""
        op = self.fusable.get(name)
        if op is None or self.readers[name] != 1 or op.fields.get("FusedActivationFunction", 0):
            return False
        op.fields["FusedActivationFunction"] = activation
        return True
