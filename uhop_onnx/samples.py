"""Sample inputs for timing and checking (random, reproducible, of the declared types and shapes), and ONNX
Runtime's outputs on them, the reference every provider is checked against."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from . import ortlib
from .dtypes import numpy_dtype
from .errors import ModelError, first_line


def sample_feeds(inputs: Iterable, seed: int = 0, shapes: Mapping[str, Sequence[int]] | None = None
                 ) -> dict[str, np.ndarray]:
    """One array per input signature (`.name`, `.type`, `.shape`): standard normal floats, zero integers,
    false booleans; of the shape `shapes` gives for it, else the declared one with free dimensions at 1."""
    rng = np.random.default_rng(seed)
    feeds = {}
    for sig in inputs:
        dtype = numpy_dtype(sig.type) or np.dtype(np.float32)
        shape = (list((shapes or {})[sig.name]) if sig.name in (shapes or {})
                 else [d if isinstance(d, int) and d > 0 else 1 for d in (sig.shape or ())])
        feeds[sig.name] = (rng.standard_normal(shape) if dtype.kind == "f" else np.zeros(shape)).astype(dtype)
    return feeds


def reference_outputs(model: str | os.PathLike | bytes, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """ONNX Runtime CPU's outputs of a model (its path or serialized bytes), by name; a `ModelError` naming
    the feeds' shapes when ONNX Runtime cannot run it on them."""
    return reference_runs(model, [feeds])[0]


def reference_runs(model: str | os.PathLike | bytes, samples: Sequence[dict[str, np.ndarray]]
                   ) -> list[dict[str, np.ndarray]]:
    """`reference_outputs` of each of `samples`, from one ONNX Runtime session."""
    session = ortlib.load().InferenceSession(model if isinstance(model, bytes) else str(model), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    outputs = []
    for feeds in samples:
        try:
            outputs.append(dict(zip(names, session.run(names, feeds), strict=True)))
        except Exception as error:  # noqa: BLE001 - ONNX Runtime's own refusal of these inputs is the message
            raise ModelError(f"ONNX Runtime cannot run the model on sample inputs of shapes {shapes_text(feeds)}: "
                             f"{first_line(error)}") from error
    return outputs


def shapes_text(feeds: Mapping[str, np.ndarray | Sequence[int]] | None) -> str:
    """`x: 1x3x8x8, n: scalar`: the shapes of some feeds (arrays, or their shapes as lists), for messages."""
    if feeds is None:
        return "no shapes"
    dims = {name: v if isinstance(v, (list, tuple)) else np.shape(v) for name, v in feeds.items()}
    return ", ".join(f"{name}: {'x'.join(map(str, d)) or 'scalar'}" for name, d in dims.items()) or "no inputs"
