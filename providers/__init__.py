"""The provider registry: every provider uhop-onnx knows, in the order placement prefers them."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
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


def _flag(value: Any) -> bool:
    """An ONNX Runtime option flag (`True`, `1`, `"1"`, `"True"`) as a bool."""
    return str(value).strip().lower() in ("1", "true")


def _device_type(value: Any) -> str:
    """OpenVINO EP's `device_type` (`"CPU"`, `"GPU_FP16"`, `"GPU.0"`) as an OpenVINO device."""
    return str(value).split("_FP")[0]


# ONNX Runtime's execution provider names -> (provider id, {EP option: (our option, converter)}).
ORT_NAMES: dict[str, tuple[str, dict[str, tuple[str, Callable[[Any], Any]]]]] = {
    "CPUExecutionProvider": ("ort-cpu", {}),
    "CUDAExecutionProvider": ("ort-cuda", {"device_id": ("device_id", int)}),
    "TensorrtExecutionProvider": ("ort-tensorrt", {"device_id": ("device_id", int), "trt_fp16_enable": ("fp16", _flag),
                                                   "trt_engine_cache_path": ("engine_cache", str)}),
    "MIGraphXExecutionProvider": ("ort-rocm", {"device_id": ("device_id", int)}),
    "OpenVINOExecutionProvider": ("openvino", {"device_type": ("device", _device_type)}),
}

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
    "get_available_providers",
    "parse_spec",
    "resolve",
    "from_ort",
]


def from_ort(name: str, options: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    """An ONNX Runtime EP name and its options -> (provider id, options); ids and unknown names pass as they
    are. Only the EP options with a meaning here are accepted (others: `ProviderError`, listing them)."""
    if name not in ORT_NAMES:
        return name, dict(options)
    ident, table = ORT_NAMES[name]
    unknown = sorted(set(options) - set(table))
    if unknown:
        valid = ", ".join(sorted(table)) or "none"
        raise ProviderError(f"{name}: option(s) {', '.join(unknown)} have no meaning here; valid options: {valid}")
    return ident, {table[key][0]: table[key][1](value) for key, value in options.items()}


def parse_spec(spec: ProviderSpec) -> tuple[str, dict[str, Any]]:
    """`"openvino"`, `"openvino:GPU"` or `("openvino", {"device": "GPU"})` -> (id, options). ONNX Runtime's
    names are aliases: `"CPUExecutionProvider"`, `("OpenVINOExecutionProvider", {"device_type": "GPU"})`."""
    if isinstance(spec, str):
        ident, _, device = spec.partition(":")
        options = {"device": device} if device else {}
    elif isinstance(spec, (tuple, list)) and len(spec) == 2 and isinstance(spec[0], str) and isinstance(spec[1], dict):
        ident, options = spec[0], dict(spec[1])
    else:
        raise ProviderError(f"providers: expected an id or an (id, options) pair, got {spec!r}")
    ident, options = from_ort(ident, options)
    if ident not in REGISTRY:
        raise ProviderError(f"unknown provider {ident!r}; valid providers: {', '.join(REGISTRY)} "
                            f"(or ONNX Runtime's names: {', '.join(ORT_NAMES)})")
    return ident, options


def create(spec: ProviderSpec, threads: int | None = None) -> Provider:
    ident, options = parse_spec(spec)
    return REGISTRY[ident](options, threads)


def resolve(specs: Sequence[ProviderSpec] | None, threads: int | None = None, strict: bool = False) -> list[Provider]:
    """The providers a plan may use, in preference order: the listed ones, or every present one when `specs`
    is None; `ort-cpu` is appended as the last resort wherever it is installed (`appended`, when a list did
    not name it: it runs only the nodes no listed provider supports). A listed provider absent
    here is skipped with one warning, as ONNX Runtime does; with `strict` it raises `ProviderError`."""
    if isinstance(specs, str):
        specs = [s for s in specs.split(",") if s]
    if specs is None:
        chosen = [p for p in (cls(None, threads) for cls in REGISTRY.values()) if p.present]
    else:
        listed = [create(spec, threads) for spec in specs]
        if not listed:
            raise ProviderError(f"providers is empty; give at least one of: {', '.join(REGISTRY)}")
        chosen = []
        for provider in listed:
            if strict or provider.present:
                provider.require()
                chosen.append(provider)
            else:
                a = provider.availability
                warnings.warn(f"provider {provider.label!r} is not available here ({a.reason}); skipped. "
                              f"Pass strict=True to make this an error", UserWarning, stacklevel=3)
    if all(p.id != LAST_RESORT for p in chosen):
        last = REGISTRY[LAST_RESORT](None, threads)
        last.appended = specs is not None
        if last.present:
            chosen.append(last)
    if not chosen:
        raise ProviderError("no provider is present on this host; install one: pip install onnxruntime")
    return chosen


def get_available_providers() -> list[str]:
    """The ids of the providers present on this host, in registry order (onnxruntime's function of that name)."""
    return [ident for ident, cls in REGISTRY.items() if cls().present]


def devices() -> list[Availability]:
    """Every provider and device uhop-onnx knows, present or not."""
    return [p.availability for p in _known()]


def _known() -> Iterable[Provider]:
    for ident, cls in REGISTRY.items():
        for options in cls.known_options():
            yield cls(options)
