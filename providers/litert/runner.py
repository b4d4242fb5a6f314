"""A `.tflite` stage run by the LiteRT interpreter (`ai_edge_litert`, or `tflite_runtime` on boards that
have only that), with XNNPACK on CPU or an external delegate."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from uhop_onnx.errors import ProviderError

from ..base import Runner
from . import delegates

log = logging.getLogger(__name__)


def interpreter_module():
    """`ai_edge_litert.interpreter`, else `tflite_runtime.interpreter`."""
    try:
        from ai_edge_litert import interpreter
    except ImportError:
        from tflite_runtime import interpreter
    return interpreter


class LiteRtRunner(Runner):
    """A LiteRT interpreter over one stage. Tensors are fed and read by their ONNX names, which the
    `.tflite` model carries on its inputs and outputs."""

    error: float | None = None  # largest difference from ONNX Runtime found when the stage was checked

    def __init__(self, model: bytes, threads: int | None = None, delegate: str | None = None,
                 delegate_options: Mapping[str, Any] | None = None, allow_fallback: bool = False):
        lite = interpreter_module()
        self.model = model
        threads = threads or os.cpu_count() or 1  # LiteRT's own default is one thread; ONNX Runtime's, every core
        loaded = load_delegate(lite, delegate, delegate_options, allow_fallback) if delegate else None
        self.delegates = [loaded] if loaded is not None else []
        self.interpreter = lite.Interpreter(model_content=model, num_threads=threads,
                                            experimental_delegates=self.delegates or None)
        self.interpreter.allocate_tensors()
        self.inputs = [(d["name"], d["index"], d["dtype"]) for d in self.interpreter.get_input_details()]
        self.outputs = [(d["name"], d["index"]) for d in self.interpreter.get_output_details()]

    def run(self, feeds: Mapping[str, Any]) -> dict[str, Any]:
        for name, index, dtype in self.inputs:
            self.interpreter.set_tensor(index, np.require(feeds[name], dtype, "C"))
        self.interpreter.invoke()
        return {name: self.interpreter.get_tensor(index) for name, index in self.outputs}

    def close(self) -> None:
        self.interpreter = None
        self.delegates = []


def load_stage(folder: Path, artifact: Mapping[str, Any], threads: int | None, exclusive: bool,
               trusted: bool = False) -> LiteRtRunner:
    """A bundle's `.tflite` stage, with the delegate it was exported with: any when `trusted` (a signature
    the loader checked covers the manifest), else only a known or allowed one (see `delegates`)."""
    options = artifact.get("options", {})
    why = "" if trusted or not options.get("delegate") else delegates.refusal(options["delegate"])
    if why:
        raise ProviderError(f"the unsigned bundle's LiteRT delegate {why}")
    return LiteRtRunner((Path(folder) / artifact["files"][0]).read_bytes(), threads, options.get("delegate"),
                        options.get("delegate_options"), bool(options.get("allow_fallback")))


def load_delegate(lite, library: str, options: Mapping[str, Any] | None, allow_fallback: bool):
    """The external delegate in `library`; when it fails to load, an error naming it, or None (XNNPACK)
    with a warning when fallback is allowed."""
    try:
        return lite.load_delegate(delegates.resolve(library), {k: str(v) for k, v in (options or {}).items()})
    except (ValueError, OSError, RuntimeError, AttributeError) as error:  # AttributeError: no delegate's symbols
        message = f"LiteRT delegate {library!r} failed to load: {str(error).strip().splitlines()[0]}"
        if not allow_fallback:
            raise ProviderError(f"{message}; pass allow_fallback=True to run on XNNPACK instead") from None
        log.warning("%s; running on XNNPACK instead", message)
        return None
