"""A TFLite flatbuffer writer: tensors, constant buffers and builtin operators, over the `tflite`
package's generated builders (schema version 3)."""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any

import flatbuffers
import numpy as np
from tflite.BuiltinOperator import BuiltinOperator
from tflite.BuiltinOptions import BuiltinOptions

from uhop_onnx.foundation.dtypes import tflite_type

PLACEHOLDER_FOR_GREATER_OP_CODES = 127
VERSIONS = {BuiltinOperator.BROADCAST_TO: 2}  # builtins LiteRT registers from a version above 1
ALIGNMENT = 16  # LiteRT reads constant buffers in place: keep them aligned
TABLE_BYTES = 512  # more than a tensor's or an operator's tables and vectors take, its name apart


def _builder(table: str, name: str):
    """`tflite.<table>.<table><name>`, e.g. Conv2DOptionsStart. Submodules are imported by name, since
    `tflite`'s star imports shadow them with the classes."""
    return getattr(importlib.import_module(f"tflite.{table}"), f"{table}{name}")


@dataclass(frozen=True)
class Quantization:
    """real = (q - zero_point) * scale, per tensor, or per slice along `axis` (one scale and zero point each)."""

    scales: tuple[float, ...]
    zero_points: tuple[int, ...]
    axis: int = 0


@dataclass
class Tensor:
    name: str
    shape: tuple[int, ...]
    dtype: np.dtype
    buffer: int = 0  # 0 is the empty buffer: a tensor computed at run time
    quantization: Quantization | None = None


@dataclass
class Operator:
    name: str  # the builtin's name, e.g. "CONV_2D"
    inputs: list[int]
    outputs: list[int]
    options: str | None = None  # e.g. "Conv2DOptions"
    fields: dict[str, Any] = field(default_factory=dict)  # e.g. {"StrideH": 1}
    node: str = ""  # the ONNX node it was lowered from


class ModelWriter:
    """Collects one subgraph and serializes it as a `.tflite` model."""

    def __init__(self):
        self.tensors: list[Tensor] = []
        self.buffers: list[bytes] = [b""]
        self.operators: list[Operator] = []
        self.inputs: list[int] = []
        self.outputs: list[int] = []

    def tensor(self, name: str, shape, dtype=np.float32) -> int:
        self.tensors.append(Tensor(name, tuple(int(d) for d in shape), np.dtype(dtype)))
        return len(self.tensors) - 1

    def constant(self, name: str, array: np.ndarray) -> int:
        array = np.require(array, requirements="C")  # keeps a scalar a scalar
        index = self.tensor(name, array.shape, array.dtype)
        self.buffers.append(array.tobytes())
        self.tensors[index].buffer = len(self.buffers) - 1
        return index

    def op(self, name: str, inputs: list[int], outputs: list[int], options: str | None = None, **fields) -> Operator:
        operator = Operator(name, list(inputs), list(outputs), options, fields)
        self.operators.append(operator)
        return operator

    def serialize(self) -> bytes:
        """The model as `.tflite` bytes, without operators whose results nothing reads. Each constant is let go
        once it is written, so the weights are held twice at most (the writer is spent after)."""
        operators = self._live()
        used = sorted({i for op in operators for i in (*op.inputs, *op.outputs) if i >= 0}
                      | set(self.inputs) | set(self.outputs))
        renumber = {old: new for new, old in enumerate(used)} | {-1: -1}
        # sized for all it will hold, so it never grows (each growth copies the whole buffer into one twice its size)
        b = flatbuffers.Builder(1024 + sum(len(self.buffers[self.tensors[i].buffer]) + ALIGNMENT + TABLE_BYTES
                                           + len(self.tensors[i].name) for i in used) + TABLE_BYTES * len(operators))
        buffers = [_buffer(b, b"")]
        for i in used:
            if self.tensors[i].buffer:
                buffers.append(_buffer(b, self.buffers[self.tensors[i].buffer]))
                self.buffers[self.tensors[i].buffer] = b""
        tensors, next_buffer = [], 1
        for i in used:
            tensor = self.tensors[i]
            buffer = next_buffer if tensor.buffer else 0
            next_buffer += bool(tensor.buffer)
            tensors.append(_tensor(b, tensor, buffer))
        codes = list(dict.fromkeys(getattr(BuiltinOperator, op.name) for op in operators))
        ops = [_operator(b, op, codes.index(getattr(BuiltinOperator, op.name)), renumber) for op in operators]
        subgraph = _table(b, "SubGraph", Tensors=_vector(b, "SubGraph", "Tensors", tensors, offsets=True),
                          Inputs=_vector(b, "SubGraph", "Inputs", [renumber[i] for i in self.inputs]),
                          Outputs=_vector(b, "SubGraph", "Outputs", [renumber[i] for i in self.outputs]),
                          Operators=_vector(b, "SubGraph", "Operators", ops, offsets=True),
                          Name=b.CreateString("main"))
        opcodes = [_table(b, "OperatorCode", DeprecatedBuiltinCode=min(c, PLACEHOLDER_FOR_GREATER_OP_CODES),
                          BuiltinCode=c, Version=VERSIONS.get(c, 1)) for c in codes]
        description = b.CreateString("uhop-onnx")
        model = _table(b, "Model", Version=3,
                       OperatorCodes=_vector(b, "Model", "OperatorCodes", opcodes, offsets=True),
                       Subgraphs=_vector(b, "Model", "Subgraphs", [subgraph], offsets=True),
                       Description=description,
                       Buffers=_vector(b, "Model", "Buffers", buffers, offsets=True))
        b.Finish(model, file_identifier=b"TFL3")
        return bytes(memoryview(b.Bytes)[b.Head():])  # one copy (`Output()` slices a copy first)

    def _live(self) -> list[Operator]:
        needed, live = set(self.outputs), []
        for op in reversed(self.operators):
            if needed.intersection(op.outputs):
                live.append(op)
                needed.update(op.inputs)
        return live[::-1]


