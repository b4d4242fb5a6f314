"""Sample inputs for timing and checking (random, reproducible, of the declared types and shapes), and ONNX
Runtime's outputs on them, the reference every provider is checked against."""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np

from . import ortlib
from .dtypes import numpy_dtype
from .errors import InputError, ModelError, TooLargeError, first_line
from .host import available_memory

if TYPE_CHECKING:
    import onnx


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
        raise TooLargeError(f"sample inputs of shapes {shapes} need {need / 2**30:.3g} GiB, more than the "
                         f"{free / 2**30:.3g} GiB this host has free; give smaller shapes (--shape NAME:DIMS, "
                         "shapes=) or sample inputs (--inputs, inputs=)")


def check_runs_fit(model: onnx.ModelProto, shapes: Mapping[str, Sequence[int]], runs: int) -> None:
    """`InputError`, before anything runs, when `runs` runs of `model` at once (a search runs several: the
    whole plans it times, each in its own process, and its own sample values), at `shapes` (input -> dims),
    need more memory than this host has free. A run needs at least what its largest node reads and writes
    (`largest_node`)."""
    free = available_memory()
    if free is None:
        return
    node, need = largest_node(model, shapes)
    if runs * need > free:
        raise TooLargeError(f"at {shapes_text(shapes)}, node {node} reads and writes {need / 2**30:.3g} GiB; {runs} "
                         f"runs at once need {runs * need / 2**30:.3g} GiB, more than the {free / 2**30:.3g} GiB "
                         "this host has free; give smaller shapes (--shape NAME:DIMS, shapes=) or sample inputs "
                         "(--inputs, inputs=)")


def largest_node(model: onnx.ModelProto, shapes: Mapping[str, Sequence[int]]) -> tuple[str, int]:
    """The node whose tensors (the ones it reads that are not weights, and the ones it writes) take the most
    bytes at `shapes`, and those bytes; `("", 0)` where shape inference fails. Inference runs on the model's
    `weightless` copy; a dimension it cannot find counts as 1."""
    import onnx  # here, not at the top: a board's runner reads samples and has no onnx

    from .inference import weightless

    weights = {t.name for t in model.graph.initializer}
    light = weightless(model, shapes)
    try:
        inferred = onnx.shape_inference.infer_shapes(light, data_prop=True).graph
    except Exception:  # noqa: BLE001 - no estimate is no refusal; the run itself says what is wrong
        return "", 0
    sizes = {v.name: _nbytes(v) for v in (*inferred.input, *inferred.value_info, *inferred.output)}
    activations = ((n.name, sum(sizes.get(t, 0) for t in {*n.input, *n.output} if t and t not in weights))
                   for n in model.graph.node)
    return max(activations, key=lambda pair: pair[1], default=("", 0))


def _nbytes(value: onnx.ValueInfoProto) -> int:
    """The bytes of a tensor of this type (an unknown dimension as 1); 0 for what is not a tensor."""
    from onnx import helper

    tensor = value.type.tensor_type
    if not value.type.HasField("tensor_type") or not tensor.elem_type:
        return 0
    dims = [d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else 1 for d in tensor.shape.dim]
    return math.prod(dims) * np.dtype(helper.tensor_dtype_to_np_dtype(tensor.elem_type)).itemsize


def reference_outputs(model: str | os.PathLike | bytes, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """ONNX Runtime CPU's outputs of a model (its path or serialized bytes), by name; a `ModelError` naming
    the feeds' shapes when ONNX Runtime cannot run it on them."""
    return reference_runs(model, [feeds])[0]


def reference_runs(model: str | os.PathLike | bytes, samples: Sequence[dict[str, np.ndarray]]
                   ) -> list[dict[str, np.ndarray]]:
    """`reference_outputs` of each of `samples`, from one ONNX Runtime session."""
    session = ortlib.reference_session(model if isinstance(model, bytes) else str(model))
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
