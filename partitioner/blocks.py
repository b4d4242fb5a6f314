"""Cut a graph's topological order into blocks: the units the measured placement times and moves.

A block is a contiguous run of the graph's topological order, so any union of consecutive blocks is a
convex subgraph. Cuts go where few tensors are live, never between an op and the elementwise op a runtime
would fuse into it, and blocks are merged until there are at most `max_blocks`. A block that no single
provider can run whole is split where its first-choice provider changes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from uhop_onnx.foundation.graph import Graph, reads
from uhop_onnx.providers import Support

from .static_cost import nbytes

SMALLEST_CLASS = 1 << 12  # boundary size classes: 4 KiB, 64 KiB, 1 MiB, ... (each 16 times the last)
# Ops runtimes fuse into the op that feeds them (activations, bias adds, clips).
FUSABLE = frozenset({"Relu", "Clip", "Sigmoid", "Tanh", "LeakyRelu", "HardSwish", "HardSigmoid", "Add", "Mul",
                     "BatchNormalization", "Elu", "Selu", "Softplus", "Gelu", "Erf", "Div", "Sub"})


def live_tensors(graph: Graph) -> list[list[str]]:
    """For each cut position c (before node c), the tensors written before c and read at or after c."""
    last_read: dict[str, int] = {}
    for node in graph.nodes:
        for name in reads(node):
            last_read[name] = node.index
    live: list[list[str]] = []
    current: list[str] = []
    for node in graph.nodes:
        current = [t for t in current if last_read.get(t, -1) >= node.index]
        live.append(list(current))
        current += [o for o in node.outputs if o and o in last_read]
    return live


def blocks(graph: Graph, support: Mapping[str, Mapping[str, Support]], pinned: Mapping[str, str],
           max_live: int = 2, max_blocks: int = 24) -> list[tuple[int, ...]]:
    """Blocks of node indices, in run order; `support` is provider label -> node name -> Support, in
    preference order, and `pinned` node name -> provider label."""
    n = len(graph.nodes)
    if n == 0:
        return []
    live = live_tensors(graph)
    cuts = [c for c in range(1, n) if len(live[c]) <= max_live and not _fuses(graph, c)]
    bounds = [0, *cuts, n]
    spans = [list(range(a, b)) for a, b in zip(bounds, bounds[1:])]
    while len(spans) > max_blocks:
        k = min(range(len(spans) - 1), key=lambda i: len(spans[i]) + len(spans[i + 1]))
        spans[k:k + 2] = [spans[k] + spans[k + 1]]
    return [piece for span in spans for piece in _runnable(graph, span, support, pinned)]


def _fuses(graph: Graph, c: int) -> bool:
    """Whether node c is an elementwise op fused into node c-1 (it reads c-1's output, and only it does)."""
    node, previous = graph.nodes[c], graph.nodes[c - 1]
    return node.op_type in FUSABLE and previous.outputs[0] in node.inputs and graph.readers.get(previous.outputs[0]) == {c}


def _runnable(graph: Graph, span: list[int], support: Mapping[str, Mapping[str, Support]],
              pinned: Mapping[str, str]) -> list[tuple[int, ...]]:
    """`span` whole when one provider runs all of it and no node in it is pinned elsewhere; else split it
    where the first provider able to run each node (or its pin) changes."""
    if allowed_providers(graph, support, pinned, span):
        return [tuple(span)]
    names = [graph.nodes[i].name for i in span]
    first = [pinned.get(x, next((p for p, t in support.items() if t[x].ok), None)) for x in names]
    pieces: list[list[int]] = []
    previous = None
    for i, choice in zip(span, first):
        if pieces and choice == previous:
            pieces[-1].append(i)
        else:
            pieces.append([i])
        previous = choice
    return [tuple(p) for p in pieces]


def allowed_providers(graph: Graph, support: Mapping[str, Mapping[str, Support]], pinned: Mapping[str, str],
                      block: Sequence[int]) -> list[str]:
    """The providers (labels) that run every node of `block`, and to which none of them is pinned elsewhere."""
    names = [graph.nodes[i].name for i in block]
    pins = {pinned[x] for x in names if x in pinned}
    return [p for p, table in support.items() if all(table[x].ok for x in names) and pins <= {p}]


def expand(units: Sequence[Sequence[int]], choice: Sequence[str]) -> list[str]:
    """A provider per block -> a provider per node."""
    placement = {i: p for block, p in zip(units, choice) for i in block}
    return [placement[i] for i in range(len(placement))]


def boundary_classes(graph: Graph, units: Sequence[Sequence[int]]) -> list[int]:
    """Per block, the size class of the tensors live where it starts (the graph's inputs, for the first)."""
    live = live_tensors(graph)
    classes = []
    for block in units:
        size, c = sum(nbytes(graph, t) for t in live[block[0]] or graph.inputs), SMALLEST_CLASS
        while c < size:
            c *= 16
        classes.append(c)
    return classes
