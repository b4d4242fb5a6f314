"""The accuracy rule: how far an output is from its reference, and whether it is within a tolerance. The
precision gate, `compare`, `verify_bundle`, adaptive sessions and the tests all judge outputs here.

A tolerance is one of two forms:
- `{"rtol": r, "atol": a}`, element by element (numpy's `allclose`): `|y - ref| <= a + r * |ref|`;
- `{"scaled": t}`, the precision gate's, over the whole output: `max|y - ref| <= t * (1 + max|ref|)`.

One NaN rule for both: an element agrees where both sides are equal, the same infinity included, or both NaN;
any other element where either side is not finite is outside every tolerance. One relative error:
`max|y - ref| / max|ref|`, of the output's largest finite reference magnitude. Numpy only (a board's verify
uses it).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

Tolerance = Mapping[str, float]
CHUNK = 1 << 18  # elements compared at a time: float64 working copies of 2 MiB each
FP32_TOLERANCE = {"rtol": 1e-4, "atol": 1e-5}  # an fp32 provider's results against ONNX Runtime CPU


def scaled(tolerance: float) -> dict[str, float]:
    """The precision gate's tolerance of `tolerance` (see the module's docstring)."""
    return {"scaled": tolerance}


def compare(got: Any, want: Any, tolerance: Tolerance | None = None) -> dict[str, Any]:
    """`got` against its reference `want`: `max_abs_error` (over the elements that are finite on both sides),
    `max_rel_error`, `cosine`, `scale` (`1 + max|ref|`), `nonfinite` (elements outside every tolerance by
    the NaN rule) and, for 2-D float scores, `top1_agrees` (in every row); with a `tolerance`, `ok`.
    Outputs of different shapes, or non-numeric ones that differ, are `{"ok": False, "error"}` (no `ok`
    without a tolerance). Compared `CHUNK` elements at a time, so its float64 working copies stay small
    whatever the output's size."""
    got, want = np.asarray(got), np.asarray(want)
    verdict = {} if tolerance is None else {"ok": False}
    if got.shape != want.shape:
        return {**verdict, "error": f"shape {list(got.shape)}, expected {list(want.shape)}"}
    if got.dtype.kind not in "biufc" or want.dtype.kind not in "biufc":
        if not np.array_equal(got, want):
            return {**verdict, "error": "differs (not numbers: compared whole)"}
        entry = {"max_abs_error": None, "max_rel_error": None, "cosine": None}
        return entry if tolerance is None else {**entry, "ok": True}
    elementwise = tolerance is not None and "scaled" not in tolerance
    flat_got, flat_want = got.ravel(), want.ravel()
    worst = peak = dot = norm_got = norm_want = 0.0
    nonfinite, ok, same = 0, True, True
    for start in range(0, max(flat_got.size, 1), CHUNK):
        a = flat_got[start:start + CHUNK].astype(np.float64)
        b = flat_want[start:start + CHUNK].astype(np.float64)
        agree = (a == b) | (np.isnan(a) & np.isnan(b))
        diff = np.abs(np.subtract(a, b, out=np.zeros_like(a), where=~agree))
        finite, both, known = np.isfinite(diff), np.isfinite(a) & np.isfinite(b), np.isfinite(b)
        worst = max(worst, float(diff[finite].max())) if finite.any() else worst
        peak = max(peak, float(np.abs(b[known]).max())) if known.any() else peak
        if elementwise:
            ok = ok and bool((agree | finite & (diff <= tolerance["atol"] + tolerance["rtol"] * np.abs(b))).all())
        nonfinite += int((~finite).sum())
        a, b = a[both], b[both]
        dot += float(a @ b)
        norm_got = math.hypot(norm_got, float(np.linalg.norm(a)))  # hypot: no overflow where a norm would not
        norm_want = math.hypot(norm_want, float(np.linalg.norm(b)))
        same = same and np.array_equal(a, b)
    norms = norm_got * norm_want
    entry = {"max_abs_error": worst, "max_rel_error": worst / peak if peak else worst,
             "cosine": dot / norms if norms > 0 else float(same), "scale": 1.0 + peak, "nonfinite": nonfinite}
    if want.ndim == 2 and want.dtype.kind == "f" and want.shape[1] > 1:
        entry["top1_agrees"] = bool((got.argmax(1) == want.argmax(1)).all())
    if tolerance is None:
        return entry
    if "scaled" in tolerance:
        return {**entry, "ok": within_scaled(entry, tolerance["scaled"])}
    return {**entry, "ok": ok}


def within_scaled(entry: Mapping[str, Any], tolerance: float) -> bool:
    """Whether `compare`'s `entry` is within the precision gate's rule at `tolerance`."""
    return "error" not in entry and (entry.get("max_abs_error") is None or (
        entry["nonfinite"] == 0 and entry["max_abs_error"] <= tolerance * entry["scale"]))


def errors(got: Mapping[str, Any], reference: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """`compare`'s figures of every output of `reference` (by name) in `got`."""
    return {name: compare(got[name], want) for name, want in reference.items()}
