"""Gather indices out of range: ONNX Runtime fails the call; LiteRT wraps them and OpenVINO reads 0.

A stage on those runtimes takes indices that inputs' values reach only as its own inputs into constant data
(an embedding lookup), and checks them before it runs, failing as ONNX Runtime does; other such indices,
computed inside a stage, could not be checked, so those nodes are refused. Indices computed from constants
and shapes alone are the model's own.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from uhop_onnx.foundation.errors import InputError

from .runner import Runner

if TYPE_CHECKING:
    import onnx

GATHERS = ("Gather", "GatherElements", "GatherND")


class Bound(NamedTuple):
    node: str
    indices: str  # the stage input holding them
    size: int  # indices must lie in -size..size-1


def _axis(node: onnx.NodeProto) -> int:
    return next((a.i for a in node.attribute if a.name == "axis"), 0)


def _from_shapes(model: onnx.ModelProto) -> set[str]:
    """Tensors computed from constants and tensor shapes only (an exporter's position ids, shape arithmetic):
    the model's own values, which no input's values reach."""
    known = {t.name for t in model.graph.initializer}
    for node in model.graph.node:
        if node.op_type in ("Shape", "Size", "Constant") or all(n in known for n in node.input if n):
            known.update(node.output)
    return known


def unchecked(model: onnx.ModelProto) -> dict[str, str]:
    """Gather nodes whose variable indices no check before the stage reaches, by name, with the reason."""
    constants = {t.name for t in model.graph.initializer}
    inputs = {v.name for v in model.graph.input} - constants
    own = _from_shapes(model)
    refused = {}
    for node in model.graph.node:
        if node.op_type not in GATHERS or node.domain not in ("", "ai.onnx") or node.input[1] in own:
            continue
        if node.op_type == "GatherND" or node.input[1] not in inputs or node.input[0] not in constants:
            refused[node.name] = (f"{node.op_type} of variable indices {node.input[1]!r}: checked only as a model "
                                  "input into constant data; out of range, this runtime gives numbers where "
                                  "ONNX Runtime fails")
    return refused


def bounds(model: onnx.ModelProto) -> list[Bound]:
    """The stage inputs that index constant data, with the size each indexes."""
    constants = {t.name: t for t in model.graph.initializer}
    inputs = {v.name for v in model.graph.input} - constants.keys()
    found = []
    for node in model.graph.node:
        if node.op_type in GATHERS[:2] and node.input[1] in inputs and node.input[0] in constants:
            dims = constants[node.input[0]].dims
            found.append(Bound(node.name or node.output[0], node.input[1], int(dims[_axis(node) % len(dims)])))
    return found


class CheckedIndices(Runner):
    """`runner`, after checking that its index inputs lie in range (`InputError` naming the node if not)."""

    def __init__(self, runner: Runner, found: list[Bound]):
        self.runner, self.bounds = runner, found
        self.device = runner.device

    def run(self, feeds: Mapping[str, Any]) -> dict[str, Any]:
        for bound in self.bounds:
            index = np.asarray(feeds[bound.indices])
            if index.size and (index.min() < -bound.size or index.max() >= bound.size):
                raise InputError(f"{bound.node}: indices {bound.indices!r} hold {int(index.min())}.."
                                 f"{int(index.max())}, outside -{bound.size}..{bound.size - 1}; send indices in range")
        return self.runner.run(feeds)

    def to_host(self, value: Any) -> np.ndarray:
        return self.runner.to_host(value)

    def close(self) -> None:
        self.runner.close()

    def __getattr__(self, name: str) -> Any:  # the wrapped runner's own attributes (`error`, ...)
        return getattr(self.__dict__["runner"], name)


def checked(model: onnx.ModelProto, runner: Runner) -> Runner:
    """`runner` with its index inputs checked, or itself when the stage has none."""
    return guarded(runner, bounds(model))


def guarded(runner: Runner, found: list[Bound]) -> Runner:
    """`runner` with the index inputs `found` (a stage's `bounds`) checked, or itself when there are none."""
    return CheckedIndices(runner, found) if found else runner
