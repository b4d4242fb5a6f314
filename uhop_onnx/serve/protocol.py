"""The Open Inference Protocol (KServe v2 REST) codec: JSON tensors and the binary tensor extension.

A request body is a JSON header, optionally followed by raw tensor bytes; the header's length is in the
`Inference-Header-Content-Length` HTTP header and each binary input says its `binary_data_size`. Responses
use the same layout for outputs asked for as binary. The datatype tables and the BYTES packing are
`tritonclient.utils`'s, so the codec agrees with Triton's own client byte for byte.

JSON has no NaN or infinity: in JSON tensors they are the strings "NaN", "Infinity" and "-Infinity" (which
`tritonclient` reads back as floats), never the bare tokens Python's `json` writes; requests may use either.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from tritonclient.utils import deserialize_bytes_tensor, np_to_triton_dtype, serialize_byte_tensor, triton_to_np_dtype

from ..foundation.errors import InputError
from ..foundation.dtypes import TensorSig

HEADER_LENGTH = "Inference-Header-Content-Length"

# ONNX element types -> protocol datatypes, for those numpy has no dtype for.
_ONNX_ONLY = {"bfloat16": "BF16"}
# How JSON tensors spell the floats JSON has no number for.
NON_FINITE = {"NaN": float("nan"), "Infinity": float("inf"), "-Infinity": float("-inf")}


class ProtocolError(InputError):
    """A request the protocol refuses; `status` is the HTTP status to answer with."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status

    def __reduce__(self):  # raised in a worker process, it comes back with its status
        return type(self), (str(self), self.status)


@dataclass(frozen=True)
class InferRequest:
    """A decoded infer request: feeds by input name, and the outputs wanted with whether each is binary."""

    id: str | None
    feeds: dict[str, np.ndarray]
    outputs: list[tuple[str, bool]]


def datatype(sig: TensorSig) -> str:
    """The protocol datatype of a signature (`tensor(float)` -> `FP32`)."""
    kind = _kind(sig.dtype) if sig.dtype is not None else None
    if kind is not None:
        return kind
    name = sig.type.removeprefix("tensor(").removesuffix(")")
    return _ONNX_ONLY.get(name, name.upper())


def tensor_metadata(sig: TensorSig) -> dict[str, Any]:
    """`{"name", "datatype", "shape"}` with -1 for dimensions that vary."""
    shape = [d if isinstance(d, int) and d >= 0 else -1 for d in sig.shape] if sig.shape is not None else [-1]
    return {"name": sig.name, "datatype": datatype(sig), "shape": shape}


def decode_request(body: bytes, header_length: str | None, inputs: Sequence[TensorSig],
                   outputs: Sequence[TensorSig]) -> InferRequest:
    """Parse and check an infer request against the model's signatures; `ProtocolError` (400) when bad."""
    header, binary = _split(body, header_length)
    try:
        request = json.loads(header)
    except (UnicodeDecodeError, ValueError) as error:
        raise ProtocolError(f"malformed JSON in the request: {error}") from None
    except RecursionError:
        raise ProtocolError("the request's JSON is nested too deeply") from None
    if not isinstance(request, dict) or not isinstance(request.get("inputs"), list):
        raise ProtocolError('the request must be a JSON object with an "inputs" list')
    signatures = {s.name: s for s in inputs}
    feeds: dict[str, np.ndarray] = {}
    offset = 0
    for item in request["inputs"]:
        name, array, offset = _decode_input(item, signatures, binary, offset)
        if name in feeds:
            raise ProtocolError(f"input {name!r} is given twice")
        feeds[name] = array
    if offset != len(binary):
        raise ProtocolError(f"the request has {len(binary) - offset} bytes of binary data that no input claims")
    missing = [n for n in signatures if n not in feeds]
    if missing:
        raise ProtocolError(f"missing input(s) {', '.join(map(repr, missing))}; {_listing('inputs', inputs)}")
    request_id = request.get("id")
    return InferRequest(str(request_id) if request_id is not None else None, feeds,
                        _wanted_outputs(request, outputs))