def _table(b: flatbuffers.Builder, table: str, **fields) -> int:
    """Write one table; every field value must already be in the buffer (offsets) or be a scalar."""
    _builder(table, "Start")(b)
    for name, value in fields.items():
        if value is not None:
            _builder(table, f"Add{name}")(b, value)
    return _builder(table, "End")(b)


def _vector(b: flatbuffers.Builder, table: str, name: str, items: list[int], offsets: bool = False) -> int:
    if not offsets:
        return b.CreateNumpyVector(np.asarray(items, np.int32))
    _builder(table, f"Start{name}Vector")(b, len(items))
    for item in reversed(items):
        b.PrependUOffsetTRelative(item)
    return b.EndVector()


def _buffer(b: flatbuffers.Builder, data: bytes) -> int:
    if not data:
        return _table(b, "Buffer")
    b.StartVector(1, len(data), ALIGNMENT)
    b.head -= len(data)
    b.Bytes[b.head:b.head + len(data)] = data
    b.vectorNumElems = len(data)
    return _table(b, "Buffer", Data=b.EndVector())


def _tensor(b: flatbuffers.Builder, tensor: Tensor, buffer: int) -> int:
    name = b.CreateString(tensor.name)
    shape = _vector(b, "Tensor", "Shape", list(tensor.shape))
    q = tensor.quantization
    quantization = None if q is None else _table(
        b, "QuantizationParameters", Scale=b.CreateNumpyVector(np.asarray(q.scales, np.float32)),
        ZeroPoint=b.CreateNumpyVector(np.asarray(q.zero_points, np.int64)), QuantizedDimension=q.axis)
    return _table(b, "Tensor", Shape=shape, Type=tflite_type(tensor.dtype), Buffer=buffer, Name=name, HasRank=True,
                  Quantization=quantization)


def _operator(b: flatbuffers.Builder, op: Operator, code: int, renumber: dict[int, int]) -> int:
    options = _table(b, op.options, **op.fields) if op.options else None
    inputs = _vector(b, "Operator", "Inputs", [renumber[i] for i in op.inputs])
    outputs = _vector(b, "Operator", "Outputs", [renumber[i] for i in op.outputs])
    return _table(b, "Operator", OpcodeIndex=code, Inputs=inputs, Outputs=outputs,
                  BuiltinOptionsType=getattr(BuiltinOptions, op.options) if op.options else None,
                  BuiltinOptions=options)
