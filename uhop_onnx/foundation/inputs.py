"""Inputs from the command line and from files: `--shape NAME:1x3x224x224`, and arrays from an `.npz`, an
`.npy` or one of ONNX's `test_data_set_*` folders (`input_0.pb`, ... each a serialized TensorProto); and the
inputs a model is measured at, the shapes or sample arrays a user gives checked against its signatures.

Without either, a free leading dimension (the batch) is measured at 1; any other free dimension is never
guessed: `profile_feeds` raises an `InputError` naming each one and the option that sets it.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from .dtypes import TensorSig
from .errors import FreeDimensionError, InputError
from .inference import inferred
from .samples import sample_feeds

Shapes = Mapping[str, Sequence[int]]
Inputs = Mapping[str, np.ndarray] | str | os.PathLike


def parse_shape(text: str) -> tuple[str, tuple[int, ...]]:
    """`"input:1x3x224x224"` -> `("input", (1, 3, 224, 224))`; a name may itself hold colons."""
    name, _, dims = text.rpartition(":")
    if not name or not re.fullmatch(r"\d+(x\d+)*", dims or ""):
        raise InputError(f"--shape {text!r}: expected NAME:DIMS with DIMS like 1x3x224x224")
    return name, tuple(int(d) for d in dims.split("x"))


def parse_shapes(texts: Sequence[str] | None) -> dict[str, tuple[int, ...]] | None:
    """Repeated `--shape` options as a dict (None when there are none); a name given twice is an error."""
    shapes: dict[str, tuple[int, ...]] = {}
    for name, shape in map(parse_shape, texts or ()):
        if name in shapes:
            raise InputError(f"--shape {name}: given twice ({shapes[name]} and {shape}); give each input once")
        shapes[name] = shape
    return shapes or None


def read_inputs(path: str | os.PathLike, names: Sequence[str] | None = None) -> dict[str, np.ndarray]:
    """Arrays by input name from an `.npz` (its names), an `.npy` (for the model's only input, given in
    `names`), or a `test_data_set_*` folder (each tensor's own name, else the input at its position); a
    model folder holding such sets reads the first."""
    path = Path(path)
    try:
        if path.is_dir():
            return _test_data_set(path, names)
        if path.suffix == ".npy":
            return _npy(path, names)
        with np.load(path, allow_pickle=False) as data:
            if isinstance(data, np.ndarray):
                return _npy(path, names)
            return {name: data[name] for name in data.files}
    except InputError:
        raise
    except (OSError, ValueError, EOFError) as error:
        raise InputError(f"{path}: cannot read inputs ({error}); give an .npz (numpy.savez), an .npy or a "
                         "test_data_set_* folder of input_*.pb tensors") from None


def profile_feeds(signatures: Sequence[TensorSig], shapes: Shapes | None = None, inputs: Inputs | None = None,
                  seed: int = 0) -> dict[str, np.ndarray]:
    """One array per input: the given sample where there is one, else seeded random values of the given
    shape, else of the declared shape with a free leading dimension at 1. Raises `InputError` for a name
    the model lacks, a shape or sample its signature refuses, or free dimensions nobody gave."""
    names = [s.name for s in signatures]
    given = dict(read_inputs(inputs, names) if isinstance(inputs, (str, os.PathLike)) else inputs or {})
    shapes = {name: tuple(int(d) for d in shape) for name, shape in (shapes or {}).items()}
    by_name = dict(zip(names, signatures))
    for option, names in (("shapes", shapes), ("inputs", given)):
        unknown = [n for n in names if n not in by_name]
        if unknown:
            raise InputError(f"{option}: the model has no input {', '.join(map(repr, unknown))}; "
                             f"its inputs: {', '.join(by_name) or 'none'}")
    for name, value in given.items():
        value = given[name] = np.asarray(value)
        expected = by_name[name].dtype
        if expected is not None and value.dtype != expected:
            raise InputError(f"input {name!r}: the sample has dtype {value.dtype}; the model expects {expected} "
                             f"({by_name[name].type})")
        if name in shapes and shapes[name] != value.shape:
            raise InputError(f"input {name!r}: shapes gives {list(shapes[name])} but the sample has shape "
                             f"{list(value.shape)}; give one of them")
        shapes[name] = value.shape
    unset = []
    for sig in signatures:
        if sig.name in shapes:
            check_shape(sig, shapes[sig.name])
        else:
            unset += [(sig.name, axis, dim) for axis, dim in enumerate(sig.shape or ())
                      if axis > 0 and not _fixed(dim)]
    if unset:
        raise FreeDimensionError(_unset_message(signatures, unset))
    sampled = sample_feeds([sig for sig in signatures if sig.name not in given], seed=seed, shapes=shapes)
    return {sig.name: given[sig.name] if sig.name in given else sampled[sig.name] for sig in signatures}


def check_shape(sig: TensorSig, shape: Sequence[int]) -> None:
    """`InputError` naming the input, dimension and expected value when `shape` does not fit `sig`."""
    if sig.shape is None:
        return
    if len(shape) != len(sig.shape):
        raise InputError(f"input {sig.name!r}: shape {list(shape)} has rank {len(shape)}; the model expects rank "
                         f"{len(sig.shape)}: {sig.shape}")
    for axis, (got, want) in enumerate(zip(shape, sig.shape)):
        if _fixed(want) and got != want:
            raise InputError(f"input {sig.name!r}: shape {list(shape)} does not fit {sig.shape}: dimension {axis} "
                             f"must be {want}")


def free_inputs(model) -> list[str]:
    """Names of a model's inputs (`onnx.ModelProto`) with a free or unknown dimension."""
    initializers = {t.name for t in model.graph.initializer}
    return [v.name for v in model.graph.input if v.name not in initializers and v.type.HasField("tensor_type") and (
        not v.type.tensor_type.HasField("shape")
        or any(not d.HasField("dim_value") or d.dim_value < 0 for d in v.type.tensor_type.shape.dim))]


def shape_values(model, most: int = 8) -> list[str]:
    """Names of a model's (`onnx.ModelProto`) small integer inputs: int32 or int64, a scalar or a vector of at
    most `most` entries. Cut from its shape arithmetic, a stage gets its shapes, repeats and slice bounds
    from another stage as such inputs, where a runtime that builds for fixed shapes needs constants."""
    from onnx import TensorProto

    initializers = {t.name for t in model.graph.initializer}
    small = []
    for v in model.graph.input:
        tensor = v.type.tensor_type
        if (v.name in initializers or not v.type.HasField("tensor_type") or not tensor.HasField("shape")
                or tensor.elem_type not in (TensorProto.INT32, TensorProto.INT64)):
            continue
        dims = tensor.shape.dim
        if len(dims) == 0 or (len(dims) == 1 and 0 < dims[0].dim_value <= most):
            small.append(v.name)
    return small


def at_shapes(model, shapes: Shapes, values: Mapping[str, np.ndarray] | None = None):
    """A copy of `model` (`onnx.ModelProto`) whose inputs have the fixed `shapes`, and whose inputs named in
    `values` are those constants, every other shape inferred again from them: what a runtime that builds for
    fixed shapes compiles."""
    import onnx
    from onnx import numpy_helper

    fixed = onnx.ModelProto()
    fixed.CopyFrom(model)
    graph = fixed.graph
    if values:
        kept = [v for v in graph.input if v.name not in values]
        del graph.input[:]
        graph.input.extend(kept)
        graph.initializer.extend(numpy_helper.from_array(np.asarray(a), name) for name, a in values.items())
    for value in graph.input:
        if value.name in shapes and value.type.HasField("tensor_type"):
            dims = value.type.tensor_type.shape
            dims.ClearField("dim")
            for size in shapes[value.name]:
                dims.dim.add().dim_value = int(size)
    del graph.value_info[:]
    for value in graph.output:
        if value.type.HasField("tensor_type"):
            value.type.tensor_type.ClearField("shape")
    return inferred(fixed)


def measured_shapes(feeds: Mapping[str, np.ndarray]) -> dict[str, list[int]]:
    """The shapes a plan records it was measured at."""
    return {name: list(np.shape(value)) for name, value in feeds.items()}


def feeds_digest(feeds: Mapping[str, np.ndarray]) -> str:
    """A short digest of arrays by name (their dtypes, shapes and values): what cached figures were measured on."""
    import hashlib

    digest = hashlib.sha256()
    for name in sorted(feeds):
        value = np.ascontiguousarray(feeds[name])
        digest.update(f"{name}:{value.dtype}:{value.shape}:".encode() + value.tobytes())
    return digest.hexdigest()[:16]


def inputs_digest(inputs: Inputs) -> str:
    """`feeds_digest` of given arrays, or a digest of an inputs file's (or folder's) bytes."""
    if not isinstance(inputs, (str, os.PathLike)):
        return feeds_digest(inputs)
    import hashlib

    path = Path(inputs)
    digest = hashlib.sha256()
    for file in sorted(path.rglob("*")) if path.is_dir() else [path]:
        if file.is_file():
            digest.update(f"{file.relative_to(path) if path.is_dir() else file.name}:".encode() + file.read_bytes())
    return digest.hexdigest()[:16]


def _fixed(dim) -> bool:
    return isinstance(dim, int) and dim >= 0


def _unset_message(signatures: Sequence[TensorSig], unset: list[tuple[str, int, object]]) -> str:
    listed = ", ".join(f"input {name!r} axis {axis}" + (f" ({dim!r})" if dim else "") for name, axis, dim in unset)
    examples = []
    for sig in signatures:
        if any(name == sig.name for name, _, _ in unset):
            dims = [str(d) if _fixed(d) else "1" if axis == 0 else (d or "N").upper() if isinstance(d, str) else "N"
                    for axis, d in enumerate(sig.shape or ())]
            examples.append(f"{sig.name}:{'x'.join(dims)}")
    return (f"free dimension(s) with no size to measure at: {listed}; only a free leading (batch) dimension is "
            f"taken as 1. Give the shapes to measure at: --shape {' --shape '.join(examples)} "
            f"(shapes={{name: (...)}} in Python), or sample inputs: --inputs in.npz (inputs=)")


def _npy(path: Path, names: Sequence[str] | None) -> dict[str, np.ndarray]:
    if names is None or len(names) != 1:
        listed = ", ".join(names or ()) or "unknown"
        raise InputError(f"{path}: an .npy holds one array, and the model's inputs are {listed}; "
                         "give an .npz with one array per input")
    return {names[0]: np.load(path, allow_pickle=False)}


def _test_data_set(folder: Path, names: Sequence[str] | None) -> dict[str, np.ndarray]:
    files = sorted(folder.glob("input_*.pb"), key=lambda p: int(re.sub(r"\D", "", p.stem) or 0))
    if not files:
        sets = sorted(folder.glob("test_data_set_*"))
        if sets and sets[0].is_dir():
            return _test_data_set(sets[0], names)
        raise InputError(f"{folder}: no input_*.pb files (nor test_data_set_* folders) in it")
    from onnx import TensorProto, numpy_helper

    feeds = {}
    for k, file in enumerate(files):
        tensor = TensorProto()
        try:
            tensor.ParseFromString(file.read_bytes())
        except Exception as error:  # noqa: BLE001 - protobuf's DecodeError, or a read error
            raise InputError(f"{file}: not a serialized TensorProto ({error})") from None
        name = tensor.name or (names[k] if names is not None and k < len(names) else None)
        if name is None:
            raise InputError(f"{file}: the tensor has no name and the model has no input at position {k}")
        feeds[name] = numpy_helper.to_array(tensor)
    return feeds
