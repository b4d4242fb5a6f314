"""The provider registry: every provider uhop-onnx knows, in the order placement prefers them."""

from __future__ import annotations

from collections import UserDict
from collections.abc import Iterable, Sequence
from importlib import import_module
from typing import Any

from uhop_onnx.foundation.errors import InputError, ProviderError

from .base import DEVICE_KINDS, ArtifactFormat, Availability, Lowering, Provider
from .runner import Runner
from .capability import CapabilityTable, OpRule, Support
from .ort_names import ORT_NAMES, from_ort, warn


class _Registry(UserDict):
    """Provider classes by id; a provider's module is imported when its class is first asked for, so that a
    session on ONNX Runtime imports no other provider's module (and none of the runtimes they import)."""

    def __getitem__(self, ident: str) -> type[Provider]:
        found = self.data[ident]
        if isinstance(found, str):
            module, _, name = found.partition(":")
            found = self.data[ident] = getattr(import_module(module, __name__), name)
        return found


# Accelerators first; ort-cpu, the last resort, last.
REGISTRY: UserDict[str, type[Provider]] = _Registry({
    "ort-tensorrt": ".ort:OrtTensorRT", "ort-cuda": ".ort:OrtCuda", "ort-rocm": ".ort:OrtRocm",
    "ort-qnn": ".ort:OrtQnn", "rknn": ".rknn:Rknn", "openvino": ".openvino:OpenVino", "litert": ".litert:LiteRt",
    "kernels": ".kernels:KernelsProvider", "ort-cpu": ".ort:OrtCpu"})
LAST_RESORT = "ort-cpu"

ProviderSpec = str | tuple[str, dict[str, Any]]


# How `resolve` reads ONNX Runtime's names: "device" (a name is a device, every provider present there
# competes) or "literal" (a name is an alias of one provider: CPUExecutionProvider = ort-cpu).
POLICIES = ("device", "literal")
# The providers that run on this host's CPU, in registry order: what CPUExecutionProvider names as a device.
HOST_CPU: tuple[tuple[str, dict[str, Any]], ...] = (("openvino", {}), ("litert", {}), ("kernels", {}), ("ort-cpu", {}))

__all__ = [
    "DEVICE_KINDS",
    "LAST_RESORT",
    "ORT_NAMES",
    "POLICIES",
    "REGISTRY",
    "ArtifactFormat",
    "Availability",
    "CapabilityTable",
    "Lowering",
    "OpRule",
    "Provider",
    "Runner",
    "Support",
    "create",
    "device_kind",
    "devices",
    "get_available_providers",
    "listed",
    "parse_spec",
    "resolve",
    "from_ort",
]


def parse_spec(spec: ProviderSpec) -> tuple[str, dict[str, Any]]:
    """`"openvino"`, `"openvino:GPU"` or `("openvino", {"device": "GPU"})` -> (id, options). ONNX Runtime's
    names are read as aliases here: `"CPUExecutionProvider"`, `("OpenVINOExecutionProvider", {"device_type":
    "GPU"})` (`resolve` reads them as devices)."""
    ident, options = from_ort(*_split(spec))
    if ident not in REGISTRY:
        raise ProviderError(f"unknown provider {ident!r}; valid providers: {', '.join(REGISTRY)} "
                            f"(or ONNX Runtime's names: {', '.join(ORT_NAMES)})")
    return ident, options


def _split(spec: ProviderSpec) -> tuple[str, dict[str, Any]]:
    """A spec as written -> (name, options), the name not yet read."""
    if isinstance(spec, str):
        ident, _, device = spec.partition(":")
        return ident, {"device": device} if device else {}
    if isinstance(spec, (tuple, list)) and len(spec) == 2 and isinstance(spec[0], str) and isinstance(spec[1], dict):
        return spec[0], dict(spec[1])
    raise ProviderError(f"providers: expected an id or an (id, options) pair, got {spec!r}")


def device_kind(ident: str, options: dict[str, Any]) -> str:
    """The device kind (`DEVICE_KINDS`: "cpu", "gpu", "npu", "delegate") a stage of provider `ident` with
    `options` computes on, as the provider declares it."""
    if ident not in REGISTRY:
        raise ProviderError(f"unknown provider {ident!r}; valid providers: {', '.join(REGISTRY)}")
    return REGISTRY[ident].device_kind(options)


def create(spec: ProviderSpec, threads: int | None = None) -> Provider:
    ident, options = parse_spec(spec)
    return REGISTRY[ident](options, threads)


