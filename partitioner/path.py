"""The cheapest provider per block: the dynamic programme the measured search and the static cost model share."""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from typing import TypeVar

from uhop_onnx.runtime.measure import Measurement

P = TypeVar("P", bound=Hashable)  # a provider, as the caller names it


def cheapest_path(allowed: Sequence[Sequence[P]], costs: Sequence[Mapping[P, Measurement]],
                  entry: Sequence[Mapping[P, Measurement]],
                  boundary: Sequence[Mapping[tuple[P, P], Measurement]] | None = None) -> list[P]:
    """For each block, a provider, minimising block costs plus the boundary paid wherever the provider
    changes. `entry[k]` and `boundary[k]` are the figures at the size of what enters block k.

    A block's own figure includes one stage entry fed from the host, so consecutive blocks on one provider
    are charged the block figure less that entry, and a block after another provider q the block figure
    with the entry replaced by the boundary from q (when measured). For the same reason an entry is worth
    no more than the provider's cheapest block: a larger entry figure is work the probe stage did, not the
    boundary's price. `allowed` holds only measured providers; a missing entry or boundary is not subtracted."""
    used = {p for ps in allowed for p in ps}
    cheapest = {p: min(costs[k][p].ms for k, ps in enumerate(allowed) if p in ps) for p in used}
    best: dict[P, tuple[float, list[P]]] = {}
    for k, ps in enumerate(allowed):
        step: dict[P, tuple[float, list[P]]] = {}
        for p in ps:
            own = costs[k][p].ms
            probe = entry[k].get(p)  # absent where the entry was not measured: nothing is taken off
            inside = own if probe is None else max(own - min(probe.ms, cheapest[p]), 0.0)  # without its entry
            options = [(own, [p])] if not best else []
            for q, (total, path) in best.items():
                measured = boundary[k].get((q, p)) if boundary else None
                extra = inside if q == p else own if measured is None else inside + measured.ms
                options.append((total + extra, [*path, p]))
            step[p] = min(options, key=lambda o: o[0])
        best = step
    return min(best.values(), key=lambda o: o[0])[1] if best else []  # no blocks: a graph of no nodes
