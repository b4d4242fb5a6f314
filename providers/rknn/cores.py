"""Which NPU cores a stage runs on (its `core_mask`): a rule where the bundle is written away from the board,
a measurement where it is written on the board (`tune`).

The rule: a batch-1 stage on a chip of several NPU cores spreads over all of them (`0_1_2` on an RK3588, `0_1`
on an RK3576), since one inference is all the work there is; a larger batch is left to the runtime (`auto`),
which places each call on a free core, as independent models are. A chip of one core has nothing to choose.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from uhop_onnx.foundation.samples import sample_feeds
from uhop_onnx.foundation.timing import round_median

if TYPE_CHECKING:
    import onnx

    from ..runner import Runner

CORES = {"rk3588": 3, "rk3576": 2}  # NPU cores per target; the others have one
SPREAD = {3: "0_1_2", 2: "0_1"}
MEASURED = {3: ("0", "0_1", "0_1_2"), 2: ("0", "0_1")}  # the masks `tune` times on the board
RUNS = 20  # timed calls per mask, after one warm-up


def chosen(model: onnx.ModelProto, target: str) -> str:
    """The rule's core mask for a stage at fixed shapes (see the module's docstring)."""
    cores = CORES.get(target, 1)
    if cores == 1:
        return "auto"
    return SPREAD[cores] if batch(model) == 1 else "auto"


def batch(model: onnx.ModelProto) -> int | None:
    """The first dimension of the stage's first non-constant input, where fixed."""
    initializers = {t.name for t in model.graph.initializer}
    for value in model.graph.input:
        if value.name not in initializers:
            dims = value.type.tensor_type.shape.dim
            return dims[0].dim_value if dims and dims[0].HasField("dim_value") else None
    return None


def measured(model: onnx.ModelProto, target: str, open_runner: Callable[[str], Runner]) -> dict[str, float]:
    """Median milliseconds of a call to the stage on each core mask worth trying on `target`, each run by
    `open_runner(mask)` (the board's runtime on the stage's `.rknn`) on seeded inputs after one warm-up call."""
    from uhop_onnx.foundation.graph import Graph

    graph = Graph.from_model(model)
    feeds = sample_feeds([graph.signature(name) for name in graph.inputs])
    timings = {}
    for mask in MEASURED.get(CORES.get(target, 1), ("auto",)):
        with open_runner(mask) as runner:
            runner.run(feeds)
            timings[mask] = round(1e3 * round_median(lambda: runner.run(feeds), RUNS), 4)  # noqa: B023 - used now
    return timings


def fastest(timings: Mapping[str, float]) -> str:
    return min(timings, key=timings.get)
