"""ONNX Runtime's own classes, bound once, whatever a program later assigns to `onnxruntime.InferenceSession`.

A program may put uhop under a library with `onnxruntime.InferenceSession = uhop_onnx.InferenceSession`.
uhop's own use of ONNX Runtime (the ort providers, reference runs, calibration, build checks, benchmarks)
must still get ONNX Runtime's session, so it reads every class from the module that defines it
(`onnxruntime.capi.*`), which assigning to the package's attributes does not touch. onnxruntime is imported
on first use (a bundle on a board may run without it); `uhop_onnx` binds at import when onnxruntime is
already loaded.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType, SimpleNamespace
from typing import Any

_lock = threading.Lock()
_bound: SimpleNamespace | None = None
# Held while ONNX Runtime's own modules are shown its real session (`own_session`).
_restore_lock = threading.RLock()

_FROM_COLLECTION = ("InferenceSession", "OrtValue", "IOBinding", "SparseTensor")
_FROM_PYBIND = ("SessionOptions", "RunOptions", "GraphOptimizationLevel", "ExecutionMode", "ExecutionOrder",
                "ModelMetadata", "NodeArg", "get_available_providers", "get_all_providers",
                "set_default_logger_severity", "set_default_logger_verbosity")


def load() -> SimpleNamespace:
    """ONNX Runtime's real classes and functions, as attributes named as onnxruntime's (`InferenceSession`,
    `SessionOptions`, `OrtValue`, `get_available_providers`, `__version__`, `preload_dlls` where the build
    has it...). `ImportError` when onnxruntime is not installed."""
    global _bound
    if _bound is None:
        with _lock:
            if _bound is None:
                _bound = _bind()
    return _bound


def _bind() -> SimpleNamespace:
    import onnxruntime
    from onnxruntime.capi import _pybind_state as pybind
    from onnxruntime.capi import onnxruntime_inference_collection as collection

    names = {n: getattr(collection, n) for n in _FROM_COLLECTION if hasattr(collection, n)}
    names.update({n: getattr(pybind, n) for n in _FROM_PYBIND if hasattr(pybind, n)})
    if hasattr(onnxruntime, "preload_dlls"):
        names["preload_dlls"] = onnxruntime.preload_dlls
    return SimpleNamespace(__version__=onnxruntime.__version__, **names)


# ONNX Runtime's log severity for the sessions uhop-onnx creates: 4 (fatal only: its errors reach the caller
# raised, with their message, and are not printed beside that).
_log_severity = 4


def set_log_severity(level: int) -> None:
    """ONNX Runtime's own logging, process-wide, for its default logger and every session uhop-onnx creates
    from now on: 0 verbose, 1 info, 2 warning, 3 error, 4 fatal."""
    global _log_severity
    _log_severity = int(level)
    load().set_default_logger_severity(_log_severity)


def log_severity() -> int:
    """The severity `set_log_severity` set (4 unless set)."""
    return _log_severity


def reference_session(model: str | bytes) -> Any:
    """ONNX Runtime's own CPU session of a model (its path or serialized bytes), logging at uhop-onnx's
    severity (its optimizer's warnings are not the program's business): the reference others are checked
    against."""
    ort = load()
    options = ort.SessionOptions()
    options.log_severity_level = _log_severity
    return ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])


def bind_if_loaded() -> None:
    """Bind now when onnxruntime is already imported (it costs nothing then); else on first use."""
    if "onnxruntime" in sys.modules:
        load()


@contextmanager
def own_session() -> Iterator[None]:
    """Within: ONNX Runtime's own modules (its quantizer and calibrator look `onnxruntime.InferenceSession`
    up themselves, as may NNCF) see its real session, whatever a program assigned there; restored on exit.
    One such block runs at a time; another thread of the program that makes a session meanwhile gets ONNX
    Runtime's own."""
    real = load().InferenceSession
    with _restore_lock:
        swapped = {m: m.InferenceSession for m in _ort_modules() if _assigned(m.InferenceSession)}
        for module in swapped:
            module.InferenceSession = real
        try:
            yield
        finally:
            for module, assigned in swapped.items():
                if module.InferenceSession is real:
                    module.InferenceSession = assigned


def _assigned(value: object) -> bool:
    """Whether a module's `InferenceSession` is something a program put there, not ONNX Runtime's own (the
    Python class, or the native one its `capi` modules hold)."""
    return not str(getattr(value, "__module__", "")).startswith("onnxruntime.")


def _ort_modules() -> list[ModuleType]:
    """The loaded modules of onnxruntime's package that hold an `InferenceSession` name."""
    return [m for name, m in list(sys.modules.items())
            if (name == "onnxruntime" or name.startswith("onnxruntime.")) and hasattr(m, "InferenceSession")]
