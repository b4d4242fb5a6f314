"""How far one output is from its reference: max absolute and relative error, cosine similarity, and whether
it is within `rtol`/`atol` (numpy's `allclose`). Numpy only, so a board's verify can use it."""

from __future__ import annotations

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
