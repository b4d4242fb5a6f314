"""Inputs from the command line and from files: `--shape NAME:1x3x224x224`, and arrays from an `.npz`, an
`.npy` or one of ONNX's `test_data_set_*` folders (`input_0.pb`, ... each a serialized TensorProto)."""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from .errors import InputError


def parse_shape(text: str) -> tuple[str, tuple[int, ...]]:
    """`"input:1x3x224x224"` -> `("input", (1, 3, 224, 224))`; a name may itself hold colons."""
    name, _, dims = text.rpartition(":")
    if not name or not re.fullmatch(r"\d+(x\d+)*", dims or ""):
        raise InputError(f"--shape {text!r}: expected NAME:DIMS with DIMS like 1x3x224x224")
    return name, tuple(int(d) for d in dims.split("x"))


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
