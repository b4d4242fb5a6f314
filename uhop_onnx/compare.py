"""How far one output is from its reference: max absolute and relative error, cosine similarity, and whether
it is within `rtol`/`atol` (numpy's `allclose`). Numpy only, so a board's verify can use it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np


def compare_arrays(got: Any, want: Any, rtol: float, atol: float) -> dict[str, Any]:
    """`{"ok", "max_abs_error", "max_rel_error", "cosine"}`, or `{"ok": False, "error"}` when the shapes
    differ; non-float outputs must be equal (their errors are None)."""
    got, want = np.asarray(got), np.asarray(want)
    if got.shape != want.shape:
        return {"ok": False, "error": f"shape {list(got.shape)}, expected {list(want.shape)}"}
    if got.dtype.kind not in "fc" or want.dtype.kind not in "fc":
        return {"ok": bool(np.array_equal(got, want)), "max_abs_error": None, "max_rel_error": None, "cosine": None}
    a, b = got.astype(np.float64).ravel(), want.astype(np.float64).ravel()
    diff = np.abs(a - b)
    finite = np.isfinite(diff)
    norms = np.linalg.norm(a) * np.linalg.norm(b)
    return {
        "ok": bool(np.allclose(got, want, rtol=rtol, atol=atol, equal_nan=True)),
        "max_abs_error": float(diff[finite].max()) if finite.any() else 0.0,
        "max_rel_error": float((diff[finite] / np.maximum(np.abs(b[finite]), np.finfo(np.float32).tiny)).max())
        if finite.any() else 0.0,
        "cosine": float(a @ b / norms) if norms > 0 else float(np.array_equal(a, b)),
    }


def compare_within(got: Any, want: Any, tolerance: Mapping[str, float]) -> dict[str, Any]:
    """`compare_arrays` against a bundle's tolerance: `{"rtol", "atol"}`, element by element (numpy's
    `allclose`), or `{"scaled": t}`, the precision gate's rule over the whole output,
    `max|got - want| <= t * (1 + max|want|)` (a non-finite difference fails unless both are NaN)."""
    if "scaled" not in tolerance:
        return compare_arrays(got, want, tolerance["rtol"], tolerance["atol"])
    result = compare_arrays(got, want, 0.0, 0.0)
    if "error" in result or result["max_abs_error"] is None:
        return result
    a, b = np.asarray(got, np.float64), np.asarray(want, np.float64)
    diff = np.abs(a - b)
    finite = np.isfinite(diff) | (np.isnan(a) & np.isnan(b))
    bound = tolerance["scaled"] * (1.0 + (float(np.abs(b[np.isfinite(b)]).max()) if np.isfinite(b).any() else 0.0))
    return {**result, "ok": bool(finite.all() and result["max_abs_error"] <= bound)}
