"""Declarative capability tables: which ops a provider runs, at which opsets, types and attributes; and
`Support`, a provider's answer for one node, whoever gave it.

A table is data. `check` reads one node against it and answers `Support(ok, reason)`, where a "no"
quotes the actual value and what the provider requires. The table is the first word only: a runtime's own
query and a provider's build check (`partitioner.capabilities`) may turn a "yes" into a "no".
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from uhop_onnx.foundation.graph import Graph, Node

ANY_OPSET = (1, 10_000)


@dataclass(frozen=True)
class Support:
    """A provider's answer for one node: yes, or no with the reason; `source` says who said so: "table"
    (`check`), "runtime" (the runtime's own query), "check" (the provider's build check refused the node),
    "list" (a last resort that was not listed takes only what no listed provider runs), "simplify" (a
    node folded to a constant at the shapes a fixed-shape runtime is asked at) or "unknown" (a no for want
    of a rank or length that shape inference could not find: the runtime, given the whole model, may find
    it)."""

    ok: bool
    reason: str = ""
    source: str = "table"

    def __bool__(self) -> bool:
        return self.ok


YES = Support(True)


@dataclass(frozen=True)
class OpRule:
    """One op a provider runs, and the constraints under which it runs it."""

    op: str
    domain: str = ""
    opsets: tuple[int, int] = ANY_OPSET  # inclusive range of the domain's opset version
    dtypes: frozenset[str] | None = None  # element types allowed on inputs and outputs; None: the table's
    attributes: Mapping[str, tuple[Any, ...]] = field(default_factory=dict)  # name -> allowed values
    defaults: Mapping[str, Any] = field(default_factory=dict)  # attribute values when absent
    ranks: tuple[int, ...] | None = None  # allowed ranks of the first input
    constant_inputs: tuple[int, ...] = ()  # input positions that must be initializers
    sized_inputs: tuple[int, ...] = ()  # input positions (1-D shape tensors) whose length must be known
    absent_inputs: tuple[int, ...] = ()  # optional input positions that must be left out


@dataclass(frozen=True)
class CapabilityTable:
    """The ops one provider runs. With `any_op`, every op of `domains` is run unless a rule says otherwise.
    `checked_dtypes` are element types the runtime computes, but not always as ONNX Runtime does: placement
    leaves them off it; `admitting()` is the table with them, for a plan whose results are checked on the
    program's own inputs (an adapting session's candidate)."""

    provider: str
    rules: tuple[OpRule, ...]
    dtypes: frozenset[str]
    domains: Mapping[str, tuple[int, int]]  # domain -> opset range the provider accepts
    any_op: bool = False
    checked_dtypes: frozenset[str] = frozenset()

    def admitting(self) -> CapabilityTable:
        """This table with its `checked_dtypes` accepted."""
        return replace(self, dtypes=self.dtypes | self.checked_dtypes, checked_dtypes=frozenset())

    def rule(self, domain: str, op: str) -> OpRule | None:
        return self._index.get((domain, op))

    @cached_property
    def _index(self) -> dict[tuple[str, str], OpRule]:
        return {(r.domain, r.op): r for r in self.rules}


def check(table: CapabilityTable, node: Node, graph: Graph) -> Support:
    """Whether `table` accepts `node`, and if not, why."""
    where = f"{node.domain or 'ai.onnx'}.{node.op_type}"
    if node.domain not in table.domains:
        known = ", ".join(repr(d or "ai.onnx") for d in table.domains)
        return Support(False, f"domain {node.domain!r} is not supported by {table.provider} (supported: {known})")
    version = graph.opsets.get(node.domain, 0)
    low, high = table.domains[node.domain]
    if not low <= version <= high:
        return Support(False, f"opset {version} of {node.domain or 'ai.onnx'} is outside {low}..{high}")
    rule = table.rule(node.domain, node.op_type)
    if rule is None:
        return YES if table.any_op else Support(False, f"{where} is not in {table.provider}'s table")
    if not rule.opsets[0] <= version <= rule.opsets[1]:
        return Support(False, f"{where} at opset {version}; supported opsets {rule.opsets[0]}..{rule.opsets[1]}")
    allowed = rule.dtypes or table.dtypes
    for name in (*node.inputs, *node.outputs):
        info = graph.tensors.get(name) if name else None
        if info is not None and info.dtype is not None and info.dtype not in allowed:
            return Support(False, f"tensor {name!r} is {info.dtype}; supported: {', '.join(sorted(allowed))}")
    for attr, values in rule.attributes.items():
        value = node.attributes.get(attr, rule.defaults.get(attr))
        if value not in values:
            return Support(False, f"attribute {attr}={value!r}; supported: {', '.join(map(repr, values))}")
    if rule.ranks is not None and node.inputs:
        shape = graph.tensors.get(node.inputs[0])
        rank = len(shape.shape) if shape and shape.shape is not None else None
        if rank not in rule.ranks:
            return Support(False, f"input rank {rank}; supported ranks: {', '.join(map(str, rule.ranks))}",
                           "table" if rank is not None else "unknown")
    for position in rule.constant_inputs:
        name = node.inputs[position] if position < len(node.inputs) else ""
        if name and name not in graph.initializers:
            return Support(False, f"input {position} ({name!r}) must be a constant initializer")
    for position in rule.absent_inputs:
        if position < len(node.inputs) and node.inputs[position]:
            return Support(False, f"input {position} ({node.inputs[position]!r}) is not supported; leave it out")
    for position in rule.sized_inputs:
        name = node.inputs[position] if position < len(node.inputs) else ""
        info = graph.tensors.get(name) if name else None
        if name and not (info and info.shape and isinstance(info.shape[0], int)):
            return Support(False, f"input {position} ({name!r}) must have a known length: the output's rank "
                                  "depends on it", "unknown")
    return YES