def resolve(specs: Sequence[ProviderSpec] | None, threads: int | None = None, strict: bool = False,
            policy: str = "device") -> list[Provider]:
    """The providers a plan may use, in preference order: the listed ones, or every one present when `specs`
    is None (as its installed files tell, where they can: no runtime is imported to list it); `ort-cpu` is
    appended as the last resort wherever it is installed (`appended`, when a list did not name it: it runs
    only the nodes no listed provider supports). Under `policy="device"`, ONNX Runtime's names name devices
    (`listed`); under "literal" they are aliases. A listed provider its probe finds absent here is skipped
    with one warning, as ONNX Runtime does; with `strict` it raises `ProviderError`."""
    if policy not in POLICIES:
        raise InputError(f"policy: {policy!r} is not one of {', '.join(POLICIES)}")
    if isinstance(specs, str):
        specs = [s for s in specs.split(",") if s]
    if specs is None:
        chosen = [p for p in (cls(None, threads) for cls in REGISTRY.values()) if p.availability.present]
    else:
        if not specs:
            raise ProviderError(f"providers is empty; give at least one of: {', '.join(REGISTRY)}")
        chosen = []
        for provider in listed(specs, threads, policy, strict):
            if strict or provider.present:
                provider.require()
                chosen.append(provider)
            else:
                a = provider.probed
                warn(f"provider {provider.label!r} is not available here ({a.reason}); skipped. "
                     f"Pass strict=True to make this an error")
    if all(p.id != LAST_RESORT for p in chosen):
        last = REGISTRY[LAST_RESORT](None, threads)
        last.appended = specs is not None
        if last.present:
            chosen.append(last)
    if not chosen:
        raise ProviderError("no provider is present on this host; install one: pip install onnxruntime")
    return chosen


def listed(specs: Sequence[ProviderSpec], threads: int | None, policy: str, strict: bool = False) -> list[Provider]:
    """The providers `specs` name, in order, without duplicates. uhop's ids name exactly one provider. Under
    `policy="device"`, `CPUExecutionProvider` is every provider present that runs on this host's CPU
    (`HOST_CPU`), a GPU or NPU EP name its own provider followed, after every name listed, by the CPU ones (for
    what the device cannot run), and `ort-cpu` comes last. ONNX Runtime's other EP names (`AzureExecutionProvider`,
    `CoreMLExecutionProvider`...) have no provider here: skipped with a warning, as ONNX Runtime skips an EP
    its build lacks (`strict`: `ProviderError`)."""
    names = [_split(spec) for spec in specs]
    devices = [ORT_NAMES[n].device if n in ORT_NAMES and policy == "device" else None for n, _ in names]
    cpu = [p for p in (REGISTRY[i](o, threads) for i, o in HOST_CPU) if p.present] if any(devices) else []
    named: list[Provider] = []
    for (name, options), device in zip(names, devices, strict=True):
        if name.endswith("ExecutionProvider") and name not in ORT_NAMES:
            if strict:
                raise ProviderError(f"ONNX Runtime's {name} has no provider in uhop-onnx; valid: "
                                    f"{', '.join(REGISTRY)} or {', '.join(ORT_NAMES)}")
            warn(f"ONNX Runtime's {name} has no provider in uhop-onnx; skipped")
            continue
        ident, options = from_ort(name, options)
        named.extend(cpu if device == "cpu" else [create((ident, options), threads)])
    named.extend(cpu if {"gpu", "npu"} & set(devices) else [])
    unique: dict[tuple, Provider] = {}
    for provider in named:
        unique.setdefault(_key(provider), provider)
    return sorted(unique.values(), key=lambda p: p.id == LAST_RESORT) if any(devices) else list(unique.values())


def _key(provider: Provider) -> tuple:
    """What makes two listed providers the same: the id and the options (a `device` of CPU is the default)."""
    options = {k: v for k, v in provider.options.items() if not (k == "device" and str(v).upper() == "CPU")}
    return provider.id, tuple(sorted((k, repr(v)) for k, v in options.items()))


def get_available_providers() -> list[str]:
    """The ids of the providers present on this host as their probes find them, in registry order
    (onnxruntime's function of that name)."""
    return [ident for ident, cls in REGISTRY.items() if cls().present]


def devices() -> list[Availability]:
    """Every provider and device uhop-onnx knows, present or not, as its probe finds it."""
    return [p.probed for p in _known()]


def _known() -> Iterable[Provider]:
    for ident, cls in REGISTRY.items():
        for options in cls.known_options():
            yield cls(options)
