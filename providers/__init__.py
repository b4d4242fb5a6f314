"""The provider registry: every provider uhop-onnx knows, in the order placement prefers them."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from uhop_onnx.errors import ProviderError

from .base import Availability, Provider, Runner
from .capability import CapabilityTable, OpRule, Support
from .kernels import KernelsProvider
from .litert import LiteRt
from .openvino import OpenVino
from .ort import OrtCpu, OrtCuda, OrtRocm, OrtTensorRT
from .rknn import Rknn

# Accelerators first; ort-cpu, the last resort, last.
REGISTRY: dict[str, type[Provider]] = {cls.id: cls for cls in (OrtTensorRT, OrtCuda, OrtRocm, Rknn, OpenVino, LiteRt, KernelsProvider, OrtCpu)}
LAST_RESORT = "ort-cpu"

ProviderSpec = str | tuple[str, dict[str, Any]]

__all__ = [
    "LAST_RESORT",
    "REGISTRY",
    "Availability",
    "CapabilityTable",
    "OpRule",
    "Provider",
    "Runner",
    "Support",
    "create",
    "devices",
    "parse_spec",
    "resolve",
]


def parse_spec(spec: ProviderSpec) -> tuple[str, dict[str, Any]]:
    """`"openvino"`, `"openvino:GPU"` or `("openvino", {"device": "GPU"})` -> (id, options)."""
    if isinstance(spec, str):
        ident, _, device = spec.partition(":")
        options = {"device": device} if device else {}
    elif isinstance(spec, (tuple, list)) and len(spec) == 2 and isinstance(spec[0], str) and isinstance(spec[1], dict):
        ident, options = spec[0], dict(spec[1])
    else:
        raise ProviderError(f"providers: expected an id or an (id, options) pair, got {spec!r}")
    if ident not in REGISTRY:
        raise ProviderError(f"unknown provider {ident!r}; valid providers: {', '.join(REGISTRY)}")
    return ident, options


def create(spec: ProviderSpec, threads: int | None = None) -> Provider:
    ident, options = parse_spec(spec)
    return REGISTRY[ident](options, threads)


def resolve(specs: Sequence[ProviderSpec] | None, threads: int | None = None) -> list[Provider]:
    """The providers a plan may use, in preference order: the listed ones (each must be present), or every
    present one when `specs` is None; `ort-cpu` is appended as the last resort wherever it is installed."""
    if isinstance(specs, str):
        specs = [s for s in specs.split(",") if s]
    if specs is None:
        chosen = [p for p in (cls(None, threads) for cls in REGISTRY.values()) if p.present]
    else:
        chosen = [create(spec, threads) for spec in specs]
        for provider in chosen:
            provider.require()
        if not chosen:
            raise ProviderError(f"providers is empty; give at least one of: {', '.join(REGISTRY)}")
    if all(p.id != LAST_RESORT for p in chosen):
        last = REGISTRY[LAST_RESORT](None, threads)
        if last.present:
            chosen.append(last)
    if not chosen:
        raise ProviderError("no provider is present on this host; install one: pip install onnxruntime")
    return chosen


def devices() -> list[Availability]:
    """Every provider and device uhop-onnx knows, present or not."""
    return [p.availability for p in _known()]


def _known() -> Iterable[Provider]:
    for ident, cls in REGISTRY.items():
        for options in cls.known_options():
            yield cls(options)
