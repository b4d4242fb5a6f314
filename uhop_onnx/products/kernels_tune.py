"""`tune_model`: autotune ahead of time every schedule a model's `kernels` stages need (`uhop-onnx kernels tune`)."""

from __future__ import annotations

from ..custom_ops.autotune import table
from ..custom_ops.verify import host_library
from ..foundation.samples import sample_feeds
from .session import InferenceSession


def tune_model(model, threads: int | None = None) -> list[dict]:
    """Run `model` once with random inputs, its Conv/Gemm/MatMul nodes on `kernels` with tuning on, so every
    schedule it needs is searched and cached; returns the newly cached entries (op, schedule, GFLOP/s)."""
    winners = table(host_library())
    before = set(winners.read())
    session = InferenceSession(model, providers=[("kernels", {"tune": True}), "ort-cpu"], profile=False,
                               threads=threads)
    session.run(None, sample_feeds(session.get_inputs()))
    return [{"op": key, **entry} for key, entry in sorted(winners.read().items()) if key not in before]
