"""Reduced precision: the precisions a plan may use, calibration samples, and the accuracy gate a
reduced-precision plan must pass against ONNX Runtime fp32 (a stage is built at a reduced precision by its
provider: `providers/quantize.py`).

Tolerance, per output and per sample: `max|y - ref| <= tolerance * (1 + max|ref|)`.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .errors import InputError
from .files import read_npz

PRECISIONS = ("fp32", "bf16", "fp16", "int8")  # what a stage runs at
CHOICES = ("fp32", "auto", "bf16", "fp16", "int8")  # what `optimize(precision=...)` accepts
DEFAULT_TOLERANCE = 1e-2


def check_choice(precision: str, tolerance: float | None) -> float:
    """The tolerance a `precision` choice is gated with; `InputError` for an unknown precision or a
    tolerance that is not a positive number."""
    if precision not in CHOICES:
        raise InputError(f"precision: {precision!r} is not one of {', '.join(CHOICES)}")
    if tolerance is None:
        return DEFAULT_TOLERANCE
    if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)) or not tolerance > 0:
        raise InputError(f"tolerance: {tolerance!r} must be a positive number (1e-2: outputs within 1% of "
                         "their largest magnitude)")
    return float(tolerance)


def wanted(choice: str, offered: Sequence[str]) -> list[str]:
    """The precisions of a provider's `offered` ones that compete under `choice`: every one under `auto`;
    the named one and fp32 otherwise."""
    return [p for p in offered if choice == "auto" or p in ("fp32", choice)]


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


def errors(got: Mapping[str, np.ndarray], reference: Mapping[str, np.ndarray]) -> dict[str, dict[str, Any]]:
    """Per output: max abs error, max relative error (to the largest reference magnitude), cosine, the scale
    `1 + max|ref|` the tolerance is taken of, and for 2-D float scores whether the top-1 agrees in every row."""
    out = {}
    for name, want in reference.items():
        want, have = np.asarray(want), np.asarray(got[name])
        if have.shape != want.shape:
            out[name] = {"error": f"shape {list(have.shape)}, expected {list(want.shape)}"}
            continue
        a, b = have.astype(np.float64).ravel(), want.astype(np.float64).ravel()
        diff = float(np.abs(a - b).max()) if a.size else 0.0
        peak = float(np.abs(b).max()) if b.size else 0.0
        norms = float(np.linalg.norm(a) * np.linalg.norm(b))
        entry = {"max_abs_error": diff, "max_rel_error": diff / peak if peak else diff,
                 "cosine": float(a @ b / norms) if norms > 0 else float(np.array_equal(a, b)), "scale": 1.0 + peak}
        if want.ndim == 2 and want.dtype.kind == "f" and want.shape[1] > 1:
            entry["top1_agrees"] = bool((have.argmax(1) == want.argmax(1)).all())
        out[name] = entry
    return out


def gate(per_sample: Sequence[Mapping[str, Mapping[str, Any]]], tolerance: float) -> tuple[bool, dict[str, Any]]:
    """Whether every output of every sample is within `tolerance` (`errors`' figures per sample), and per
    output the worst figures over the samples: max abs, max rel, lowest cosine, top-1 agreement."""
    worst: dict[str, dict[str, Any]] = {}
    ok = True
    for sample in per_sample:
        for name, e in sample.items():
            w = worst.setdefault(name, {"max_abs_error": 0.0, "max_rel_error": 0.0, "cosine": 1.0})
            if "error" in e or not np.isfinite(e["max_abs_error"]) or e["max_abs_error"] > tolerance * e["scale"]:
                ok = False
            if "error" in e:
                w["error"] = e["error"]
                continue
            w["max_abs_error"] = max(w["max_abs_error"], e["max_abs_error"])
            w["max_rel_error"] = max(w["max_rel_error"], e["max_rel_error"])
            w["cosine"] = min(w["cosine"], e["cosine"])
            if "top1_agrees" in e:
                w["top1_agrees"] = w.get("top1_agrees", True) and e["top1_agrees"]
    return ok, worst


def gate_run(run: Callable[[Mapping[str, Any]], Sequence[Any]], outputs: Sequence[str],
             samples: Sequence[Mapping[str, Any]], references: Sequence[Mapping[str, Any]],
             tolerance: float) -> tuple[bool, dict[str, Any]]:
    """`gate` of a plan's outputs (`run(feeds)`, in `outputs` order) on every sample against its reference."""
    return gate([errors(dict(zip(outputs, run(s), strict=True)), ref) for s, ref in zip(samples, references)],
                tolerance)
