"""uhop-onnx's session in ONNX Runtime's place, for programs whose libraries make their sessions themselves.

`patch_onnxruntime()` sets `onnxruntime.InferenceSession` to uhop-onnx's session (a library that looks it
up, `ort.InferenceSession(...)`, or imports it after the patch gets uhop-onnx's); `unpatch_onnxruntime()`
puts ONNX Runtime's own back. uhop-onnx itself keeps using ONNX Runtime's real classes (`ortlib`).
"""

from __future__ import annotations

import inspect
import logging
import os
import threading
from collections.abc import Mapping
from types import MappingProxyType, TracebackType
from typing import Any

from ..foundation import ortlib
from ..foundation.errors import InputError
from .session import InferenceSession

log = logging.getLogger(__name__)
_lock = threading.Lock()

# ONNX Runtime's own parameters: a program passes them, positionally or not, so they are never defaults.
_ORT_PARAMETERS = ("path_or_bytes", "sess_options", "providers", "provider_options")


class Patch:
    """A patch in force; as a context manager, it puts back on exit what `onnxruntime.InferenceSession`
    was before it."""

    def __init__(self, previous: type):
        self.previous = previous

    def __enter__(self) -> Patch:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        import onnxruntime

        with _lock:
            onnxruntime.InferenceSession = self.previous


def patch_onnxruntime(**defaults: Any) -> Patch:
    """Make `onnxruntime.InferenceSession` uhop-onnx's session. `defaults` are keywords of
    `uhop_onnx.InferenceSession` (`precision="fp16"`, `policy="literal"`, `threads=2`...) given to every
    session made through it, under the keywords the program passes itself. Each such session logs once, at
    INFO, the model and the providers of its plan. Idempotent: calling it again leaves one patch in force
    (with the latest defaults). Returns a `Patch`, a context manager that restores on exit."""
    _check(defaults)
    import onnxruntime

    ortlib.load()  # ONNX Runtime's own classes are bound before its name is taken
    with _lock:
        previous = onnxruntime.InferenceSession
        onnxruntime.InferenceSession = _PLAIN if not defaults else _session_class(defaults)
    return Patch(previous)


def unpatch_onnxruntime() -> None:
    """Put ONNX Runtime's own `InferenceSession` back where uhop-onnx's is (a program's own replacement,
    anything but uhop-onnx's session, is left as it is)."""
    import onnxruntime

    with _lock:
        current = onnxruntime.InferenceSession
        if isinstance(current, type) and issubclass(current, InferenceSession):
            onnxruntime.InferenceSession = ortlib.load().InferenceSession


def _check(defaults: Mapping[str, Any]) -> None:
    """`InputError` for a default that is no keyword of the session (or of `optimize`, where it goes)."""
    if not defaults:
        return
    from .optimizer import optimize

    valid = {name for fn in (InferenceSession.__init__, optimize) for name, p in inspect.signature(fn).parameters.items()
             if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)} - {"self", "model", *_ORT_PARAMETERS}
    wrong = sorted(set(defaults) - valid)
    if wrong:
        raise InputError(f"patch_onnxruntime: {', '.join(wrong)} cannot be a default for the program's sessions; "
                         f"valid: {', '.join(sorted(valid))}")


def _session_class(defaults: Mapping[str, Any]) -> type[InferenceSession]:
    """uhop-onnx's session with `defaults` under the caller's keywords, logging what it runs."""

    class PatchedSession(InferenceSession):
        __doc__ = InferenceSession.__doc__
        patch_defaults = MappingProxyType(dict(defaults))

        def __init__(self, path_or_bytes: Any, *args: Any, **kwargs: Any):
            super().__init__(path_or_bytes, *args, **{**self.patch_defaults, **kwargs})
            log.info("onnxruntime.InferenceSession(%s) runs on uhop-onnx: %s in %d stage(s)", _described(path_or_bytes),
                     ", ".join(self.get_providers()), len(self._serving.plan.stages))  # its structure unread

    PatchedSession.__name__ = PatchedSession.__qualname__ = "InferenceSession"
    return PatchedSession


def _described(model: Any) -> str:
    """A model source as a log line names it: its path, or what it is."""
    if isinstance(model, (str, os.PathLike)):
        return os.fspath(model)
    if isinstance(model, (bytes, bytearray)):
        return f"a model of {len(model)} bytes"
    return type(model).__name__


_PLAIN = _session_class({})
