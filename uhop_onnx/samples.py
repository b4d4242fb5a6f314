"""Sample inputs for timing and checking (random, reproducible, of the declared types and shapes), and ONNX
Runtime's outputs on them, the reference every provider is checked against."""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from . import ortlib
from .dtypes import numpy_dtype
from .errors import InputError, ModelError, first_line
from .host import available_memory


def sample_feeds(inputs: Iterable, seed: int = 0, shapes: Mapping[str, Sequence[int]] | None = None
                 ) -> dict[str, np.ndarray]:
    """One array per input signature (`.name`, `.type`, `.shape`): standard normal floats, zero integers,
    false booleans; of the shape `shapes` gives for it, else the declared one with free dimensions at 1. An
    `InputError`, before anything is allocated, when they would not fit in the memory this host has free."""
    planned = {}
    for sig in inputs:
        dtype = numpy_dtype(sig.type) or np.dtype(np.float32)
        planned[sig.name] = (list((shapes or {})[sig.name]) if sig.name in (shapes or {})
                             else [d if isinstance(d, int) and d > 0 else 1 for d in (sig.shape or ())], dtype)
    _check_fits(planned)
    rng = np.random.default_rng(seed)
    return {name: (rng.standard_normal(shape) if dtype.kind == "f" else np.zeros(shape)).astype(dtype)
            for name, (shape, dtype) in planned.items()}


def _check_fits(planned: Mapping[str, tuple[list[int], np.dtype]]) -> None:
    """`InputError` when arrays of these shapes and dtypes (each drawn in float64 first) need more bytes than
    this host has free."""
    sizes = {name: math.prod(shape) for name, (shape, _) in planned.items()}
    drawn = 8 * max(sizes.values(), default=0)
    need = sum(sizes[name] * dtype.itemsize for name, (_, dtype) in planned.items()) + drawn
    free = available_memory()
    if free is not None and need > free:
        shapes = shapes_text({name: shape for name, (shape, _) in planned.items()})
        raise InputError(f"sample inputs of shapes {shapes} need {need / 2**30:.3g} GiB, more than the "
                         f"{free / 2**30:.3g} GiB this host has free; give smaller shapes (--shape NAME:DIMS, "
                         "shapes=) or sample inputs (--inputs, inputs=)")


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
