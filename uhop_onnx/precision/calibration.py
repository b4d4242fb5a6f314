"""Calibration samples: read from an `.npz`, a folder of them or a dict, split one feed per sample as the
model's inputs declare, and checked against the model's inputs."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..foundation.errors import InputError
from ..foundation.files import read_npz
from .values import check_choice


def read_choice(precision: str, tolerance: float | None, calibration: Any, shapes: Any, inputs: Any,
                model: Any = None) -> tuple[float, list[dict[str, np.ndarray]] | None, Any]:
    """What `optimize` and `export_bundle` take of their precision arguments: the tolerance, the calibration
    samples (None at fp32 or without calibration; split as `model`'s inputs declare, see `read_calibration`)
    and the inputs measurements run on (`inputs`, or without `shapes` and `inputs` the first calibration
    sample)."""
    tolerance = check_choice(precision, tolerance)
    samples = (None if precision == "fp32" or calibration is None
               else read_calibration(calibration, declared_inputs(model)))
    return tolerance, samples, samples[0] if samples and shapes is None and inputs is None else inputs


def sample_error(error: InputError) -> InputError:
    """`error`, raised on the first calibration sample (measurements ran on it), said of that sample."""
    return InputError(f"calibration sample 0: {str(error).removeprefix('inputs: ')} ({FORMS})")


FORMS = ("a calibration .npz gives each input one more axis, of samples: for an input of shape (4, 3, 224, 224), "
         "arrays of shape (samples, 4, 3, 224, 224); or stacks its samples on the batch axis: (samples * 4, 3, "
         "224, 224)")


def read_calibration(source: str | os.PathLike | Mapping[str, Any],
                     declared: Mapping[str, Sequence[int | None]] | None = None) -> list[dict[str, np.ndarray]]:
    """Calibration samples, one feed dict per sample: from a folder of `.npz` files, one sample each, or from
    an `.npz` (or a dict) whose arrays carry a leading sample axis. Where `declared` gives an input's
    dimensions (None where free), an array of one more dimension holds one sample per entry, and one of the
    same rank holds its samples stacked on the batch axis, as many rows each as the input's fixed first
    dimension (else 1)."""
    if isinstance(source, Mapping):
        return _split(dict(source), "calibration", declared or {})
    path = Path(source)
    if not path.is_dir():
        return _split(_read_npz(path), str(path), declared or {})
    files = sorted(path.glob("*.npz"))
    if not files:
        raise InputError(f"calibration: {path} holds no .npz file; give one .npz per sample, or one .npz "
                         "whose arrays carry a leading sample axis")
    return [_read_npz(file) for file in files]


def declared_inputs(model: Any) -> dict[str, list[int | None]]:
    """A model's (path, bytes or `onnx.ModelProto`) inputs' declared dimensions, None where free; empty
    where it cannot be read (loading it names the problem)."""
    if model is None:
        return {}
    import onnx

    try:
        proto = (model if isinstance(model, onnx.ModelProto) else onnx.load_from_string(model)
                 if isinstance(model, bytes) else onnx.load(os.fspath(model), load_external_data=False))
    except Exception:  # noqa: BLE001 - not readable: `load` says why, later
        return {}
    initializers = {t.name for t in proto.graph.initializer}
    return {v.name: [d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else None
                     for d in v.type.tensor_type.shape.dim]
            for v in proto.graph.input if v.name not in initializers and v.type.tensor_type.HasField("shape")}


def check_samples(samples: Sequence[Mapping[str, Any]], names: Sequence[str]) -> None:
    """`InputError` unless every calibration sample holds exactly the model's inputs `names`."""
    for k, sample in enumerate(samples):
        missing, extra = sorted(set(names) - set(sample)), sorted(set(sample) - set(names))
        if missing or extra:
            raise InputError(f"calibration sample {k}: " + "; ".join(
                part for part in (missing and f"lacks input(s) {', '.join(missing)}",
                                  extra and f"has no such input(s) {', '.join(extra)}") if part)
                + f"; the model's inputs: {', '.join(names)}")


def _read_npz(path: Path) -> dict[str, np.ndarray]:
    try:
        return read_npz(path)
    except InputError as error:
        raise InputError(f"calibration: {error}; give an .npz (numpy.savez) or a folder of them") from None


def _split(arrays: dict[str, Any], where: str, declared: Mapping[str, Sequence[int | None]]
           ) -> list[dict[str, np.ndarray]]:
    """Arrays with a leading sample axis -> one feed dict per sample (see `read_calibration`)."""
    arrays = {name: np.asarray(value) for name, value in arrays.items()}
    rows = {name: _rows(value, declared.get(name), where, name) for name, value in arrays.items() if value.ndim}
    counts = {name: len(arrays[name]) // (rows[name] or 1) for name in rows}
    if not arrays or len(counts) < len(arrays) or len(set(counts.values())) != 1:
        raise InputError(f"calibration: {where}: every array must carry the same leading sample axis "
                         f"(found {', '.join(f'{n}: {list(np.shape(v))}' for n, v in arrays.items()) or 'none'}); "
                         f"{FORMS}")
    return [{name: value[k] if rows[name] is None else value[k * rows[name]:(k + 1) * rows[name]]
             for name, value in arrays.items()} for k in range(next(iter(counts.values())))]


def _rows(value: np.ndarray, dims: Sequence[int | None] | None, where: str, name: str) -> int | None:
    """How many rows of `value` make one sample of an input declared `dims`: None where it has one axis
    more (each entry is a sample), else its fixed batch (1 where free or unknown)."""
    if dims is None:
        return 1
    if value.ndim == len(dims) + 1:
        return None
    batch = dims[0] if value.ndim == len(dims) and dims and dims[0] else 1
    if len(value) % batch:
        raise InputError(f"calibration: {where}: array {name!r} of shape {list(value.shape)} stacks its samples "
                         f"on the batch axis of an input whose batch is {batch}, so its length must be a "
                         f"multiple of {batch}; {FORMS}")
    return batch
