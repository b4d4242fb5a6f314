"""The precision gate: a plan with reduced-precision stages is accepted only if, on every gate sample, each
output is within the tolerance of ONNX Runtime fp32's on the original model, by `accuracy`'s scaled rule
(`max|y - ref| <= tolerance * (1 + max|ref|)`). `optimize` and `export_bundle` gate plans here."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

from ..foundation.errors import first_line
from .accuracy import errors, within_scaled

Verdict = tuple[bool, dict[str, Any]]  # accepted, and per output the worst figures (or {"error"})


@dataclass(frozen=True)
class Precision:
    """What a reduced-precision search is gated on: the choice (`"auto"`, `"int8"`, ...), the tolerance,
    the samples each candidate plan runs on, ONNX Runtime fp32's outputs of the original model on them,
    and the calibration data (a `providers.quantize.Calibration`; None: none was given, int8 is not tried)."""

    choice: str
    tolerance: float
    samples: list[dict[str, Any]]
    references: list[dict[str, Any]]
    calibration: Any

    def check(self, compiled: Callable[[], AbstractContextManager[Any]]) -> Verdict:
        """The gate's verdict on the plan `compiled()` opens (an `Executor`, or anything with `outputs` and
        `run(None, feeds)`), run on every sample; a plan that fails to build or run is rejected."""
        try:
            with compiled() as executor:
                return gate_run(lambda s: executor.run(None, s), executor.outputs, self.samples, self.references,
                                self.tolerance)
        except Exception as error:  # noqa: BLE001 - a plan that cannot run its samples is not accepted
            return False, {"error": first_line(error)}


def gate(per_sample: Sequence[Mapping[str, Mapping[str, Any]]], tolerance: float) -> Verdict:
    """Whether every output of every sample is within `tolerance` (`accuracy.errors`' figures per sample),
    and per output the worst figures over the samples: max abs, max rel, lowest cosine, top-1 agreement."""
    worst: dict[str, dict[str, Any]] = {}
    ok = True
    for sample in per_sample:
        for name, e in sample.items():
            ok = ok and within_scaled(e, tolerance)
            w = worst.setdefault(name, {"max_abs_error": 0.0, "max_rel_error": 0.0, "cosine": 1.0})
            if "error" in e:
                w["error"] = e["error"]
            elif e["max_abs_error"] is not None:
                w["max_abs_error"] = max(w["max_abs_error"], e["max_abs_error"])
                w["max_rel_error"] = max(w["max_rel_error"], e["max_rel_error"])
                w["cosine"] = min(w["cosine"], e["cosine"])
            if "top1_agrees" in e:
                w["top1_agrees"] = w.get("top1_agrees", True) and e["top1_agrees"]
    return ok, worst


def gate_run(run: Callable[[Mapping[str, Any]], Sequence[Any]], outputs: Sequence[str],
             samples: Sequence[Mapping[str, Any]], references: Sequence[Mapping[str, Any]],
             tolerance: float) -> Verdict:
    """`gate` of a plan's outputs (`run(feeds)`, in `outputs` order) on every sample against its reference."""
    return gate([errors(dict(zip(outputs, run(s), strict=True)), ref) for s, ref in zip(samples, references)],
                tolerance)
