"""A `.tflite` stage run by the LiteRT interpreter (`ai_edge_litert`, or `tflite_runtime` on boards that
have only that), with XNNPACK on CPU or an external delegate."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from uhop_onnx.foundation.errors import ProviderError, logger

from ..runner import Pool, Runner
from . import delegates

log = logger(__name__)


def interpreter_module():
    """`ai_edge_litert.interpreter`, else `tflite_runtime.interpreter`; where neither imports, ai-edge-litert's
    error (a broken install says why) unless it is only not installed."""
    try:
        from ai_edge_litert import interpreter
    except ImportError as error:
        try:
            from tflite_runtime import interpreter
        except ImportError:
            if error.name == "ai_edge_litert":  # not installed: tflite-runtime's error says as much
                raise
            raise error from None  # installed but broken: its own error says why
    return interpreter


class LiteRtRunner(Runner):
    """A LiteRT interpreter over one stage. Tensors are fed and read by their ONNX names, which the
    `.tflite` model carries on its inputs and outputs. An interpreter serves one call at a time, so
    concurrent calls each borrow one from a pool (made on demand, with its own delegate)."""

    error: float | None = None  # largest difference from ONNX Runtime found when the stage was checked
    conversion: str | None = None  # the key the checked conversion is kept under in the cache

    def __init__(self, model: bytes, threads: int | None = None, delegate: str | None = None,
                 delegate_options: Mapping[str, Any] | None = None, allow_fallback: bool = False):
        self.model = model
        self.threads = threads or os.cpu_count() or 1  # LiteRT's own default is one thread; ONNX Runtime's, every core
        self.delegate = (delegate, delegate_options, allow_fallback)
        first = self._interpreter()
        self.interpreters = Pool(self._interpreter, first)
        self.inputs = [(d["name"], d["index"], d["dtype"]) for d in first.get_input_details()]
        self.outputs = [(d["name"], d["index"]) for d in first.get_output_details()]

    def run(self, feeds: Mapping[str, Any]) -> dict[str, Any]:
        with self.interpreters.borrow() as interpreter:
            for name, index, dtype in self.inputs:
                interpreter.set_tensor(index, np.asarray(feeds[name], dtype, order="C"))
            interpreter.invoke()
            return {name: interpreter.get_tensor(index) for name, index in self.outputs}

    def close(self) -> None:
        self.interpreters = None

    def _interpreter(self):
        lite = interpreter_module()
        library, options, allow_fallback = self.delegate
        loaded = load_delegate(lite, library, options, allow_fallback) if library else None
        interpreter = lite.Interpreter(model_content=self.model, num_threads=self.threads,
                                       experimental_delegates=[loaded] if loaded is not None else None)
        interpreter.allocate_tensors()
        return interpreter


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


class EmptyRunner(Runner):
    """A stage at input shapes with a zero dimension, which LiteRT cannot hold: its outputs, all zero-sized
    at the shapes ONNX shape inference gives them, made here as ONNX Runtime returns them."""

    def __init__(self, outputs: Mapping[str, np.ndarray]):
        self.outputs = dict(outputs)

    def run(self, feeds: Mapping[str, Any]) -> dict[str, Any]:
        return {name: value.copy() for name, value in self.outputs.items()}


def empty_runner(model) -> EmptyRunner | None:
    """For a stage fixed at input shapes with a zero dimension, its `EmptyRunner` (`ProviderError` when an
    output would hold values or has a shape inference cannot fix); None for other shapes."""
    import onnx
    from onnx import helper

    from uhop_onnx.foundation.inference import weightless

    def dims(value):
        shape = value.type.tensor_type.shape
        return [d.dim_value if d.HasField("dim_value") else None for d in shape.dim]

    if all(0 not in dims(v) for v in model.graph.input):
        return None
    inferred = onnx.shape_inference.infer_shapes(weightless(model), data_prop=True)
    outputs = {}
    for value in inferred.graph.output:
        shape = dims(value) if value.type.tensor_type.HasField("shape") else [None]
        if None in shape or 0 not in shape:
            raise ProviderError(f"litert holds no zero-sized tensor, and output {value.name!r} of this stage would "
                                f"be {shape} at these input shapes; run the stage elsewhere (fallback=True does)")
        outputs[value.name] = np.zeros(shape, helper.tensor_dtype_to_np_dtype(value.type.tensor_type.elem_type))
    return EmptyRunner(outputs)
