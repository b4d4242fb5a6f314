"""What `uhop-onnx compare` holds a plan's outputs to: the rule its gate passed it at where it was gated at a
reduced precision, else fp32's (`FP32_TOLERANCE`), unless `--rtol`/`--atol` are given. Outputs are judged by
the one accuracy rule, `precision.accuracy.compare`."""

from __future__ import annotations

from ..precision.accuracy import FP32_TOLERANCE, Tolerance, compare, scaled


def tolerance_for(gated: float | None, rtol: float | None = None, atol: float | None = None) -> Tolerance:
    """`{"rtol", "atol"}` where either is given (the other at fp32's), else the gate's `scaled(gated)` for
    a plan gated at `gated`, else `FP32_TOLERANCE`."""
    if rtol is not None or atol is not None:
        return {"rtol": FP32_TOLERANCE["rtol"] if rtol is None else rtol,
                "atol": FP32_TOLERANCE["atol"] if atol is None else atol}
    return FP32_TOLERANCE if gated is None else scaled(gated)


def tolerance_text(tolerance: Tolerance) -> str:
    """A tolerance as the command line shows it: `rtol 0.0001, atol 1e-05`, or the gate's rule."""
    if "scaled" in tolerance:
        return f"max|y - ref| <= {tolerance['scaled']:g} (1 + max|ref|), the plan's gate"
    return f"rtol {tolerance['rtol']:g}, atol {tolerance['atol']:g}"