def encode_response(model_name: str, request: InferRequest, values: Mapping[str, np.ndarray],
                    signatures: Sequence[TensorSig]) -> tuple[bytes, dict[str, str]]:
    """The response body and its extra headers, outputs in the order asked for."""
    types = {s.name: datatype(s) for s in signatures}
    entries, blobs = [], []
    for name, binary in request.outputs:
        value = np.asarray(values[name])
        kind = (_kind(value.dtype) or types[name]) if value.dtype.kind not in "OSU" else "BYTES"
        entry: dict[str, Any] = {"name": name, "datatype": kind, "shape": list(value.shape)}
        if binary:
            blob = _to_bytes(value, kind)
            entry["parameters"] = {"binary_data_size": len(blob)}
            blobs.append(blob)
        else:
            entry["data"] = _to_json_data(value, kind)
        entries.append(entry)
    response: dict[str, Any] = {"model_name": model_name, "model_version": "1", "outputs": entries}
    if request.id is not None:
        response["id"] = request.id
    header = json.dumps(response, separators=(",", ":"), allow_nan=False).encode()
    if not blobs:
        return header, {"content-type": "application/json"}
    return b"".join([header, *blobs]), {HEADER_LENGTH: str(len(header)), "content-type": "application/octet-stream"}


def error_body(message: str) -> bytes:
    return json.dumps({"error": message}).encode()


def too_large(limit: int) -> ProtocolError:
    return ProtocolError(f"the request is larger than the server's limit of {limit} bytes", 413)


def _split(body: bytes, header_length: str | None) -> tuple[bytes, memoryview]:
    if header_length is None:
        return body, memoryview(b"")
    try:
        length = int(header_length)
    except ValueError:
        length = -1
    if not 0 <= length <= len(body):
        raise ProtocolError(f"{HEADER_LENGTH} is {header_length!r}; it must be an integer from 0 to the body "
                            f"size ({len(body)})")
    return body[:length], memoryview(body)[length:]


def _decode_input(item: Any, signatures: Mapping[str, TensorSig], binary: memoryview,
                  offset: int) -> tuple[str, np.ndarray, int]:
    if not isinstance(item, dict) or not isinstance(item.get("name"), str):
        raise ProtocolError(f'each input must be an object with a "name", got {_short(item)}')
    name = item["name"]
    if name not in signatures:
        raise ProtocolError(f"unknown input {name!r}; {_listing('inputs', signatures.values())}")
    sig = signatures[name]
    kind, shape = item.get("datatype"), item.get("shape")
    expected = datatype(sig)
    if kind != expected:
        raise ProtocolError(f"input {name!r} has datatype {kind!r}; the model expects {expected}")
    if triton_to_np_dtype(kind) is None:
        raise ProtocolError(f"input {name!r}: datatype {kind} has no numpy type; this model cannot be served")
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                              for d in shape):
        raise ProtocolError(f"input {name!r}: shape must be a list of non-negative integers, got {_short(shape)}")
    _check_shape(sig, shape)
    parameters = item.get("parameters") or {}
    size = parameters.get("binary_data_size") if isinstance(parameters, dict) else None
    if size is not None:
        if not isinstance(size, int) or size < 0 or offset + size > len(binary):
            raise ProtocolError(f"input {name!r}: binary_data_size {size!r} exceeds the {len(binary) - offset} "
                                "bytes of binary data left")
        array = _from_bytes(name, binary[offset:offset + size], kind, shape)
        return name, array, offset + size
    if "data" not in item:
        raise ProtocolError(f'input {name!r} has neither "data" nor parameters.binary_data_size')
    return name, _from_json_data(name, item["data"], kind, shape), offset


def _check_shape(sig: TensorSig, shape: list[int]) -> None:
    if sig.shape is None:
        return
    fixed = [d if isinstance(d, int) and d >= 0 else -1 for d in sig.shape]
    if len(shape) != len(fixed) or any(want not in (-1, got) for got, want in zip(shape, fixed)):
        raise ProtocolError(f"input {sig.name!r} has shape {shape}; the model expects {fixed} (-1: any size)")


def _from_bytes(name: str, raw: memoryview, kind: str, shape: list[int]) -> np.ndarray:
    count = math.prod(shape)
    if kind == "BYTES":
        try:
            items = deserialize_bytes_tensor(raw)
        except struct.error as error:
            raise ProtocolError(f"input {name!r}: BYTES data is not length-prefixed elements ({error})") from None
        if len(items) != count:
            raise ProtocolError(f"input {name!r}: {len(items)} BYTES elements for shape {shape} ({count} expected)")
        return items.reshape(shape)
    dtype = np.dtype(triton_to_np_dtype(kind))
    if len(raw) != count * dtype.itemsize:
        raise ProtocolError(f"input {name!r}: {len(raw)} bytes of binary data for shape {shape} of {kind} "
                            f"({count * dtype.itemsize} expected)")
    return np.frombuffer(raw, dtype=dtype.newbyteorder("<")).astype(dtype, copy=True).reshape(shape)


