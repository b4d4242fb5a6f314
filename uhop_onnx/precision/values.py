"""The precisions: what a stage runs at, what `optimize(precision=...)` accepts, and the default tolerances."""

from __future__ import annotations

from collections.abc import Sequence

from ..foundation.errors import InputError

PRECISIONS = ("fp32", "bf16", "fp16", "int8")  # what a stage runs at, from the most precise down
REDUCED = PRECISIONS[1:]  # what a provider (or a target profile's provider) may offer besides fp32
CHOICES = ("fp32", "auto", *REDUCED)  # what `optimize(precision=...)` accepts
DEFAULT_TOLERANCE = 1e-2  # the gate's, without `tolerance=`


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


def lowest(in_use: Sequence[str]) -> str:
    """The least precise of the precisions `in_use`: the one a plan outside its gate gives up first."""
    return max(in_use, key=PRECISIONS.index)
