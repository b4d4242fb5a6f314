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


def read_choice(precision: str, tolerance: float | None, calibration: Any, shapes: Any, inputs: Any
                ) -> tuple[float, list[dict[str, np.ndarray]] | None, Any]:
    """What `optimize` and `export_bundle` take of their precision arguments: the tolerance, the calibration
    samples (None at fp32 or without calibration) and the inputs measurements run on (`inputs`, or without
    `shapes` and `inputs` the first calibration sample)."""
    tolerance = check_choice(precision, tolerance)
    samples = None if precision == "fp32" or calibration is None else read_calibration(calibration)
    return tolerance, samples, samples[0] if samples and shapes is None and inputs is None else inputs


def sample_error(error: InputError) -> InputError:
    """`error`, raised on the first calibration sample (measurements ran on it), said of that sample."""
    return InputError(f"calibration sample 0: {str(error).removeprefix('inputs: ')} (a calibration .npz stacks "
                      "its samples on the batch axis: for an input of shape (1, 3, 224, 224), arrays of shape "
                      "(samples, 3, 224, 224))")


def read_calibration(source: str | os.PathLike | Mapping[str, Any]) -> list[dict[str, np.ndarray]]:
    """Calibration samples, one feed dict per sample: from an `.npz` (or a dict) whose arrays carry a leading
    sample axis, or from a folder of `.npz` files, one sample each."""
    if isinstance(source, Mapping):
        samples = _split(dict(source), "calibration")
    else:
        path = Path(source)
        if path.is_dir():
            files = sorted(path.glob("*.npz"))
            if not files:
                raise InputError(f"calibration: {path} holds no .npz file; give one .npz per sample, or one .npz "
                                 "whose arrays carry a leading sample axis")
            samples = [_read_npz(file) for file in files]
        else:
            samples = _split(_read_npz(path), str(path))
    return samples


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
        with np.load(path, allow_pickle=False) as data:
            return {name: data[name] for name in data.files}
    except (OSError, ValueError, EOFError, AttributeError) as error:
        raise InputError(f"calibration: cannot read {path} ({error}); give an .npz (numpy.savez) or a folder "
                         "of them") from None


def _split(arrays: dict[str, Any], where: str) -> list[dict[str, np.ndarray]]:
    """Arrays with a leading sample axis -> one feed dict per sample (each keeps a batch axis of 1)."""
    arrays = {name: np.asarray(value) for name, value in arrays.items()}
    counts = {name: len(value) for name, value in arrays.items() if value.ndim}
    if not arrays or len(counts) < len(arrays) or len(set(counts.values())) != 1:
        raise InputError(f"calibration: {where}: every array must carry the same leading sample axis "
                         f"(found {', '.join(f'{n}: {list(np.shape(v))}' for n, v in arrays.items()) or 'none'})")
    n = next(iter(counts.values()))
    return [{name: value[k:k + 1] for name, value in arrays.items()} for k in range(n)]


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
