"""`load`: read an ONNX model safely, check it, name its nodes and infer its shapes."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import onnx
from google.protobuf import unknown_fields
from google.protobuf.message import DecodeError, Message
from onnx import external_data_helper, shape_inference

from ..foundation.errors import ModelError, first_line, logger
from ..foundation import ortlib
from ..foundation.files import check_external_data, check_locations, read_mapped, skeleton, temporary_folder
from ..foundation.graph import outer_inputs
from ..foundation.inference import inferred

log = logger(__name__)

MIN_OPSET = 1
MIN_IR_VERSION = 3


def load(model: str | os.PathLike | onnx.ModelProto | bytes, check: bool = True) -> onnx.ModelProto:
    """Load and check a model; return it with every node named and shapes inferred.

    Unnamed nodes become `f"{op_type}_{index}"`; a clash gets a numeric suffix. External data is read only
    from inside the model's own folder. With `check=False` the model is only parsed, named and given its
    external data: for a runtime that checks it itself (ONNX Runtime, running the model as it is).
    """
    data, where, folder = _bytes(model)
    proto = _parse(data, where, check)
    _check_versions(proto, where)
    external = check_external_data(data, folder, where)
    if external:
        read_external_data(proto, folder, where)
    name_nodes(proto.graph)
    if not check:
        return proto
    _check_structure(proto.graph, where)
    _check_sizes(proto.graph, where)
    del data  # the checker reads one serialization of the model, shape inference the model parsed from it
    with _within_protobuf(where, external):
        checked = serialized(proto)
    del proto
    try:
        onnx.checker.check_model(checked)
    except onnx.checker.ValidationError as error:
        raise ModelError(f"{where}: {first_line(error)}") from None
    proto = onnx.load_from_string(checked)
    del checked
    return _infer_shapes(proto, where)


_SKELETON = 1 << 20  # a smaller model is parsed whole: walking its wire format costs more


def load_as_read(model: str | os.PathLike | onnx.ModelProto | bytes) -> tuple[onnx.ModelProto, bytes | str]:
    """The model's structure (`load(model, check=False)` without its tensors' values, past `_SKELETON` bytes:
    names, signature, metadata, nodes named as `load` names them), and what a runtime given the model as it is
    takes, without reading or serializing it again: a file's resolved path (its external data checked to lie
    in its folder, not read; ONNX Runtime checks the same when it reads them), else the model's bytes."""
    if isinstance(model, (str, os.PathLike)):
        path, where, folder = _file(model)
        data = str(path.resolve())
        structure = (read_mapped(path, lambda view: skeleton(view, where)) if path.stat().st_size >= _SKELETON
                     else path.read_bytes())
    else:
        data, where, folder = _bytes(model)
        structure = skeleton(data, where) if len(data) >= _SKELETON else data
    proto = _parse(structure, where, check=False)
    _check_versions(proto, where)
    check_locations([(t.name, {e.key: e.value for e in t.external_data}) for t in _tensors(proto)
                     if t.data_location == onnx.TensorProto.EXTERNAL], folder, where)
    name_nodes(proto.graph)
    return proto, data


def _bytes(model: str | os.PathLike | onnx.ModelProto | bytes) -> tuple[bytes, str, Path | None]:
    """A model's serialized bytes, what to call it in messages, and the folder its external data lies in."""
    if isinstance(model, onnx.ModelProto):
        with _within_protobuf("model"):
            return serialized(model), "model", None
    if isinstance(model, bytes):
        return model, "model", None
    path, where, folder = _file(model)
    return path.read_bytes(), where, folder


def _file(model: object) -> tuple[Path, str, Path]:
    """A model file's path, what to call it in messages, and its folder; a `ModelError` when it is no file."""
    if not isinstance(model, (str, os.PathLike)):
        raise TypeError(f"a model is a file path, bytes or an onnx.ModelProto, not {type(model).__name__}")
    path = Path(model)
    if not path.is_file():
        raise ModelError(f"{path}: no such file")
    return path, str(path), path.resolve().parent


