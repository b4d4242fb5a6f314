"""Sample inputs for timing and checking: random, reproducible, of the declared types and shapes."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from .dtypes import numpy_dtype


def sample_feeds(inputs: Iterable, seed: int = 0) -> dict[str, np.ndarray]:
    """One array per input signature (`.name`, `.type`, `.shape`): standard normal floats, zero integers,
    false booleans; symbolic or unknown dimensions are 1."""
    rng = np.random.default_rng(seed)
    feeds = {}
    for sig in inputs:
        dtype = numpy_dtype(sig.type) or np.dtype(np.float32)
        shape = [d if isinstance(d, int) and d > 0 else 1 for d in (sig.shape or ())]
        feeds[sig.name] = (rng.standard_normal(shape) if dtype.kind == "f" else np.zeros(shape)).astype(dtype)
    return feeds
