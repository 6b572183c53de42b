"""The lineage graph around a bundle, from the bundles of its context (no I/O, no locks)."""

from __future__ import annotations

from collections.abc import Mapping

from opml_bundle_store.core.manifest import Bundle, LineageGraph, age


def lineage_graph(bundles: Mapping[str, Bundle], start: Bundle, *, upstream: bool, downstream: bool,
                  max_depth: int) -> LineageGraph:
    """``start``'s inputs (upstream) and their inputs, and the bundles that consumed it (downstream)
    and their consumers, up to ``max_depth`` hops each way, among ``bundles`` (uuid -> bundle).
    Edges (input uuid, output uuid) to inputs that are not in ``bundles`` are kept."""
    found: dict[str, Bundle] = {start.uuid: start}
    edges: set[tuple[str, str]] = set()
    if upstream:
        frontier = [start]
        for _ in range(max_depth):
            next_frontier = []
            for bundle in frontier:
                for input_uuid in bundle.lineage.input_uuids:
                    edges.add((input_uuid, bundle.uuid))
                    parent = bundles.get(input_uuid)
                    if parent is not None and parent.uuid not in found:
                        found[parent.uuid] = parent
                        next_frontier.append(parent)
            frontier = next_frontier
    if downstream:
        consumers: dict[str, list[Bundle]] = {}
        for bundle in sorted(bundles.values(), key=age):
            for input_uuid in bundle.lineage.input_uuids:
                consumers.setdefault(input_uuid, []).append(bundle)
        frontier = [start]
        for _ in range(max_depth):
            next_frontier = []
            for bundle in frontier:
                for child in consumers.get(bundle.uuid, ()):
                    edges.add((bundle.uuid, child.uuid))
                    if child.uuid not in found:
                        found[child.uuid] = child
                        next_frontier.append(child)
            frontier = next_frontier
    return LineageGraph(tuple(found.values()), tuple(sorted(edges)))