@contextmanager
def _within_protobuf(where: str, external: bool = False) -> Iterator[None]:
    """Protobuf's refusal to serialize a model past 2 GB, as a `ModelError` naming `where` (and, for a model
    whose weights are `external` already, what still runs it)."""
    try:
        yield
    except ValueError as error:
        remedy = ("its weights are external already, but checking and placing it serialize it whole; run it as "
                  "it is in a session (uhop_onnx.InferenceSession(path) gives ONNX Runtime its path)" if external else
                  "save it with its weights as external data and load it from its path")
        raise ModelError(f"{where}: cannot be serialized ({first_line(error)}); {remedy}") from None


def serialized(model: onnx.ModelProto) -> bytes:
    """`model.SerializeToString()`, the same bytes, made from `pieces` (about twice the model's size at its
    peak, where protobuf's own serializer takes about four times)."""
    return b"".join(pieces(model))


def saved(model: onnx.ModelProto, path: str | os.PathLike) -> str:
    """Write `model` to `path` as `model.SerializeToString()` would, piece by piece (`pieces`); its sha256."""
    digest = hashlib.sha256()
    with open(path, "wb") as f:
        for piece in pieces(model):
            f.write(piece)
            digest.update(piece)
    return digest.hexdigest()


def reference_session(model: onnx.ModelProto):
    """ONNX Runtime's reference session (`ortlib.reference_session`) of `model`, read from a file written piece by
    piece (`saved`): given the bytes, ONNX Runtime holds them beside its own copy while it builds (a ResNet-18
    of 45 MB peaks at 319 MiB so, at 261 from a file)."""
    with temporary_folder("reference") as folder:
        path = os.path.join(folder, "model.onnx")
        saved(model, path)
        return ortlib.reference_session(path)


def sha256(model: onnx.ModelProto) -> str:
    """The sha256 of `model.SerializeToString()`, read piece by piece (`pieces`)."""
    digest = hashlib.sha256()
    for piece in pieces(model):
        digest.update(piece)
    return digest.hexdigest()


def pieces(model: onnx.ModelProto) -> Iterator[bytes]:
    """The bytes of `model.SerializeToString()` in pieces, made one at a time, each weight of its graph one:
    protobuf's serializer holds about four times a message's size while it writes (its buffer grows by
    doubling, then is copied), which for a whole model of large weights is the peak of everything else.
    Fields come in field-number order, as protobuf writes them; a model or graph carrying fields this onnx
    does not know is serialized whole. `ValueError` past protobuf's 2 GB, as protobuf's own."""
    graph = model.graph
    if unknown_fields.UnknownFieldSet(model) or unknown_fields.UnknownFieldSet(graph):
        yield model.SerializeToString()
        return
    for field, value in model.ListFields():
        if field.name != "graph":
            yield type(model)(**{field.name: value}).SerializeToString()
            continue
        fields = graph.ListFields()
        small = {inner.name: type(graph)(**{inner.name: items}).SerializeToString()
                 for inner, items in fields if inner.name != "initializer"}
        number = graph.DESCRIPTOR.fields_by_name["initializer"].number
        size = sum(map(len, small.values())) + sum(len(_record(number, n)) + n
                                                   for n in (t.ByteSize() for t in graph.initializer))
        if size >= 2**31:
            raise ValueError("the model's serialization would pass protobuf's limit of 2 GB")
        yield _record(field.number, size)
        for inner, items in fields:
            if inner.name != "initializer":
                yield small[inner.name]
                continue
            for tensor in items:
                data = tensor.SerializeToString()
                yield _record(inner.number, len(data))
                yield data


def _record(number: int, size: int) -> bytes:
    """The key and length that start a length-delimited field `number` of `size` bytes."""
    head = bytearray()
    for value in ((number << 3) | 2, size):
        while value >= 0x80:
            head.append(value & 0x7F | 0x80)
            value >>= 7
        head.append(value)
    return bytes(head)