def _from_json_data(name: str, data: Any, kind: str, shape: list[int]) -> np.ndarray:
    count = math.prod(shape)
    try:
        if kind == "BYTES":
            flat = np.array(data, dtype=np.object_).reshape(-1)
            array = np.array([v.encode() if isinstance(v, str) else v for v in flat], dtype=np.object_)
            if not all(isinstance(v, bytes) for v in array):
                raise TypeError("BYTES data must be strings")
        else:
            array = np.array(data)
            dtype = np.dtype(triton_to_np_dtype(kind))
            if array.dtype.kind == "U" and dtype.kind == "f":
                array = _spelled_floats(data)
            if array.dtype.kind not in "biuf" or (array.dtype.kind == "f" and dtype.kind in "biu"):
                raise TypeError(f"values of type {array.dtype} cannot be {kind}")
            array = array.astype(dtype)
    except (TypeError, ValueError, OverflowError) as error:
        raise ProtocolError(f"input {name!r}: data is not a list of {kind} values ({error})") from None
    if array.size != count:
        raise ProtocolError(f"input {name!r}: {array.size} values for shape {shape} ({count} expected)")
    return array.reshape(shape)


def _wanted_outputs(request: dict[str, Any], outputs: Sequence[TensorSig]) -> list[tuple[str, bool]]:
    parameters = request.get("parameters") or {}
    binary_default = bool(parameters.get("binary_data_output", False)) if isinstance(parameters, dict) else False
    asked = request.get("outputs")
    if asked is None:
        return [(s.name, binary_default) for s in outputs]
    if not isinstance(asked, list):
        raise ProtocolError('"outputs" must be a list of objects with a "name"')
    valid = {s.name for s in outputs}
    wanted = []
    for item in asked:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str) or item["name"] not in valid:
            name = item.get("name") if isinstance(item, dict) else item
            raise ProtocolError(f"unknown output {_short(name)}; {_listing('outputs', outputs)}")
        options = item.get("parameters") or {}
        if not isinstance(options, dict):
            raise ProtocolError(f"output {item['name']!r}: parameters must be an object")
        if options.get("classification"):
            raise ProtocolError(f"output {item['name']!r}: the classification extension is not supported")
        wanted.append((item["name"], bool(options.get("binary_data", binary_default))))
    return wanted


def _to_bytes(value: np.ndarray, kind: str) -> bytes:
    if kind != "BYTES":
        return np.ascontiguousarray(value, dtype=value.dtype.newbyteorder("<")).tobytes()
    packed = serialize_byte_tensor(value.astype(np.object_))
    return packed.item() if packed.size else b""


def _kind(dtype: np.dtype) -> str | None:
    """The protocol datatype of a numpy dtype, None for those the protocol has not."""
    return np_to_triton_dtype(np.dtype(dtype))


def _to_json_data(value: np.ndarray, kind: str) -> list:
    flat = value.reshape(-1)
    if kind == "BYTES":
        return [v.decode(errors="replace") if isinstance(v, bytes) else str(v) for v in flat]
    if flat.dtype.kind == "f" and not np.isfinite(flat).all():
        spelled = flat.astype(np.object_)
        for text, number in NON_FINITE.items():
            spelled[np.isnan(flat) if text == "NaN" else flat == number] = text
        return spelled.tolist()
    return flat.tolist()


def _spelled_floats(data: Any) -> np.ndarray:
    """JSON float data holding strings: those of `NON_FINITE` become their floats; any other string is refused."""
    values = np.array(data, dtype=np.object_)
    flat = values.reshape(-1)
    for i, v in enumerate(flat):
        if isinstance(v, str):
            if v not in NON_FINITE:
                raise TypeError(f"the string {_short(v)} is no number; the only strings a float tensor takes "
                                f"are {', '.join(NON_FINITE)}")
            flat[i] = NON_FINITE[v]
    return values.astype(np.float64)


def _listing(what: str, signatures) -> str:
    listed = ", ".join(f"{s.name} ({datatype(s)} {tensor_metadata(s)['shape']})" for s in signatures)
    return f"the model's {what}: {listed or 'none'}"


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."