def _infer_shapes(proto: onnx.ModelProto, where: str) -> onnx.ModelProto:
    """`proto` with its shapes inferred strictly (`inference.inferred`); an error inside the body of a standard
    op's function (onnx's own bodies do not all pass strict inference) is logged and inference redone
    leniently."""
    try:
        return inferred(proto, check_type=True, strict_mode=True)
    except shape_inference.InferenceError as error:
        if not _in_function_body(str(error)):
            raise ModelError(f"{where}: {first_line(error)}") from None
        log.warning("%s: shape inference failed inside a function body (%s); using partial shapes",
                    where, first_line(error))
    try:
        return inferred(proto, check_type=True, strict_mode=False)
    except shape_inference.InferenceError as error:
        raise ModelError(f"{where}: {first_line(error)}") from None


def _in_function_body(message: str) -> bool:
    """Whether a strict inference error is nested: raised by a node of an op's function body."""
    return message.count("(op_type:") > 1


def name_nodes(graph: onnx.GraphProto) -> None:
    """Give every node a unique name: unnamed ones `op_type_index`, clashes a numeric suffix."""
    taken: set[str] = set()
    for index, node in enumerate(graph.node):
        base = node.name or f"{node.op_type}_{index}"
        name, k = base, 0
        while name in taken:
            k += 1
            name = f"{base}_{k}"
        node.name = name
        taken.add(name)


def _parse(data: bytes, where: str, check: bool = True) -> onnx.ModelProto:
    if not data:
        raise ModelError(f"{where}: the file is empty")
    proto = onnx.ModelProto()
    try:
        proto.ParseFromString(data)
    except (DecodeError, RuntimeError, ValueError) as error:
        raise ModelError(f"{where}: not an ONNX model or truncated ({first_line(error)})") from None
    if not proto.HasField("graph") or proto.ir_version == 0:
        raise ModelError(f"{where}: not an ONNX model (no graph or no IR version)")
    if check:
        _check_text(proto, where)
    return proto


def _check_text(message, where: str) -> None:
    """Refuse a string field that is not UTF-8 (protobuf hands such a field back as bytes, and fails only
    when it is written). Bytes fields, such as tensor data, are not read."""
    for field in message.DESCRIPTOR.fields:
        if field.type == field.TYPE_STRING:
            value = getattr(message, field.name)
            bad = next((v for v in ([value] if isinstance(value, (str, bytes)) else value) if isinstance(v, bytes)), None)
            if bad is not None:
                raise ModelError(f"{where}: {message.DESCRIPTOR.name}.{field.name} {bad[:40]!r} is not valid UTF-8; "
                                 "the file is corrupt")
        elif field.type == field.TYPE_MESSAGE:
            value = getattr(message, field.name)
            if not isinstance(value, Message):
                for item in value:
                    _check_text(item, where)
            elif message.HasField(field.name):
                _check_text(value, where)


def _check_versions(model: onnx.ModelProto, where: str) -> None:
    if not MIN_IR_VERSION <= model.ir_version <= onnx.IR_VERSION:
        raise ModelError(
            f"{where}: IR version {model.ir_version} is outside {MIN_IR_VERSION}..{onnx.IR_VERSION} "
            f"(onnx {onnx.__version__}); re-export the model with a supported IR version"
        )
    newest = onnx.defs.onnx_opset_version()
    for opset in model.opset_import:
        if opset.domain in ("", "ai.onnx") and not MIN_OPSET <= opset.version <= newest:
            raise ModelError(
                f"{where}: opset {opset.version} of ai.onnx is outside the supported {MIN_OPSET}..{newest}; "
                "convert it with onnx.version_converter or re-export"
            )


def read_external_data(model: onnx.ModelProto, folder: Path, where: object, error: type = ModelError) -> None:
    """Read into `model` the data its tensors keep in files of `folder`, once `files.check_external_data`
    accepted them, so that no runtime resolves those paths again (a sparse tensor's is refused: onnx reads
    none)."""
    try:
        external_data_helper.load_external_data_for_model(model, str(folder))
    except (OSError, ValueError) as failure:
        raise error(f"{where}: cannot read external data ({first_line(failure)})") from None
    left = next((t for t in _tensors(model) if t.data_location == onnx.TensorProto.EXTERNAL), None)
    if left is not None:
        raise error(f"{where}: tensor {left.name!r} keeps its data in another file, which is read only for "
                    "initializers and tensor attributes; store it in the model")


def _tensors(model: onnx.ModelProto):
    """Every tensor of a model (what `files.external_tensors` walks in the serialized bytes): initializers,
    sparse tensors' parts and tensor attributes, in every subgraph and function."""

    def of_graph(graph):
        yield from graph.initializer
        for sparse in graph.sparse_initializer:
            yield from (sparse.values, sparse.indices)
        yield from of_nodes(graph.node)

    def of_nodes(nodes):
        for node in nodes:
            for a in node.attribute:
                yield from (*([a.t] if a.HasField("t") else []), *a.tensors)
                for sparse in (*([a.sparse_tensor] if a.HasField("sparse_tensor") else []), *a.sparse_tensors):
                    yield from (sparse.values, sparse.indices)
                for graph in (*([a.g] if a.HasField("g") else []), *a.graphs):
                    yield from of_graph(graph)

    yield from of_graph(model.graph)
    for function in model.functions:
        yield from of_nodes(function.node)


def _check_sizes(graph: onnx.GraphProto, where: str) -> None:
    """Graph inputs and outputs whose fixed dimensions multiply past what an int64 can count."""
    for value in (*graph.input, *graph.output):
        dims = [d.dim_value for d in value.type.tensor_type.shape.dim if d.HasField("dim_value")]
        elements = 1
        for d in dims:
            elements *= d
        if elements >= 2**63:
            raise ModelError(f"{where}: tensor {value.name!r} declares shape {dims}, more elements than any runtime "
                             "can address; fix the model's declared dimensions")


def _check_structure(graph: onnx.GraphProto, where: str) -> None:
    """Dangling inputs, tensors written twice, and cycles, named; an unsorted acyclic graph is sorted."""
    available = {i.name for i in graph.input} | {i.name for i in graph.initializer}
    available |= {i.values.name for i in graph.sparse_initializer}
    writer: dict[str, int] = {}
    for index, node in enumerate(graph.node):
        for out in filter(None, node.output):
            if out in writer or out in available:
                first = f"node {graph.node[writer[out]].name!r}" if out in writer else "a graph input or initializer"
                raise ModelError(f"{where}: tensor {out!r} is written by both {first} and node {node.name!r}")
            writer[out] = index
    for node in graph.node:
        for name in filter(None, node.input):
            if name not in writer and name not in available:
                raise ModelError(
                    f"{where}: node {node.name!r} reads {name!r}, which no node, graph input or initializer provides"
                )
    for out in graph.output:
        if out.name not in writer and out.name not in available:
            raise ModelError(f"{where}: graph output {out.name!r} is produced by nothing")
    _sort(graph, writer, where)


def _sort(graph: onnx.GraphProto, writer: dict[str, int], where: str) -> None:
    """Topologically sort the nodes (depth first, stable), or name the cycle that prevents it."""
    nodes = list(graph.node)
    deps = [sorted({writer[i] for i in (*n.input, *outer_inputs(n)) if i in writer}) for n in nodes]
    order: list[int] = []
    state = [0] * len(nodes)  # 0 unseen, 1 on the path, 2 placed
    for root in range(len(nodes)):
        if state[root]:
            continue
        path = [(root, iter(deps[root]))]
        state[root] = 1
        while path:
            index, pending = path[-1]
            dep = next(pending, None)
            if dep is None:
                path.pop()
                state[index] = 2
                order.append(index)
            elif state[dep] == 1:
                on_path = [i for i, _ in path]
                cycle = [nodes[i].name for i in on_path[on_path.index(dep):]] + [nodes[dep].name]
                raise ModelError(f"{where}: the graph has a cycle through nodes {' -> '.join(cycle)}")
            elif state[dep] == 0:
                state[dep] = 1
                path.append((dep, iter(deps[dep])))
    if order != list(range(len(nodes))):
        del graph.node[:]
        graph.node.extend(nodes[i] for i in order)

